"""remnant.kv.paged: kept-first window records (quantize_kept_first, dequantize_kept_first,
store_kept_first_reference). The reference decode over them is tests/kernels/decode/
test_reference.py's."""

from __future__ import annotations

import torch

from remnant.kv.codec import dequantize, quantize
from remnant.kv.formats import NOPE_DIM
from remnant.kv.layout import KeptColumns, PageLayout
from remnant.kv.paged import dequantize_kept_first, gather, quantize_kept_first, store_kept_first_reference
from tests.kernels.inputs import latents

CPU = torch.device("cpu")


def _cols(seed: int, n_kept: int = 192) -> tuple[torch.Tensor, KeptColumns]:
    keep = torch.randperm(448, generator=torch.Generator().manual_seed(seed))[:n_kept].sort().values
    return keep, KeptColumns.of(keep, CPU)


def test_kept_first_records_tile_scales_by_kept_first_position():
    # Natural tile t of every latent has magnitude 4^t, so a natural tiling and a kept-first
    # one give different scales; the record must be the native record of the latent read in
    # kept-first order: codes of the kept columns (map order), then the dropped, and tile
    # t's scale from kept-first positions 64t..64t+63.
    keep, cols = _cols(4)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(5))
    x[:, :NOPE_DIM] *= (4.0 ** (torch.arange(NOPE_DIM) // 64)).float()
    records = quantize_kept_first(x, cols)
    dropped = torch.ones(NOPE_DIM, dtype=torch.bool)
    dropped[keep] = False
    permuted = torch.cat([x[:, keep], x[:, :NOPE_DIM][:, dropped], x[:, NOPE_DIM:]], dim=1)
    assert torch.equal(records, quantize(permuted))
    xb = x.to(torch.bfloat16).float()[:, cols.order.long()]
    amax = xb[:, :NOPE_DIM].abs().unflatten(1, (7, 64)).amax(-1)
    assert torch.equal(records[:, 576:583].long(), (torch.ceil(torch.log2(amax / 448)) + 127).long())
    assert not torch.equal(records[:, 576:583], quantize(x)[:, 576:583])


def test_kept_first_records_round_trip_to_natural_order():
    _, cols = _cols(6, n_kept=256)
    x = latents(9, torch.Generator().manual_seed(7)).float()
    back = dequantize_kept_first(quantize_kept_first(x, cols), cols)
    assert torch.equal(back[:, NOPE_DIM:], x[:, NOPE_DIM:])  # RoPE is bf16 as given
    # FP8 e4m3: within 2^-4 of each value, or 2^-10 of its tile's scale below the normals.
    scales = torch.exp2(quantize_kept_first(x, cols)[:, 576:583].float() - 127)
    floor = scales[:, cols.inverse[:NOPE_DIM].long() // 64] * 2.0**-10
    assert bool(((back - x)[:, :NOPE_DIM].abs() <= 2.0**-4 * x[:, :NOPE_DIM].abs() + floor).all())
    # All 448 kept: kept-first order is the natural one, and the records are native.
    native = KeptColumns.of(None, CPU)
    assert torch.equal(quantize_kept_first(x, native), quantize(x))
    assert torch.equal(dequantize_kept_first(quantize(x), native), dequantize(quantize(x)))


def test_store_kept_first_reference_writes_quantize_kept_first_records():
    keep, cols = _cols(8)
    layout = PageLayout.sglang(16)
    pages = torch.full((3, layout.page_stride), 0xAB, dtype=torch.uint8)
    x = latents(11, torch.Generator().manual_seed(9))
    locs = torch.tensor([0, 5, 17, 3, 40, 41, 2, 33, 20, 9, 47])
    store_kept_first_reference(x, pages, layout, locs, keep)
    assert torch.equal(gather(pages, layout, locs), quantize_kept_first(x, cols))
