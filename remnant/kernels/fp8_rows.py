"""FP8 e4m3 codes with one float32 scale per slice: the MoE's FP8 operands.

fp8_codes is the plain reference (torch's cast rounds to nearest even): quantize_experts
(remnant.kernels.moe) and quantize_rows use it. quantize_rows_triton is the same
quantization of activation rows in one kernel, a program a row, which the MoE's FP8
activations (MoEConfig.fp8_x, fp8_h) run between its kernels: torch's five ops for it
(abs, amax, clamp, divide, cast) had cost 40-50 us a call at 8-32 tokens on an H100
(2026-12-07, benchmarks/engine-h100-routed-apart/). Its codes and scales are the
reference's bit for bit (tests/kernels/test_fp8_rows.py, on an H100 at d7a8263; under
Triton's interpreter through cast_nearest's FP8 rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from remnant.kernels.common import cast_nearest, interpreted
from remnant.kv.formats import FP8_MAX

#: The least normal float32: the scale of a slice of zeros, so that codes stay 0, not NaN.
TINY = torch.finfo(torch.float32).tiny


def fp8_codes(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 codes of t (float) and float32 scales, one per slice along axis 1 (the
    summed axis of experts [E, K, N] and of activations [R, C]): scale = amax over it times
    float32(1 / 448) (TINY for a slice of zeros), codes = t / scale cast by torch (round to
    nearest even). Times the reciprocal, not divided by 448: torch divides a CUDA tensor by
    a number that way and a CPU one exactly, which differ in the last bit for about half
    of all amax; a multiply is the same on both, and in the kernel."""
    t = t.float()
    scale = (t.abs().amax(dim=1) * (1.0 / FP8_MAX)).clamp_min(TINY)
    return (t / scale.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 codes and float32 scales of activations t float [R, C], one scale per row.
    Returns (codes float8_e4m3fn [R, C], scale float32 [R]): the aligned MoE kernels'
    operands with MoEConfig.fp8_x and fp8_h."""
    if t.ndim != 2 or not t.is_floating_point():
        raise ValueError(f"quantize_rows expects float [R, C] activations, got {t.dtype} {tuple(t.shape)}")
    return fp8_codes(t)


@triton.jit
def _quantize_rows_kernel(t_ptr, stride_t, codes_ptr, stride_c, scale_ptr, C: tl.constexpr, BLOCK: tl.constexpr,
                          TINY_SCALE: tl.constexpr, INTERPRETED: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    inside = c < C
    v = tl.load(t_ptr + r * stride_t + c, mask=inside, other=0.0).to(tl.float32)
    # The scale as fp8_codes forms it (times float32(1 / 448)); the codes by IEEE division,
    # as torch divides two tensors (Triton's plain '/' compiles to div.approx.f32).
    scale = tl.maximum(tl.max(tl.abs(v), axis=0) * (1.0 / 448.0), TINY_SCALE)
    q = tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0)
    tl.store(codes_ptr + r * stride_c + c, cast_nearest(q, codes_ptr.dtype.element_ty, INTERPRETED), mask=inside)
    tl.store(scale_ptr + r, scale)


def quantize_rows_triton(t: torch.Tensor, codes: torch.Tensor | None = None,
                         scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows in one kernel: on CUDA tensors compiled, on CPU ones under Triton's
    interpreter. Graph-safe (no host sync). codes (float8_e4m3fn, t's shape) and scale
    (float32 [R]): output buffers, allocated when None. A row is one program's block, so C
    is at most 16384 (the MoE's rows: hidden 4096, I 2048)."""
    if t.ndim != 2 or not t.is_floating_point() or t.stride(1) != 1:
        raise ValueError(f"quantize_rows_triton expects float [R, C] activations with contiguous rows, got "
                         f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")
    R, C = t.shape
    if C > 16384:
        raise ValueError(f"quantize_rows_triton takes rows of at most 16384 values (one program's block), got {C}")
    codes = torch.empty(R, C, dtype=torch.float8_e4m3fn, device=t.device) if codes is None else codes
    scale = torch.empty(R, dtype=torch.float32, device=t.device) if scale is None else scale
    if codes.shape != t.shape or codes.dtype != torch.float8_e4m3fn or codes.stride(1) != 1:
        raise ValueError(f"codes must be float8_e4m3fn {tuple(t.shape)} with contiguous rows, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    if scale.shape != (R,) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be float32 ({R},), got {scale.dtype} {tuple(scale.shape)}")
    if R:
        block = triton.next_power_of_2(C)
        _quantize_rows_kernel[(R,)](t, t.stride(0), codes, codes.stride(0), scale, C=C, BLOCK=block,
                                    TINY_SCALE=TINY, INTERPRETED=interpreted(), num_warps=max(1, min(8, block // 512)))
    return codes, scale
