"""The copies' "shared" permutations compile to what makes them fast on the H200.

Their speed rests on how Triton lowers tl.gather: along a row it picks a warp-local layout
and several warp shuffles per value; over the block flattened to one axis, spanning warps,
it goes through shared memory (a store, then one load per value). That is a compiler
choice, not the kernels' semantics, so the interpreter cannot see it: these tests compile
the kernels for sm_90 with the installed Triton (its bundled ptxas, no GPU needed) and
count instructions in the SASS, so a Triton upgrade that changes the lowering fails here
rather than only in the next benchmark.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import triton

from remnant.kernels import reconstruct, store
from remnant.kv.layout import PageLayout
from tests.kernels.launches import ROOT, compile_launches, needs_interpreter, recorded_launches

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(TOOLS, "nvdisasm")),
                                reason="this Triton has no bundled nvdisasm to read SASS with")


def _compile_and_list(kernel: str, signature: dict, constants: dict, num_warps: int, cubin: str) -> str:
    """SASS listing of remnant.kernels' `kernel` ("module:name") compiled for sm_90, pointers
    and strides specialised as 16-byte aligned (as the launcher specialises real arguments).
    Runs in a process of its own: under TRITON_INTERPRET, which the test session sets
    without a GPU, @triton.jit gives interpreted functions that cannot be compiled."""
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name = kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    aligned = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(signature)
               if arg.endswith("ptr") or arg.endswith("stride")}
    source = ASTSource(fn, signature={**signature, **{c: "constexpr" for c in constants}}, constexprs=constants,
                       attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with open(cubin, "wb") as f:
        f.write(compiled.asm["cubin"])
    with open(cubin.removesuffix(".cubin") + ".ptx", "w") as f:
        f.write(compiled.asm["ptx"])
    return subprocess.run([os.path.join(TOOLS, "nvdisasm"), "-c", cubin], capture_output=True, text=True,
                          check=True).stdout


def _listing(kernel: str, signature: dict, constants: dict, num_warps: int, tmp_path) -> str:
    """The kernel's SASS listing (see _compile_and_list), compiled in a process of its own."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    args = json.dumps([kernel, signature, constants, num_warps, str(tmp_path / "kernel.cubin")])
    return subprocess.run([sys.executable, __file__, args], capture_output=True, text=True, env=env, check=True,
                          cwd=ROOT).stdout


def _ops(launch, tmp_path) -> collections.Counter:
    """SASS opcode counts of the one kernel launch() makes (its wrapper's own launch,
    recorded under the interpreter: tests/kernels/launches.py)."""
    with recorded_launches() as launches:
        launch()
    assert len(launches) == 1, launches
    (result,) = compile_launches(launches, tmp_path)
    assert "error" not in result, result["error"]
    return collections.Counter(result["ops"])


def _reconstruct_ops(permute: str, retention: int, tmp_path) -> collections.Counter:
    """reconstruct's launch as its wrapper makes it: packed records of R = retention into
    native pages (SGLang's pages of 64), `permute`'s default launch."""
    packed, native = PageLayout.sglang(64, retention), PageLayout.sglang(64)
    locs = torch.arange(128, dtype=torch.int32)
    return _ops(lambda: reconstruct.reconstruct(
        torch.empty(4, packed.page_stride, dtype=torch.uint8), packed, locs, torch.arange(retention - 64),
        torch.empty(4, native.page_stride, dtype=torch.uint8), native, locs, permute=permute), tmp_path)


@pytest.mark.slow
@needs_interpreter
def test_reconstruct_shared_gathers_through_shared_memory_without_shuffles(tmp_path):
    shared, registers = _reconstruct_ops("shared", 256, tmp_path), _reconstruct_ops("registers", 256, tmp_path)
    assert shared["SHFL"] == 0 and shared["LDS"] >= 32, shared
    assert registers["SHFL"] > 100, registers  # the row gather's shuffles, which "shared" avoids


