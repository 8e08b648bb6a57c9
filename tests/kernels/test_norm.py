"""remnant.kernels.norm.rms_norm against the plain rms_norm (remnant.engine.ops), at the
step's call shapes: the hidden state [T, 4096] and the query LoRA, a column slice
[T, 1024] of the projections; bf16 and float32 weights."""

from __future__ import annotations

import pytest
import torch

from remnant.engine.ops import rms_norm as rms_norm_plain
from remnant.kernels.norm import rms_norm
from tests.kernels.inputs import DEVICE


def _inputs(tokens, width, dtype, weight_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, width + 96, generator=gen) * 3).to(DEVICE, dtype)[:, 96:]  # row-strided
    weight = (1 + 0.2 * torch.randn(width, generator=gen)).to(DEVICE, weight_dtype)
    return x, weight


@pytest.mark.parametrize("width", [1024, 4096, 1000])
def test_bf16_rms_norm_rounds_where_the_plain_op_rounds(width, tokens=5):
    x, weight = _inputs(tokens, width, torch.bfloat16, torch.bfloat16, width)
    got = rms_norm(x, weight, 1e-6)
    want = rms_norm_plain(x, weight, 1e-6)
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape and got.is_contiguous()
    # The same values but where the float32 mean's summation order (or 1/sqrt against the
    # GPU's approximate rsqrt) puts one across a bf16 rounding boundary: rarely. Two
    # roundings in a row (the normed row, then its product with the weight) can each cross
    # one: up to 1.5 steps, under 2^-6 of the value (a one-step bound failed on the H100
    # at 8192 x 4096 values, 2026-12-06). A wrong mean or a missing rounding would move most values.
    assert (got != want).float().mean() < 0.01
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2.0**-6 + 1e-6).all()


@pytest.mark.parametrize("x_dtype,weight_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_a_float32_operand_gives_the_float32_result(x_dtype, weight_dtype):
    x, weight = _inputs(3, 512, x_dtype, weight_dtype, 4)
    got = rms_norm(x, weight, 1e-6)
    want = rms_norm_plain(x, weight, 1e-6)
    assert got.dtype == want.dtype == torch.float32
    if x_dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # the normed row rounds to bf16 first: at most one bf16 step apart
        assert ((got - want).abs() <= want.abs() * 2.0**-7 + 1e-6).all()


def test_leading_dimensions_are_rows_and_empty_is_empty():
    x, weight = _inputs(6, 512, torch.float32, torch.float32, 5)
    x3 = x.contiguous().view(2, 3, 512)
    torch.testing.assert_close(rms_norm(x3, weight, 1e-6), rms_norm(x, weight, 1e-6).view(2, 3, 512))
    assert rms_norm(x[:0], weight, 1e-6).shape == (0, 512)


def test_rms_norm_refuses_a_weight_of_another_width():
    x, weight = _inputs(2, 512, torch.float32, torch.float32, 6)
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(x, weight[:256], 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 24, 128, 8192])
def test_rms_norm_at_the_engines_shapes_on_the_gpu(tokens):
    for width in (1024, 4096):
        test_bf16_rms_norm_rounds_where_the_plain_op_rounds(width, tokens)
