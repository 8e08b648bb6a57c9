"""Timings on one GPU for parts of the decode step, printed as tables:

- the routed-expert kernels (remnant.kernels.moe) at V4-Flash's expert shape (32 experts of
  hidden 4096, moe_intermediate_size 2048, FP8, top-6) at 1 to 128 tokens: the
  configuration default_config picks beside the aligned kernels' batch-1 splits and the
  former default, at 1 token a grid of the per-pair GEMV's tiles and splits and at 2 and 4
  its batch-1 tile (each checked against the former default's output);
- remnant.kernels.top_k against torch.topk and remnant.engine.ops.index_top_k;
- the MoE's routing: route_tokens' torch ops against remnant.kernels.route;
- the indexer's decode scores (remnant.kernels.indexer.index_scores) at V4-Flash's shapes,
  over a grid of launch configs beside ScoresConfig's defaults (`indexer`);
- the RMS norm at the step's call sites (plain torch, compiled by remnant.engine.step_ops),
  each replayed 100 times in one CUDA graph: the time a call costs inside a step's graph.

Each timed as a step runs it: replayed in a CUDA graph (graph_us), so that launches cost
what they cost inside a step's graph (do_bench's eager calls add tens of microseconds of
host launch time to a batch-1 MoE call). The MoE's weights (150 MB at batch 1) do not fit
in L2, so repeated calls read them from HBM as a step does.
    python runners/device/moe_topk_timings.py [TABLE ...]   (default: rms_norm route top_k moe;
                                                          moe_tiles: the aligned kernels' tiles;
                                                          moe_f16: their float16 operands against bf16;
                                                          moe_fp8: FP8 activations, both expert layouts;
                                                          indexer: the scores' launch configs;
                                                          moe_prefill, indexer_prefill: a prefill
                                                          chunk's MoE and indexer scores)
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from remnant.engine.ops import index_top_k
from remnant.kernels.bench.harness import time_graph
from remnant.kernels.moe import MoEConfig, default_config, quantize_experts, routed_experts_triton
from remnant.kernels.top_k import top_k, top_k_locations


#: V4-Flash's expert shape: routed experts, hidden, moe_intermediate_size, experts per token.
E, HIDDEN, INTER, K = 32, 4096, 2048, 6


def v4_experts(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """FP8 experts of V4-Flash's shape on the GPU: (w_gate_up, w_down, gate_up_scale,
    down_scale), routed_experts_triton's order."""
    w_gate_up, gu_scale = quantize_experts(torch.randn(E, HIDDEN, 2 * INTER, device="cuda", generator=gen) / 64)
    w_down, dn_scale = quantize_experts(torch.randn(E, INTER, HIDDEN, device="cuda", generator=gen) / 45)
    return w_gate_up, w_down, gu_scale, dn_scale


def routed_tokens(T: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """T bf16 tokens, each routed to K distinct experts at random weights: x, ids, weights
    and the number of distinct experts they reach."""
    x = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:K] for _ in range(T)])
    weights = torch.rand(T, K, device="cuda", generator=gen)
    return x, ids, weights, ids.unique().numel()


def time_if_close(cfg, run, ref: torch.Tensor, times: dict, measure, against: str) -> None:
    """times[cfg] = measure(cfg) where run(cfg) is within 2e-2 of ref (relative to its
    largest value); a config off it, or one that cannot launch, is printed and skipped.
    cfg: a launch config (MoEConfig, ScoresConfig)."""
    if cfg in times:
        return
    try:
        err = (run(cfg).float() - ref).abs().max().item() / ref.abs().max().item()
        if err > 2e-2:
            print(f"  {cfg}: off the {against} by {err:.3g}", flush=True)
            return
        times[cfg] = measure(cfg)
    except Exception as e:  # out of shared memory or registers for a tile: not a candidate
        print(f"  {cfg}: {type(e).__name__}", flush=True)


