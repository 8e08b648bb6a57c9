"""The remnant-kernels run: the ceilings, the checks, then store, reconstruct, the decode
tuning and sweep and FlashMLA's rows, timed, into one record (remnant.records.kinds.KERNEL_BENCH)
with the targets it measured (remnant.kernels.bench.targets)."""

from __future__ import annotations

import datetime as dt
import json

import torch

from remnant.kernels.bench.cases import (HEADS, KERNEL_R, SM90_CONFIG, TOPK, TUNED, WINDOW, DecodeCase, FlashMLACase,
                                         decode_bytes_flops, decode_cases, decode_configs, flashmla_bytes_flops,
                                         flashmla_cases, planned_window_apart, store_variants, tuned_kind)
from remnant.kernels.bench.checks import check_copies, check_decode, check_flashmla
from remnant.kernels.bench.harness import (Ceilings, compiled_info, gpu_provenance, measure_ceilings, progress_row,
                                           roofline, rotations, time_graph)
from remnant.kernels.bench.inputs import DecodeInputs, random_keep
from remnant.kernels.bench.targets import against_flashmla, targets
from remnant.records.kinds import KERNEL_BENCH


def _launch(kernel: str, permute: str) -> dict:
    """The launch a copy row ran with: the kernel's default for its permutation."""
    from remnant.kernels import reconstruct, store

    block_rows, num_warps = (store if kernel == "store" else reconstruct).LAUNCH[permute]
    return {"block_rows": block_rows, "num_warps": num_warps}


