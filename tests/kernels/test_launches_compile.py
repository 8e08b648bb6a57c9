"""What the engine's kernel wrappers launch at V4-Flash's shapes compiles for sm_90, without
register spills.

Under the interpreter a kernel may take code a GPU compile refuses (a return inside a
runtime branch failed only on the H100 on 2026-12-07), and a hand-written signature in a
compile test goes stale when the kernel's arguments change (test_compiled's top-k entry,
the same day). Here the wrappers themselves run at the engine's shapes with their launches
recorded, not run (tests/kernels/launches.py), and each distinct launch is compiled for
sm_90 with the installed Triton and its ptxas (no GPU needed) in a process of its own, out
of the interpreter.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from tests.kernels.launches import assert_compile_without_spills, needs_interpreter, recorded_launches

pytestmark = needs_interpreter


def _model():
    from remnant.config import ModelConfig
    from remnant.engine.capacity_report import load_model_preset
    from remnant.engine.model import ModelArgs

    return ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig(**load_model_preset("dsv4_flash_h200"))))


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [1, 4, 8, 32, 128, 512, 2048])
def test_moe_launches_compile_for_sm90(tokens, tmp_path):
    # The routed experts as a decode step runs them (default_config on a GPU), FP8 experts
    # of V4-Flash's shape, the shared expert's output and the residual added at the end.
    from remnant.kernels.moe import default_config, routed_experts_triton

    a = _model()
    E, k, hidden, inter = a.n_routed_experts, a.num_experts_per_tok, a.hidden_size, a.moe_intermediate_size
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16)
    ids = torch.arange(tokens * k).remainder(E).view(tokens, k)
    weights = torch.empty(tokens, k)
    w_gate_up = torch.empty(E, hidden, 2 * inter, dtype=torch.float8_e4m3fn)
    w_down = torch.empty(E, inter, hidden, dtype=torch.float8_e4m3fn)
    scales = torch.empty(E, 2 * inter), torch.empty(E, hidden)
    config = default_config(tokens * k, E, True, hidden, inter)
    configs = [config] + ([dataclasses.replace(config, fp8_x=True, fp8_h=True)] if not config.per_pair else [])
    with recorded_launches() as launches:
        for cfg in configs:  # the default, and the FP8-activation option where it applies
            routed_experts_triton(x, ids, weights, w_gate_up, w_down, *scales, config=cfg, adds=(x, x))
    assert_compile_without_spills(launches, tmp_path)


@pytest.mark.slow
def test_router_top_k_indexer_and_quantizer_launches_compile_for_sm90(tmp_path):
    from remnant.kernels.fp8_rows import quantize_rows_triton
    from remnant.kernels.indexer import ScoresConfig, index_scores, index_scores_shared
    from remnant.kernels.route import route_triton
    from remnant.kernels.top_k import top_k, top_k_locations
    from remnant.kv.index_keys import index_key_format
    from remnant.engine.pools import SplitPages

    a = _model()
    heads, dim, n = a.index_n_heads, a.index_head_dim, 16384  # a 32k context's page-table bucket
    with recorded_launches() as launches:
        for tokens in (1, 128):
            route_triton(torch.empty(tokens, a.hidden_size, dtype=torch.bfloat16),
                         torch.empty(a.hidden_size, a.n_routed_experts), a.num_experts_per_tok, 1.0)
            scores, counts = torch.empty(tokens, n), torch.full((tokens,), n // 2, dtype=torch.int32)
            top_k(scores, a.index_topk)
            top_k_locations(scores, a.index_topk, torch.empty(tokens, n, dtype=torch.int32), counts)
            for name in ("fp8", "mxfp4"):
                # The indexer pool's pages as the engine makes them (remnant.engine.pools).
                fmt = index_key_format(name, dim)
                keys = SplitPages(n // 64 + 1, 64, fmt.data_bytes + fmt.tail_bytes, fmt.tail_bytes)
                layout, pages = keys.layout, keys.buf
                q = torch.empty(tokens, heads, dim, dtype=torch.bfloat16)
                w = torch.empty(tokens, heads, dtype=torch.bfloat16)
                # The defaults (default_scores_config), and FP8 keys' float16-operand and FP8-query options.
                # ... and the head sums down the accumulator's columns (keys_on_m off), the former
                # default, which the timing tables run beside it.
                options = (None, ScoresConfig(f16_operands=True), ScoresConfig(fp8_q=True),
                           ScoresConfig(keys_on_m=False), ScoresConfig(fp8_q=True, keys_on_m=False))
                for config in options if name == "fp8" else (None,):
                    index_scores(q, w, pages, layout, torch.empty(tokens, n, dtype=torch.int32), counts, name,
                                 config=config)
                shared = list(itertools.product((False, True), repeat=2)) if name == "fp8" else [(False, False)]
                for fp8_q, keys_on_m in shared:
                    index_scores_shared(q, w, pages, layout, torch.empty(n, dtype=torch.int32), counts,
                                        key_format=name, fp8_q=fp8_q, keys_on_m=keys_on_m)
        for rows, cols in ((128, a.hidden_size), (768, a.moe_intermediate_size)):
            quantize_rows_triton(torch.empty(rows, cols, dtype=torch.bfloat16))
    kernels = {launch.kernel.split(":")[1] for launch in launches}
    assert {"_logits_kernel", "_select_kernel", "_radix_pass", "_count_pass", "_write_pass", "_row_scores_kernel",
            "_shared_scores_kernel", "_quantize_rows_kernel"} <= kernels, kernels
    unique = list({launch.key(): launch for launch in launches}.values())
    results = dict(zip((launch.key() for launch in unique), assert_compile_without_spills(launches, tmp_path)))
    # The scores' MMAs as Hopper runs them: bf16 wgmma for the defaults (HGMMA...F32.BF16),
    # float16 with f16_operands (HGMMA...F32: float16 is the unnamed default), FP8 (QGMMA,
    # E4M3 on both sides) with FP8 queries, where no key is widened; decode's and prefill's.
    def form(m: str) -> str:
        return "fp8" if m.endswith("E4M3.E4M3") else "bf16" if m.endswith(".BF16") else "f16"

    for launch in unique:
        if launch.kernel.endswith(("_row_scores_kernel", "_shared_scores_kernel")) and not launch.constants["MXFP4"]:
            mma = results[launch.key()]["mma"]
            want = "fp8" if launch.constants.get("FP8_Q") else ("f16" if launch.constants.get("F16") else "bf16")
            assert mma and {form(m) for m in mma} == {want}, (launch.constants, mma)


@pytest.mark.slow
def test_the_decode_steps_row_kernels_compile_for_sm90(tmp_path):
    # The compressor's update (C4 and C128, float32 and bf16 state) with its norm + RoPE, the
    # index keys' update, the queries' norm + RoPE, the RMS norms, the record slots of both
    # ratios and the MoE's alignment of a batch of 128's 768 pairs, at the engine's shapes.
    from remnant.engine.pools import SplitPages
    from remnant.kernels.compress import compress_decode, index_key_decode
    from remnant.kernels.moe import align_triton
    from remnant.kernels.norm import rms_norm
    from remnant.kernels.rope import norm_rope
    from remnant.kernels.slots import ratio_slots
    from remnant.kv.index_keys import index_key_format

    a = _model()
    B, bf16, i64 = 32, torch.bfloat16, torch.int64
    rows = torch.arange(B, dtype=i64)
    with recorded_launches() as launches:
        projections = torch.empty(B, 4 * 512, dtype=bf16)  # c and g as row-strided column slices
        for ratio in (4, 128):
            for state_dtype in (torch.float32, bf16):
                compress_decode(projections[:, :512], projections[:, 512:1024], torch.empty(B, 2, 512, dtype=state_dtype),
                                rows, torch.empty(B, ratio, dtype=i64), torch.empty(ratio, 512, dtype=bf16),
                                torch.empty(512, dtype=bf16), rows, ratio, 1e-6, 10000.0,
                                complete=torch.empty(B, dtype=torch.bool))
            ratio_slots(rows, torch.empty(B, 129, dtype=i64), rows, 256, ratio, 8 if ratio == 4 else 128, 0)
        fmt = index_key_format("fp8", a.index_head_dim)
        keys = SplitPages(B, 64, fmt.data_bytes + fmt.tail_bytes, fmt.tail_bytes)
        index_key_decode(projections[:, :a.index_head_dim], torch.empty(B, 2, 512), rows,
                         torch.empty(B, 4, dtype=i64), keys.buf, keys.layout, torch.zeros(B, dtype=torch.int32))
        q = torch.empty(B, a.num_attention_heads, 2 * 512, dtype=bf16)[..., :512]
        norm_rope(q, torch.empty(512, dtype=bf16), 1e-6, rows, 10000.0)
        for width in (a.q_lora_rank, a.hidden_size):
            rms_norm(torch.empty(B, width, dtype=bf16), torch.empty(width, dtype=bf16), 1e-6)
        align_triton(torch.arange(128 * a.num_experts_per_tok).remainder(a.n_routed_experts).view(128, -1),
                     a.n_routed_experts, 16)
    kernels = {launch.kernel.split(":")[1] for launch in launches}
    assert {"_gate_kernel", "_norm_rope_kernel", "_ratio_slots_kernel", "_index_key_kernel", "_rms_norm_kernel",
            "_align_kernel"} <= kernels, kernels
    assert_compile_without_spills(launches, tmp_path)

