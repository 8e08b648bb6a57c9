"""remnant.kernels.indexer: the indexer's scores over FP8 keys in their pages against the
float64 reference."""

from __future__ import annotations

import pytest
import torch

from remnant.engine.ops import index_top_k
from remnant.kernels.top_k import top_k_reference
from remnant.kv.index_keys import quantize_index_keys
from remnant.engine.pools import SplitPages
from remnant.kernels.indexer import index_scores, index_scores_reference, index_scores_shared, keys_at
from tests.kernels.inputs import DEVICE, ON_GPU


def _pool(gen: torch.Generator, pages: int, per_page: int) -> SplitPages:
    """An indexer pool (the engine's layout) whose every slot holds a fresh quantized key."""
    pool = SplitPages(pages, per_page, 132, 4, device=DEVICE)
    keys = torch.randn(pages * per_page, 128, generator=gen) * torch.exp(torch.randn(pages * per_page, 1, generator=gen))
    pool.layout.write(pool.buf, torch.arange(pages * per_page, device=DEVICE), quantize_index_keys(keys).to(DEVICE))
    return pool


@pytest.mark.parametrize(("heads", "dtype", "n"), [(8, torch.float32, 100), (64, torch.float32, 64),
                                                    (64, torch.bfloat16, 130)])
def test_scores_are_the_reference(heads, dtype, n):
    gen = torch.Generator().manual_seed(heads + n)
    B, per_page = 3, 16
    pool = _pool(gen, 12, per_page)
    locs = torch.randint(0, 12 * per_page, (B, n), generator=gen)
    locs[1, ::7] = -1                                    # padding columns
    counts = torch.tensor([n, n // 2, 0])
    q = torch.randn(B, heads, 128, generator=gen).to(DEVICE, dtype)
    w = torch.randn(B, heads, generator=gen).to(DEVICE)
    locs, counts = locs.to(DEVICE), counts.to(DEVICE)
    got = index_scores(q, w, pool.buf, pool.layout, locs, counts)
    want = index_scores_reference(q, w, pool.buf, pool.layout, locs, counts)
    _same_scores(got, want)
    assert torch.isneginf(got[2]).all() and torch.isneginf(got[1, n // 2:]).all() and torch.isneginf(got[1, ::7]).all()


@pytest.mark.parametrize(("tokens", "block_t", "dtype"), [(1, 16, torch.float32), (37, 16, torch.float32),
                                                           (20, 4, torch.bfloat16)])
def test_shared_scores_are_the_reference(tokens, block_t, dtype):
    # A prefill's tokens of one sequence against its keys: token t sees the first counts[t].
    gen = torch.Generator().manual_seed(tokens)
    pool = _pool(gen, 10, 16)
    n = 90
    locs = torch.randperm(160, generator=gen)[:n].to(DEVICE)
    counts = torch.randint(0, n + 1, (tokens,), generator=gen).to(DEVICE)
    q = torch.randn(tokens, 64, 128, generator=gen).to(DEVICE, dtype)
    w = torch.randn(tokens, 64, generator=gen).to(DEVICE)
    got = index_scores_shared(q, w, pool.buf, pool.layout, locs, counts, block_t=block_t)
    want = index_scores_reference(q, w, pool.buf, pool.layout, locs, counts)
    _same_scores(got, want)
    # The same as each token scoring its own copy of the locations.
    torch.testing.assert_close(got, index_scores(q, w, pool.buf, pool.layout, locs.expand(tokens, n), counts))


def _same_scores(got: torch.Tensor, want: torch.Tensor) -> None:
    """-inf exactly where the reference has it; elsewhere float32 accumulation of exact
    products (codes are exact in q's dtype): summation order only."""
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    seen = ~torch.isneginf(want)
    assert torch.isfinite(got[seen]).all()
    if seen.any():
        torch.testing.assert_close(got[seen], want[seen], rtol=1e-5, atol=1e-4 * want[seen].abs().max().item())


def test_scores_read_the_keys_where_the_layout_puts_them():
    # One key at a time: a score with one head and weight 1 is relu(q . key), the key as
    # keys_at dequantizes it from its page.
    gen = torch.Generator().manual_seed(5)
    pool = _pool(gen, 4, 8)
    locs = torch.tensor([[0, 7, 8, 31]], device=DEVICE)
    q = torch.randn(1, 1, 128, generator=gen).to(DEVICE)
    got = index_scores(q, torch.ones(1, 1, device=DEVICE), pool.buf, pool.layout, locs, torch.tensor([4], device=DEVICE))
    keys = keys_at(pool.buf, pool.layout, locs)[0]
    torch.testing.assert_close(got[0], torch.relu(keys @ q[0, 0]), rtol=1e-5, atol=1e-5)


def test_bad_arguments_name_the_argument():
    pool = SplitPages(2, 4, 132, 4, device=DEVICE)
    q, w = torch.zeros(1, 2, 128, device=DEVICE), torch.zeros(1, 2, device=DEVICE)
    locs, counts = torch.zeros(1, 3, dtype=torch.long, device=DEVICE), torch.ones(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="q must be"):
        index_scores(q[..., :64], w, pool.buf, pool.layout, locs, counts)
    with pytest.raises(ValueError, match="w must be"):
        index_scores(q, w[:, :1], pool.buf, pool.layout, locs, counts)
    with pytest.raises(ValueError, match="counts must be"):
        index_scores(q, w, pool.buf, pool.layout, locs, counts.float())
    with pytest.raises(ValueError, match=r"locs must be int \[n\]"):
        index_scores_shared(q, w, pool.buf, pool.layout, locs, counts)
    native = SplitPages(2, 4, 584, device=DEVICE)
    with pytest.raises(ValueError, match="128 code bytes"):
        index_scores(q, w, native.buf, native.layout, locs, counts)


@pytest.mark.skipif(not ON_GPU, reason="compiled on the GPU; the interpreter runs the same function above")
@pytest.mark.gpu
def test_scores_at_v4_flash_shapes_on_gpu():
    gen = torch.Generator().manual_seed(0)
    pool = _pool(gen, 130, 64)
    B, n = 32, 8192
    locs = torch.randperm(130 * 64, generator=gen)[:n].repeat(B, 1).to(DEVICE)
    counts = torch.randint(1, n + 1, (B,), generator=gen).to(DEVICE)
    q = torch.randn(B, 64, 128, generator=gen).to(DEVICE, torch.bfloat16)
    w = torch.randn(B, 64, generator=gen).to(DEVICE)
    got = index_scores(q, w, pool.buf, pool.layout, locs, counts)
    _same_scores(got, index_scores_reference(q, w, pool.buf, pool.layout, locs, counts))
    shared = index_scores_shared(q, w, pool.buf, pool.layout, locs[0], counts)
    _same_scores(shared, index_scores_reference(q, w, pool.buf, pool.layout, locs[0], counts))
    # The selection from them on the GPU: the stable sort's, ties and -inf included.
    for k in (1, 512, n):
        assert torch.equal(index_top_k(got, k)[1], top_k_reference(got, k)[1])
