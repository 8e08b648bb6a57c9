"""quantize equals SGLang 0.5.18's DeepSeek-V4 FP8 quantizer, run from its own source.

SGLang's kernel (kernels/ops/attention/dsv4/quant_k_cache.py) runs here under Triton's
interpreter. The interpreter's float32 -> float8e4nv cast is wrong near powers of two
(triton-lang/triton#8322), so the kernel writes its scaled values into a float32 buffer
instead (the kernel casts to its output's dtype) and both sides use torch's correct FP8
cast: scales are compared exactly, and codes through the same cast of equal floats.
"""

from __future__ import annotations

import os

import pytest
import torch

from remnant.kv import dequantize, quantize
from tests.kv.sglang_source import load_function

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

KERNEL = "kernels/ops/attention/dsv4/quant_k_cache.py"


@pytest.fixture(scope="module")
def sglang_quant():
    if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 on a machine without a GPU")
    kernel = load_function(KERNEL, "_quant_k_cache_fused_kernel", {"triton": triton, "tl": tl})

    def run(x: torch.Tensor):
        """SGLang's quantizer with the FP8 store replaced by a float32 store."""
        k = x.to(torch.bfloat16).contiguous()
        n = k.shape[0]
        scaled = torch.full((n, 448), float("nan"), dtype=torch.float32)
        rope = torch.zeros(n, 64, dtype=torch.bfloat16)
        scales = torch.full((n, 7), 255, dtype=torch.uint8)
        fp8 = torch.finfo(torch.float8_e4m3fn)
        kernel[(n, 8)](
            k, scaled, rope, scales, k.stride(0), scaled.stride(0), rope.stride(0), scales.stride(0),
            DIM_NOPE=448, DIM_ROPE=64, TILE_SIZE=64, NUM_TILES=7, FP8_MIN=fp8.min, FP8_MAX=fp8.max, EPS=1e-8,
        )
        return scaled, rope, scales

    return run


def _check(x: torch.Tensor, run) -> None:
    scaled, rope, scales = run(x)
    rec = quantize(x)
    assert torch.equal(rec[:, 576:583], scales), "UE8M0 scales differ from SGLang's"
    assert torch.equal(rec[:, 448:576].contiguous().view(torch.bfloat16), rope)
    codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(rec[:, :448], codes), "FP8 codes differ from SGLang's scaled values"


def _edge_rows() -> torch.Tensor:
    rows = [torch.zeros(512), torch.full((512,), 1e-30), torch.full((512,), -3e38)]
    tile = torch.randn(512, generator=torch.Generator().manual_seed(0))
    for amax in (448.0, 448.0 * 2**-10, 448.0 * 1.0000001, 1e-8, 1e-9, 2.0**-133, 126.35, 3.0e38):
        r = tile.clone()
        r[:64] = r[:64] / r[:64].abs().max() * amax  # tile 0's amax at an exact edge
        rows.append(r)
    mixed = tile.clone()
    mixed[64:128] = 0.0  # one all-zero tile among normal ones
    mixed[128:192] *= 1e20
    rows.append(mixed)
    return torch.stack(rows)


def test_edge_values_match_sglang(sglang_quant):
    _check(_edge_rows(), sglang_quant)


@pytest.mark.parametrize("seed", range(3))
def test_random_heavy_tailed_match_sglang(sglang_quant, seed):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(1, 512, generator=g) * 3)  # channel scales over ~8 decades
    x = torch.randn(67, 512, generator=g) * scale
    _check(x, sglang_quant)


def test_edge_semantics_stated():
    rec = quantize(_edge_rows())
    # All-zero tile: amax is clamped to 1e-8, so exponent = ceil(log2(1e-8 / 448)) = -35.
    assert int(rec[0, 576]) == 127 - 35 and (rec[0, :448] == 0).all()
    # Values below the smallest FP8 subnormal at their tile's scale flush to +-0.
    assert torch.equal(dequantize(rec)[0], torch.zeros(512))


def test_non_finite_input_is_refused():
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.zeros(3, 512)
        x[1, 100] = bad
        with pytest.raises(ValueError, match=r"quantize: row 1 has non-finite values"):
            quantize(x)
