"""remnant.engine.ops: the indexer's top-k against a stable sort."""

from __future__ import annotations

import pytest
import torch

from remnant.engine.ops import index_top_k
from remnant.kernels.top_k import top_k_reference


@pytest.mark.parametrize("n", [1, 37, 600, 4096])
def test_index_top_k_is_a_stable_sorts_first_k(n):
    gen = torch.Generator().manual_seed(n)
    rows = [torch.randn(n, generator=gen),
            torch.relu(torch.randn(n, generator=gen)) * (torch.rand(n, generator=gen) < 0.3),  # many exact zeros
            torch.randint(-3, 3, (n,), generator=gen).float(),                               # ties everywhere
            torch.full((n,), float("-inf"))]
    mixed = torch.randn(n, generator=gen)
    mixed[::3] = float("-inf")
    mixed[1::5] = -0.0
    mixed[2::5] = 0.0
    scores = torch.stack(rows + [mixed, -mixed.abs() * 1e30])
    for k in sorted({1, min(n, 5), min(n, 512), n}):
        got_v, got_i = index_top_k(scores, k)
        want_v, want_i = top_k_reference(scores, k)
        assert torch.equal(got_i, want_i), k
        assert torch.equal(got_v, want_v), k
