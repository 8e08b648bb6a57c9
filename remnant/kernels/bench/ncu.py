"""Nsight Compute summaries of the decode kernels (`remnant-kernels --ncu`): FlashMLA's V4
decode and each packed kernel's folded call (SM90 Gluon, Triton) at batch 64 and 512, top-k
512 and window 128, as the benchmark's decode rows run them with the plan's default configs
(a sweep's best config may differ).

Each case runs in an ncu process of its own (`python -m remnant.kernels.bench.ncu CASE
BATCH`): inputs built and the call compiled and run once outside the profiled range, then
one call inside it (cudaProfilerStart/Stop with --profile-from-start off), so that the
report holds that call's kernels only. ncu's clocks are left as they are (--clock-control
none: the device's own rule). The report (.ncu-rep) is written beside the record and kept
out of git (.gitignore); the record keeps a summary per kernel: duration, DRAM, memory and
SM throughput, achieved occupancy, registers per thread and the three largest stall
reasons (warps stalled per issued instruction), read back with `ncu --import --csv --page
raw`.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

#: The summary's fields and the ncu metric each is read from.
METRICS = {
    "duration_us": "gpu__time_duration.sum",
    "dram_throughput_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "memory_throughput_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "sm_throughput_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "registers_per_thread": "launch__registers_per_thread",
}
#: Warps stalled per issued instruction, one metric per reason (the WarpStateStats section's),
#: asked for by a pattern (the reasons differ by GPU) with no anchors or suffix, so that it
#: matches whether ncu compares it with the base names or with the suffixed ones (.ratio).
STALL_PREFIX, STALL_MARK = "smsp__average_warps_issue_stalled_", "_per_issue_active"
STALLS = f"regex:{STALL_PREFIX}.*{STALL_MARK}"
CASES = ("flashmla", "sm90", "triton")
BATCHES = (64, 512)
#: ncu's time units, in microseconds: the long names of its older releases and the short
#: ones of later ones (the import asks for base units, --print-units base, either way).
_TIME_UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,
               "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}
#: Stall reasons left out of the top three: "selected" counts the warp that issued, 1 per
#: issue whatever the kernel does.
_NOT_STALLS = ("selected",)
#: ncu's error when the GPU's performance counters are not open to this user: every case
#: would fail alike, so the rest are not run.
COUNTER_PERMISSION = "ERR_NVGPUCTRPERM"


def _number(text: str) -> float | None:
    """A value of ncu's CSV: thousands separators dropped; None where it gives none."""
    text = text.strip().replace(",", "")
    if text in ("", "n/a", "N/A"):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def parse_raw_csv(text: str) -> list[dict]:
    """`ncu --csv --page raw` output: a header row (ID, ..., Kernel Name, ..., one column per
    metric), a row of units where ncu prints them, then a row per profiled kernel. Returns
    a summary per kernel, in profile order: its name, METRICS' fields (duration in
    microseconds; None where the report lacks one) and `stalls`, the three largest stall
    reasons as {reason, warps_per_issue}. Lines before the header (ncu's ==PROF== notes)
    are skipped. Raises ValueError where no header with "Kernel Name" is found."""
    rows = list(csv.reader(io.StringIO(text)))
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if start is None:
        raise ValueError("no ncu CSV header (a row naming 'Kernel Name') in the output")
    head, body = rows[start], rows[start + 1:]
    units = body.pop(0) if body and not body[0][head.index("ID")].strip() else [""] * len(head)
    out = []
    for row in body:
        if len(row) != len(head):
            continue
        cells = dict(zip(head, row))
        unit = dict(zip(head, units))
        summary = {"kernel": cells["Kernel Name"][:160]}
        for field, metric in METRICS.items():
            value = _number(cells.get(metric, ""))
            if value is not None and field == "duration_us":
                scale = _TIME_UNITS.get(unit.get(metric, "").strip())
                value = None if scale is None else value * scale
            summary[field] = value
        # One value per reason: its .ratio column where ncu prints several of one metric.
        by_reason: dict[str, float] = {}
        for name in sorted(head, key=lambda h: not h.endswith(".ratio")):
            if name.startswith(STALL_PREFIX) and STALL_MARK in name:
                reason, value = name[len(STALL_PREFIX):name.index(STALL_MARK)], _number(cells[name])
                if value is not None and value >= 0 and reason not in by_reason and reason not in _NOT_STALLS:
                    by_reason[reason] = value
        stalls = sorted(by_reason.items(), key=lambda rv: -rv[1])[:3]
        summary["stalls"] = [{"reason": r, "warps_per_issue": v} for r, v in stalls]
        out.append(summary)
    return out


def ncu_version(ncu: str = "ncu") -> str | None:
    """ncu's version line, or None where it is not on PATH."""
    path = shutil.which(ncu)
    if path is None:
        return None
    p = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    return p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else None


