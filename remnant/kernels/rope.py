"""RoPE in Triton, and norm_rope: the queries' and window latents' RMS norm and RoPE in one
launch.

A 512-coordinate latent is held as a [ROWS, 32] tile, so RoPE's two halves (coordinates
448-479 and 480-511) are its last two rows and rotate as whole rows (`rotate`). Angles are
formed as remnant.engine.ops.rope forms them (float32 position times the same float32
inverse frequencies, made by the same expression on the same device); tl.cos and tl.sin
are libdevice's accurate ones on the GPU (full range reduction, as torch's), so the 1e5-1e6
rad angles of long contexts lose nothing to them.

norm_rope replaces TorchInductor's three kernels a call (a reduction and two pointwise
kernels, `step_ops`' compiled norm_rope) with one launch, a program per token and
HEADS_PER_PROGRAM of its heads: twice a layer and once
more a compressed layer (the compressor's latent), 127 launches of a V4-Flash step. It
rounds where the plain ops round (the norm's bf16 result, its product with the weight,
each rotated half: remnant.kernels.norm.normed_times_weight), so it gives their values
but where a float32 rounding apart (the mean's summation order, sqrt then divide for
rsqrt) crosses a bf16 rounding boundary. Plain reference: remnant.engine.ops.norm_rope
(tests/kernels/test_rope.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from remnant.kernels.common import cast_nearest, interpreted
from remnant.kernels.norm import normed_times_weight
from remnant.kv.formats import HEAD_DIM, NOPE_DIM

ROPE_HALF = (HEAD_DIM - NOPE_DIM) // 2  # 32: RoPE rotates coordinate i with i + 32 of the last 64
#: A latent as a [ROWS, ROPE_HALF] tile: its last two rows are RoPE's two halves.
ROWS = HEAD_DIM // ROPE_HALF
#: Most heads of a token one norm_rope program takes. One: on an H100 the q call (64 heads)
#: took 2.6 us at batch 1 and 19.6 us at batch 128 in the kernel before f235e99, a program
#: per head (4851dd4's kernel logs, benchmarks/engine-h100-fused/), and 5.7 and 24.3 us
#: with 8 heads a program, which form their angles once (7d1eb02's, benchmarks/engine-h100-
#: launch-ahead/): the angles cost less than the parallelism fewer programs lose. This
#: kernel at one head a program (a [1, 16, 32] tile) is not yet timed.
HEADS_PER_PROGRAM = 1


@functools.cache
def rope_inverse_frequencies(theta: float, device: torch.device) -> torch.Tensor:
    """float32 [32]: RoPE's inverse frequencies as remnant.engine.ops.rope forms them, on
    `device` (the same expression on the same device, so the same roundings). Cached: a
    CUDA graph replays the tensor made by the eager call before its capture (the engine
    runs each bucket eagerly first, remnant.engine.graphs; made inside a capture, it would
    hold whatever the graph's first replay left there)."""
    return theta ** (-torch.arange(ROPE_HALF, dtype=torch.float32, device=device) / ROPE_HALF)


@triton.jit
def rotate(x, position, inv_ptr, ROWS: tl.constexpr, HALF: tl.constexpr):
    """x float32 [HEADS, ROWS, HALF] (latents sharing one position) rotated at `position`
    (an integer): the last two rows of each are the halves r1, r2 -> r1 cos - r2 sin,
    r1 sin + r2 cos, in float32. The angles are formed once for all of them."""
    r = tl.arange(0, ROWS)[None, :, None]
    angle = position.to(tl.float32) * tl.load(inv_ptr + tl.arange(0, HALF))  # float32, as torch forms it
    cos = tl.cos(angle)[None, None, :]
    sin = tl.sin(angle)[None, None, :]
    r1 = tl.sum(tl.where(r == ROWS - 2, x, 0.0), axis=1)[:, None, :]
    r2 = tl.sum(tl.where(r == ROWS - 1, x, 0.0), axis=1)[:, None, :]
    return tl.where(r == ROWS - 2, r1 * cos - r2 * sin, tl.where(r == ROWS - 1, r1 * sin + r2 * cos, x))


@triton.jit
def _norm_rope_kernel(x_ptr, x_stride_t, x_stride_h, w_ptr, pos_ptr, pos_scale, inv_ptr, out_ptr, eps, H,
                      ROWS: tl.constexpr, HALF: tl.constexpr, HEADS: tl.constexpr, ROUND_Y: tl.constexpr,
                      INTERPRETED: tl.constexpr):
    """Token pid0's heads [pid1 * HEADS, +HEADS): they share its position, so its angles."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    d = tl.arange(0, ROWS)[:, None] * HALF + tl.arange(0, HALF)[None, :]
    inside = (h < H)[:, None, None]
    x = tl.load(x_ptr + t * x_stride_t + h.to(tl.int64)[:, None, None] * x_stride_h + d[None, :, :], mask=inside,
                other=0.0)
    xf = x.to(tl.float32)
    ms = tl.sum(tl.sum(xf * xf, axis=2), axis=1) / (ROWS * HALF)
    y = normed_times_weight(x, ms[:, None, None], tl.load(w_ptr + d)[None, :, :], eps, ROUND_Y, INTERPRETED)
    rotated = rotate(y, tl.load(pos_ptr + t) * pos_scale, inv_ptr, ROWS, HALF)
    # Where y is already in the output's dtype its cast is exact: each value rounds once.
    out = tl.where(d[None, :, :] < ROWS * HALF - 2 * HALF, y, rotated)
    tl.store(out_ptr + (t * H + h.to(tl.int64)[:, None, None]) * (ROWS * HALF) + d[None, :, :],
             cast_nearest(out, out_ptr.dtype.element_ty, INTERPRETED), mask=inside)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
              theta: float, position_scale: int = 1, out_dtype: torch.dtype | None = None,
              heads_per_program: int = HEADS_PER_PROGRAM) -> torch.Tensor:
    """remnant.engine.ops.norm_rope in one launch: x [T, 512] or [T, H, 512] (a row-strided
    view is fine), weight [512], positions int [T] (times position_scale: a compressor's
    block index times its ratio). Returns a new contiguous tensor of the plain function's
    dtype (x's and weight's promoted), or of out_dtype (the last step's float32 value
    rounded to it). Graph-safe. heads_per_program: a power of two, the most heads of a
    token one program takes (tests take others than the default)."""
    if x.ndim not in (2, 3) or x.shape[-1] != HEAD_DIM or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, {HEAD_DIM}] or [T, H, {HEAD_DIM}] with unit column stride, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if positions.shape != x.shape[:1] or weight.shape != (HEAD_DIM,):
        raise ValueError(f"positions must be [{x.shape[0]}] and weight [{HEAD_DIM}], got {tuple(positions.shape)} "
                         f"and {tuple(weight.shape)}")
    if heads_per_program < 1 or heads_per_program & (heads_per_program - 1):
        raise ValueError(f"heads_per_program={heads_per_program} is not allowed; allowed: a power of two")
    heads = x.shape[1] if x.ndim == 3 else 1
    product = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype or product, device=x.device)
    if x.numel():
        block = min(heads_per_program, triton.next_power_of_2(heads))
        _norm_rope_kernel[(x.shape[0], triton.cdiv(heads, block))](
            x, x.stride(0), x.stride(1) if x.ndim == 3 else 0, weight.contiguous(), positions.contiguous(),
            position_scale, rope_inverse_frequencies(float(theta), x.device), out, eps, heads,
            ROWS=ROWS, HALF=ROPE_HALF, HEADS=block, ROUND_Y=product == x.dtype, INTERPRETED=interpreted(),
            num_warps=4)
    return out
