"""remnant.kernels.fp8_rows: the per-row FP8 quantizing kernel against its torch reference,
bit for bit (under Triton's interpreter through cast_nearest's FP8 rounding; on a GPU the
compiled cast)."""

from __future__ import annotations

import pytest
import torch

from remnant.kernels.fp8_rows import TINY, quantize_rows, quantize_rows_triton
from tests.kernels.inputs import DEVICE, ON_GPU


def test_quantize_rows_scales_each_row_to_fp8s_range():
    t = torch.tensor([[1.0, -3.0, 0.5], [0.0, 0.0, 0.0], [1e-3, 2e-3, -4e-3]])
    codes, scale = quantize_rows(t)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (3,)
    assert scale[0] == pytest.approx(3.0 / 448) and scale[2] == pytest.approx(4e-3 / 448) and scale[1] == TINY
    assert codes.float().abs().amax(dim=1).tolist() == [448.0, 0.0, 448.0]  # each row's largest is FP8's largest
    back = codes.float() * scale[:, None]
    torch.testing.assert_close(back, t, rtol=2 ** -4, atol=0)  # 3 mantissa bits: half an ulp is 2^-4


def _rows(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of every magnitude (FP8's subnormals included once scaled), a zero row, and a
    row whose largest value is negative."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=gen) * 10.0 ** torch.randint(-3, 4, (rows, 1), generator=gen)
    t[:, : cols // 8] *= 1e-4  # small beside each row's largest: FP8 subnormal codes
    t[1] = 0.0
    t[2, 3] = -100.0 * t[2].abs().max()
    return t.to(DEVICE, dtype)


def check_against_reference(rows: int, cols: int, dtype: torch.dtype, seed: int) -> None:
    t = _rows(rows, cols, dtype, seed)
    want_codes, want_scale = quantize_rows(t)
    codes = torch.full_like(t, float("nan"), dtype=torch.float32).to(torch.float8_e4m3fn)
    scale = torch.full((rows,), float("nan"), device=DEVICE)
    got_codes, got_scale = quantize_rows_triton(t, codes, scale)
    assert got_codes is codes and got_scale is scale  # written into the buffers given
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got_codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert (got_codes.float().abs() < 2.0 ** -6).sum() > 0  # subnormal codes were exercised


@pytest.mark.parametrize("rows,cols,dtype", [(5, 96, torch.float32), (4, 128, torch.bfloat16),
                                             (3, 1000, torch.bfloat16)])
def test_kernel_gives_the_references_codes_and_scales(rows, cols, dtype):
    check_against_reference(rows, cols, dtype, seed=cols)


def test_kernel_refuses_what_it_cannot_quantize():
    t = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous rows, got torch.float32 \\(8, 2\\)"):
        quantize_rows_triton(t.t())
    with pytest.raises(ValueError, match="rows of at most 16384 values"):
        quantize_rows_triton(torch.zeros(1, 16385, device=DEVICE))
    with pytest.raises(ValueError, match=r"scale must be float32 \(2,\)"):
        quantize_rows_triton(t, scale=torch.zeros(3, device=DEVICE))
    codes, scale = quantize_rows_triton(t[:0])
    assert codes.shape == (0, 8) and scale.shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU: the compiled FP8 cast")
@pytest.mark.parametrize("rows,cols", [(128, 4096), (768, 2048)])
def test_kernel_at_the_moes_shapes_on_gpu(rows, cols):
    """x's rows at 128 tokens of V4-Flash, h's at 128 x 6 pairs."""
    check_against_reference(rows, cols, torch.bfloat16, seed=rows)
