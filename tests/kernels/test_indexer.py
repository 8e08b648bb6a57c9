"""remnant.kernels.indexer: the indexer's scores over FP8 keys in their pages against the
float64 reference."""

from __future__ import annotations

import pytest
import torch

from remnant.engine.ops import index_top_k, index_top_k_reference, quantize_index_keys
from remnant.engine.pools import SplitPages
from remnant.kernels.indexer import index_scores, index_scores_reference, keys_at
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
    visible = torch.rand(B, n, generator=gen) < 0.8
    q = torch.randn(B, heads, 128, generator=gen).to(DEVICE, dtype)
    w = torch.randn(B, heads, generator=gen).to(DEVICE)
    locs, visible = locs.to(DEVICE), visible.to(DEVICE)
    got = index_scores(q, w, pool.buf, pool.layout, locs, visible)
    want = index_scores_reference(q, w, pool.buf, pool.layout, locs, visible)
    hidden = ~visible | (locs < 0)
    assert torch.isneginf(got[hidden]).all() and torch.isfinite(got[~hidden]).all()
    # float32 accumulation of exact products (codes are exact in q's dtype): summation order only.
    torch.testing.assert_close(got[~hidden], want[~hidden], rtol=1e-5, atol=1e-4 * want.abs().max().item())


def test_scores_read_the_keys_where_the_layout_puts_them():
    # One key at a time: a score with one head and weight 1 is relu(q . key), the key as
    # keys_at dequantizes it from its page.
    gen = torch.Generator().manual_seed(5)
    pool = _pool(gen, 4, 8)
    locs = torch.tensor([[0, 7, 8, 31]], device=DEVICE)
    q = torch.randn(1, 1, 128, generator=gen).to(DEVICE)
    got = index_scores(q, torch.ones(1, 1, device=DEVICE), pool.buf, pool.layout, locs,
                       torch.ones(1, 4, dtype=torch.bool, device=DEVICE))
    keys = keys_at(pool.buf, pool.layout, locs)[0]
    torch.testing.assert_close(got[0], torch.relu(keys @ q[0, 0]), rtol=1e-5, atol=1e-5)


def test_bad_arguments_name_the_argument():
    pool = SplitPages(2, 4, 132, 4, device=DEVICE)
    q, w = torch.zeros(1, 2, 128, device=DEVICE), torch.zeros(1, 2, device=DEVICE)
    locs, visible = torch.zeros(1, 3, dtype=torch.long, device=DEVICE), torch.ones(1, 3, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="q must be"):
        index_scores(q[..., :64], w, pool.buf, pool.layout, locs, visible)
    with pytest.raises(ValueError, match="w must be"):
        index_scores(q, w[:, :1], pool.buf, pool.layout, locs, visible)
    with pytest.raises(ValueError, match="visible bool"):
        index_scores(q, w, pool.buf, pool.layout, locs, visible.int())
    native = SplitPages(2, 4, 584, device=DEVICE)
    with pytest.raises(ValueError, match="128 code bytes"):
        index_scores(q, w, native.buf, native.layout, locs, visible)


@pytest.mark.skipif(not ON_GPU, reason="compiled on the GPU; the interpreter runs the same function above")
@pytest.mark.gpu
def test_scores_at_v4_flash_shapes_on_gpu():
    gen = torch.Generator().manual_seed(0)
    pool = _pool(gen, 130, 64)
    B, n = 32, 8192
    locs = torch.randperm(130 * 64, generator=gen)[:n].repeat(B, 1).to(DEVICE)
    visible = (torch.arange(n)[None, :] < torch.randint(1, n + 1, (B, 1), generator=gen)).to(DEVICE)
    q = torch.randn(B, 64, 128, generator=gen).to(DEVICE, torch.bfloat16)
    w = torch.randn(B, 64, generator=gen).to(DEVICE)
    got = index_scores(q, w, pool.buf, pool.layout, locs, visible)
    want = index_scores_reference(q, w, pool.buf, pool.layout, locs, visible)
    ok = visible
    torch.testing.assert_close(got[ok], want[ok], rtol=1e-4, atol=1e-3 * want[ok].abs().max().item())
    assert torch.isneginf(got[~ok]).all()
    # The selection from them on the GPU: the stable sort's, ties and -inf included.
    for k in (1, 512, n):
        assert torch.equal(index_top_k(got, k)[1], index_top_k_reference(got, k)[1])
