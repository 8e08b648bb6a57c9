"""remnant.kernels.rope.norm_rope: RMS norm and RoPE in one launch against the plain ops
(remnant.engine.ops.norm_rope), at the engine's call shapes: the queries [T, H, 512] and
the window latents, a column slice [T, 512] of the projections."""

from __future__ import annotations

import pytest
import torch

from remnant.engine.ops import norm_rope as norm_rope_plain
from remnant.kernels.rope import norm_rope
from remnant.kv.formats import NOPE_DIM
from tests.kernels.inputs import DEVICE


def _inputs(shape, dtype, weight_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape[:-1], shape[-1] + 256, generator=gen) * 3).to(DEVICE, dtype)[..., 256:]  # row-strided
    weight = (1 + 0.2 * torch.randn(512, generator=gen)).to(DEVICE, weight_dtype)
    pos = torch.randint(0, 2**20, (shape[0],), generator=gen).to(DEVICE)  # angles up to 1e6 rad
    return x, weight, pos


@pytest.mark.parametrize("shape,heads_per_program", [((7, 512), 1), ((3, 8, 512), 1),
                                                     ((2, 12, 512), 8)])  # 12 heads: a program of 8 and one of 4
def test_bf16_norm_rope_rounds_where_the_plain_ops_round(shape, heads_per_program):
    x, weight, pos = _inputs(shape, torch.bfloat16, torch.bfloat16, len(shape))
    got = norm_rope(x, weight, 1e-6, pos, 10000.0, heads_per_program=heads_per_program)
    want = norm_rope_plain(x, weight, 1e-6, pos, 10000.0)
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape and got.is_contiguous()
    # The same bf16 values but where float32 summation order (the norm's mean), 1/sqrt
    # against the GPU's approximate rsqrt, or a cos rounding puts a value across a bf16
    # rounding boundary: rarely. Two roundings in a row (the normed row, then its product
    # with the weight) can each cross one, so up to 1.5 steps of the NoPE value; a rotated
    # pair carries its inputs' difference, so that bound scales with the pair's length (a
    # rotation keeps it), not with a value cancellation made small (one-step bounds
    # failed on the H100 at 128 and 8192 tokens, 2026-12-06).
    differ = got != want
    assert differ.float().mean() < 0.01
    w = want.float()
    nope, r1, r2 = w[..., :NOPE_DIM], w[..., NOPE_DIM:NOPE_DIM + 32], w[..., NOPE_DIM + 32:]
    pair = torch.hypot(r1, r2)
    step = torch.cat([nope.abs(), torch.cat([pair, pair], dim=-1) * 2.0**0.5], dim=-1) * 2.0**-6 + w.abs() * 2.0**-8
    assert ((got.float() - w).abs() <= step + 1e-6).all()
    # The NoPE part: the norm alone. A rotation by a wrong angle would move the rest by O(1),
    # most of its values off the plain ones.
    assert differ[..., :NOPE_DIM].float().mean() < 0.01
    assert differ[..., NOPE_DIM:].float().mean() < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 24, 128, 8192])
def test_norm_rope_at_the_engines_shapes_on_the_gpu(tokens):
    for shape, heads_per_program in (((tokens, 512), 1), ((tokens, 64, 512), 1), ((tokens, 64, 512), 4)):
        test_bf16_norm_rope_rounds_where_the_plain_ops_round(shape, heads_per_program)


def test_float32_latents_with_a_bf16_weight_are_float32():
    x, weight, pos = _inputs((5, 512), torch.float32, torch.bfloat16, 9)
    got = norm_rope(x, weight, 1e-6, pos, 160000.0)
    want = norm_rope_plain(x, weight, 1e-6, pos, 160000.0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_norm_rope_refuses_shapes_it_does_not_take():
    x, weight, pos = _inputs((4, 512), torch.float32, torch.float32, 1)
    with pytest.raises(ValueError, match="x must be"):
        norm_rope(x[:, :256], weight, 1e-6, pos, 1e4)
    with pytest.raises(ValueError, match="positions must be"):
        norm_rope(x, weight, 1e-6, pos[:3], 1e4)
