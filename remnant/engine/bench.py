"""The engine's decode step per mode beside its roofline, and its prefill speed.

    python -m remnant.cli.engine_bench --model dsv4_flash_h200 --device cuda --out engine-bench.json
    python -m remnant.cli.engine_bench --model tiny --batches 1,4 --contexts 256 --prefill-contexts 512 \
        --out tiny.json   # CPU

For each mode, batch and context: a model as remnant-serve builds it (decode_path auto,
CUDA graphs on cuda; packed modes keep the `prefix` policy's columns, which do not change
what a step reads), pools holding `batch` sequences of `context` tokens filled with valid
records (quantized random latents: no prefill, so 32k contexts take seconds), and the
decode step timed over `--steps` steps (each sequence's length put back after each, so
every step reads the same context), then again with each step launched before the last
one is read, on its tokens still on the device, as the engine serves greedy decodes
(host.launch_ahead: the host's work between steps overlaps the GPU's). Beside each time: the roofline of remnant.engine.
roofline (bytes over the copy bandwidth and FLOPs over the matmul peak, both measured here
in the same run) and, on CUDA, where the GPU's time goes inside a step (torch profiler:
the share of the step's wall time no kernel covers, kernels per step, the kernels taking most time). Prefill: per mode and prompt length
(`--prefill-contexts`), one prompt of random tokens prefilled in chunks of `--chunk` tokens
(SGLang's chunked prefill; remnant.engine.prefill_step), timed whole: tokens/s. Writes one
JSON document (remnant/engine-bench) and prints a table; the command is
remnant.cli.engine_bench.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from remnant.kv.formats import KERNEL_RETENTION
from remnant.kv.modes import mode_of
from remnant.records.kinds import ENGINE_BENCH


def measure_device(device: torch.device) -> dict:
    """Copy bandwidth (bytes read + written per second) and matmul peak (FLOP/s), measured."""
    big = device.type == "cuda"
    n = (1 << 30) if big else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    size, dtype = (8192, torch.bfloat16) if big else (1024, torch.float32)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    copy_s = _best(lambda: dst.copy_(src), device)
    mm_s = _best(lambda: a @ b, device)
    return {"copy_bytes_per_s": 2 * n / copy_s, "matmul_flops_per_s": 2 * size**3 / mm_s,
            "how": f"best of 5: copy of {n} bytes, {dtype} [{size}]^3 matmul"}


def _best(fn, device: torch.device, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: Index-key pages quantized at a time by fill_pools (64 keys a page: 8 MB of float32 keys).
KEY_PAGES_AT_ONCE = 256


def fill_pools(model, pools, seed: int = 0) -> None:
    """Every page, window block and index key of `pools` holds a valid record of `model`'s
    formats: records and window blocks one page of quantized random latents copied to every
    page (what they hold does not change what a step reads), index keys each its own
    quantized random key (the same in every CSA layer), so that a row's indexer scores are
    as distinct as a served sequence's and the top-k sorts them as it would. With one page
    of keys copied everywhere (before this), each score came 128 times at 32k context, and
    the top-k timed ties."""
    from remnant.kv.codec import quantize

    gen = torch.Generator().manual_seed(seed)
    for li, pages in [*pools.c4.items(), *pools.c128.items()]:
        per = pages.layout.per_page
        records = model.layer_format(li).write(quantize(torch.randn(per, 512, generator=gen)))
        pages.layout.write(pages.buf, torch.arange(per, device=pages.buf.device), records.to(pages.buf.device))
        pages.buf[1:] = pages.buf[0]
    first = None
    for li, pages in pools.indexer.items():
        if first is not None:
            pages.buf.copy_(first)
            continue
        per, count = pages.layout.per_page, pages.buf.shape[0]
        keys_gen = torch.Generator(device=pages.buf.device).manual_seed(seed)
        for page in range(0, count, KEY_PAGES_AT_ONCE):
            locs = torch.arange(page * per, min(page + KEY_PAGES_AT_ONCE, count) * per, device=pages.buf.device)
            keys = torch.randn(locs.numel(), model.args.index_head_dim, generator=keys_gen, device=pages.buf.device)
            pages.layout.write(pages.buf, locs, model.quantize_index_keys(keys.to(model.device)).to(pages.buf.device))
        first = pages.buf
    for li, (layout, buf) in enumerate(zip(pools.swa.layouts, pools.swa.bufs)):
        records = model.layer_format(li).ring_records(torch.randn(layout.per_page, 512, generator=gen).to(model.device))
        layout.write(buf, torch.arange(layout.per_page, device=model.device), records)
        buf[1:] = buf[0]


def _timed_cell(model, batch: int, context: int, steps: int,
                kernel_log: Path | None = None) -> tuple[float, "StepProfile | None", float]:
    """time_step over `batch` sequences of `context` tokens in pools of their own, filled
    with quantized random records. The model's graphs, captured over these pools, are
    dropped on return (also on an error), so that no cell's pools outlive it: the next
    cell's would otherwise be allocated beside them."""
    from remnant.engine.pools import new_sequence, scratch_pools

    try:
        pools = scratch_pools(model, context + 1, sequences=batch, window_blocks=batch)
        fill_pools(model, pools)
        seqs = [new_sequence(pools, context + 1) for _ in range(batch)]
        for s in seqs:
            s.length = context
            s.token_ids = [0] * context
        return time_step(model, pools, seqs, steps, kernel_log)
    finally:
        if model.graphs is not None:
            model.graphs.clear()


