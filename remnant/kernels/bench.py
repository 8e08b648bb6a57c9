"""remnant-kernels: time store, reconstruct and decode on one CUDA GPU, against FlashMLA and its own ceilings.

Every decode figure is stated against FlashMLA's V4 sparse decode (sgl-flash-mla, the
stock attention SGLang serves DeepSeek-V4 with), timed in the same run and harness:
kernel mode's direct packed decode / FlashMLA (the targets), and triton mode's decode
(SGLang's staging of the selected records by Remnant's reconstruct, then FlashMLA) /
FlashMLA. Remnant's Triton native kernel is a cross-check row, not the anchor.

Every number comes from this run: the copy bandwidth (device-to-device copy, bytes read
plus written) and the bf16 matrix rate are measured first and serve as the roofline.
Each case is timed as CUDA-graph replays of a rotation of input sets whose bytes exceed
three times the L2 cache (so the cache does not serve repeated reads), with CUDA events,
after warm-up; the median replay over the rotation length is the time of one call.

Bytes are the fewest a call must move (each input read once, each output written once);
FLOPs count the tensor-core work the kernel issues (padding included: a packed kernel at
R = 384 multiplies its 320 kept columns as blocks of 256 and 64, and 64 RoPE columns, per
C4 record, and for window tokens the kept blocks, the dropped columns padded to a power of
two, and RoPE, or, with the window in a program of its own, the native program's 512 and
64). The JSON (schema remnant/kernel-bench, version SCHEMA_VERSION) is validated before it
is written.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from remnant.records.provenance import GIT_COMMIT_ENV

SCHEMA_VERSION = 12
HEADS = 64
H_BLOCK = 64  # heads per decode program in every tuned config: all 64 of a token
WINDOW = 128
TOPK = 512
KERNEL_R = 256


@dataclass
class Ceilings:
    copy_gbps: float
    matmul_tflops: float
    l2_bytes: int


def _sync_time_graph(calls: list, reps: int) -> float:
    """Median seconds of one call: graph of `calls` (rotation), replayed `reps` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[: min(3, len(calls))]:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    del graph
    return statistics.median(times)


def _progress_row(row: dict) -> None:
    """One line per finished case on stderr, so a run cut short still shows its numbers."""
    shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
             if k in ("kernel", "variant", "retention", "records", "permute", "batch", "topk", "window", "columns",
                      "window_columns", "config", "splits", "join", "time_us",
                      "fraction_of_copy_bandwidth", "fraction_of_matmul_rate", "n_regs", "n_spills", "max_rel_error",
                      "error")}
    print(json.dumps(shown), file=sys.stderr, flush=True)


def _rotations(call_bytes: int, l2_bytes: int, most: int = 256) -> int:
    return max(2, min(most, math.ceil(3 * l2_bytes / max(call_bytes, 1))))


@functools.cache
def _copy_kernel():
    """A plain streaming Triton copy, built once (triton is imported only with a GPU)."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=ok), mask=ok)

    return copy


def _triton_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    """The second candidate for the copy ceiling."""
    _copy_kernel()[(-(-src.numel() // 8192),)](src, dst, src.numel(), BLOCK=8192, num_warps=8)


def measure_ceilings(reps: int) -> Ceilings:
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    n = 2 * 2**30  # 2 GiB each way: far past L2
    # float32 elements: a byte-element copy kernel moves fewer bytes per thread and ran at
    # 2.7 TB/s here, below what wide copies reach (store beat it by 20%).
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(100):  # about 0.2 s of copies: the clocks leave idle before timing
        dst.copy_(src)
    torch.cuda.synchronize()
    # The faster of torch's copy and a plain Triton streaming copy is the ceiling.
    t_copy = min(_sync_time_graph([lambda: dst.copy_(src)], reps), _sync_time_graph([lambda: _triton_copy(src, dst)], reps))
    del src, dst
    size = 8192
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    t_mm = _sync_time_graph([lambda: a @ b], max(5, reps // 4))
    del a, b
    torch.cuda.empty_cache()
    return Ceilings(copy_gbps=2 * n / t_copy / 1e9, matmul_tflops=2 * size**3 / t_mm / 1e12, l2_bytes=l2)


def _keep(retention: int, gen: torch.Generator) -> torch.Tensor | None:
    if retention == 512:
        return None
    return torch.randperm(448, generator=gen)[: retention - 64].sort().values


def _roofline(seconds: float, nbytes: int, flops: float, ceil: Ceilings) -> dict:
    t_bytes = nbytes / (ceil.copy_gbps * 1e9)
    t_flops = flops / (ceil.matmul_tflops * 1e12)
    return {
        "time_us": seconds * 1e6,
        "bytes": nbytes,
        "flops": flops,
        "achieved_gbps": nbytes / seconds / 1e9,
        "fraction_of_copy_bandwidth": t_bytes / seconds,
        "fraction_of_matmul_rate": t_flops / seconds,
        "floor_us": max(t_bytes, t_flops) * 1e6,
        "floor_bound": "memory" if t_bytes >= t_flops else "tensor-core",
    }


def _store_variants(retention: int) -> list[str]:
    from remnant.kernels.store import PERMUTES

    # Native records need no permutation: one row, labelled by the kernel's contiguous store.
    return ["registers"] if retention == 512 else list(PERMUTES)


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
        keep = KeptColumns.of(_keep(retention, gen), torch.device("cuda"))
        layout = PageLayout.sglang(per_page, retention)
        for n in sizes:
            call_bytes = n * (1024 + layout.record_bytes + 4)
            sets = _rotations(call_bytes, ceil.l2_bytes, most=64)
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
            for permute in _store_variants(retention):
                seconds = _sync_time_graph(
                    [lambda x=x, locs=locs, p=permute: store(x, pool, layout, locs, keep, permute=p) for x, locs in calls],
                    reps)
                rows.append({"kernel": "store", "retention": retention, "records": n, "permute": permute,
                             **_launch("store", permute), "record_bytes": layout.record_bytes, **_roofline(seconds, call_bytes, 0.0, ceil)})
                _progress_row(rows[-1])
            del pool, calls
            torch.cuda.empty_cache()
    return rows


def bench_reconstruct(ceil: Ceilings, sizes: list[int], retentions: list[int], reps: int, gen) -> list[dict]:
    from remnant.kernels.reconstruct import PERMUTES, reconstruct
    from remnant.kv.layout import KeptColumns, PageLayout

    rows = []
    for retention in retentions:
        keep = KeptColumns.of(_keep(retention, gen), torch.device("cuda"))
        layout = PageLayout.sglang(64, retention)
        pool_records = 8 * 2**20  # random picks from a pool of 8M records (1.5-3.6 GB)
        pool = torch.randint(0, 255, (pool_records // 64, layout.page_stride), dtype=torch.uint8, device="cuda")
        for k in sizes:
            call_bytes = k * (layout.record_bytes + 584 + 4)
            sets = _rotations(call_bytes, ceil.l2_bytes, most=64)
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
                seconds = _sync_time_graph(
                    [lambda locs=locs, out=out, ol=ol, p=permute: reconstruct(pool, layout, locs, keep, out, native, ol, permute=p)
                     for locs, out, ol in calls], reps)
                rows.append({"kernel": "reconstruct", "retention": retention, "records": k, "permute": permute,
                             **_launch("reconstruct", permute), "record_bytes": layout.record_bytes, **_roofline(seconds, call_bytes, 0.0, ceil)})
                _progress_row(rows[-1])
            del calls
        del pool
        torch.cuda.empty_cache()
    return rows


@dataclass
class DecodeCase:
    variant: str  # "native" or "packed"
    retention: int
    batch: int
    topk: int
    window: int
    columns: str = "natural"  # packed: q and out in the model's order, or "kept_first" (decode's columns)
    window_columns: str = "natural"  # packed: the window records' form, native or kept-first (decode's window_columns)
    splits: int | None = None  # programs per token and head block (decode's splits); None: auto_splits
    window_apart: bool | None = None  # packed, all orders natural: the window in a program of its own (decode's)
    split_plan: str | None = None  # how splits share the records (decode's split_plan); None: split_plan_for
    join: str | None = None  # how splits join (decode's join); None: join_for
    kernel: str = "triton"  # the decode kernel (remnant.kernels.decode.KERNELS): "sm90", the folded packed call only

    def plan(self, launch: dict):
        """decode's plan for this case at the launch settings `launch` (h_block, num_warps
        and the loop settings: a tuned config) on this GPU: remnant.kernels.decode.plan_decode,
        as decode itself makes it."""
        from remnant.kernels.decode import DecodeConfig, plan_decode

        config = DecodeConfig(kernel=self.kernel, **launch, splits=self.splits, window_apart=self.window_apart,
                              split_plan=self.split_plan, join=self.join)
        return plan_decode(self.batch, HEADS, self.window, self.topk, self.variant == "packed", torch.device("cuda"),
                           columns=self.columns, window_columns=self.window_columns, config=config,
                           n_kept=self.retention - 64, q_dtype=torch.bfloat16)


def _plan_fields(plan) -> dict:
    """A decode row's record of its plan: the splits and what decode chose for them."""
    return {"splits": plan.splits, "window_apart": plan.window_apart, "partials": plan.partials,
            "split_plan": plan.split_plan, "join": plan.join}