def bench_store(ceil: Ceilings, sizes: list[int], retentions: list[int], reps: int, gen) -> list[dict]:
    from remnant.kernels.store import store
    from remnant.kv.layout import KeptColumns, PageLayout

    rows = []
    per_page = 64
    for retention in retentions:
        keep = KeptColumns.of(random_keep(retention, gen), torch.device("cuda"))
        layout = PageLayout.sglang(per_page, retention)
        for n in sizes:
            call_bytes = n * (1024 + layout.record_bytes + 4)
            sets = rotations(call_bytes, ceil.l2_bytes, most=64)
            pages_needed = -(-n // per_page) * sets
            pool = torch.empty(pages_needed, layout.page_stride, dtype=torch.uint8, device="cuda")
            page_order = torch.randperm(pages_needed, generator=gen).to("cuda")
            calls = []
            for s in range(sets):
                x = torch.randn(n, 512, device="cuda", dtype=torch.bfloat16)
                # Prefill writes whole pages: shuffled pages, slots in order within each.
                pages = page_order[s * (-(-n // per_page)) : (s + 1) * (-(-n // per_page))]
                locs = (pages[:, None] * per_page + torch.arange(per_page, device="cuda")).flatten()[:n].to(torch.int32)
                calls.append((x, locs))
            for permute in store_variants(retention):
                seconds = time_graph(
                    [lambda x=x, locs=locs, p=permute: store(x, pool, layout, locs, keep, permute=p) for x, locs in calls],
                    reps)
                rows.append({"kernel": "store", "retention": retention, "records": n, "permute": permute,
                             **_launch("store", permute), "record_bytes": layout.record_bytes, **roofline(seconds, call_bytes, 0.0, ceil)})
                progress_row(rows[-1])
            del pool, calls
            torch.cuda.empty_cache()
    return rows


def bench_reconstruct(ceil: Ceilings, sizes: list[int], retentions: list[int], reps: int, gen) -> list[dict]:
    from remnant.kernels.reconstruct import PERMUTES, reconstruct
    from remnant.kv.layout import KeptColumns, PageLayout

    rows = []
    for retention in retentions:
        keep = KeptColumns.of(random_keep(retention, gen), torch.device("cuda"))
        layout = PageLayout.sglang(64, retention)
        pool_records = 8 * 2**20  # random picks from a pool of 8M records (1.5-3.6 GB)
        pool = torch.randint(0, 255, (pool_records // 64, layout.page_stride), dtype=torch.uint8, device="cuda")
        for k in sizes:
            call_bytes = k * (layout.record_bytes + 584 + 4)
            sets = rotations(call_bytes, ceil.l2_bytes, most=64)
            calls = []
            native = PageLayout.sglang(64)
            for _ in range(sets):
                # Selected records (random picks) into native pages, as the triton mode
                # gathers them for the stock attention.
                locs = torch.randint(0, pool_records, (k,), generator=gen).to(device="cuda", dtype=torch.int32)
                out = torch.empty(-(-k // 64), native.page_stride, dtype=torch.uint8, device="cuda")
                out_locs = torch.arange(k, dtype=torch.int32, device="cuda")
                calls.append((locs, out, out_locs))
            for permute in PERMUTES:
                seconds = time_graph(
                    [lambda locs=locs, out=out, ol=ol, p=permute: reconstruct(pool, layout, locs, keep, out, native, ol, permute=p)
                     for locs, out, ol in calls], reps)
                rows.append({"kernel": "reconstruct", "retention": retention, "records": k, "permute": permute,
                             **_launch("reconstruct", permute), "record_bytes": layout.record_bytes, **roofline(seconds, call_bytes, 0.0, ceil)})
                progress_row(rows[-1])
            del calls
        del pool
        torch.cuda.empty_cache()
    return rows


def plan_fields(plan) -> dict:
    """A decode row's record of its plan: the splits and what decode chose for them."""
    return {"splits": plan.splits, "window_apart": plan.window_apart, "partials": plan.partials,
            "split_plan": plan.split_plan, "join": plan.join}


def tune_decode(inputs: DecodeInputs, ceil: Ceilings, reps: int, quick: bool, batch: int,
                defaults: bool = False) -> tuple[list[dict], dict]:
    """Time each TUNED kind's configs; returns the rows and {kind: its best config}."""
    rows, best = [], {}
    for kind in TUNED:
        variant, window_columns, window_apart = kind
        case = DecodeCase(variant, 512 if variant == "native" else KERNEL_R, batch, TOPK, WINDOW,
                          window_columns=window_columns, window_apart=window_apart if variant == "packed" else None)
        nbytes, flops = decode_bytes_flops(case, planned_window_apart(case))
        for config in decode_configs(kind, quick, defaults):
            compiled: list = []
            try:
                plan = case.plan(config)
                error = check_decode(inputs, case, plan)
                seconds = time_graph(inputs.call_sets(case, ceil.l2_bytes, plan, compiled), reps)
            except Exception as exc:  # a config that does not compile or launch is recorded, not fatal
                rows.append({"variant": variant, "window_columns": window_columns, "config": config,
                             "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            row = {"variant": variant, "window_columns": window_columns, "config": config, **plan_fields(plan),
                   "max_rel_error": error,
                   **compiled_info(compiled), **roofline(seconds, nbytes, flops, ceil)}
            rows.append(row)
            progress_row(row)
            if not error < 1e-2:
                raise RuntimeError(f"decode {variant} {config}: relative error {error:.2e} against the float64 reference")
            if kind not in best or seconds * 1e6 < best[kind][1]:
                best[kind] = (config, seconds * 1e6)
    missing = [kind for kind in TUNED if kind not in best]
    if missing:
        raise RuntimeError(f"no decode config ran for {missing}: {rows}")
    return rows, {kind: c for kind, (c, _) in best.items()}


def bench_decode(inputs: DecodeInputs, ceil: Ceilings, reps: int, best: dict, cases: list[DecodeCase]) -> list[dict]:
    rows = []
    for case in cases:
        config = SM90_CONFIG if case.kernel == "sm90" else best[tuned_kind(case)]
        # The SM90 kernel's program is fixed (SM90_CONFIG records its tile for the row):
        # plan_decode refuses the Triton kernel's settings for it, so it is planned with none.
        plan = case.plan({} if case.kernel == "sm90" else config)
        nbytes, flops = decode_bytes_flops(case, plan.window_apart)
        compiled: list = []
        seconds = time_graph(inputs.call_sets(case, ceil.l2_bytes, plan, compiled), reps)
        fields = plan_fields(plan)
        rows.append({"variant": case.variant, "kernel": plan.kernel, "retention": case.retention, "batch": case.batch,
                     "topk": case.topk, "window": case.window, "columns": case.columns,
                     "window_columns": case.window_columns, "heads": HEADS, "config": config, "splits": fields.pop("splits"), "auto_splits": case.splits is None, **fields,
                     **compiled_info(compiled), **roofline(seconds, nbytes, flops, ceil)})
        progress_row(rows[-1])
    return rows


def bench_flashmla(inputs: DecodeInputs, ceil: Ceilings, reps: int, cases: list[FlashMLACase]) -> list[dict]:
    rows = []
    for case in cases:
        error = check_flashmla(inputs, case)
        if not error < 1e-2:
            raise RuntimeError(f"{case}: relative error {error:.2e} against the float64 reference")
        nbytes, flops = flashmla_bytes_flops(case)
        seconds = time_graph(inputs.flashmla_call_sets(case, ceil.l2_bytes), reps)
        rows.append({"kernel": case.kernel, "retention": case.retention, "batch": case.batch, "topk": case.topk,
                     "window": case.window, "heads": HEADS, "max_rel_error": error,
                     **roofline(seconds, nbytes, flops, ceil)})
        progress_row(rows[-1])
    return rows


def flashmla_status(without: bool) -> dict:
    """FlashMLA's package and whether this run times it (the record's "flashmla"): where the
    decode plan would run it on this GPU's native records (remnant.kernels.decode.choose)."""
    from remnant.kernels.decode import choose, flashmla

    why = "not asked for (--without-flashmla)" if without else choose(torch.device("cuda"), HEADS, False).reason
    return {"version": flashmla.version(), "timed": why is None, "reason": why}


SWEEPS = ("full", "decode", "quick")


def run(sweep: str, reps: int, seed: int, progress=print, stock: dict | None = None) -> dict:
    """The benchmark; stock: flashmla_status (None: this GPU's, FlashMLA asked for).
    sweep: "full" (every size, every tuned config), "quick" (a short sweep), or "decode"
    (every decode and FlashMLA case; copies at the quick sizes, decode at its default
    configs, which the full tuning chose: the sweep when only decode changed)."""
    if sweep not in SWEEPS:
        raise ValueError(f"sweep={sweep!r} is not allowed; allowed: {', '.join(SWEEPS)}")
    quick = sweep == "quick"
    copies_quick = sweep != "full"
    stock = stock or flashmla_status(without=False)
    gen = torch.Generator().manual_seed(seed)
    started = dt.datetime.now(dt.timezone.utc)
    progress("ceilings: copy bandwidth and bf16 matmul")
    ceil = measure_ceilings(reps)
    progress(f"  copy {ceil.copy_gbps:.0f} GB/s, matmul {ceil.matmul_tflops:.0f} TFLOP/s, L2 {ceil.l2_bytes >> 20} MiB")
    big = [2**16, 2**20] if copies_quick else [2**14, 2**17, 2**20, 2**22]
    progress("checks: store and reconstruct against the references")
    checks = check_copies(gen)
    progress(json.dumps(checks))
    if any(c["bytes_differing"] for c in checks):
        raise RuntimeError(f"store or reconstruct differ from the reference: {checks}")
    progress("store")
    store_rows = bench_store(ceil, big, [512, KERNEL_R] if copies_quick else [512, 128, 192, KERNEL_R, 320, 384, 448],
                             reps, gen)
    progress("reconstruct")
    reconstruct_rows = bench_reconstruct(ceil, big, [KERNEL_R] if copies_quick else [64, 128, 192, KERNEL_R, 320, 448],
                                         reps, gen)
    inputs = DecodeInputs(gen)
    progress("decode: tuning")
    tuning, best = tune_decode(inputs, ceil, reps, quick, batch=128, defaults=sweep == "decode")
    progress(f"  best: {best}")
    progress("decode: sweep")
    from remnant.kernels.decode import choose

    sm90 = choose(torch.device("cuda"), HEADS, True, n_kept=KERNEL_R - 64, columns="kept_first",
                  window_columns="kept_first", q_dtype=torch.bfloat16)
    progress("  SM90 Gluon kernel: " + ("timed" if sm90.kernel == "sm90" else f"not timed: {sm90.reason}"))
    decode_rows = bench_decode(inputs, ceil, reps, best, decode_cases(quick, sm90=sm90.kernel == "sm90"))
    flashmla_rows = []
    if stock["timed"]:
        progress(f"decode: FlashMLA V4 (sgl-flash-mla {stock['version']}) and triton mode's reconstruct + FlashMLA")
        flashmla_rows = bench_flashmla(inputs, ceil, reps, flashmla_cases(quick))
    provenance = gpu_provenance()
    return {
        **KERNEL_BENCH.header(),
        "created_at": started.isoformat(timespec="seconds"),
        "seed": seed,
        "provenance": provenance,
        "method": {"timing": "CUDA graph of a rotation of input sets (> 3x L2), replayed; CUDA events; median",
                   "replays": reps, "quick": quick, "sweep": sweep, "heads": HEADS},
        "ceilings": {"copy_gbps": ceil.copy_gbps, "matmul_bf16_tflops": ceil.matmul_tflops, "l2_bytes": ceil.l2_bytes},
        "checks": checks,
        "store": store_rows,
        "reconstruct": reconstruct_rows,
        "decode_tuning": tuning,
        "decode": decode_rows,
        "flashmla": stock,
        "flashmla_decode": flashmla_rows,
        "against_flashmla": against_flashmla(decode_rows, flashmla_rows),
        "targets": targets(decode_rows, store_rows, reconstruct_rows, flashmla_rows, provenance["gpu"]["capability"]),
    }
