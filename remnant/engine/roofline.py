"""The physical limit of one decode step: it reads its weights and its KV once.

A step of B tokens at context L (tokens each sequence holds) reads, per layer: the
attention weights (all of them), the feed-forward weights it touches (a dense block whole;
a routed MoE's router, shared experts and the distinct routed experts B tokens hit, their
expected number under uniform routing: remnant.engine.moe.expected_distinct_experts), and
per token its window records (packed as window_records says), on CSA layers every
visible C4 index key (FP8 or MXFP4) and the top-k C4 records (packed ones in triton and
kernel modes; triton mode also writes and reads back the native reconstruction of each
packed record, window and C128 ones included), on HCA layers every visible C128 record
(packed as c128_records says). Its matrix FLOPs
are the weights' 2 x B x (weights a token multiplies) plus attention's scores and outputs
and the indexer's scores. The roofline time is the larger of bytes / copy bandwidth and
FLOPs / matmul peak, both measured on the device where the step runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from remnant.kv.formats import CSA_RATIO, HCA_RATIO, HEAD_DIM, NATIVE_RECORD_BYTES, index_key_parts
from remnant.kv.modes import mode_of

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class StepCost:
    """What one decode step reads and computes (bytes, FLOPs), by part."""

    weight_bytes: float
    kv_bytes: float
    flops: float
    parts: dict

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    def seconds(self, copy_bytes_per_s: float, matmul_flops_per_s: float) -> float:
        """The roofline: the larger of the bytes at copy bandwidth and the FLOPs at matmul peak."""
        return max(self.bytes / copy_bytes_per_s, self.flops / matmul_flops_per_s)


def step_cost(args, batch: int, context: int, mode: str = "native", retention: int = 256,
              dtype: str = "bfloat16", index_key_format: str = "fp8", window_records: str = "native",
              c128_records: str = "native") -> StepCost:
    """The cost of a decode step of `batch` tokens at `context` tokens each, for `args`
    (remnant.engine.model.ModelArgs) in `mode` with `retention` (packed modes), weights in
    `dtype` (routed experts in args.expert_dtype), index keys in `index_key_format`, window
    and C128 records as `window_records` and `c128_records` say (remnant.kv.formats)."""
    from remnant.engine.moe import expected_distinct_experts

    a, wb = args, DTYPE_BYTES[dtype]
    h, H = a.hidden_size, a.num_attention_heads
    q = h * a.q_lora_rank + a.q_lora_rank * H * HEAD_DIM + h * HEAD_DIM
    out = (H * HEAD_DIM * a.o_lora_rank + a.o_groups * a.o_lora_rank * h) if a.o_lora_rank else H * HEAD_DIM * h
    compressor = 2 * h * HEAD_DIM
    indexer = a.q_lora_rank * a.index_n_heads * a.index_head_dim + h * a.index_head_dim + h * a.index_n_heads
    weight_bytes = flops_weights = 0.0
    for ratio in a.compress_ratios:
        params = q + out + (compressor if ratio else 0) + (indexer if ratio == CSA_RATIO else 0)
        weight_bytes += params * wb
        flops_weights += 2 * batch * params
    moe_bytes = dense_params = 0.0
    if a.n_routed_experts:
        inter = a.moe_intermediate_size
        expert = 3 * h * inter
        eb = DTYPE_BYTES[a.expert_dtype]
        scales = (2 * inter + h) * 4 if a.expert_dtype == "float8_e4m3fn" else 0
        shared = 3 * h * inter * a.n_shared_experts
        hit = expected_distinct_experts(batch, a.n_routed_experts, a.num_experts_per_tok)
        moe_bytes = len(a.compress_ratios) * (h * a.n_routed_experts * wb + shared * wb + hit * (expert * eb + scales))
        flops_weights += len(a.compress_ratios) * 2 * batch * (a.num_experts_per_tok * expert + shared)
    elif a.intermediate_size:
        dense_params = 3 * h * a.intermediate_size * len(a.compress_ratios)
        flops_weights += 2 * batch * dense_params
    head = h * a.vocab_size
    weight_bytes += moe_bytes + dense_params * wb + head * wb
    flops_weights += 2 * batch * head

    window = min(context, a.window_size)
    c4 = context // CSA_RATIO
    top = min(a.index_topk, c4)
    c128 = context // HCA_RATIO
    rules = mode_of(mode)
    record = rules.record_bytes(retention)
    rebuilt = 2 * NATIVE_RECORD_BYTES if rules.reconstructs else 0  # triton mode's reconstruction, written and read
    key_bytes = sum(index_key_parts(index_key_format, a.index_head_dim))
    per_token = {"window": 0.0, "index_keys": 0.0, "c4_records": 0.0, "c128_records": 0.0}
    attn_flops = 0.0
    for ratio in a.compress_ratios:
        packed_window = rules.packed and (window_records == "packed" or
                                          (window_records == "packed_csa" and ratio == CSA_RATIO))
        per_token["window"] += window * (record + rebuilt if packed_window else NATIVE_RECORD_BYTES)
        keys = window
        if ratio == CSA_RATIO:
            per_token["index_keys"] += c4 * key_bytes
            per_token["c4_records"] += top * (record + rebuilt)
            attn_flops += 2 * a.index_n_heads * a.index_head_dim * c4
            keys += top
        elif ratio == HCA_RATIO:
            packed_c128 = rules.packed and c128_records == "packed"
            per_token["c128_records"] += c128 * (record + rebuilt if packed_c128 else NATIVE_RECORD_BYTES)
            keys += c128
        attn_flops += 2 * 2 * H * HEAD_DIM * keys  # scores and outputs, V = K
    kv_bytes = batch * sum(per_token.values())
    parts = {"weights_attention_bytes": weight_bytes - moe_bytes - dense_params * wb - head * wb,
             "weights_ffn_bytes": moe_bytes + dense_params * wb, "lm_head_bytes": head * wb,
             **{f"{k}_bytes": batch * v for k, v in per_token.items()},
             "matmul_flops": flops_weights, "attention_flops": batch * attn_flops}
    return StepCost(weight_bytes, kv_bytes, flops_weights + batch * attn_flops, parts)
