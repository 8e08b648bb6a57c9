"""remnant.kernels.common.byte_permute against a model of PTX's prmt.b32: under Triton's
interpreter its int64 emulation, on a GPU the instruction itself."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from remnant.kernels.common import byte_permute, interpreted
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
