"""Native record codec: layout, UE8M0 scales, FP8 codes as torch casts them."""

from __future__ import annotations

import torch

from remnant.kv import NATIVE_RECORD_BYTES, dequantize, packed_record_bytes, quantize


def test_sizes():
    assert NATIVE_RECORD_BYTES == 584
    assert [packed_record_bytes(r) for r in (64, 256, 448)] == [136, 328, 520]


def test_layout_and_round_trip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 512, generator=g) * torch.logspace(-3, 3, 37)[:, None]
    rec = quantize(x)
    assert rec.shape == (37, 584) and rec.dtype == torch.uint8
    assert (rec[:, 583] == 0).all()  # pad byte
    xb = x.to(torch.bfloat16).float()
    # RoPE is kept bit-exact as bf16.
    assert torch.equal(rec[:, 448:576].contiguous().view(torch.bfloat16).float(), xb[:, 448:])
    # Each tile's scale is the smallest power of two with amax / scale <= 448.
    tiles = xb[:, :448].view(37, 7, 64).abs().amax(-1)
    exp = rec[:, 576:583].float() - 127
    assert (tiles / torch.exp2(exp) <= 448).all() and (tiles / torch.exp2(exp - 1) > 448).all()
    y = dequantize(rec)
    rel = (y[:, :448] - xb[:, :448]).abs() / tiles.repeat_interleave(64, dim=1)
    assert rel.max() < 2**-4  # e4m3: 3 mantissa bits


def test_codes_are_torchs_fp8_cast():
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    rec = quantize(x)
    xb = x.to(torch.bfloat16).float()[:, :448].view(5, 7, 64)
    scale = torch.exp2(rec[:, 576:583].float() - 127)[..., None]
    codes = (xb / scale).to(torch.float8_e4m3fn).view(torch.uint8).reshape(5, 448)
    assert torch.equal(rec[:, :448], codes)


def test_zero_tile():
    rec = quantize(torch.zeros(1, 512))
    assert (rec[:, :448] == 0).all()
    assert torch.equal(dequantize(rec), torch.zeros(1, 512))


def test_bad_shapes_and_dtypes():
    import pytest

    with pytest.raises(ValueError, match=r"quantize expects float \[n, 512\] latents, got torch.float32 \(3, 511\)"):
        quantize(torch.zeros(3, 511))
    with pytest.raises(ValueError, match=r"quantize expects float"):
        quantize(torch.zeros(3, 512, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"dequantize expects uint8 \[n, 584\] records, got torch.int8"):
        dequantize(torch.zeros(3, 584, dtype=torch.int8))
