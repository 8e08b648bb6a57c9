"""remnant.kernels.reconstruct against remnant.kv.paged.reconstruct_reference (exact: a byte copy)."""

from __future__ import annotations

import pytest
import torch

from remnant.kernels.reconstruct import PERMUTES, reconstruct as reconstruct_kernel
from remnant.kv.formats import RETENTION_VALUES
from remnant.kv.layout import PageLayout
from remnant.kv.paged import gather, reconstruct_reference
from tests.kernels.inputs import DEVICE, ON_GPU, POISON, filled_pool, keep_map, poisoned_pages


def check_reconstruct(k: int, retention: int, pages: int, seed: int, permute: str = "registers") -> None:
    gen = torch.Generator().manual_seed(seed)
    keep = keep_map(retention, gen)
    layout = PageLayout.sglang(64, retention)
    pool = filled_pool(layout, pages, keep, gen)
    locs = torch.randint(0, layout.capacity(pool), (k,), generator=gen).to(DEVICE)
    want = reconstruct_reference(pool, layout, locs, keep)

    rows = reconstruct_kernel(pool, layout, locs, keep, check_range=True, permute=permute)
    assert torch.equal(rows, want)

    native = PageLayout.sglang(64)
    out = poisoned_pages(native, -(-k // 64) + 1)
    out_locs = torch.randperm(native.capacity(out), generator=gen)[:k].to(DEVICE)
    reconstruct_kernel(pool, layout, locs, keep, out, native, out_locs, check_range=True, permute=permute)
    assert torch.equal(gather(out, native, out_locs), want)
    others = torch.ones(native.capacity(out), dtype=torch.bool)
    others[out_locs.cpu()] = False
    assert bool((gather(out, native, others.nonzero().flatten().to(DEVICE)) == POISON).all())


@pytest.mark.parametrize("permute", PERMUTES)
@pytest.mark.parametrize("retention", RETENTION_VALUES)
def test_reconstruct_matches_reference(retention, permute):
    check_reconstruct(k=29, retention=retention, pages=3, seed=retention, permute=permute)


def test_reconstruct_refuses_a_keep_of_other_size():
    layout = PageLayout.sglang(64, 256)
    with pytest.raises(ValueError, match="keep holds 128 codes .264-byte records., but the layout holds 328"):
        reconstruct_kernel(poisoned_pages(layout, 1), layout, torch.arange(3, device=DEVICE), torch.arange(128))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("permute", PERMUTES)
@pytest.mark.parametrize("retention", [64, 128, 256, 448])  # 128: code words stored one per thread
def test_reconstruct_exact_on_gpu_at_size(retention, permute):
    check_reconstruct(k=50_001, retention=retention, pages=3000, seed=5 + retention, permute=permute)
