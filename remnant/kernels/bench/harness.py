"""The timer and the roofline of remnant-kernels: CUDA-graph replays of a rotation of input
sets past L2, the copy and bf16 matmul ceilings measured in the same run, each row's
fraction of them, its compiled kernel's registers, and where it ran."""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
from dataclasses import dataclass

import torch

from remnant.records.provenance import GIT_COMMIT_ENV


@dataclass
class Ceilings:
    copy_gbps: float
    matmul_tflops: float
    l2_bytes: int


def time_graph(calls: list, reps: int) -> float:
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


def progress_row(row: dict) -> None:
    """One line per finished case on stderr, so a run cut short still shows its numbers."""
    shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
             if k in ("kernel", "variant", "retention", "records", "permute", "batch", "topk", "window", "columns",
                      "window_columns", "config", "splits", "join", "time_us",
                      "fraction_of_copy_bandwidth", "fraction_of_matmul_rate", "n_regs", "n_spills", "max_rel_error",
                      "error")}
    print(json.dumps(shown), file=sys.stderr, flush=True)


def rotations(call_bytes: int, l2_bytes: int, most: int = 256) -> int:
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
    t_copy = min(time_graph([lambda: dst.copy_(src)], reps), time_graph([lambda: _triton_copy(src, dst)], reps))
    del src, dst
    size = 8192
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    t_mm = time_graph([lambda: a @ b], max(5, reps // 4))
    del a, b
    torch.cuda.empty_cache()
    return Ceilings(copy_gbps=2 * n / t_copy / 1e9, matmul_tflops=2 * size**3 / t_mm / 1e12, l2_bytes=l2)


def roofline(seconds: float, nbytes: int, flops: float, ceil: Ceilings) -> dict:
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


def compiled_info(compiled: list) -> dict:
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
