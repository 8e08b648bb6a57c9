"""RMS norm in Triton, one program per row: the step's hidden-state and query-LoRA norms
(three a layer, 130 launches a V4-Flash step).

Why not TorchInductor's: its compiled rms_norm (remnant.engine.step_ops) took 3.6 us a call
at batch 1 on an H100 at 65f013e and 17 us at 4851dd4 (2026-12-06, the same kernel name and
shapes; `benchmarks/engine-h200-per-pair/`), a config chosen by size hints this project does
not control. A row here is one tile, so its time does not depend on them.

It rounds where the plain function rounds (the normed row in x's dtype, its product with
the weight in the product's dtype), so it gives its values but where a float32 rounding
apart (the mean's summation order, sqrt then divide for rsqrt) crosses a rounding
boundary. Plain reference: remnant.engine.ops.rms_norm (tests/kernels/test_norm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from remnant.kernels.common import cast_nearest, interpreted


@triton.jit
def normed_times_weight(x, ms, w, eps, ROUND_Y: tl.constexpr, INTERPRETED: tl.constexpr):
    """remnant.engine.ops.rms_norm's roundings, given x's mean square ms (float32): x *
    rsqrt(ms + eps) rounded to x's dtype, times w in the product's dtype (x's where
    ROUND_Y, else float32). Returns float32 (holding that dtype's values). rope.norm_rope
    uses it too."""
    normed = cast_nearest(x.to(tl.float32) * (1.0 / tl.sqrt(ms + eps)), x.dtype, INTERPRETED)
    y = normed.to(tl.float32) * w.to(tl.float32)
    if ROUND_Y:
        y = cast_nearest(y, x.dtype, INTERPRETED).to(tl.float32)
    return y


@triton.jit
def _rms_norm_kernel(x_ptr, x_stride, w_ptr, out_ptr, eps, D: tl.constexpr, BLOCK: tl.constexpr,
                     ROUND_Y: tl.constexpr, INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    inside = d < D
    x = tl.load(x_ptr + row * x_stride + d, mask=inside, other=0.0)
    xf = x.to(tl.float32)
    y = normed_times_weight(x, tl.sum(xf * xf, axis=0) / D, tl.load(w_ptr + d, mask=inside, other=0.0), eps,
                            ROUND_Y, INTERPRETED)
    tl.store(out_ptr + row * D + d, cast_nearest(y, out_ptr.dtype.element_ty, INTERPRETED), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """remnant.engine.ops.rms_norm in one launch: x [..., D] (a row-strided 2-D view is
    fine: the step's column slices of its projections), weight [D]. Returns a new
    contiguous tensor of the plain function's dtype (x's and weight's promoted). Graph-safe."""
    D = x.shape[-1]
    if x.stride(-1) != 1 or weight.shape != (D,):
        raise ValueError(f"x must have unit column stride and weight shape ({D},), got x strides {x.stride()} "
                         f"and weight {tuple(weight.shape)}")
    rows = x if x.ndim == 2 else x.reshape(-1, D)
    product = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=product, device=x.device)
    if rows.shape[0] and D:
        block = triton.next_power_of_2(D)
        _rms_norm_kernel[(rows.shape[0],)](rows, rows.stride(0), weight.contiguous(), out, eps, D=D, BLOCK=block,
                                           ROUND_Y=product == x.dtype, INTERPRETED=interpreted(),
                                           num_warps=min(16, max(4, block // 512)))
    return out