def moe_table() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts = v4_experts(gen)
    hidden, inter, k = HIDDEN, INTER, K
    expert_bytes = 3 * hidden * inter
    aligned_split = MoEConfig(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=3, split_k=4,
                              down_split_k=2)
    former = MoEConfig(block_m=16, block_n=64, block_k=128)
    print("| tokens | distinct experts | default us | default | best us | best config | best TB/s | "
          "aligned 4/2 us | former default us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T in (1, 2, 4, 8, 32, 128):
        x, ids, weights, distinct = routed_tokens(T, gen)

        def run(cfg):
            return routed_experts_triton(x, ids, weights, *experts, config=cfg)

        ref = run(former).float()
        times = {}

        def timed(cfg):
            time_if_close(cfg, run, ref, times, lambda cfg: graph_us(lambda: run(cfg), calls=10), "former default")

        default = default_config(T * k, E, True, hidden, inter)
        for cfg in (default, aligned_split, former):
            timed(cfg)
        if T in (2, 4):  # where the per-pair GEMV stops paying: its batch-1 tile
            timed(dataclasses.replace(default_config(k, E, True, hidden, inter), per_pair=True))
        if T == 1:
            # The per-pair GEMV: tiles at splits 4/2, then the splits at the best tile.
            for bn, bk, warps in itertools.product((64, 128, 256), (16, 32, 64), (4, 8)):
                timed(MoEConfig(per_pair=True, block_m=1, block_n=bn, block_k=bk, num_warps=warps, num_stages=3,
                                split_k=4, down_split_k=2))
            tile = min((c for c in times if c.per_pair), key=times.get)
            for s, d in itertools.product((1, 2, 4, 8), (1, 2, 4)):
                timed(dataclasses.replace(tile, split_k=s, down_split_k=d))
            timed(dataclasses.replace(min((c for c in times if c.per_pair), key=times.get), num_stages=1))
        best = min(times, key=times.get)
        print(f"| {T} | {distinct} | {times[default]:.1f} | {default} | {times[best]:.1f} | {best} | "
              f"{distinct * expert_bytes / times[best] / 1e6:.2f} | {times.get(aligned_split, float('nan')):.1f} | "
              f"{times[former]:.1f} |", flush=True)


def kernel_us(fn, names: tuple[str, ...], calls: int = 10) -> dict[str, float]:
    """Microseconds per call of each kernel in `names` (a name's substring) over `calls`
    eager calls of fn(), from the profiler's kernel durations: launch gaps do not count,
    so each kernel is timed alone even where the call launches several."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = dict.fromkeys(names, 0.0)
    for event in prof.events():
        for name in names:
            if name in event.name and event.device_type == torch.autograd.DeviceType.CUDA:
                total[name] += event.time_range.end - event.time_range.start
    return {name: us / calls for name, us in total.items()}


def moe_tile_table() -> None:
    """The aligned kernels' tiles at 32 and 128 tokens (V4-Flash's expert shape, FP8, top-6
    of 32 experts): each candidate's gate/up and down kernel timed apart (profiler), the
    best tile of each kernel composed into one config (down_* fields) and timed whole in a
    graph beside default_config's. Gate/up reads two [BLOCK_K, BLOCK_N] FP8 tiles a step,
    down one, so their best tiles need not agree."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts = v4_experts(gen)
    hidden, inter, k = HIDDEN, INTER, K
    names = ("_gate_up_kernel", "_down_kernel")
    print("| tokens | kernel | default us | default TB/s | best us | best TB/s | best tile (block_m, block_n, "
          "block_k, warps, stages, split) |")
    print("|---|---|---|---|---|---|---|")
    for T, block_ms in ((32, (16,)), (128, (64, 32))):
        x, ids, weights, distinct = routed_tokens(T, gen)
        nbytes = {"_gate_up_kernel": distinct * 2 * hidden * inter, "_down_kernel": distinct * inter * hidden}

        def run(cfg):
            return routed_experts_triton(x, ids, weights, *experts, config=cfg)

        default = default_config(T * k, E, True, hidden, inter)
        ref = run(default).float()
        seen: dict[MoEConfig, dict[str, float]] = {}

        def timed(cfg):
            time_if_close(cfg, run, ref, seen, lambda cfg: kernel_us(lambda: run(cfg), names), "default")

        timed(default)
        for bm, bn, bk, warps, stages in itertools.product(block_ms[:1], (64, 128, 256), (64, 128, 256), (4, 8),
                                                           (3, 4)):
            timed(MoEConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages))
        # Splits and the other row blocks at each kernel's best tile so far.
        for name in names:
            tile = min(seen, key=lambda c: seen[c][name])
            for bm in block_ms[1:]:
                timed(dataclasses.replace(tile, block_m=bm))
            timed(dataclasses.replace(tile, split_k=2) if name == names[0] else
                  dataclasses.replace(tile, down_split_k=2))
        best = {name: min(seen, key=lambda c: seen[c][name]) for name in names}
        for name in names:
            cfg = best[name]
            print(f"| {T} | {name} | {seen[default][name]:.1f} | {nbytes[name] / seen[default][name] / 1e6:.2f} | "
                  f"{seen[cfg][name]:.1f} | {nbytes[name] / seen[cfg][name] / 1e6:.2f} | {cfg.block_m}, {cfg.block_n}, "
                  f"{cfg.block_k}, {cfg.num_warps}, {cfg.num_stages}, "
                  f"{cfg.split_k if name == names[0] else cfg.down_split_k} |", flush=True)
        gu, dn = best[names[0]], best[names[1]]
        composed = dataclasses.replace(gu, down_split_k=dn.down_split_k, down_block_n=dn.block_n,
                                       down_block_k=dn.block_k, down_num_warps=dn.num_warps,
                                       down_num_stages=dn.num_stages)
        if gu.block_m != dn.block_m:  # one alignment serves both kernels: gate/up's rows
            print(f"  down's best rows {dn.block_m} differ from gate/up's {gu.block_m}; composed at {gu.block_m}")
        timed(composed)
        whole = {cfg: graph_us(lambda cfg=cfg: run(cfg), calls=10) for cfg in (default, composed) if cfg in seen}
        print(f"  T={T} whole call in a graph: default {whole.get(default, float('nan')):.1f} us, composed "
              f"{whole.get(composed, float('nan')):.1f} us = {composed}", flush=True)