def _decode_bytes_flops(case: DecodeCase, window_apart: bool = False) -> tuple[int, float]:
    rb = 584 if case.variant == "native" else case.retention + 72
    io = 2 * case.batch * HEADS * 512 * 2  # q read, out written (bf16)
    nbytes = case.batch * (case.topk * (rb + 4) + case.window * (584 + 4)) + io
    # Multiply-adds the kernel issues per (head, record), padding included (x 2 FLOPs):
    # native: 512 + 64 columns for the score and for P.V. Packed C4 records: the kept
    # column blocks (remnant.kernels.decode.triton.kept_column_blocks), plus RoPE, for both.
    # Packed window tokens: kept blocks, dropped columns padded to a power of two, plus
    # RoPE, for both; with the window apart (the native program reads it), as native.
    if case.variant == "native":
        c4_macs = win_macs = 2 * (512 + 64)
    else:
        from remnant.kernels.decode.triton import kept_column_blocks

        def padded(n: int) -> int:
            return max(16, 2 ** math.ceil(math.log2(max(n, 1))))

        kept = case.retention - 64
        kept_macs = sum(kept_column_blocks(kept, padded(kept)))
        c4_macs = 2 * (kept_macs + 64)
        win_macs = 2 * (512 + 64) if window_apart else 2 * (kept_macs + padded(448 - kept) + 64)
    flops = 2 * case.batch * HEADS * (case.topk * c4_macs + case.window * win_macs)
    return nbytes, float(flops)


