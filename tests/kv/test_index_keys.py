"""remnant.kv.index_keys: the indexer key formats (fp8, mxfp4), their byte sizes, and the
MXFP4 codec against SGLang 0.5.18's own encoders: a scalar transcription of its CUDA writer
(fused_norm_rope_v2.cuh, the default compressor's) on edge values, and its Triton writer
and page store (kernels/ops/attention/dsv4/fp4_indexer.py), run from its source under
Triton's interpreter. No FP8 cast is involved, so the interpreter's FP8 defect
(triton-lang/triton#8322) does not touch these comparisons."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from remnant.engine.pools import SplitPages
from remnant.kv.index_keys import (E2M1_VALUES, FP8_KEY_BYTES, MXFP4_KEY_BYTES, IndexKeyFormat,
                                   dequantize_index_keys, dequantize_index_keys_mxfp4, index_key_codes_mxfp4,
                                   index_key_format, quantize_index_keys, quantize_index_keys_mxfp4)
from tests.kv.sglang_source import load_function

THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def test_formats_name_their_bytes():
    fp8, mx = IndexKeyFormat("fp8"), IndexKeyFormat("mxfp4")
    assert (fp8.data_bytes, fp8.tail_bytes, fp8.bytes_per_key) == (128, 4, 132) == (128, 4, FP8_KEY_BYTES)
    assert (mx.data_bytes, mx.tail_bytes, mx.bytes_per_key) == (64, 4, 68) == (64, 4, MXFP4_KEY_BYTES)
    assert IndexKeyFormat("mxfp4", 256).bytes_per_key == 136 and IndexKeyFormat("fp8", 256).bytes_per_key == 264
    assert index_key_format("mxfp4") == mx and index_key_format(mx) is mx
    with pytest.raises(ValueError, match="index key format='nvfp4' is unknown; allowed: fp8, mxfp4"):
        IndexKeyFormat("nvfp4")
    with pytest.raises(ValueError, match="index_head_dim=48 must be a positive multiple of 32 for mxfp4"):
        IndexKeyFormat("mxfp4", 48)
    with pytest.raises(ValueError, match="index_head_dim=64 must be a positive multiple of 128 for fp8"):
        IndexKeyFormat("fp8", 64)


def test_fp8_format_is_the_fp8_functions():
    keys = torch.randn(9, 128, generator=torch.Generator().manual_seed(0)) * 3
    fmt = IndexKeyFormat("fp8")
    assert torch.equal(fmt.quantize(keys), quantize_index_keys(keys))
    assert torch.equal(fmt.dequantize(fmt.quantize(keys)), dequantize_index_keys(quantize_index_keys(keys)))


def _sglang_cuda(row: np.ndarray) -> bytes:
    """One key float32 [d] as SGLang's CUDA writer stores it (fused_norm_rope_indexer_fp4:
    cast_to_ue8m0(fmaxf(1e-4f, amax) / 6.0f), x * inv_scale_ue8m0, quant_fp4_e2m1), one
    coordinate at a time in numpy float32."""
    codes, exps = [], []
    for block in row.reshape(-1, 32):
        amax = np.float32(np.abs(block).max())
        raw = np.float32(max(np.float32(1e-4), amax) / np.float32(6.0))
        u = int(raw.view(np.uint32))
        exp = ((u >> 23) & 0xFF) + ((u & 0x7FFFFF) != 0)
        inv = np.uint32((127 + 127 - exp) << 23).view(np.float32)
        for x in block:
            y = np.float32(x * inv)
            ax = min(abs(float(y)), 6.0)
            idx = sum(ax > t for t in THRESHOLDS)
            codes.append(idx | (8 if (y < 0 and idx) else 0))
        exps.append(exp)
    return bytes([codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)] + exps)


def _edge_keys() -> torch.Tensor:
    """Keys float32 [k, 128] of blocks that hit every rounding threshold, ties included,
    on both sides of zero, at scales on and off powers of two, below the 1e-4 floor, and
    tiny negatives that round to zero."""
    g = torch.Generator().manual_seed(1)
    t = torch.tensor(THRESHOLDS)
    ties = torch.cat([t, -t, torch.nextafter(t, torch.tensor(9.0)), -torch.nextafter(t, torch.tensor(9.0)),
                      torch.tensor([6.0, -6.0, 0.0, -0.0, -0.1, 0.1, 0.24, -0.26])])          # 36
    tie_block = torch.cat([ties, torch.zeros(4)])[:32].clone()
    tie_block[0] = 6.0                                                                      # amax 6: scale 1
    blocks = [
        tie_block, tie_block * 2.0**-12, tie_block * 2.0**20,                               # exact power-of-two scales
        tie_block * 0.8, tie_block * 1.3,                                                   # amax off a power of two
        torch.zeros(32), torch.full((32,), 3e-5), torch.randn(32, generator=g) * 1e-5,      # below the floor
        torch.randn(32, generator=g) * 2e-4,                                                # amax near 6e-4
        torch.randn(32, generator=g) * 1e30, -torch.rand(32, generator=g) * 0.2 - 6,
        torch.randn(32, generator=g),
    ]
    blocks = torch.stack(blocks)
    rows = [blocks[torch.randperm(len(blocks), generator=g)[:4]].reshape(128) for _ in range(24)]
    rows.append(blocks[:4].reshape(128))
    return torch.stack(rows).float()


def _heavy_keys(k: int, seed: int) -> torch.Tensor:
    """Student-t (3 d.o.f.) keys with per-row scales over 4 decades: float32 [k, 128]."""
    g = torch.Generator().manual_seed(seed)
    # torch's StudentT takes no generator: a normal over the root of a chi-square / 3.
    z = torch.randn(k, 128, generator=g)
    chi = torch.randn(k, 128, 3, generator=g).pow(2).sum(-1)
    return (z / (chi / 3).sqrt() * torch.exp(2 * torch.randn(k, 1, generator=g))).float()


@pytest.mark.parametrize("source", ["edge", "heavy"])
def test_mxfp4_is_sglangs_cuda_writer(source):
    keys = _edge_keys() if source == "edge" else _heavy_keys(64, 2)
    got = quantize_index_keys_mxfp4(keys)
    assert got.shape == (keys.shape[0], 68) and got.dtype == torch.uint8
    want = torch.tensor([list(_sglang_cuda(row.numpy())) for row in keys], dtype=torch.uint8)
    assert torch.equal(got, want)
    # bf16 keys (the engine's compute dtype) are widened first, as SGLang's loads are.
    assert torch.equal(quantize_index_keys_mxfp4(keys.bfloat16()), quantize_index_keys_mxfp4(keys.bfloat16().float()))


def test_mxfp4_decodes_every_byte_exactly():
    # Every code byte under low, unit and high exponents (s = 0 reads as 0; the writer never
    # stores it; from s = 253 up, 6 x 2^(s - 127) overflows float32 and is inf).
    codes = torch.arange(256, dtype=torch.uint8).reshape(4, 64)                        # 4 keys, 256 bytes
    exps = torch.tensor([[1, 111, 127, 252], [127, 128, 126, 200], [0, 127, 127, 127], [130, 120, 127, 253]],
                        dtype=torch.uint8)
    got = dequantize_index_keys_mxfp4(torch.cat([codes, exps], dim=1))
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    nib = torch.stack([codes & 15, codes >> 4], -1).reshape(4, 128).long()
    value = torch.where(nib >= 8, -table[nib & 7], table[nib & 7])
    scale = torch.where(exps == 0, 0.0, torch.exp2(exps.double() - 127)).repeat_interleave(32, 1)
    want = value * scale
    assert torch.equal(got.double(), torch.where(want.abs() > torch.finfo(torch.float32).max, want.sign() * torch.inf,
                                                 want))
    assert got.dtype == torch.float32
    # Leading dims are kept, and a bad width names the shape it wants.
    assert dequantize_index_keys_mxfp4(torch.cat([codes, exps], dim=1).view(2, 2, 68)).shape == (2, 2, 128)
    with pytest.raises(ValueError, match=r"MXFP4 index keys must be uint8 \[..., 17 d / 32\]"):
        dequantize_index_keys_mxfp4(torch.zeros(3, 132, dtype=torch.uint8))


def test_mxfp4_rounds_to_the_nearest_grid_value():
    # Dequantized keys are the nearest e2m1 multiple of each block's scale, within half the
    # local grid step, and the block's scale is the smallest power of two >= amax / 6.
    keys = _heavy_keys(200, 3)
    codes, exps = index_key_codes_mxfp4(keys)
    back = dequantize_index_keys_mxfp4(quantize_index_keys_mxfp4(keys)).double()
    scale = torch.exp2(exps.double() - 127)                                      # [k, 4]
    blocks = keys.double().view(200, 4, 32)
    amax = blocks.abs().amax(-1).clamp_min(1e-4)
    assert (amax / 6 <= scale).all() and (amax / 6 > scale / 2).all()
    err = (back.view(200, 4, 32) - blocks).abs() / scale[..., None]
    assert (err <= 1.0).all()                                                    # half the widest step (4 -> 6)
    small = blocks.abs() / scale[..., None] <= 2
    assert (err[small] <= 0.25).all()                                            # half the step below 2


def test_mxfp4_keys_sit_in_pages_where_sglang_stores_them():
    # SGLang's Triton writer and page store, from its source, under the interpreter, against
    # quantize_index_keys_mxfp4 written through the engine's split pages: per page P x 64
    # code bytes, then P x 4 exponent bytes; with 64 keys a page both pages are 4352 bytes.
    if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 on a machine without a GPU")
    triton = pytest.importorskip("triton")
    tl = pytest.importorskip("triton.language")
    path = "kernels/ops/attention/dsv4/fp4_indexer.py"
    ns = {"triton": triton, "tl": tl, "torch": torch}
    for name in ("_select_group_value", "_ceil_ue8m0_exp", "_fp4_e2m1_code", "_quantize_fp4_indexer_kernel",
                 "_store_fp4_index_k_cache_kernel", "quantize_fp4_indexer_tensor", "store_fp4_index_k_cache"):
        load_function(path, name, ns)
    per_page, pages = 64, 3
    keys = _heavy_keys(70, 4)
    # The Triton writer floors the scale as max(amax / 6, 1e-4), the CUDA one (ours) as
    # max(1e-4, amax) / 6: equal wherever a block's amax is above 6e-4, so lift smaller blocks.
    amax = keys.view(70, 4, 32).abs().amax(-1, keepdim=True)
    keys = (keys.view(70, 4, 32) * (1e-3 / amax).clamp_min(1.0)).reshape(70, 128)
    locs = torch.randperm(pages * per_page, generator=torch.Generator().manual_seed(6))[:70]
    cache = torch.zeros(pages, per_page * 68, dtype=torch.uint8)
    ns["store_fp4_index_k_cache"](keys, cache, locs.to(torch.int64), page_size=per_page)
    pool = SplitPages(pages, per_page, 68, 4)
    assert pool.buf.shape == cache.shape
    pool.layout.write(pool.buf, locs, quantize_index_keys_mxfp4(keys))
    assert torch.equal(pool.buf, cache)
