"""remnant.kernels.common against models of what the GPU does: byte_permute against PTX's
prmt.b32, cast_nearest against torch's casts (round to nearest even); under Triton's
interpreter their emulations, on a GPU the instructions themselves."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from remnant.kernels.common import byte_permute, cast_nearest, interpreted
from tests.kernels.inputs import DEVICE, ON_GPU, prmt


@triton.jit
def _permute_kernel(a_ptr, b_ptr, sel_ptr, out_ptr, INTERPRETED: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    out = byte_permute(tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(sel_ptr + i), INTERPRETED)
    tl.store(out_ptr + i, out)


def check_byte_permute(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = 256
    a, b = (torch.randint(-2**31, 2**31, (n,), dtype=torch.int64, generator=gen).to(torch.int32) for _ in range(2))
    # Selectors of every kind: plain picks (the kernels'), and nibbles with the sign bit.
    sel = torch.randint(0, 2**16, (n,), dtype=torch.int64, generator=gen).to(torch.int32)
    sel[: n // 2] &= 0x7777
    out = torch.empty(n, dtype=torch.int32)
    args = [t.to(DEVICE) for t in (a, b, sel, out)]
    _permute_kernel[(1,)](*args, INTERPRETED=interpreted(), N=n)
    got = args[3].cpu().tolist()
    for i in range(n):
        pair = (a[i].item() & 0xFFFFFFFF) | ((b[i].item() & 0xFFFFFFFF) << 32)
        assert got[i] & 0xFFFFFFFF == prmt(pair, sel[i].item()), f"element {i}: selector {sel[i].item():#06x}"


def test_byte_permute_matches_prmt():
    check_byte_permute(seed=1)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_byte_permute_on_gpu_is_the_instruction_the_model_describes():
    check_byte_permute(seed=2)


@triton.jit
def _cast_kernel(x_ptr, out_ptr, INTERPRETED: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, cast_nearest(tl.load(x_ptr + i), out_ptr.dtype.element_ty, INTERPRETED))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cast_nearest_rounds_as_torch_does(dtype):
    # Random values over FP8's whole range, its subnormals and exact ties included, and the
    # values next to powers of two that Triton's interpreter casts wrongly (126.35 -> 64).
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(4096, generator=gen) * 4.0 ** torch.randint(-6, 5, (4096,), generator=gen),
                   torch.tensor([126.35, -126.35, 0.0, 448.0, -448.0, 2.0 ** -6, 2.0 ** -9, 3 * 2.0 ** -10,
                                 2.0 ** -10, 1.0625, 1.1875, 240.0, 247.0, 248.0, 7.0e-3, -1e-7, -0.0])])
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-448.0, 448.0)  # torch's cast does not saturate; the kernels clamp first
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())])
    out = torch.empty(n, dtype=dtype, device=DEVICE)
    _cast_kernel[(1,)](x.to(DEVICE), out, INTERPRETED=interpreted(), N=n)
    want = x.to(dtype)
    assert torch.equal(out.cpu().float(), want.float()), (x[out.cpu().float() != want.float()][:8])
