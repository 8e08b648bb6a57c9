"""remnant.kernels.store against remnant.kv.paged.store_reference (the torch reference)."""

from __future__ import annotations

import pytest
import torch

from remnant.kernels.common import alignment
from remnant.kernels.store import PERMUTES, store as store_kernel
from remnant.kernels.store import store_kept_first
from remnant.kv.formats import NOPE_DIM
from remnant.kv.layout import KeptColumns, PageLayout
from remnant.kv.paged import gather, quantize_kept_first, store_reference
from tests.kernels.inputs import DEVICE, ON_GPU, POISON, keep_map, latents, poisoned_pages, triton_fp8_codes


def _scaled_kept(x: torch.Tensor, keep) -> torch.Tensor:
    """x / 2^e per tile, at the kept columns: the values the kernel casts to FP8."""
    nope = x[:, :NOPE_DIM].float().view(-1, 7, 64)
    e = torch.ceil(torch.log2(nope.abs().amax(-1).clamp_min(1e-8) / 448.0))
    scaled = (nope * torch.exp2(-e)[..., None]).reshape(-1, NOPE_DIM)
    return scaled if keep is None else scaled[:, keep.to(scaled.device)]


def check_store(n: int, retention: int, per_page: int, pages: int, seed: int, permute: str | None = "registers") -> None:
    gen = torch.Generator().manual_seed(seed)
    keep = keep_map(retention, gen)
    layout = PageLayout.sglang(per_page, retention) if per_page > 1 else PageLayout.rows(
        PageLayout.sglang(2, retention).record_bytes)
    x = latents(n, gen).to(DEVICE)
    locs = torch.randperm(per_page * pages, generator=gen)[:n].to(DEVICE)
    want = poisoned_pages(layout, pages)
    store_reference(x, want, layout, locs, keep)
    got = poisoned_pages(layout, pages)
    store_kernel(x, got, layout, locs, keep, check_range=True, permute=permute)

    if ON_GPU:
        assert torch.equal(got, want)
        return
    # Interpreter: every byte equal except FP8 codes where Triton 3.9's interpreted cast
    # differs from torch's; those must be exactly the interpreter's cast of the same value.
    codes_n = NOPE_DIM if keep is None else keep.numel()
    got_rec, want_rec = gather(got, layout, locs), gather(want, layout, locs)
    assert torch.equal(got_rec[:, codes_n:], want_rec[:, codes_n:]), "RoPE, scales or pad differ"
    differ = got_rec[:, :codes_n] != want_rec[:, :codes_n]
    interpreted = triton_fp8_codes(_scaled_kept(x, keep))
    assert torch.equal(got_rec[:, :codes_n][differ], interpreted[differ])
    assert codes_n == 0 or differ.float().mean() < 0.1  # R = 64 keeps no code
    untouched = torch.ones(layout.capacity(got), dtype=torch.bool)
    untouched[locs.cpu()] = False
    rest = untouched.nonzero().flatten()
    assert torch.equal(gather(got, layout, rest), gather(want, layout, rest)), "bytes outside locs were written"


@pytest.mark.parametrize("permute", PERMUTES)
@pytest.mark.parametrize("retention", [512, 448, 320, 256, 192, 128, 64])
def test_store_matches_reference_in_split_pages(retention, permute):
    check_store(n=37, retention=retention, per_page=16, pages=5, seed=retention, permute=permute)


@pytest.mark.parametrize("retention", [512, 256, 192, 128])
def test_store_default_permutation_matches_reference(retention):
    # "loads" up to R = 192, "shared" above: both sides of the switch.
    check_store(n=41, retention=retention, per_page=16, pages=5, seed=3 + retention, permute=None)