def _run(cmd: list[str], step: str, timeout_s: float) -> str:
    """cmd's output (stdout then stderr); RuntimeError naming the step, its exit status and
    its last output where it fails or prints ncu's ==ERROR== lines. A process group of its
    own, killed whole at the timeout: the profiled Python would otherwise outlive ncu and
    keep its GPU memory through the next cases."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise RuntimeError(f"ncu {step}: no answer in {timeout_s:.0f} s; killed") from None
    errors = [line for line in (out + err).splitlines() if line.startswith("==ERROR==")]
    if p.returncode != 0 or errors:
        tail = "\n".join(errors) or (out + err)[-1500:]
        raise RuntimeError(f"ncu {step} exited {p.returncode}: {tail} (command: {' '.join(cmd[:3])} ...)")
    return out


def profile_case(case: str, batch: int, reports: Path, ncu: str = "ncu", timeout_s: float = 240) -> dict:
    """Profile one case in an ncu process; returns its record entry: the case, the batch,
    each kernel's summary (parse_raw_csv) and the report file with its size. Raises
    RuntimeError with ncu's errors or last output where a step fails."""
    reports.mkdir(parents=True, exist_ok=True)
    rep = reports / f"{case}-b{batch}.ncu-rep"
    rep.unlink(missing_ok=True)  # an earlier run's report would be imported where ncu wrote none
    metrics = ",".join([*METRICS.values(), STALLS])
    _run([ncu, "--clock-control", "none", "--profile-from-start", "off", "--metrics", metrics, "--force-overwrite",
          "--export", str(rep), sys.executable, "-m", "remnant.kernels.bench.ncu", case, str(batch)], "profile",
         timeout_s)
    if not rep.exists():
        raise RuntimeError(f"ncu profile wrote no report ({rep.name}): no kernel ran in the profiled range")
    # The report holds only what was collected: the import asks for no metrics again.
    out = _run([ncu, "--import", str(rep), "--csv", "--page", "raw", "--print-units", "base"], "import", timeout_s)
    kernels = parse_raw_csv(out)
    if not kernels:
        raise RuntimeError(f"ncu profiled no kernel for {case} at batch {batch}: {out[-1500:]}")
    return {"case": case, "batch": batch, "kernels": kernels,
            "report": {"path": rep.name, "bytes": rep.stat().st_size}}


def profile(reports: Path, progress=print, ncu: str = "ncu", on_case=None) -> dict:
    """Every case at every batch (CASES x BATCHES): the record's "ncu" entry. A case that
    fails is recorded with its error, not fatal (the timings are already taken).
    on_case(entry so far): called after each case, so that a caller can write the record
    then (a device call that ends mid-way keeps the cases done)."""
    version = ncu_version(ncu)
    if version is None:
        raise RuntimeError(f"{ncu} (Nsight Compute) is not on PATH; --ncu needs it")
    entries = []
    doc = {"version": version, "clock_control": "none", "reports": str(reports), "cases": entries}
    blocked = None  # the counters' permission error, once seen
    for batch in BATCHES:
        for case in CASES:
            if blocked:
                entries.append({"case": case, "batch": batch, "kernels": [], "error": f"not run: {blocked}"})
            else:
                progress(f"ncu: {case} at batch {batch}")
                try:
                    entries.append(profile_case(case, batch, reports, ncu))
                except (RuntimeError, ValueError, OSError) as exc:
                    entries.append({"case": case, "batch": batch, "kernels": [], "error": str(exc)[:2000]})
                    if COUNTER_PERMISSION in str(exc):
                        blocked = f"the GPU's performance counters are not open to this user ({COUNTER_PERMISSION})"
            if on_case:
                on_case(doc)
    return doc


def _profiled_call(case: str, batch: int) -> None:
    """Inside ncu: build the case's inputs, run its call once (compiling it), then the same
    call on other inputs between cudaProfilerStart and Stop (ncu flushes the caches before
    it, by default, too)."""
    import torch

    from remnant.kernels.bench.cases import KERNEL_R, TOPK, WINDOW, DecodeCase, FlashMLACase
    from remnant.kernels.bench.inputs import DecodeInputs

    inputs = DecodeInputs(torch.Generator().manual_seed(0))
    if case == "flashmla":
        calls = inputs.flashmla_call_sets(FlashMLACase("flashmla", batch, TOPK, WINDOW), 0)
    else:
        # The folded call with a kept-first window, as the decode rows time it.
        decode_case = DecodeCase("packed", KERNEL_R, batch, TOPK, WINDOW, "kept_first", "kept_first",
                                 kernel="sm90" if case == "sm90" else "triton")
        calls = inputs.call_sets(decode_case, 0, decode_case.plan({}))
    calls[0]()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    calls[1]()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in CASES or not sys.argv[2].isdigit():
        sys.exit(f"usage: python -m remnant.kernels.bench.ncu {{{','.join(CASES)}}} BATCH")
    _profiled_call(sys.argv[1], int(sys.argv[2]))