class DecodeInputs:
    """Pools shared by all decode cases (native and packed C4, one window pool), random locs.

    Random codes and scales are valid window records of either form (native, or kept-first:
    remnant.kv.paged.quantize_kept_first), so every case reads the one window pool, and the
    reference reads it in the case's form (window_columns)."""

    def __init__(self, gen: torch.Generator, c4_records: int = 4 * 2**20, window_records: int = 2**20):
        from remnant.kv.layout import PageLayout

        self.gen = gen
        self.window_layout = PageLayout.sglang(64)
        self.window = self._random_records(self.window_layout, window_records)
        self.c4_records = c4_records
        self.pools: dict[int, tuple] = {}

    def _random_records(self, layout, records: int) -> torch.Tensor:
        # Random codes with realistic scales: byte 120..134 exponents, codes any finite FP8.
        per_page, data_bytes = layout.per_page, layout.data_bytes
        pool = torch.randint(0, 255, (records // per_page, layout.page_stride), dtype=torch.uint8, device="cuda")
        data = per_page * data_bytes
        tail = pool[:, data : data + per_page * 8].unflatten(1, (per_page, 8))
        tail[:, :, :7] = torch.randint(120, 135, tail[:, :, :7].shape, dtype=torch.uint8, device="cuda")
        tail[:, :, 7] = 0
        body = pool[:, :data].unflatten(1, (per_page, data_bytes))
        n_codes = data_bytes - 128
        body[:, :, :n_codes] &= 0xBF  # FP8 e4m3 with the top exponent bit clear: no NaN, |x| < 2
        rope = body[:, :, n_codes:].view(torch.bfloat16)
        rope.copy_(torch.randn(rope.shape, device="cuda").to(torch.bfloat16))
        return pool

    def pool(self, retention: int):
        from remnant.kv.layout import KeptColumns, PageLayout

        if retention not in self.pools:
            layout = PageLayout.sglang(64, retention)
            # Native pools get the all-columns table too, built here: nothing may be copied
            # from the host while a CUDA graph is being captured.
            keep = KeptColumns.of(_keep(retention, self.gen), torch.device("cuda"))
            self.pools[retention] = (layout, self._random_records(layout, self.c4_records), keep)
        return self.pools[retention]

    def check(self, case: DecodeCase, plan) -> float:
        return _check_decode(self, case, plan)

    def call_sets(self, case: DecodeCase, l2_bytes: int, plan, compiled: list | None = None) -> list:
        """Timed calls of `case`, each on inputs of its own, running `plan` (case.plan)."""
        from remnant.kernels.decode import decode

        layout, pool, keep = self.pool(512 if case.variant == "native" else case.retention)
        nbytes, _ = _decode_bytes_flops(case)
        window = self.window
        calls = []
        sink = torch.randn(HEADS, device="cuda")
        for _ in range(_rotations(nbytes, l2_bytes)):
            q, c4_locs, win_locs = self._random_call(case.batch, case.topk, case.window)
            out = torch.empty_like(q)
            calls.append(lambda q=q, c=c4_locs, w=win_locs, out=out: decode(
                q, pool, layout, c, window, self.window_layout, w, sink, keep, columns=case.columns,
                window_columns=case.window_columns, out=out, config=plan, compiled=compiled))
        return calls


    def flashmla_call(self, case: FlashMLACase, q, c4_locs, win_locs, sink, out=None):
        """One call of `case` on these inputs (a closure, for graphs and checks). Timed
        calls give no `out`: FlashMLA returns its own output, as SGLang takes it (a copy
        into `out` would add a pass over the output to FlashMLA's time)."""
        from remnant.kernels.decode import flashmla
        from remnant.kv.layout import PageLayout

        window, window_layout = self.window, self.window_layout
        if case.kernel == "flashmla":
            layout, pool, _ = self.pool(512)
            return lambda: flashmla.decode(q, pool, layout, c4_locs, window, window_layout, win_locs, sink, out=out)
        from remnant.sglang.buffers import stage_selected

        layout, pool, keep = self.pool(case.retention)
        staged_layout = PageLayout.sglang(STAGE_PER_PAGE)
        records = q.shape[0] * c4_locs.shape[1]
        scratch = torch.empty(max(1, -(-records // STAGE_PER_PAGE)), staged_layout.page_stride, dtype=torch.uint8,
                              device=q.device)

        def call():
            staged = stage_selected(pool, layout, keep, c4_locs, scratch, STAGE_PER_PAGE)
            return flashmla.decode(q, scratch, staged_layout, staged, window, window_layout, win_locs, sink, out=out)

        return call

    def flashmla_call_sets(self, case: FlashMLACase, l2_bytes: int) -> list:
        nbytes, _ = _flashmla_bytes_flops(case)
        sink = torch.randn(HEADS, device="cuda")
        calls = []
        for _ in range(_rotations(nbytes, l2_bytes)):
            q, c4_locs, win_locs = self._random_call(case.batch, case.topk, case.window)
            calls.append(self.flashmla_call(case, q, c4_locs, win_locs, sink))
        return calls

    def _random_call(self, batch: int, topk: int, window: int):
        """q bf16 [batch, 64, 512], C4 locations int32 [batch, topk] over the C4 pools, and
        `window` consecutive window locations int32 per token."""
        q = torch.randn(batch, HEADS, 512, device="cuda", dtype=torch.bfloat16)
        c4_locs = torch.randint(0, self.c4_records, (batch, topk), device="cuda", dtype=torch.int32)
        base = torch.randint(0, self.window_layout.capacity(self.window) - window, (batch, 1), device="cuda")
        win_locs = (base + torch.arange(window, device="cuda")).to(torch.int32)
        return q, c4_locs, win_locs


def poison_next_allocation(like: torch.Tensor) -> None:
    """Fill a freed block of `like`'s size with NaN: PyTorch's caching allocator hands it to
    the next allocation of that size (the output a kernel allocates itself), so an element
    the kernel does not write reads NaN."""
    torch.full_like(like, float("nan"))


def _check_flashmla(inputs: DecodeInputs, case: FlashMLACase) -> float:
    """Worst relative error per token of a FlashMLA row's call against remnant.kernels.decode.reference's
    float64 reference (native records; triton mode: the packed records' reference, dropped
    coordinates zero), on four tokens with -1 padding in one. FlashMLA allocates its own
    output: the block it takes is filled with NaN first (poison_next_allocation)."""
    from remnant.kernels.decode.reference import decode_native_reference, decode_packed_reference

    q, c4_locs, win_locs = inputs._random_call(4, case.topk, case.window)
    if case.topk > 5:
        c4_locs[0, -5:] = -1
    sink = torch.randn(HEADS, device="cuda")
    poison_next_allocation(q)
    out = inputs.flashmla_call(case, q, c4_locs, win_locs, sink)()
    layout, pool, keep = inputs.pool(case.retention)
    window = (inputs.window, inputs.window_layout, win_locs, sink)
    if case.kernel == "flashmla":
        ref = decode_native_reference(q, pool, layout, c4_locs, *window)
    else:
        ref = decode_packed_reference(q, pool, layout, c4_locs, keep.kept[: keep.n_kept].long().cpu(), *window)
    if out.isnan().any():
        return float("inf")
    return float(((out.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).max())


def bench_flashmla(inputs: DecodeInputs, ceil: Ceilings, reps: int, cases: list[FlashMLACase]) -> list[dict]:
    rows = []
    for case in cases:
        error = _check_flashmla(inputs, case)
        if not error < 1e-2:
            raise RuntimeError(f"{case}: relative error {error:.2e} against the float64 reference")
        nbytes, flops = _flashmla_bytes_flops(case)
        seconds = _sync_time_graph(inputs.flashmla_call_sets(case, ceil.l2_bytes), reps)
        rows.append({"kernel": case.kernel, "retention": case.retention, "batch": case.batch, "topk": case.topk,
                     "window": case.window, "heads": HEADS, "max_rel_error": error,
                     **_roofline(seconds, nbytes, flops, ceil)})
        _progress_row(rows[-1])
    return rows


def against_flashmla(decode_rows: list[dict], flashmla_rows: list[dict]) -> list[dict]:
    """Every decode row (at auto_splits) and triton mode's rows over FlashMLA's row of the
    same batch, top-k and window: time / FlashMLA's time."""
    stock = {(r["batch"], r["topk"], r["window"]): r for r in flashmla_rows if r["kernel"] == "flashmla"}
    out = []
    for r in [*(d for d in decode_rows if d["auto_splits"]), *(f for f in flashmla_rows if f["kernel"] != "flashmla")]:
        flash = stock.get((r["batch"], r["topk"], r["window"]))
        if flash is None:
            continue
        if "variant" not in r:
            what = f"triton mode (reconstruct R={r['retention']} + FlashMLA)"
        elif r["variant"] == "native":
            what = "Remnant's Triton native kernel (cross-check)"
        else:
            what = (f"kernel mode, packed R={r['retention']} ({_orders_label(r['columns'], r['window_columns'])}"
                    f"{_kernel_label(r)})")
        out.append({"name": f"{what}, batch {r['batch']}, top-k {r['topk']}, window {r['window']}",
                    "batch": r["batch"], "topk": r["topk"], "window": r["window"],
                    "value": r["time_us"] / flash["time_us"]})
    return out


def check_copies(gen: torch.Generator) -> list[dict]:
    """store and reconstruct against remnant.kv.paged's references: bytes must be equal."""
    from remnant.kernels.reconstruct import PERMUTES, reconstruct
    from remnant.kernels.store import store
    from remnant.kv import paged
    from remnant.kv.layout import PageLayout

    checks = []
    n = 100_003
    for retention in (512, 128, 192, 256, 320, 384, 448, 64):
        keep = _keep(retention, gen)
        layout = PageLayout.sglang(64, retention)
        x = (torch.randn(n, 512, device="cuda") * torch.exp(torch.randn(n, 1, device="cuda") * 2)).to(torch.bfloat16)
        locs = torch.randperm(n + 997, device="cuda")[:n]
        want = torch.full((-(-(n + 997) // 64), layout.page_stride), 0xAB, dtype=torch.uint8, device="cuda")
        paged.store_reference(x, want, layout, locs, keep)
        for permute in _store_variants(retention):
            got = torch.full_like(want, 0xAB)
            store(x, got, layout, locs, keep, check_range=True, permute=permute)
            checks.append({"kernel": "store", "retention": retention, "records": n, "permute": permute,
                           "bytes_differing": int((got != want).sum())})
        if keep is not None:
            picks = torch.randint(0, n + 997, (n,), device="cuda")
            ref = paged.reconstruct_reference(want, layout, picks, keep)
            for permute in PERMUTES:
                out = reconstruct(want, layout, picks, keep, check_range=True, permute=permute)
                checks.append({"kernel": "reconstruct", "retention": retention, "records": n, "permute": permute,
                               "bytes_differing": int((out != ref).sum())})
    return checks


def _check_decode(inputs: "DecodeInputs", case: DecodeCase, plan) -> float:
    """Worst relative error of the kernel against its float64 reference (remnant.kernels.decode.reference).

    Four tokens drawn from the benchmark's own pools (with -1 padding in one), each
    token's error ||out - ref|| / ||ref||; the output is poisoned with NaN first.
    """
    from remnant.kernels.decode import decode
    from remnant.kernels.decode.reference import decode_native_reference, decode_packed_reference

    layout, pool, keep = inputs.pool(512 if case.variant == "native" else case.retention)
    batch = 4
    q = torch.randn(batch, HEADS, 512, device="cuda", dtype=torch.bfloat16)
    c4_locs = torch.randint(0, inputs.c4_records, (batch, case.topk), device="cuda")
    c4_locs[0, -5:] = -1
    base = torch.randint(0, inputs.window_layout.capacity(inputs.window) - case.window, (batch, 1), device="cuda")
    win_locs = base + torch.arange(case.window, device="cuda")
    sink = torch.randn(HEADS, device="cuda")
    out = torch.full_like(q, float("nan"))
    window = inputs.window
    # The timed case's plan (its splits, whatever this check's batch would choose).
    orders = dict(columns=case.columns, window_columns=case.window_columns, config=plan)
    if case.columns == "kept_first":  # q in and out back in kept-first order, compared in the model's
        got = torch.full_like(q, float("nan"))
        decode(q[:, :, keep.order], pool, layout, c4_locs, window, inputs.window_layout, win_locs, sink, keep,
               out=got, **orders)
        out[:, :, keep.order] = got
    else:
        decode(q, pool, layout, c4_locs, window, inputs.window_layout, win_locs, sink, keep, out=out, **orders)
    if case.variant == "native":
        ref = decode_native_reference(q, pool, layout, c4_locs, window, inputs.window_layout, win_locs, sink)
    else:
        keep_idx = keep.kept[: keep.n_kept].long().cpu()
        ref = decode_packed_reference(q, pool, layout, c4_locs, keep_idx, window, inputs.window_layout, win_locs,
                                      sink, window_columns=case.window_columns)
    if out.isnan().any():
        return float("inf")
    errors = (out.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
    return float(errors.max())


# FlashMLA's rows: the stock decode over native records ("flashmla"), and triton mode's
# decode as the SGLang plugin runs it ("reconstruct+flashmla": stage_selected reconstructs
# each token's selected packed records into native pages, then FlashMLA reads those).
FLASHMLA_KERNELS = ("flashmla", "reconstruct+flashmla")
STAGE_PER_PAGE = 64  # the plugin stages into SGLang's C4 pages (page size 256)


@dataclass
class FlashMLACase:
    kernel: str  # one of FLASHMLA_KERNELS
    batch: int
    topk: int
    window: int
    retention: int = 512  # reconstruct+flashmla: the packed records' R

    def native_case(self) -> DecodeCase:
        return DecodeCase("native", 512, self.batch, self.topk, self.window)


def _flashmla_bytes_flops(case: FlashMLACase) -> tuple[int, float]:
    """FlashMLA's call as the native decode's; the staging adds per selected record its
    packed read, its native write and its location."""
    nbytes, flops = _decode_bytes_flops(case.native_case())
    if case.kernel == "reconstruct+flashmla":
        nbytes += case.batch * case.topk * (case.retention + 72 + 584 + 4)
    return nbytes, flops


def flashmla_cases(quick: bool) -> list[FlashMLACase]:
    """FlashMLA's rows at every batch and window the decode rows have at top-k 512, triton
    mode's beside them, and FlashMLA at the other top-k the decode rows time."""
    batches = [16, 64, 128] if quick else DECODE_BATCHES
    cases = [FlashMLACase(kernel, batch, TOPK, window, 512 if kernel == "flashmla" else KERNEL_R)
             for batch in batches for window in (WINDOW, 0) for kernel in FLASHMLA_KERNELS]
    cases += [FlashMLACase("flashmla", 128, topk, WINDOW) for topk in ([2048] if quick else [128, 2048])]
    return cases


def _compiled_info(compiled: list) -> dict:
    kernel = compiled[-1] if compiled else None
    info = {}
    for key in ("n_regs", "n_spills"):
        value = getattr(kernel, key, None)
        if isinstance(value, int):
            info[key] = value
    shared = getattr(getattr(kernel, "metadata", None), "shared", None)
    if isinstance(shared, int):
        info["shared_bytes"] = shared
    return info


# What is tuned, each for its own best config (equal care): native records, and packed
# records with the window in each code order (the window loop differs: by index or by
# words) or, in natural order, in a program of its own (decode's window_apart).
TUNED = [("native", "natural", False), ("packed", "natural", False), ("packed", "natural", True),
         ("packed", "kept_first", False)]

# Per tuned kind, the loop forms in the sweep: (C4 loop records per step, its scores
# transposed, window loop records per step, its scores transposed), each at 1-3 pipeline
# stages, 64 heads per program on 8 warps. The forms are the best three per kind of the
# fourth round's probes (the window apart: the sixth's; benchmarks/kernels/NOTES.md),
# which also measured and dropped: 16-warp programs (+35-60%), two 32-head programs per SM
# (+55-60%), and for native records 64 records per step with transposed scores (+35-90%:
# spills).
DECODE_FORMS = {
    ("native", "natural", False): [(32, True, 32, True), (64, False, 32, True), (16, True, 16, True)],
    ("packed", "natural", False): [(64, False, 16, True), (32, True, 16, True), (64, True, 16, True)],
    ("packed", "natural", True): [(64, False, 32, True), (64, False, 16, True), (32, False, 32, True)],
    ("packed", "kept_first", False): [(64, False, 32, False), (64, False, 16, True), (32, True, 32, True)],
}
DECODE_STAGES = (1, 2, 3)


# The decode defaults (remnant.kernels.decode.plan.DEFAULT_CONFIGS) of each tuned kind.
DEFAULT_OF_KIND = {("native", "natural", False): "native", ("packed", "natural", False): "packed",
                   ("packed", "natural", True): "packed, window apart",
                   ("packed", "kept_first", False): "packed, kept-first window"}


def decode_configs(kind: tuple[str, str, bool], quick: bool, defaults: bool = False) -> list[dict]:
    """The configs tune_decode times for `kind`: every form at every depth, the first form
    at one stage (quick), or decode's own default (defaults: the tuning's winner)."""
    if defaults:
        from remnant.kernels.decode.plan import DEFAULT_CONFIGS

        return [dict(h_block=H_BLOCK, num_warps=8, **DEFAULT_CONFIGS[DEFAULT_OF_KIND[kind]])]
    forms = DECODE_FORMS[kind][:1] if quick else DECODE_FORMS[kind]
    return [dict(h_block=H_BLOCK, block_n=bn, num_warps=8, num_stages=stages, scores_transposed=t,
                 window_block_n=wbn, window_scores_transposed=wt)
            for bn, t, wbn, wt in forms for stages in ((1,) if quick else DECODE_STAGES)]


def tune_decode(inputs: DecodeInputs, ceil: Ceilings, reps: int, quick: bool, batch: int,
                defaults: bool = False) -> tuple[list[dict], dict]:
    """Time each TUNED kind's configs; returns the rows and {kind: its best config}."""
    rows, best = [], {}
    for kind in TUNED:
        variant, window_columns, window_apart = kind
        case = DecodeCase(variant, 512 if variant == "native" else KERNEL_R, batch, TOPK, WINDOW,
                          window_columns=window_columns, window_apart=window_apart if variant == "packed" else None)
        nbytes, flops = _decode_bytes_flops(case, _window_apart(case))
        for config in decode_configs(kind, quick, defaults):
            compiled: list = []
            try:
                plan = case.plan(config)
                error = inputs.check(case, plan)
                seconds = _sync_time_graph(inputs.call_sets(case, ceil.l2_bytes, plan, compiled), reps)
            except Exception as exc:  # a config that does not compile or launch is recorded, not fatal
                rows.append({"variant": variant, "window_columns": window_columns, "config": config,
                             "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            row = {"variant": variant, "window_columns": window_columns, "config": config, **_plan_fields(plan),
                   "max_rel_error": error,
                   **_compiled_info(compiled), **_roofline(seconds, nbytes, flops, ceil)}
            rows.append(row)
            _progress_row(row)
            if not error < 1e-2:
                raise RuntimeError(f"decode {variant} {config}: relative error {error:.2e} against the float64 reference")
            if kind not in best or seconds * 1e6 < best[kind][1]:
                best[kind] = (config, seconds * 1e6)
    missing = [kind for kind in TUNED if kind not in best]
    if missing:
        raise RuntimeError(f"no decode config ran for {missing}: {rows}")
    return rows, {kind: c for kind, (c, _) in best.items()}


def _window_apart(case: DecodeCase) -> bool:
    """Whether decode runs the window of `case` in a program of its own (which the tuned
    kind and the FLOP count follow), at 64 heads per program."""
    return case.plan({"h_block": H_BLOCK}).window_apart


def _tuned_kind(case: DecodeCase) -> tuple[str, str, bool]:
    return case.variant, case.window_columns if case.variant == "packed" else "natural", _window_apart(case)


def bench_decode(inputs: DecodeInputs, ceil: Ceilings, reps: int, best: dict, cases: list[DecodeCase]) -> list[dict]:
    rows = []
    for case in cases:
        config = SM90_CONFIG if case.kernel == "sm90" else best[_tuned_kind(case)]
        plan = case.plan(config)
        nbytes, flops = _decode_bytes_flops(case, plan.window_apart)
        compiled: list = []
        seconds = _sync_time_graph(inputs.call_sets(case, ceil.l2_bytes, plan, compiled), reps)
        fields = _plan_fields(plan)
        rows.append({"variant": case.variant, "kernel": plan.kernel, "retention": case.retention, "batch": case.batch,
                     "topk": case.topk, "window": case.window, "columns": case.columns,
                     "window_columns": case.window_columns, "heads": HEADS, "config": config, "splits": fields.pop("splits"), "auto_splits": case.splits is None, **fields,
                     **_compiled_info(compiled), **_roofline(seconds, nbytes, flops, ceil)})
        _progress_row(rows[-1])
    return rows


# The SM90 Gluon kernel's fixed program, as a decode row's config: 64 heads on 8 warps,
# steps of 64 records, two stages of copies (remnant.kernels.decode.sm90).
SM90_CONFIG = {"h_block": 64, "block_n": 64, "num_warps": 8, "num_stages": 2}


def _other_split_plan(plan: str | None) -> str | None:
    """The split plan decode did not choose (None for one split, which has no plan)."""
    return {"even": "by_cost", "by_cost": "even"}.get(plan)


DECODE_BATCHES = [1, 16, 32, 64, 128, 256, 512]


def decode_cases(quick: bool, multiprocessors: int | None = None, sm90: bool = False) -> list[DecodeCase]:
    """The decode rows' cases; multiprocessors (default: this GPU's) sets the split counts
    of the rows that time the other split plan at auto_splits' count; sm90: the SM90 Gluon
    kernel's folded call beside the Triton one at every batch and window."""
    from remnant.kernels.decode.plan import split_plan_for, splits_for

    if multiprocessors is None:
        multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
    batches = [16, 64, 128] if quick else DECODE_BATCHES
    cases = []
    for batch in batches:
        for window in (WINDOW, 0):
            # Native (the cross-check), packed as the SGLang plugin calls it (natural orders),
            # and as the engine does (the order folded into the projections; with a window,
            # window records written in kept-first order).
            cases.append(DecodeCase("native", 512, batch, TOPK, window))
            cases.append(DecodeCase("packed", KERNEL_R, batch, TOPK, window))
            cases.append(DecodeCase("packed", KERNEL_R, batch, TOPK, window, "kept_first",
                                    "kept_first" if window else "natural"))
            if sm90:  # the same folded call on the SM90 kernel (it reads kept-first windows only)
                cases.append(DecodeCase("packed", KERNEL_R, batch, TOPK, window, "kept_first", "kept_first",
                                        kernel="sm90"))
            if batch >= 64 and window:  # each of the two orders alone
                cases.append(DecodeCase("packed", KERNEL_R, batch, TOPK, window, "kept_first"))
                if batch in (64, 128):
                    cases.append(DecodeCase("packed", KERNEL_R, batch, TOPK, window, "natural", "kept_first"))
    for topk in ([128, 2048] if not quick else [2048]):
        cases.append(DecodeCase("native", 512, 128, topk, WINDOW))
        cases.append(DecodeCase("packed", KERNEL_R, 128, topk, WINDOW))
    for retention in ([128, 384] if not quick else [128]):
        cases.append(DecodeCase("packed", retention, 128, TOPK, WINDOW))
    # The same calls without C4 records (top-k 0) at the same splits: q, out, the window
    # and the join, which native and packed calls share and which at batch 64 are most of
    # the packed call (benchmarks/kernels/NOTES.md, eighth round); targets() names them.
    for batch in ([64, 128] if not quick else [64]):
        cases.append(DecodeCase("native", 512, batch, 0, WINDOW))
        cases.append(DecodeCase("packed", KERNEL_R, batch, 0, WINDOW, "kept_first", "kept_first"))
    # Splits against auto_splits' choice (which the rows above use): each kernel at fixed
    # split counts, at batches below, at and above the multiprocessor count.
    for batch in ([16, 64, 128] if not quick else [64]):
        for splits in (1, 2, 4):
            cases.append(DecodeCase("native", 512, batch, TOPK, WINDOW, splits=splits))
            cases.append(DecodeCase("packed", KERNEL_R, batch, TOPK, WINDOW, "kept_first", "kept_first", splits=splits))
    # The other split plan at auto_splits' counts (8 at batch 16, 2 at 64 on an H200), for
    # native and the folded call: the one decode does not choose there. targets() names
    # the native one beside the ratio it would change.
    for batch in ([16, 64] if not quick else [64]):
        auto = splits_for(batch * math.ceil(HEADS / H_BLOCK), multiprocessors)
        if auto == 1:  # one split: no plan to compare
            continue
        for case in (DecodeCase("native", 512, batch, TOPK, WINDOW, splits=auto),
                     DecodeCase("packed", KERNEL_R, batch, TOPK, WINDOW, "kept_first", "kept_first", splits=auto)):
            chosen = split_plan_for(None, auto, case.variant == "packed", case.window_columns == "kept_first", False)
            cases.append(replace(case, split_plan=_other_split_plan(chosen)))
            if auto == 2:  # and the join decode does not choose at two splits: the kernel, not the exchange
                cases.append(replace(case, join="kernel"))
    return cases


def _kernel_label(row: dict) -> str:
    return ", SM90 Gluon kernel" if row.get("kernel") == "sm90" else ""


def _orders_label(columns: str, window_columns: str) -> str:
    label = f"{columns} columns"
    return label + (", kept-first window" if window_columns == "kept_first" else "")


def _order_rank(orders: tuple[str, str]) -> tuple[bool, bool]:
    """As served today first (natural, natural), the kernel alone last."""
    return orders[0] == "kept_first", orders[1] == "kept_first"


def _shared_cost(by: dict, batch: int, window: int, orders: tuple[str, str], native: dict, packed: dict) -> str:
    """The ratio target's note on the calls without C4 records (top-k 0 rows at the same
    splits, where the run has them): what the two calls share, and the ratio of the rest
    (left out where the native call's rest is not positive: timing noise on a small call)."""
    native0 = by.get(("native", 512, batch, 0, window, ("natural", "natural"), "triton"))
    packed0 = by.get(("packed", KERNEL_R, batch, 0, window, orders, packed.get("kernel", "triton")))
    if not (native0 and packed0) or (native0["splits"], packed0["splits"]) != (native["splits"], packed["splits"]):
        return ""
    note = (f"; without C4 records (q, out, the window and, where split, the join; at the same splits) native "
            f"{native0['time_us']:.1f} us and packed {packed0['time_us']:.1f} us (the full calls: "
            f"{native['time_us']:.1f} and {packed['time_us']:.1f})")
    if native["time_us"] > native0["time_us"]:
        rest = (packed["time_us"] - packed0["time_us"]) / (native["time_us"] - native0["time_us"])
        note += f"; the C4 records' time packed/native {rest:.3f}"
    return note


def _triton_native_notes(by: dict, fixed: dict, batch: int, window: int, orders: tuple[str, str], native: dict,
                         packed: dict) -> str:
    """The cross-check's evidence from earlier rounds (benchmarks/kernels/NOTES.md): what the
    packed and Triton native calls share (_shared_cost), and the native call with the split
    plan and the join decode did not choose, where the run timed them."""
    how = _shared_cost(by, batch, window, orders, native, packed)
    plan, join = native.get("split_plan"), native.get("join")
    other_plan = _other_split_plan(plan)
    natural = ("natural", "natural")
    other = fixed.get(("native", natural, batch, TOPK, window, native["splits"], other_plan, join)) if other_plan else None
    if other:  # (one split has no plan, and no other)
        how += (f"; native with split_plan={other_plan!r} (timed beside the split sweep; decode chose {plan!r}) "
                f"{other['time_us']:.1f} us against {native['time_us']:.1f}: the ratio against it "
                f"{packed['time_us'] / other['time_us']:.3f}")
    native_k = fixed.get(("native", natural, batch, TOPK, window, native["splits"], plan, "kernel"))
    packed_k = fixed.get(("packed", orders, batch, TOPK, window, packed["splits"], packed.get("split_plan"), "kernel"))
    if join == "exchange" and packed.get("join") == "exchange" and native_k and packed_k:
        how += (f"; with join='kernel' (the splits' partials joined by a kernel of its own; decode chose "
                f"'exchange') native {native_k['time_us']:.1f} us and packed {packed_k['time_us']:.1f}: ratio "
                f"{packed_k['time_us'] / native_k['time_us']:.3f}")
    return how


# Kernel mode's decode against FlashMLA's (issue "Direct packed decode that beats stock
# FlashMLA"): at most this fraction of its time at batch 64 and above, where the C4
# records' bytes dominate (their byte ratio is 328 / 584 = 0.56), and no slower at any batch.
KERNEL_VS_FLASHMLA_FROM_64 = 0.65
KERNEL_VS_FLASHMLA = 1.0


def targets(decode_rows: list[dict], store_rows: list[dict], reconstruct_rows: list[dict],
            flashmla_rows: list[dict], capability: str | None = None) -> list[dict]:
    """The targets, each with its measured value (ratios from this run only). Decode
    targets are kernel mode's time over FlashMLA V4's at the same batch, top-k and window
    (flashmla_rows); none without them. capability: the GPU's compute capability; on 9.0
    (whose multiprocessor limits _residency knows) the decode rows' bound is named from
    their compiled kernels."""
    out = []
    def orders(r: dict) -> tuple[str, str]:
        return r["columns"], r.get("window_columns", "natural")

    # The split sweep's rows are evidence, not targets; a native row at a target's split
    # count with the other split plan, and both rows with the other join, are named in
    # that target's note.
    fixed = {(r["variant"], orders(r), r["batch"], r["topk"], r["window"], r["splits"], r.get("split_plan"),
              r.get("join")): r for r in decode_rows if not r["auto_splits"]}
    decode_rows = [r for r in decode_rows if r["auto_splits"]]
    by = {(r["variant"], r["retention"], r["batch"], r["topk"], r["window"], orders(r), r.get("kernel", "triton")): r
          for r in decode_rows}
    stock = {(r["batch"], r["topk"], r["window"]): r for r in flashmla_rows if r["kernel"] == "flashmla"}
    forms = {(*orders(r), r.get("kernel", "triton")) for r in decode_rows if r["variant"] == "packed"}
    for columns, window_columns, kernel in sorted(forms, key=lambda f: (_order_rank(f[:2]), f[2] == "sm90")):
        for window in (WINDOW, 0):
            for batch in sorted({r["batch"] for r in decode_rows}):
                flash = stock.get((batch, TOPK, window))
                native = by.get(("native", 512, batch, TOPK, window, ("natural", "natural"), "triton"))
                packed = by.get(("packed", KERNEL_R, batch, TOPK, window, (columns, window_columns), kernel))
                if not (flash and packed):
                    continue
                ratio = packed["time_us"] / flash["time_us"]
                limit = KERNEL_VS_FLASHMLA_FROM_64 if batch >= 64 else KERNEL_VS_FLASHMLA
                if kernel == "sm90":
                    how = ("the SM90 Gluon kernel (remnant.kernels.decode.sm90): q, out and the window in kept-first "
                           "order")
                elif packed.get("window_apart"):
                    how = ("the window read by a program of its own in natural order, the C4 records by the "
                           "others through the kept columns, joined in natural order")
                elif columns == "natural":
                    how = "q and out permuted to and from kept-first order in the call"
                else:
                    how = "q and out in kept-first order: the permutation folded into the projections"
                if window_columns == "kept_first" and kernel != "sm90":
                    how += "; window records written in kept-first order"
                note = (f"FlashMLA V4 {flash['time_us']:.1f} us, packed {packed['time_us']:.1f} us ({how}); "
                        f"byte ratio against FlashMLA's call {packed['bytes'] / flash['bytes']:.3f} (C4 records "
                        f"alone: {(KERNEL_R + 72) / 584:.3f})")
                if native:
                    note += (f"; cross-check against Remnant's Triton native kernel ({native['time_us']:.1f} us, "
                             f"{native['time_us'] / flash['time_us']:.2f}x FlashMLA): packed/native "
                             f"{packed['time_us'] / native['time_us']:.3f}")
                    note += _triton_native_notes(by, fixed, batch, window, (columns, window_columns), native, packed)
                label = _orders_label(columns, window_columns) + (", SM90 Gluon kernel" if kernel == "sm90" else "")
                out.append({"name": f"decode packed ({label})/FlashMLA V4 time, "
                                    f"batch {batch}, top-k {TOPK}, window {window}",
                            "value": ratio, "target": f"<= {limit}", "met": ratio <= limit, "note": note})
    for kernel, rows in (("store", store_rows), ("reconstruct", reconstruct_rows)):
        largest = max((r["records"] for r in rows), default=None)
        for r in rows:
            if r["records"] == largest:
                f = r["fraction_of_copy_bandwidth"]
                out.append({"name": f"{kernel} R={r['retention']} ({r['permute']}), {largest} records: "
                                    "fraction of copy bandwidth",
                            "value": f, "target": ">= 0.80", "met": f >= 0.80, "note": ""})
    for r in decode_rows:
        if (r["batch"] >= 64 and r["topk"] == TOPK and r["window"] == WINDOW
                and orders(r) in (("natural", "natural"), ("kept_first", "kept_first"))):
            f = r["fraction_of_copy_bandwidth"]
            bound = (f"floor is {r['floor_bound']}: {r['floor_us']:.2f} us; "
                     f"tensor-core fraction {r['fraction_of_matmul_rate']:.2f}")
            if capability == "9.0" and "n_regs" in r and "shared_bytes" in r:
                bound += "; " + _residency(r)
            label = "" if r["variant"] == "native" else f" ({_orders_label(*orders(r))}{_kernel_label(r)})"
            out.append({"name": f"decode {r['variant']} R={r['retention']}{label} batch {r['batch']}: "
                                "fraction of copy bandwidth",
                        "value": f, "target": ">= 0.75 or a named bound", "met": f >= 0.75, "note": bound})
    return out


# Per multiprocessor of an H100/H200 (compute capability 9.0; targets() names residency on
# that capability only): the limits that decide how many decode programs run on one at a time.
SM_REGISTERS = 65536
SM_SHARED_BYTES = 233472  # the largest carve-out; 1 KB of it is reserved per program
SM_WARPS = 64


def _residency(row: dict) -> str:
    """The bound of a decode row named by its compiled kernel: how many of its programs fit
    on a multiprocessor and what limits them (registers are allocated per warp in units of
    256). One program per SM (named as the bound) leaves each scheduler two warps, so a step's dependent chain
    of loads, conversions, products and the softmax is not hidden by other work: the
    kernel is latency-bound (benchmarks/kernels/NOTES.md has ncu's stall reasons)."""
    warps = row["config"]["num_warps"]
    by = {"registers": SM_REGISTERS // (-(-row["n_regs"] * 32 // 256) * 256 * warps),
          "shared memory": SM_SHARED_BYTES // (row["shared_bytes"] + 1024),
          "warps": SM_WARPS // warps}
    programs = min(by.values())
    limits = " and ".join(name for name, fits in by.items() if fits == programs)  # each would have to give
    lead = "bound: latency, one program" if programs == 1 else f"{programs} programs"
    return (f"{lead} of {warps} warps per SM ({100 * programs * warps / SM_WARPS:.1f}% "
            f"occupancy, limited by {limits}: {row['n_regs']} registers per thread, {row['shared_bytes']} bytes of "
            f"shared memory, {row.get('n_spills', 0)} spilled registers)")


def gpu_provenance() -> dict:
    props = torch.cuda.get_device_properties(0)
    gpu = {"name": props.name, "capability": f"{props.major}.{props.minor}",
           "multiprocessors": props.multi_processor_count, "memory_bytes": props.total_memory,
           "l2_bytes": int(getattr(props, "L2_cache_size", 0))}
    query = "driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit,temperature.gpu"
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        values = [v.strip() for v in line.split(",")]
        gpu["nvidia_smi"] = dict(zip(query.split(","), values))
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        gpu["nvidia_smi"] = {"error": str(exc)[:200]}
    import triton

    return {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "python": platform.python_version(), "host": socket.gethostname(),
            "git_commit": os.environ.get(GIT_COMMIT_ENV, "unknown")}


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
        "schema": "remnant/kernel-bench",
        "schema_version": SCHEMA_VERSION,
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


def table(doc: dict) -> str:
    lines = [f"{doc['provenance']['gpu']['name']}: copy {doc['ceilings']['copy_gbps']:.0f} GB/s, "
             f"bf16 {doc['ceilings']['matmul_bf16_tflops']:.0f} TFLOP/s"]
    for r in doc["store"] + doc["reconstruct"]:
        lines.append(f"{r['kernel']:<12} R={r['retention']:<3} {r.get('permute', ''):<9} n={r['records']:<8} {r['time_us']:9.1f} us "
                     f"{r['achieved_gbps']:7.0f} GB/s  {100 * r['fraction_of_copy_bandwidth']:5.1f}% copy")
    for r in doc["decode"]:
        variant = r["variant"] + ("*" if r.get("columns") == "kept_first" else "") + (
            "w" if r.get("window_columns") == "kept_first" else "") + ("@sm90" if r.get("kernel") == "sm90" else "")
        splits = f"s={r['splits']}" + ("" if r["auto_splits"] else "!") if "splits" in r else ""  # (v3: no splits)
        splits += "a" if r.get("window_apart") else ""
        splits += "c" if r.get("split_plan") == "by_cost" else ""
        lines.append(f"decode {variant:<8} R={r['retention']:<3} B={r['batch']:<4} k={r['topk']:<5} W={r['window']:<3} {splits:<5}"
                     f"{r['time_us']:9.1f} us {100 * r['fraction_of_copy_bandwidth']:5.1f}% copy "
                     f"{100 * r['fraction_of_matmul_rate']:5.1f}% mma regs={r.get('n_regs', '?')} spills={r.get('n_spills', '?')}")
    for r in doc.get("flashmla_decode", []):
        lines.append(f"{r['kernel']:<21} R={r['retention']:<3} B={r['batch']:<4} k={r['topk']:<5} W={r['window']:<3} "
                     f"{r['time_us']:9.1f} us {100 * r['fraction_of_copy_bandwidth']:5.1f}% copy "
                     f"{100 * r['fraction_of_matmul_rate']:5.1f}% mma")
    for r in doc.get("against_flashmla", []):
        lines.append(f"/FlashMLA {r['value']:6.3f}  {r['name']}")
    if any(r.get("columns") == "kept_first" for r in doc["decode"]):
        lines.append("packed*: q and out in kept-first column order (the permutation folded into the projections); "
                     "packed..w: window records written in kept-first order")
    if any(r.get("kernel") == "sm90" for r in doc["decode"]):
        lines.append("@sm90: the SM90 Gluon kernel (remnant.kernels.decode.sm90); every other decode row: Triton")
    lines.append("s=N: programs per token and head block (auto_splits); s=N!: fixed, the split sweep; "
                 "s=Na: the window in a program of its own (window_apart); s=Nc: splits cut by cost (split_plan)")
    for t in doc["targets"]:
        lines.append(f"[{'met' if t['met'] else 'MISSED'}] {t['name']}: {t['value']:.3f} (target {t['target']}) {t['note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="remnant-kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("kernel-bench.json"), help="JSON file to write")
    parser.add_argument("--sweep", choices=SWEEPS, default="full",
                        help="full; decode (every decode and FlashMLA case, copies at quick sizes, decode at its "
                             "tuned defaults); quick (a short sweep)")
    parser.add_argument("--quick", action="store_true", help="the same as --sweep quick")
    parser.add_argument("--reps", type=int, default=30, help="graph replays per case (median taken)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--without-flashmla", action="store_true",
                        help="time Remnant's kernels alone where FlashMLA cannot run (no decode targets)")
    parser.add_argument("--from", dest="source", type=Path, default=None,
                        help="no run: read this kernel-bench JSON (validated), print its table and plot it")
    parser.add_argument("--plot", type=Path, default=None,
                        help="PNG to write (default: the JSON's path with .png; 'none' for no plot)")
    args = parser.parse_args(argv)
    from remnant.records.schema import RecordError, validate, write_validated

    if args.source is not None:
        try:
            doc = json.loads(args.source.read_text())
            validate(doc, str(args.source))
        except (OSError, ValueError, RecordError) as exc:
            print(f"remnant-kernels: {args.source}: {exc}", file=sys.stderr)
            return 2
        json_path = args.source
    else:
        if not torch.cuda.is_available():
            print("remnant-kernels: needs a CUDA GPU (torch.cuda.is_available() is False); "
                  "--from FILE plots an existing record", file=sys.stderr)
            return 2
        stock = flashmla_status(args.without_flashmla)
        if not stock["timed"] and not args.without_flashmla:
            print(f"remnant-kernels: FlashMLA, the baseline of every decode target, cannot run: {stock['reason']}; "
                  "pass --without-flashmla to time Remnant's kernels alone (no decode targets)", file=sys.stderr)
            return 2
        doc = run("quick" if args.quick else args.sweep, args.reps, args.seed, progress=lambda m: print(m, file=sys.stderr, flush=True),
                  stock=stock)
        write_validated(args.out, doc)
        json_path = args.out
    print(table(doc))
    if args.source is None:
        print(f"wrote {args.out}")
    if str(args.plot) != "none":
        from remnant.kernels.plot import plot

        print(f"wrote {plot(doc, args.plot or json_path.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