def decode_tokens(batch: int, vocab_size: int, seed: int = 0) -> list[int]:
    """A decode step's input tokens for `batch` rows: distinct where the vocabulary allows
    (seeded). The rows' records are copies of one another (only their index keys differ),
    so their tokens are what sets their hidden states apart: with one token for every row, every row
    routes to the same experts and a step reads 6 of a layer's 32 routed experts at any
    batch, where the roofline counts the distinct experts of uniform routing (all 32 from
    batch ~16 on), as serving's different requests hit them."""
    gen = torch.Generator().manual_seed(seed)
    if batch <= vocab_size:
        return torch.randperm(vocab_size, generator=gen)[:batch].tolist()
    return torch.randint(0, vocab_size, (batch,), generator=gen).tolist()


def time_step(model, pools, seqs: list, steps: int,
              kernel_log: Path | None = None) -> tuple[float, "StepProfile | None", float]:
    """Seconds per decode step of `seqs` (median of `steps`, each waited for), on CUDA where
    the GPU's time goes in a step (None elsewhere; kernel_log: profile_step's), and seconds
    per step launched ahead (time_launched_ahead)."""
    tokens = decode_tokens(len(seqs), model.args.vocab_size)
    lengths = [s.length for s in seqs]

    def step():
        model.decode(seqs, tokens, pools)
        for s, n in zip(seqs, lengths):
            s.length = n
            del s.token_ids[n:]

    with torch.inference_mode():
        for _ in range(2):  # captures the graph, compiles the kernels
            step()
        times, host = [], []
        for _ in range(steps):
            _sync(model.device)
            t0 = time.perf_counter()
            step()
            host.append(time.perf_counter() - t0)
            _sync(model.device)
            times.append(time.perf_counter() - t0)
        profile = profile_step(step, model.device, kernel_log=kernel_log) if model.device.type == "cuda" else None
        ahead = time_launched_ahead(model, pools, seqs, lengths, steps, tokens)
    times.sort()
    host.sort()
    # For the log: the host's share of a step (building the batch, copying it in, launching
    # the graph) before it waits for the GPU, which a step pays where the GPU waits on it.
    print(f"host {host[len(host) // 2] * 1e3:.2f} ms of a {times[len(times) // 2] * 1e3:.2f} ms step "
          f"(medians)", file=sys.stderr)
    return times[len(times) // 2], profile, ahead


def time_launched_ahead(model, pools, seqs: list, lengths: list[int], steps: int, first: list[int]) -> float:
    """Seconds per decode step of `seqs` launched as the engine launches greedy decodes
    (launch_ahead, remnant.engine.engine): the first on tokens `first`, each next one on
    the last one's tokens, still on the device, and launched before the host reads the
    last one's (a pinned copy behind it): the mean over `steps` steps in a row, so the
    host's work between steps overlaps the GPU's except where it takes longer."""
    from remnant.engine.engine import DeviceTokens

    device = model.device
    tokens = torch.tensor(first, dtype=torch.long, device=device)
    last = None  # the previous step's tokens, their copy queued behind it
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model.decode(seqs, tokens, pools)
        for s, n in zip(seqs, lengths):
            s.length = n
            del s.token_ids[n:]
        pending = DeviceTokens.of(logits)
        tokens = pending.tokens
        if last is not None:
            last.read()
        last = pending
    last.read()
    return (time.perf_counter() - t0) / steps


def time_prefill(model, pools, seq, prompt: list[int], chunk: int) -> float:
    """Seconds to prefill `prompt` into `seq` (empty) in chunks of `chunk` tokens, one
    model step per chunk, as the engine schedules a lone long prompt."""
    with torch.inference_mode():
        _sync(model.device)
        t0 = time.perf_counter()
        for start in range(0, len(prompt), chunk):
            model.forward([seq], [prompt[start: start + chunk]], pools)
        _sync(model.device)
        return time.perf_counter() - t0


def prefill_rows(model, mode: str, contexts: list[int], chunk: int, profile: bool = False):
    """Prefill tokens/s of one prompt per context length, a row as each is timed (a short
    warm-up prompt first: kernels compile there, not in the timing). profile: the same
    prompt prefilled again, untimed, counting what its attention reads (reads:
    remnant.engine.prefill_reads), and on CUDA once more under the torch profiler
    (kernel_ms: its kernels' time by what they do, prefill_kernel_ms); both null without
    it."""
    gen = torch.Generator().manual_seed(0)
    for i, context in enumerate([min(contexts), *contexts]):
        prompt = torch.randint(0, model.args.vocab_size, (context,), generator=gen).tolist()
        seconds = _prefill_fresh(model, context, prompt, chunk)
        if i == 0:
            continue
        print(f"{mode:>7} prefill {context:>6} tokens in chunks of {chunk}: {seconds:8.2f} s  "
              f"{context / seconds:10.0f} tok/s", file=sys.stderr, flush=True)
        reads, kernel_ms = profile_prefill(model, context, prompt, chunk) if profile else (None, None)
        yield {"mode": mode, "context": context, "chunk": chunk, "prefill_s": seconds,
               "tokens_per_s": context / seconds, "chunks": -(-context // chunk), "reads": reads,
               "kernel_ms": kernel_ms}


def profile_prefill(model, context: int, prompt: list[int], chunk: int) -> tuple[dict, dict | None]:
    """(reads, kernel_ms) of `prompt` prefilled into fresh pools (prefill_rows' profile):
    one pass counting what the attention reads, and on CUDA another under the profiler
    (the count's own kernels, torch.unique's sorts, would otherwise be in its times)."""
    from remnant.engine.prefill_reads import PrefillReads

    model.prefill_reads = PrefillReads()
    try:
        _prefill_fresh(model, context, prompt, chunk)
        reads = model.prefill_reads.as_record()
    finally:
        model.prefill_reads = None
    kernel_ms = None
    if model.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _prefill_fresh(model, context, prompt, chunk)
        kernel_ms = prefill_kernel_ms((e.name, e.time_range.end - e.time_range.start) for e in prof.events()
                                      if e.device_type == torch.autograd.DeviceType.CUDA)
    chunks = -(-context // chunk)
    print("  read a chunk (all layers): " + ", ".join(
        f"{part} {r['pairs'] / chunks:.0f} pairs, {r['distinct'] / chunks:.0f} distinct" for part, r in reads.items())
        + (" | kernel ms: " + ", ".join(f"{k} {v:.1f}" for k, v in kernel_ms.items()) if kernel_ms else ""),
        file=sys.stderr, flush=True)
    return reads, kernel_ms


def _prefill_fresh(model, context: int, prompt: list[int], chunk: int) -> float:
    """time_prefill of `prompt` into pools of its own, freed on return."""
    from remnant.engine.pools import new_sequence, scratch_pools

    pools = scratch_pools(model, context, sequences=1, window_blocks=1)
    return time_prefill(model, pools, new_sequence(pools, context), prompt, chunk)


#: What a prefill's kernels do, by a piece of their names (the first part that matches), as
#: they run on CUDA (the compiled step ops: Remnant's top-k, not torch.topk): rebuilding
#: packed records into native ones (triton mode), attention (FlashMLA's sparse decode and
#: its combine, Remnant's SM90 and Triton decode kernels), the indexer's scores and top-k
#: (Remnant's radix passes), the C4 and C128 record store, the routed experts' kernels and
#: the router's (moe), cuBLAS's GEMMs (dense: the projections and the shared expert's two
#: matrices). The rest is "other": norms, RoPE, the compressor and index keys, which a
#: prefill forms in torch and Inductor kernels, the window ring's writes, and at a
#: prefill's size the MoE's alignment (over ALIGN_KERNEL_MAX_PAIRS pairs it runs as
#: compiled torch, not _align_kernel) and the shared expert's activation.
PREFILL_KERNEL_PARTS = (
    ("rebuild", ("_reconstruct_kernel",)),
    ("attention", ("flash_fwd", "flash_mla", "_packed_sm90", "_join_kernel", "_decode_kernel", "_combine_kernel",
                   "_permute_columns_kernel")),
    ("indexer", ("_shared_scores_kernel", "_row_scores_kernel", "_radix_pass", "_count_pass", "_write_pass")),
    ("store", ("_store_kernel",)),
    # The routed experts (remnant.kernels.moe) and the router (remnant.kernels.route).
    ("moe", ("_gate_up_kernel", "_down_kernel", "_gate_up_pair_kernel", "_down_pair_kernel", "_finish_kernel",
             "_align_kernel", "_quantize_rows_kernel", "_logits_kernel", "_select_kernel")),
    # cuBLAS: the projections and the shared expert (after attention: FlashMLA's names hold cutlass).
    ("dense", ("nvjet", "gemm", "gemv", "splitKreduce")),
)


def prefill_kernel_ms(kernels) -> dict[str, float]:
    """Milliseconds of kernel time by part (PREFILL_KERNEL_PARTS, then "other") from
    (name, duration in us) pairs."""
    totals = dict.fromkeys([part for part, _ in PREFILL_KERNEL_PARTS] + ["other"], 0.0)
    for name, us in kernels:
        part = next((part for part, pieces in PREFILL_KERNEL_PARTS if any(p in name for p in pieces)), "other")
        totals[part] += us / 1e3
    return totals


@dataclass
class StepProfile:
    """Where a step's GPU time goes (torch profiler over a few steps)."""

    busy_us: float  # time covered by GPU kernels a step (their union)
    span_us: float  # from a step's first kernel's start to its last one's end (mean over the steps)
    kernels_per_step: float
    top_kernels: list[dict]  # {name, calls_per_step, us_per_step}, most GPU time first

    #: Kernels listed in top_kernels.
    TOP = 12


def profile_step(step, device: torch.device, steps: int = 3, kernel_log: Path | None = None) -> StepProfile:
    """Profile `steps` calls of `step` (torch profiler, CUDA activity): the GPU's busy time,
    kernels per step and the kernels taking most of the time (also printed, for the log).
    kernel_log: a TSV written with the last step's kernels in order (start and gap before
    it, duration, name), to tell one call site of a kernel from another."""
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    launch_us = sum(e.time_range.end - e.time_range.start for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CPU and e.name == "cudaGraphLaunch")
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, None
    for start, stop in spans:
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    # Each kernel costs a few microseconds however little it does, so their count matters
    # as much as the slowest ones.
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[: StepProfile.TOP]
    # Each step launches the same kernels: consecutive equal shares of them are its own.
    per = len(spans) // steps
    span = sum(max(stop for _, stop in spans[i * per: (i + 1) * per]) - spans[i * per][0]
               for i in range(steps)) / steps if per else 0.0
    result = StepProfile(busy / steps, span, len(spans) / steps,
                         [{"name": name, "calls_per_step": len(us) / steps, "us_per_step": sum(us) / steps}
                          for name, us in top])
    if kernel_log is not None:
        last = len(spans) - len(spans) // steps  # the last step's share (a remainder goes before)
        write_kernel_log(kernel_log, sorted(kernels, key=lambda e: e.time_range.start)[last:])
    print(f"{result.kernels_per_step:.0f} kernels per step, {busy / steps:.0f} us of them, cudaGraphLaunch "
          f"{launch_us / steps:.0f} us of host time; most GPU time:", file=sys.stderr)
    for k in result.top_kernels:
        print(f"  {k['us_per_step']:9.1f} us {k['calls_per_step']:6.0f} x  {k['name'][:100]}", file=sys.stderr)
    # Where the host's share goes (building and copying the batch, the launch): the CPU
    # operations taking most self time, for the log only. Not the wait for the GPU
    # (cudaDeviceSynchronize) nor the profiler's own rows (no calls).
    cpu = sorted((e for e in prof.key_averages()
                  if e.self_cpu_time_total > 0 and e.count and e.key != "cudaDeviceSynchronize"),
                 key=lambda e: -e.self_cpu_time_total)[:8]
    print("host time a step by operation: " + ", ".join(
        f"{e.key} {e.self_cpu_time_total / steps:.0f} us ({e.count / steps:.1f}x)" for e in cpu), file=sys.stderr)
    return result


def write_kernel_log(path: Path, kernels: list) -> None:
    """Kernels (profiler events, in start order) as TSV: start_us (from the first), gap_us
    (since the previous one ended), duration_us, name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = kernels[0].time_range.start if kernels else 0.0
    end = t0
    with path.open("w") as f:
        f.write("start_us\tgap_us\tduration_us\tname\n")
        for e in kernels:
            start, stop = e.time_range.start, e.time_range.end
            f.write(f"{start - t0:.1f}\t{max(0.0, start - end):.1f}\t{stop - start:.1f}\t{e.name[:160]}\n")
            end = max(end, stop)


def run(model_name: str, device: str, modes: list[str], batches: list[int], contexts: list[int],
        steps: int, cuda_graph: bool = True, prefill_contexts: list[int] | None = None, chunk: int = 8192,
        on_row=None, torch_compile: bool = True, index_key_format: str = "fp8",
        window_records: str = "native", c128_records: str = "native", kernel_logs: Path | None = None,
        prefill_profile: bool = False, index_fp8_queries: bool = False) -> dict:
    """The benchmark document (see the module docstring). `on_row(doc)` is called after each
    row with the document so far (main writes it: a run stopped part-way keeps its rows).
    kernel_logs: a folder for each CUDA cell's kernel log (profile_step), named
    <mode>-b<batch>-<context>.tsv.
    index_key_format, window_records and c128_records: the KV parts beyond C4
    (host.index_key_format, retention.window_records, retention.c128_records), recorded in
    the document's kv_parts. prefill_profile: each prefill row's reads and kernel_ms
    (prefill_rows). index_fp8_queries: the indexer scores with FP8 queries, the decode
    step's and prefill's (remnant.kernels.indexer.ScoresConfig.fp8_q;
    Model.index_scores_config)."""
    import dataclasses

    from remnant.config import ModelConfig
    from remnant.engine.capacity_report import load_model_preset
    from remnant.engine.model import Model, ModelArgs
    from remnant.engine.retention_setup import setup_retention
    from remnant.engine.roofline import step_cost
    from remnant.records.provenance import environment, sources

    preset = load_model_preset(model_name)
    args = ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig(**preset)))
    dev = torch.device(device)
    peaks = measure_device(dev if device == "cpu" else torch.device("cuda", torch.cuda.current_device()))
    # One model for every mode: a mode is its C4 formats (setup_retention), and drawing a
    # V4-sized model's weights takes tens of seconds.
    model = Model(args, device=device, cuda_graph=cuda_graph, torch_compile=torch_compile,
                  index_key_format=index_key_format)
    if index_fp8_queries:
        from remnant.kernels.indexer import ScoresConfig

        model.index_scores_config = ScoresConfig(fp8_q=True)
    dtype = str(model.dtype).removeprefix("torch.")
    rows, prefill = [], []
    doc = {**ENGINE_BENCH.header(),
           "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "model": model_name, "device": device, "dtype": dtype, "steps": steps, "peaks": peaks,
           "environment": environment(), "sources": sources(), "rows": rows, "prefill": prefill,
           "kv_parts": {"index_key_format": index_key_format, "window_records": window_records,
                        "c128_records": c128_records},
           "index_fp8_queries": index_fp8_queries,
           "limits": ["random weights; records filled with quantized random latents, not a prefill",
                      "packed modes keep the prefix policy's columns (a step reads the same bytes for any map)",
                      "MoE bytes assume uniform routing (expected distinct experts)"]}
    for mode in modes:
        # Every packed mode at the one retention they all serve.
        retention = KERNEL_RETENTION if mode_of(mode).keeps_retention else None
        setup_retention(model, mode, model_name, retention, None, None, "prefix", window_records, c128_records)
        for context in contexts:
            for batch in batches:
                try:
                    log = kernel_logs / f"{mode}-b{batch}-{context}.tsv" if kernel_logs else None
                    seconds, profile, ahead = _timed_cell(model, batch, context, steps, log)
                except torch.OutOfMemoryError:
                    seconds = None  # freed below, once the traceback no longer holds the pools
                if seconds is None:
                    # A cell whose pools do not fit beside the weights (batch 128 at 32k on an
                    # 80 GB card) is said in the record's limits; the other cells still run.
                    gc.collect()
                    torch.cuda.empty_cache()
                    doc["limits"].append(f"{mode} batch {batch} context {context}: not measured, its pools "
                                         f"({batch} x {context + 1} tokens) did not fit in the GPU's memory "
                                         f"beside the weights")
                    print(f"{mode:>7} b{batch:<4} ctx {context:>6}: out of memory, not measured", file=sys.stderr,
                          flush=True)
                    if on_row:
                        on_row(doc)
                    continue
                cost = step_cost(args, batch, context, mode, KERNEL_RETENTION, dtype, index_key_format, window_records,
                                 c128_records)
                roof = cost.seconds(peaks["copy_bytes_per_s"], peaks["matmul_flops_per_s"])
                rows.append({"mode": mode, "batch": batch, "context": context, "step_ms": seconds * 1e3,
                             "roofline_ms": roof * 1e3, "step_over_roofline": seconds / roof,
                             # Over the median timed step, not the profiled steps' wall time: the
                             # profiler slows cudaGraphLaunch by about 1 ms a step (H100,
                             # 2026-12-06), GPU time a plain step does not lose.
                             "gpu_idle_share": None if profile is None
                             else max(0.0, 1.0 - profile.busy_us / 1e6 / seconds),
                             "gpu_busy_ms": None if profile is None else profile.busy_us / 1e3,
                             # Between the step's own kernels only: the host's time before the
                             # launch, which a scheduler that launches ahead would hide, is not in it.
                             "gpu_gap_share": None if profile is None or not profile.span_us
                             else max(0.0, 1.0 - profile.busy_us / profile.span_us),
                             # Launched ahead, as the engine serves greedy decodes: the host's
                             # share between steps overlaps the GPU's.
                             "ahead_step_ms": ahead * 1e3,
                             "ahead_idle_share": None if profile is None
                             else max(0.0, 1.0 - profile.busy_us / 1e6 / ahead),
                             "bytes": cost.bytes,
                             "flops": cost.flops, "parts": cost.parts,
                             "native_decode": model.native_decode, "packed_decode": model.packed_decode,
                             "cuda_graph": model.graphs is not None, "step_ops": model.ops.name,
                             "kernels_per_step": None if profile is None else profile.kernels_per_step,
                             "top_kernels": profile.top_kernels if profile else []})
                print(row_line(rows[-1]), file=sys.stderr, flush=True)
                if on_row:
                    on_row(doc)
        if prefill_contexts:
            for row in prefill_rows(model, mode, prefill_contexts, chunk, prefill_profile):
                prefill.append(row)
                if on_row:
                    on_row(doc)
    return doc


def row_line(row: dict) -> str:
    idle = "-" if row["gpu_idle_share"] is None else f"{100 * row['gpu_idle_share']:.0f}%"
    gaps = "-" if row["gpu_gap_share"] is None else f"{100 * row['gpu_gap_share']:.0f}%"
    ahead_idle = "-" if row["ahead_idle_share"] is None else f"{100 * row['ahead_idle_share']:.0f}%"
    return (f"{row['mode']:>7} b{row['batch']:<4} ctx {row['context']:>6}: {row['step_ms']:8.2f} ms  roofline "
            f"{row['roofline_ms']:8.2f} ms  x{row['step_over_roofline']:.2f}  idle {idle} (between its kernels {gaps}); "
            f"launched ahead {row['ahead_step_ms']:.2f} ms x{row['ahead_step_ms'] / row['roofline_ms']:.2f} idle "
            f"{ahead_idle}")