@needs_interpreter
def test_reconstruct_shared_stores_few_kept_codes_as_the_gather_left_them(tmp_path):
    # R = 128: the gather's one barrier and nothing more. Stored as 16-byte vectors, the same
    # words took a layout conversion first (stmatrix, 8 barriers more): 4% of the H200's time.
    few = _reconstruct_ops("shared", 128, tmp_path)
    assert few["STSM"] == 0 and few["BAR"] == 1 and few["SHFL"] == 0, few


@pytest.mark.slow
@needs_interpreter
def test_store_shared_gathers_through_shared_memory(tmp_path):
    layout = PageLayout.sglang(64, 256)

    def ops(permute):  # R = 256, as the wrapper launches it
        return _ops(lambda: store.store(torch.empty(128, 512, dtype=torch.bfloat16),
                                        torch.empty(4, layout.page_stride, dtype=torch.uint8), layout,
                                        torch.arange(128), torch.arange(192), permute=permute), tmp_path)

    shared, registers = ops("shared"), ops("registers")
    # Both reduce each tile's maximum with shuffles; only the row gather adds ~1000 more.
    assert shared["LDS"] >= 32 and shared["SHFL"] * 4 < registers["SHFL"], (shared, registers)


# _decode_kernel's exchange join: compiled from a hand-written signature, as its wrapper
# chooses the exchange only on a CUDA GPU (remnant.kernels.decode.plan.join_for).
DECODE = {"q_ptr": "*bf16", "q_sb": "i32", "q_sh": "i32", "out_ptr": "*fp16", "o_ss": "i32", "o_sb": "i32",
          "o_sh": "i32", "lse_ptr": "*fp32", "fin_ptr": "*bf16", "f_sb": "i32", "f_sh": "i32", "sink_ptr": "*fp32",
          "H": "i32", "win_ptr": "*u8", "win_locs_ptr": "*i32", "win_sb": "i32", "W": "i32", "win_stride": "i32",
          "win_chunk": "i32", "c4_ptr": "*u8", "c4_locs_ptr": "*i32", "c4_sb": "i32", "K": "i32", "c4_stride": "i32",
          "c4_chunk": "i32", "kept_ptr": "*i32", "dropped_ptr": "*i32", "kept_starts_ptr": "*i32",
          "dropped_starts_ptr": "*i32", "qk_scale": "fp32"}


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_decode_exchange_join_passes_one_cluster_barrier_in_every_thread(packed, tmp_path):
    # Two splits as one cluster join after barrier.cluster: one arrive and one wait, not
    # predicated to some threads, or a CTA could read its sibling's partial half-written.
    from remnant.kernels.decode.plan import DEFAULT_CONFIGS

    config = DEFAULT_CONFIGS["packed, kept-first window" if packed else "native"]
    constants = dict(WIN_PER_PAGE=64, WIN_ALIGN=16, C4_PER_PAGE=64, C4_ALIGN=16, N=192 if packed else 448,
                     KA=128 if packed else 512, KA_N=128 if packed else 448, KT=64 if packed else 0,
                     DP=256 if packed else 64, PACKED=packed, H_BLOCK=64, BN=config["block_n"],
                     WIN_BN=config["window_block_n"], WIN_KEPT_FIRST=packed, WIN_PACKED=False, SCORES_T=config["scores_transposed"],
                     WIN_SCORES_T=config["window_scores_transposed"], SPLIT=True, SCALED=True, WINDOW_APART=False,
                     BY_COST=not packed, WIN_STEP_COST=2 if packed else 1, EXCHANGE=True, INTERPRETED=False)
    listing = _listing("remnant.kernels.decode.triton:_decode_kernel", DECODE, constants, 8, tmp_path)
    for op in ("UCGABAR_ARV", "UCGABAR_WAIT"):
        lines = [line for line in listing.splitlines() if re.search(rf"\b{op}\b", line)]
        assert len(lines) == 1 and not re.search(r"@!?U?P\w+\s+" + op, lines[0]), lines


# The decode step's row kernels, compiled as their wrappers launch them at the engine's
# shapes: tests/kernels/test_launches_compile.py.


if __name__ == "__main__":
    print(_compile_and_list(*json.loads(sys.argv[1])))
