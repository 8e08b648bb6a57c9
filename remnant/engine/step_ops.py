"""The model's elementwise chains (RMS norm, RoPE, the compressor's gate, the indexer keys'
FP8 codec) and the indexer's top-k: plain, or compiled for the GPU.

A decode step of V4's shapes is some 8,000 kernels when each torch operation is its own:
an RMS norm alone is seven (cast, square, mean, add, rsqrt, multiply, cast), and at batch 1
each costs a few microseconds while reading almost nothing, so launches, not bytes, set the
step's time. `compiled_ops()` runs the same functions through torch.compile (TorchInductor
fuses each chain into one or two Triton kernels), as nano-vllm compiles its norms and
rotary embedding; remnant.engine.model.Model takes them on CUDA and the plain functions
elsewhere (the CPU default, and decode_path=reference, the ground truth). The plain
functions in remnant.engine.ops and remnant.kv.index_keys are the reference the compiled
ones are tested against (tests/engine/test_step_ops.py). The top-k is not compiled but
remnant.kernels.top_k's radix select (torch.topk is a sort network: 50-140 us a call).

Shapes: the token (or block, or row) dimension of each call changes from step to step (a
CUDA graph bucket's batch, a prefill chunk's length), so it is marked dynamic on every
call: one compiled graph per call site and dtype serves every batch (batch 1 apart, which
torch.compile specialises), while the feature sizes stay static for the code generator.
Compilation happens on a call site's first call, which the engine makes eagerly before it
captures a CUDA graph (remnant.engine.graphs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from remnant.engine.ops import (compress_decode, compress_latents, index_key_decode, index_top_k, index_top_locations,
                                norm_rope, ratio_slots, rms_norm, silu_mul)
from remnant.kv.index_keys import index_key_codes, join_index_keys, quantize_index_keys, quantize_index_keys_mxfp4


@dataclass(frozen=True)
class StepOps:
    """The functions a step calls for its elementwise chains (signatures as in
    remnant.engine.ops and remnant.kv.index_keys; compiled compress_decode returns bf16
    latents where the plain one returns float32: the record store rounds both to bf16)."""

    name: str  # "plain" or "compiled", as /server_info reports it
    rms_norm: Callable
    compress_latents: Callable
    quantize_index_keys: Callable
    index_top_k: Callable
    #: MXFP4 index keys' codec (Model.quantize_index_keys picks it for index_key_format mxfp4).
    quantize_index_keys_mxfp4: Callable
    #: The MoE's routing (remnant.engine.moe.route_tokens; compiled: route_triton, two
    #: launches) and its pairs' sort by expert (remnant.kernels.moe.align; compiled:
    #: align_triton, one launch for a decode batch); None: the plain ones.
    moe_route: Callable | None = None
    moe_align: Callable | None = None
    #: rope(rms_norm(...)) in one call (remnant.engine.ops.norm_rope).
    norm_rope: Callable = norm_rope
    #: A decode token's compressor update (remnant.engine.ops.compress_decode; compiled:
    #: remnant.kernels.compress's two launches, for some ten) and its FP8 index key's
    #: (index_key_decode; compiled: one launch for some thirteen).
    compress_decode: Callable = compress_decode
    index_key_decode: Callable = index_key_decode
    #: The decode step's indexer choice as int32 record locations (remnant.engine.ops.
    #: index_top_locations; compiled: remnant.kernels.top_k.top_k_locations, no launch
    #: after the top-k's own).
    index_top_locations: Callable = index_top_locations
    #: The shared expert's activation (remnant.engine.ops.silu_mul; compiled: one kernel
    #: for two, keeping eager's bf16 rounding between them).
    silu_mul: Callable = silu_mul
    #: A decode step's positions in one ratio's records and compressor state (remnant.
    #: engine.ops.ratio_slots; compiled: remnant.kernels.slots.ratio_slots, one launch for
    #: some thirty).
    ratio_slots: Callable = ratio_slots


PLAIN_OPS = StepOps("plain", rms_norm, compress_latents, quantize_index_keys, index_top_k,
                    quantize_index_keys_mxfp4)


def _dynamic(fn: Callable, dims: dict[int, tuple[int, ...]], backend: str, eager_rounding: bool = False) -> Callable:
    """torch.compile(fn) whole (a graph break would be an error, not a silent slow path),
    its positional tensor arguments' `dims` ({argument index: dims}) marked dynamic before
    each call. eager_rounding: Inductor keeps every bf16 rounding eager makes between fused
    operations (its emulate_precision_casts), so that a chain of two ops gives the plain
    ops' values, not those of one rounding at the end."""
    options = {"emulate_precision_casts": True} if eager_rounding and backend == "inductor" else None
    compiled = torch.compile(fn, fullgraph=True, backend=backend, options=options)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        for i, ds in dims.items():
            for d in ds:
                # maybe_: a dimension of size 0 or 1 is specialised, not an error.
                torch._dynamo.maybe_mark_dynamic(args[i], d)
        return compiled(*args, **kwargs)

    return call


def _joined(codes: Callable) -> Callable:
    """quantize_index_keys from a compiled index_key_codes: the scales' reinterpretation as
    bytes stays outside the graph (Inductor does not lower a dtype view of a tensor whose
    stride is symbolic)."""

    def quantize(keys: torch.Tensor) -> torch.Tensor:
        return join_index_keys(*codes(keys))

    return quantize


@functools.cache
def compiled_ops(backend: str = "inductor") -> StepOps:
    """StepOps through torch.compile with `backend` (built once per process and backend;
    each function compiles on its first call). Tests on the CPU trace with "aot_eager"."""
    # Here, not at the top: Triton's interpreter is chosen before triton loads.
    from remnant.engine.moe import route_tokens
    from remnant.kernels import compress, norm, rope, slots
    from remnant.kernels.moe import align, align_triton
    from remnant.kernels.route import route_triton
    from remnant.kernels.top_k import top_k, top_k_locations

    # Each call site (shape family and dtype) of a function is one compiled entry; the
    # default limit (8 per function) would send later call sites back to eager silently.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return StepOps(
        "compiled",
        # Not torch.compile's (its config, chosen by size hints, took 3.6 us or 17 us a
        # call at batch 1): one program per row.
        rms_norm=norm.rms_norm,
        # Not torch.compile's (three kernels a call): one program per row.
        norm_rope=rope.norm_rope,
        compress_latents=_dynamic(compress_latents, {0: (0,), 1: (0,), 4: (0,)}, backend),
        quantize_index_keys=_joined(_dynamic(index_key_codes, {0: (0,)}, backend)),
        # Not torch.compile's: a radix select, a tenth of torch.topk's time.
        index_top_k=top_k,
        quantize_index_keys_mxfp4=_dynamic(quantize_index_keys_mxfp4, {0: (0,)}, backend),
        # Not torch.compile's: two launches, not eight.
        moe_route=functools.partial(route_triton, fallback=_dynamic(route_tokens, {0: (0,)}, backend)),
        # One launch for a decode batch's pairs; a prefill chunk's through align compiled.
        moe_align=functools.partial(align_triton, fallback=_dynamic(align, {0: (0,)}, backend)),
        # Not torch.compile's: Triton programs per sequence (the gate also per 32
        # coordinates) that also write the state rows and the index key's page in place.
        compress_decode=compress.compress_decode,
        index_key_decode=compress.index_key_decode,
        index_top_locations=top_k_locations,
        silu_mul=_dynamic(silu_mul, {0: (0,)}, backend, eager_rounding=True),
        # Not torch.compile's: one launch for some thirty a ratio.
        ratio_slots=slots.ratio_slots,
    )
