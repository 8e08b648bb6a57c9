"""Reference FP8 codec of native C4 records, as SGLang 0.5.18 quantizes the DeepSeek-V4 KV.

SGLang's quantizer (sglang/kernels/ops/attention/dsv4/quant_k_cache.py) casts the latent to
bf16, then per 64-coordinate NoPE tile takes scale = max(amax, 1e-8) / 448 rounded up to a
power of two (UE8M0, stored as exponent + 127), divides, clamps to +-448 and casts to
float8_e4m3fn; RoPE stays bf16.
"""

from __future__ import annotations

import torch

from remnant.kv.formats import (
    FP8_MAX,
    HEAD_DIM,
    NATIVE_RECORD_BYTES,
    NOPE_DIM,
    NUM_TILES,
    ROPE_BYTES,
    TILE,
    UE8M0_BIAS,
)

_EPS = 1e-8
_ROPE_START = NOPE_DIM
_SCALE_START = NOPE_DIM + ROPE_BYTES


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Quantize latents to native records.

    x: float [n, 512] (any float dtype; rounded to bf16 first, as SGLang stores bf16 K).
    Returns uint8 [n, 584].
    """
    if x.ndim != 2 or x.shape[1] != HEAD_DIM or not x.is_floating_point():
        raise ValueError(f"quantize expects float [n, {HEAD_DIM}] latents, got {x.dtype} {tuple(x.shape)}")
    finite = torch.isfinite(x).all(dim=1)
    if not bool(finite.all()):
        row = int((~finite).nonzero()[0])
        # SGLang's kernel gives implementation-defined scales for NaN/Inf (the exponent of
        # an infinite amax cast to uint8); the reference refuses them instead.
        raise ValueError(f"quantize: row {row} has non-finite values (NaN or Inf); records need finite latents")
    xb = x.to(torch.bfloat16)
    nope = xb[:, :NOPE_DIM].float().view(-1, NUM_TILES, TILE)
    amax = nope.abs().amax(dim=-1).clamp_min(_EPS)
    exponent = torch.ceil(torch.log2(amax / FP8_MAX))
    scaled = nope * torch.exp2(-exponent).unsqueeze(-1)
    codes = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)

    out = torch.zeros(x.shape[0], NATIVE_RECORD_BYTES, dtype=torch.uint8, device=x.device)
    out[:, :NOPE_DIM] = codes.reshape(-1, NOPE_DIM)
    out[:, _ROPE_START:_SCALE_START] = xb[:, NOPE_DIM:].contiguous().view(torch.uint8)
    out[:, _SCALE_START : _SCALE_START + NUM_TILES] = (exponent + UE8M0_BIAS).to(torch.uint8)
    return out


def dequantize(records: torch.Tensor) -> torch.Tensor:
    """Decode native records. records: uint8 [n, 584]. Returns float32 [n, 512]."""
    if records.dtype != torch.uint8 or records.ndim != 2 or records.shape[1] != NATIVE_RECORD_BYTES:
        raise ValueError(
            f"dequantize expects uint8 [n, {NATIVE_RECORD_BYTES}] records, got {records.dtype} {tuple(records.shape)}"
        )
    n = records.shape[0]
    codes = records[:, :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).float()
    exponent = records[:, _SCALE_START : _SCALE_START + NUM_TILES].float() - UE8M0_BIAS
    nope = codes.view(n, NUM_TILES, TILE) * torch.exp2(exponent).unsqueeze(-1)
    rope = records[:, _ROPE_START:_SCALE_START].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope.reshape(n, NOPE_DIM), rope], dim=1)


def dequantize_ordered(records: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Decode records quantized from latents with their columns in `order` (int [512]: the
    record's column j holds natural column order[j], as quantize(x[:, order]) makes them).
    Returns float32 [n, 512] in natural column order."""
    if order.shape != (HEAD_DIM,):
        raise ValueError(f"order must be a column order [{HEAD_DIM}], got {tuple(order.shape)}")
    keys = dequantize(records)
    natural = torch.empty_like(keys)
    natural[:, order.to(device=keys.device, dtype=torch.long)] = keys
    return natural