def moe_f16_table() -> None:
    """The aligned kernels with float16 operands (MoEConfig.f16_operands, the default) and
    with bf16 ones, at default_config's tile, per kernel (profiler) and whole (graph)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts = v4_experts(gen)
    hidden, inter, k = HIDDEN, INTER, K
    names = ("_gate_up_kernel", "_down_kernel")
    print("| tokens | operands | gate/up us | TB/s | down us | TB/s | whole call us | off the bf16 call |")
    print("|---|---|---|---|---|---|---|---|")
    # At 1 and 4 tokens default_config takes the per-pair GEMV (no tensor cores); the
    # aligned kernels with its batch-1 splits stand in for it there.
    aligned_split = MoEConfig(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=3, split_k=4,
                              down_split_k=2)
    for T in (1, 4, 8, 32, 128):
        x, ids, weights, distinct = routed_tokens(T, gen)
        nbytes = (distinct * 2 * hidden * inter, distinct * inter * hidden)
        default = default_config(T * k, E, True, hidden, inter)
        if default.per_pair:
            names_pp = ("_gate_up_pair_kernel", "_down_pair_kernel")

            def run_pp():
                return routed_experts_triton(x, ids, weights, *experts, config=default)

            us = kernel_us(run_pp, names_pp)
            print(f"| {T} | per-pair GEMV (default) | {us[names_pp[0]]:.1f} | {nbytes[0] / us[names_pp[0]] / 1e6:.2f} | "
                  f"{us[names_pp[1]]:.1f} | {nbytes[1] / us[names_pp[1]] / 1e6:.2f} | {graph_us(run_pp, calls=10):.1f} "
                  f"| |", flush=True)
            default = aligned_split
        out = {}
        for f16 in (False, True):
            cfg = dataclasses.replace(default, f16_operands=f16)

            def run(cfg=cfg):
                return routed_experts_triton(x, ids, weights, *experts, config=cfg)

            out[f16] = run().float()
            us = kernel_us(run, names)
            err = ((out[f16] - out[False]).abs().max() / out[False].abs().max()).item()
            print(f"| {T} | {'float16' if f16 else 'bf16'} | {us[names[0]]:.1f} | {nbytes[0] / us[names[0]] / 1e6:.2f} | "
                  f"{us[names[1]]:.1f} | {nbytes[1] / us[names[1]] / 1e6:.2f} | {graph_us(run, calls=10):.1f} | "
                  f"{err:.2e} |", flush=True)


def moe_fp8_table() -> None:
    """The aligned kernels on FP8 activations (MoEConfig.fp8_x, fp8_h: x's or h's rows
    quantized by quantize_rows_triton, FP8 MMAs) beside default_config, with the experts
    in both layouts (N contiguous as the engine keeps them, K contiguous: k_major, which an
    FP8 MMA takes as it is), at 8, 32 and 128 tokens; at 128 also gate/up tiles of 64 and
    128 columns with and without FP8 x, and 16- and 64-row blocks. Each kernel's time from
    the profiler, the whole call (quantizing included) in a graph, and how far the output
    moves from default_config's (relative norm)."""
    from remnant.kernels.moe import k_major

    gen = torch.Generator(device="cuda").manual_seed(0)
    w_gate_up, w_down, gu_scale, dn_scale = v4_experts(gen)
    layouts = {"N": (w_gate_up, w_down), "K": (k_major(w_gate_up), k_major(w_down))}
    hidden, inter, k = HIDDEN, INTER, K
    names = ("_gate_up_kernel", "_down_kernel")
    print("| tokens | layout | config | gate/up us | TB/s | down us | TB/s | whole call us | off default |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T in (8, 32, 128):
        x, ids, weights, distinct = routed_tokens(T, gen)
        nbytes = (distinct * 2 * hidden * inter, distinct * inter * hidden)
        default = default_config(T * k, E, True, hidden, inter)
        variants = [("default", default), ("fp8 x", dataclasses.replace(default, fp8_x=True)),
                    ("fp8 x and h", dataclasses.replace(default, fp8_x=True, fp8_h=True))]
        if T == 128:
            variants += [(f"{'fp8 x' if f8 else 'f16'} bm{bm} bn{bn}",
                          dataclasses.replace(default, fp8_x=f8, block_m=bm, block_n=bn, num_warps=4))
                         for f8 in (False, True) for bm, bn in ((32, 64), (32, 128), (16, 128), (64, 128))]
        ref = None
        for layout, (gu, dn) in layouts.items():
            for label, cfg in variants:
                def run(cfg=cfg, gu=gu, dn=dn):
                    return routed_experts_triton(x, ids, weights, gu, dn, gu_scale, dn_scale, config=cfg)

                try:
                    out = run().float()
                    ref = out if ref is None else ref
                    us = kernel_us(run, names)
                    whole = graph_us(run, calls=10)
                except Exception as e:  # a tile out of shared memory or registers
                    print(f"| {T} | {layout} | {label} | {type(e).__name__} | | | | | |", flush=True)
                    continue
                err = ((out - ref).norm() / ref.norm()).item()
                print(f"| {T} | {layout} | {label} | {us[names[0]]:.1f} | {nbytes[0] / us[names[0]] / 1e6:.2f} | "
                      f"{us[names[1]]:.1f} | {nbytes[1] / us[names[1]] / 1e6:.2f} | {whole:.1f} | {err:.2e} |",
                      flush=True)


def top_k_table() -> None:
    """top_k against torch.topk and the engine's tie-exact index_top_k; then the decode
    step's form, top_k_locations, over rows padded past their counts (a page-table bucket
    twice the visible records, as at 32k + 1 tokens) with and without the counts."""
    print("| rows x n | top_k us | torch.topk us | index_top_k us | same set |")
    print("|---|---|---|---|---|")
    for B, n in ((1, 8192), (32, 8192), (128, 8192), (1, 32768), (128, 32768)):
        scores = torch.relu(torch.randn(B, n, device="cuda"))
        mine = top_k(scores, 512)[1].sort(-1).values
        same = torch.equal(mine, index_top_k(scores, 512)[1].sort(-1).values)
        t = [graph_us(f, calls=20) for f in
             (lambda: top_k(scores, 512), lambda: torch.topk(scores, 512), lambda: index_top_k(scores, 512))]
        print(f"| {B} x {n} | {t[0]:.1f} | {t[1]:.1f} | {t[2]:.1f} | {same} |", flush=True)
    print("\n| rows x n, visible | top_k_locations us | with counts us | same |")
    print("|---|---|---|---|")
    for B, n in ((1, 16384), (32, 16384), (128, 16384)):
        scores = torch.relu(torch.randn(B, n, device="cuda"))
        scores[:, n // 2:] = float("-inf")
        counts = torch.full((B,), n // 2, device="cuda", dtype=torch.int32)
        locs = torch.arange(B * n, device="cuda", dtype=torch.int32).view(B, n)
        same = torch.equal(top_k_locations(scores, 512, locs), top_k_locations(scores, 512, locs, counts))
        t = [graph_us(f, calls=20) for f in
             (lambda: top_k_locations(scores, 512, locs), lambda: top_k_locations(scores, 512, locs, counts))]
        print(f"| {B} x {n}, {n // 2} | {t[0]:.1f} | {t[1]:.1f} | {same} |", flush=True)


def graph_us(fn, calls: int = 100) -> float:
    """Microseconds per call of fn() replayed `calls` times in one CUDA graph (the kernel
    benchmark's time_graph: median of 20 replays)."""
    return time_graph([fn] * calls, reps=20) * 1e6


def rms_norm_table() -> None:
    from remnant.engine.ops import rms_norm
    from remnant.engine.step_ops import compiled_ops

    compiled = compiled_ops().rms_norm
    print("| rows x width | plain us | compiled us |")
    print("|---|---|---|")
    for rows, width, sliced in ((1, 4096, False), (1, 1024, False), (1, 512, False), (64, 512, False),
                                (32, 4096, False), (2048, 512, False), (1, 1024, True), (1, 512, True),
                                (32, 1024, True)):
        # sliced: columns of one wider product, as Model.project's q_a and kv are.
        x = torch.randn(rows, width + 4096 if sliced else width, device="cuda", dtype=torch.bfloat16)
        x = x[:, 1024: 1024 + width] if sliced else x
        w = torch.randn(width, device="cuda", dtype=torch.bfloat16)
        t = [graph_us(lambda f=f: f(x, w, 1e-6)) for f in (rms_norm, compiled)]
        print(f"| {rows} x {width}{' (slice)' if sliced else ''} | {t[0]:.2f} | {t[1]:.2f} |", flush=True)


def route_table() -> None:
    from remnant.engine.moe import route_tokens
    from remnant.engine.step_ops import compiled_ops
    from remnant.kernels.route import route_triton

    compiled = compiled_ops()
    print("| tokens | route_tokens us | compiled (route_triton) us | same experts |")
    print("|---|---|---|---|")
    router = torch.randn(4096, 32, device="cuda") / 64
    for T in (1, 32, 128):
        x = torch.randn(T, 4096, device="cuda", dtype=torch.bfloat16)
        same = torch.equal(route_triton(x, router, 6, 2.5)[0], route_tokens(x, router, 6, 2.5)[0])
        t = [graph_us(lambda f=f: f(x, router, 6, 2.5)) for f in (route_tokens, compiled.moe_route)]
        print(f"| {T} | {t[0]:.2f} | {t[1]:.2f} | {same} |", flush=True)


def indexer_table() -> None:
    """index_scores of B rows over n FP8 keys each (64 heads of 128, as a CSA layer's decode
    scores them): every config of a grid, each checked against the default's output, the
    five fastest and the default printed per shape. The calls of a graph rotate over
    distinct keys (>= 256 MB in all), so that they read HBM, not L2, as a step's 21 layers do."""
    from remnant.engine.pools import SplitPages
    from remnant.kernels.indexer import ScoresConfig, index_scores
    from remnant.kv.index_keys import quantize_index_keys

    per_page, key_bytes = 64, 132
    pages = (256 << 20) // (per_page * key_bytes) + 1
    pool = SplitPages(pages, per_page, key_bytes, 4, device="cuda")
    keys = quantize_index_keys(torch.randn(per_page, 128, device="cuda"))
    pool.layout.write(pool.buf, torch.arange(per_page, device="cuda"), keys)
    pool.buf[1:] = pool.buf[0]
    total = pages * per_page
    grid = [ScoresConfig(block_n=bn, blocks=blocks, num_warps=warps, num_stages=stages)
            for bn, blocks, warps, stages in itertools.product((64, 128, 256), (1, 4), (4, 8), (1, 3))]
    print("| rows x keys | config | us | TB/s of keys | rank |")
    print("|---|---|---|---|---|")
    for B, n in ((1, 8192), (32, 1024), (32, 8192), (128, 1024), (128, 8192)):
        rotation = max(1, min(32, (256 << 20) // (B * n * key_bytes)))
        q = torch.randn(B, 64, 128, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(B, 64, device="cuda")
        counts = torch.full((B,), n, device="cuda", dtype=torch.int32)
        locs = [((c * B * n + torch.arange(B * n, device="cuda")) % total).view(B, n).to(torch.int32)
                for c in range(rotation)]
        default = ScoresConfig()

        def run(cfg, loc=locs[0]):
            return index_scores(q, w, pool.buf, pool.layout, loc, counts, config=cfg)

        def measure(cfg):
            return time_graph([lambda loc=loc: run(cfg, loc) for loc in locs] * max(1, 32 // rotation), reps=20) * 1e6

        ref = run(default)
        times: dict = {}
        for cfg in [default, dataclasses.replace(default, f16_operands=True), *grid]:
            time_if_close(cfg, run, ref, times, measure, "default")
        # The fastest bf16 configs again with float16 operands, and with FP8 queries
        # (ScoresConfig.fp8_q: FP8 MMAs), checked against the default's FP8-query output.
        fastest = sorted(times, key=times.get)[:3]
        for cfg in fastest:
            time_if_close(dataclasses.replace(cfg, f16_operands=True), run, ref, times, measure, "default")
        fp8_default = dataclasses.replace(default, fp8_q=True)
        fp8_ref = run(fp8_default)
        for cfg in [fp8_default, *(dataclasses.replace(c, fp8_q=True, f16_operands=False) for c in fastest)]:
            time_if_close(cfg, run, fp8_ref, times, measure, "fp8_q default")
        # ScoresConfig.keys_on_m either way (the sum over heads along the accumulator's rows
        # or down its columns) on the default and on FP8 queries, each row printed.
        keys_on_m = [dataclasses.replace(c, keys_on_m=not c.keys_on_m) for c in (default, fp8_default)]
        time_if_close(keys_on_m[0], run, ref, times, measure, "default")
        time_if_close(keys_on_m[1], run, fp8_ref, times, measure, "fp8_q default")
        best = sorted(times, key=times.get)
        nbytes = B * n * key_bytes
        for cfg in dict.fromkeys([*best[:5], default, fp8_default, *(c for c in keys_on_m if c in times)]):
            label = "default" if cfg == default else f"{best.index(cfg) + 1}"
            print(f"| {B} x {n} | bn{cfg.block_n} x{cfg.blocks} w{cfg.num_warps} s{cfg.num_stages}"
                  f"{' f16' if cfg.f16_operands else ''}{' fp8q' if cfg.fp8_q else ''}"
                  f"{' keys-on-m' if cfg.keys_on_m else ' heads-on-m'} | {times[cfg]:.1f} | "
                  f"{nbytes / times[cfg] / 1e6:.2f} | "
                  f"{label} |", flush=True)


def moe_prefill_table() -> None:
    """The aligned kernels at a prefill chunk's 8,192 tokens (49,152 pairs, about 1,536 rows
    an expert: MMA-bound, not byte-bound): 64-row blocks (default_config's before 0cfaed7)
    beside 128-row blocks (its tile since) and wider columns, with and without FP8
    activations (fp8_x and fp8_h: FP8 MMAs). Each kernel's time from the profiler and its
    matrix rate; how far the output moves from default_config's (relative norm)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts = v4_experts(gen)
    hidden, inter, k = HIDDEN, INTER, K
    names = ("_gate_up_kernel", "_down_kernel")
    T = 8192
    x, ids, weights, _ = routed_tokens(T, gen)
    flops = (2 * T * k * hidden * 2 * inter, 2 * T * k * inter * hidden)
    default = default_config(T * k, E, True, hidden, inter)

    def run(cfg):
        return routed_experts_triton(x, ids, weights, *experts, config=cfg)

    ref = run(default).float()
    print("| config | gate/up us | TFLOP/s | down us | TFLOP/s | whole call us | off default |")
    print("|---|---|---|---|---|---|---|")
    tiles = [(64, 128, 64, 8), (128, 128, 64, 8), (128, 256, 64, 8), (128, 128, 128, 8)]
    for (bm, bn, bk, warps), stages, fp8 in itertools.product(tiles, (3, 4), (False, True)):
        cfg = dataclasses.replace(default, block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                                  fp8_x=fp8, fp8_h=fp8)
        label = f"bm{bm} bn{bn} bk{bk} w{warps} s{stages}{' fp8' if fp8 else ''}{' (default)' if cfg == default else ''}"
        try:
            out = run(cfg).float()
            us = kernel_us(lambda: run(cfg), names, calls=5)
            whole = graph_us(lambda: run(cfg), calls=3)
        except Exception as e:  # a tile out of shared memory or registers
            print(f"| {label} | {type(e).__name__} | | | | | |", flush=True)
            continue
        err = ((out - ref).norm() / ref.norm()).item()
        print(f"| {label} | {us[names[0]]:.0f} | {flops[0] / us[names[0]] / 1e6:.0f} | {us[names[1]]:.0f} | "
              f"{flops[1] / us[names[1]] / 1e6:.0f} | {whole:.0f} | {err:.2e} |", flush=True)


def indexer_prefill_table() -> None:
    """index_scores_shared as a prefill chunk scores its tokens (64 heads of 128 over one
    sequence's n FP8 keys, each token seeing keys up to its own position): block_t tokens
    by block_n keys a program, with bf16 and with FP8 queries (fp8_q: FP8 MMAs; checked
    against the first FP8 config), and the top-k of the scores (remnant.kernels.top_k, the
    compiled step's) for the same rows; matrix rate counted over all n keys of each row."""
    from remnant.engine.pools import SplitPages
    from remnant.kernels.indexer import index_scores_shared
    from remnant.kv.index_keys import quantize_index_keys

    per_page, key_bytes = 64, 132
    print("| tokens x keys | queries | block_t | block_n | scores us | TFLOP/s | top_k 512 us |")
    print("|---|---|---|---|---|---|---|")
    # (keys-on-m: index_scores_shared's keys_on_m, its default with FP8 keys, at block_t 16
    # only; heads-on-m: the sum over heads down the accumulator's columns.)
    for T, n in ((2048, 8192), (2048, 32768)):
        pool = SplitPages(n // per_page, per_page, key_bytes, 4, device="cuda")
        pool.layout.write(pool.buf, torch.arange(n, device="cuda"), quantize_index_keys(torch.randn(n, 128, device="cuda")))
        locs = torch.arange(n, device="cuda", dtype=torch.int32)
        q = torch.randn(T, 64, 128, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(T, 64, device="cuda")
        # The last T tokens of a prompt of 4n tokens: the token at position p sees the
        # (p + 1) // 4 C4 records completed up to it.
        counts = ((4 * n - T + 1 + torch.arange(T, device="cuda")) // 4).to(torch.int32)
        refs = {}
        trials = [(fp8_q, block_t, block_n, False)
                  for fp8_q, block_t, block_n in itertools.product((False, True), (8, 16, 32), (64, 128))]
        trials += [(fp8_q, 16, block_n, True) for fp8_q, block_n in itertools.product((False, True), (64, 128))]
        for fp8_q, block_t, block_n, keys_on_m in trials:
            form = "keys-on-m" if keys_on_m else "heads-on-m"
            label = f"| {T} x {n} | {'fp8' if fp8_q else 'bf16'} {form} | {block_t} | {block_n} |"

            def run(block_t=block_t, block_n=block_n, fp8_q=fp8_q, keys_on_m=keys_on_m):
                return index_scores_shared(q, w, pool.buf, pool.layout, locs, counts, block_t=block_t,
                                           block_n=block_n, fp8_q=fp8_q, keys_on_m=keys_on_m)

            try:
                out = run()
                ref = refs.setdefault(fp8_q, out)
                seen = ref.isfinite()
                if not torch.equal(out.isfinite(), seen) or (out - ref)[seen].abs().max() > 1e-3 * ref[seen].abs().max():
                    print(f"{label} off the first config | | |", flush=True)
                    continue
                us = graph_us(run, calls=3)
            except Exception as e:  # out of shared memory or registers
                print(f"{label} {type(e).__name__} | | |", flush=True)
                continue
            print(f"{label} {us:.0f} | {2 * T * n * 64 * 128 / us / 1e6:.0f} | |", flush=True)
        scores = refs[False]
        print(f"| {T} x {n} | | | | | | {graph_us(lambda: top_k(scores, 512), calls=3):.0f} |", flush=True)

TABLES = {"rms_norm": rms_norm_table, "route": route_table, "top_k": top_k_table, "moe": moe_table,
          "moe_tiles": moe_tile_table, "moe_f16": moe_f16_table, "moe_fp8": moe_fp8_table, "indexer": indexer_table,
          "moe_prefill": moe_prefill_table, "indexer_prefill": indexer_prefill_table}

if __name__ == "__main__":
    import sys

    chosen = sys.argv[1:] or ["rms_norm", "route", "top_k", "moe"]
    unknown = [t for t in chosen if t not in TABLES]
    if unknown:
        sys.exit(f"tables {unknown} are not allowed; allowed: {', '.join(TABLES)}")
    print(torch.cuda.get_device_name())
    for table in chosen:
        TABLES[table]()