def check_store_kept_first(n: int, retention: int, pages: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    keep = keep_map(retention, gen)
    layout = PageLayout.sglang(16)
    x = latents(n, gen).to(DEVICE)
    locs = torch.randperm(16 * pages, generator=gen)[:n].to(DEVICE)
    cols = KeptColumns.of(keep, DEVICE)
    want = quantize_kept_first(x, cols)
    got_pages = poisoned_pages(layout, pages)
    store_kept_first(x, got_pages, layout, locs, keep, check_range=True)
    got = gather(got_pages, layout, locs)
    if ON_GPU:
        assert torch.equal(got, want)
    else:  # codes may differ only where the interpreter's FP8 cast does (see check_store)
        assert torch.equal(got[:, NOPE_DIM:], want[:, NOPE_DIM:]), "RoPE, scales or pad differ"
        differ = got[:, :NOPE_DIM] != want[:, :NOPE_DIM]
        interpreted = triton_fp8_codes(_scaled_kept(x[:, cols.order.long()], None))
        assert torch.equal(got[:, :NOPE_DIM][differ], interpreted[differ])
        assert differ.float().mean() < 0.1
    untouched = torch.ones(layout.capacity(got_pages), dtype=torch.bool)
    untouched[locs.cpu()] = False
    assert bool((gather(got_pages, layout, untouched.nonzero().flatten().to(DEVICE)) == POISON).all()), "bytes outside locs were written"


@pytest.mark.parametrize("retention", [256, 64, 448])
def test_store_kept_first_quantizes_the_latent_in_kept_first_order(retention):
    check_store_kept_first(n=37, retention=retention, pages=5, seed=retention + 1)


def test_store_kept_first_refuses_a_packed_layout():
    layout = PageLayout.sglang(16, 256)
    with pytest.raises(ValueError, match="store_kept_first writes native 584-byte records, but the layout holds 328"):
        store_kept_first(torch.zeros(2, 512, device=DEVICE), poisoned_pages(layout, 1), layout,
                         torch.arange(2, device=DEVICE), keep_map(256, torch.Generator().manual_seed(0)))


def test_store_into_plain_rows():
    check_store(n=13, retention=256, per_page=1, pages=21, seed=3)


def test_store_refuses_a_layout_of_other_width():
    layout = PageLayout.sglang(16, 256)
    with pytest.raises(ValueError, match="kept codes make 584-byte records, but the layout holds 328"):
        store_kernel(torch.zeros(2, 512, device=DEVICE), poisoned_pages(layout, 1), layout,
                     torch.arange(2, device=DEVICE), None)


def test_store_refuses_locations_outside_the_pool():
    layout = PageLayout.sglang(16)
    with pytest.raises(ValueError, match=r"locs must lie in \[0, 16\)"):
        store_kernel(torch.ones(1, 512, device=DEVICE), poisoned_pages(layout, 1), layout,
                     torch.tensor([16], device=DEVICE), None, check_range=True)


def test_store_refuses_padding_locations():
    # -1 pads decode's selections, which the decode kernel masks; store would write there.
    layout = PageLayout.sglang(16)
    with pytest.raises(ValueError, match=r"locs must lie in \[0, 16\), got \[-1, 0\]"):
        store_kernel(torch.ones(2, 512, device=DEVICE), poisoned_pages(layout, 1), layout,
                     torch.tensor([0, -1], device=DEVICE), None, check_range=True)


def test_alignment_of_the_layouts_the_kernels_take():
    assert alignment(PageLayout.sglang(64, 256), "c4") == 16
    assert alignment(PageLayout.sglang(64), "c4") == 16
    assert alignment(PageLayout.rows(584), "window") == 8  # the engine's window ring
    with pytest.raises(ValueError, match="indexer: the kernels need 8-byte aligned records with an 8-byte tail"):
        alignment(PageLayout(64, 132 + 4, 64 * 136, tail_bytes=4), "indexer")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU: the compiled FP8 cast")
def test_store_kept_first_bit_exact_on_gpu_at_size():
    check_store_kept_first(n=100_003, retention=256, pages=7000, seed=5)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU: the compiled FP8 cast")
@pytest.mark.parametrize("permute", PERMUTES)
@pytest.mark.parametrize("retention", [512, 64, 256, 384])
def test_store_bit_exact_on_gpu_at_size(retention, permute):
    check_store(n=100_003, retention=retention, per_page=64, pages=2000, seed=11 + retention, permute=permute)
