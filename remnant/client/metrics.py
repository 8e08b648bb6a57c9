"""Serving metrics from request records, defined as sglang.bench_serving defines them.

Definitions, so numbers compare with bench_serving's:

- TTFT: send to the first chunk that carried a token (`RequestRecord.ttft_s`).
- ITL per token: for consecutive token-carrying chunks, the gap between their arrivals
  divided by the new tokens of the later chunk, counted once per such token. The first
  chunk gives none (it is TTFT).
- TPOT = (E2E - TTFT) / (completion_tokens - 1), only where completion_tokens > 1.
- E2E = end_s - start_s; dispatch delay = start_s - intended_start_s.
- Throughputs and concurrency divide by the phase's duration: given by the caller, else
  max(end_s) - min(start_s) over the records passed.

Only successful requests enter latency distributions and token sums; failed ones are
counted. The caller selects the phase: `summarize` summarizes every record it is given.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from os import PathLike
from pathlib import Path

import numpy as np
import pandas as pd

from remnant.client.request_record import RequestRecord

log = logging.getLogger(__name__)

PERCENTILES = (50, 90, 95, 99)
DIST_KEYS = ("count", "mean", "std", "p50", "p90", "p95", "p99", "max")

_RECORD_COLUMNS = [
    "id", "phase", "index", "intended_start_s", "start_s", "end_s", "success", "error",
    "ttft_s", "chunk_times_s", "chunk_tokens", "prompt_tokens", "completion_tokens",
    "cached_tokens", "finish_reason", "expected_output_tokens",
]
_DERIVED_COLUMNS = ["e2e_s", "tpot_s", "dispatch_delay_s"]


def _as_records(records: Iterable[RequestRecord | dict]) -> list[RequestRecord]:
    out = []
    for r in records:
        if isinstance(r, RequestRecord):
            out.append(r)
        elif isinstance(r, dict):
            out.append(RequestRecord.from_dict(r))
        else:
            raise TypeError(
                f"records must be RequestRecord or dict, got {type(r).__name__}"
            )
    return out


def _tpot_s(r: RequestRecord) -> float | None:
    if r.end_s is None or r.ttft_s is None or r.completion_tokens <= 1:
        return None
    return (r.end_s - r.start_s - r.ttft_s) / (r.completion_tokens - 1)


def records_frame(records: Iterable[RequestRecord | dict]) -> pd.DataFrame:
    """One row per request: every RequestRecord field plus derived columns.

    Derived columns (seconds, NaN where undefined): e2e_s (end_s - start_s, NaN when the
    request never ended), tpot_s ((e2e - ttft) / (completion_tokens - 1), NaN unless
    completion_tokens > 1 and ttft_s is known), dispatch_delay_s (start_s -
    intended_start_s). chunk_times_s and chunk_tokens stay lists in object columns.
    """
    rows = []
    for r in _as_records(records):
        row = {c: getattr(r, c) for c in _RECORD_COLUMNS}
        row["e2e_s"] = r.e2e_s
        row["tpot_s"] = _tpot_s(r)
        row["dispatch_delay_s"] = r.start_s - r.intended_start_s
        rows.append(row)
    df = pd.DataFrame(rows, columns=_RECORD_COLUMNS + _DERIVED_COLUMNS)
    # None -> NaN in the time columns, so an all-None column is still numeric.
    for c in ("intended_start_s", "start_s", "end_s", "ttft_s", *_DERIVED_COLUMNS):
        df[c] = pd.to_numeric(df[c], errors="raise").astype("float64")
    for c in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        df[c] = df[c].astype("int64")
    df["success"] = df["success"].astype(bool)
    return df


def _itl_one(r: RequestRecord) -> list[float]:
    if len(r.chunk_times_s) != len(r.chunk_tokens):
        raise ValueError(
            f"request {r.id!r}: chunk_times_s has {len(r.chunk_times_s)} entries but "
            f"chunk_tokens has {len(r.chunk_tokens)}; they must have the same length"
        )
    out: list[float] = []
    prev_t = None
    for t, n in zip(r.chunk_times_s, r.chunk_tokens):
        # A chunk without tokens is not a token arrival; the gap runs from the last
        # chunk that did carry tokens, as in bench_serving.
        if n <= 0:
            continue
        if prev_t is not None:
            out.extend([(t - prev_t) / n] * n)
        prev_t = t
    return out


def itl_samples(records: Iterable[RequestRecord | dict]) -> np.ndarray:
    """Per-token inter-token latencies in seconds, over successful requests; shape (N,)."""
    samples: list[float] = []
    for r in _as_records(records):
        if r.success:
            samples.extend(_itl_one(r))
    return np.asarray(samples, dtype=np.float64)


def distribution(values_ms: Iterable[float | None]) -> dict:
    """Summary of samples in milliseconds: count, mean, std, p50, p90, p95, p99, max.

    None and NaN samples are dropped. Percentiles interpolate linearly (np.percentile's
    default) and std is the population std (ddof=0), as bench_serving computes them.
    With no sample, count is 0 and every other value is None. Values are plain floats.
    """
    a = np.asarray(
        [v for v in values_ms if v is not None and not math.isnan(v)], dtype=np.float64
    )
    if a.size == 0:
        return {"count": 0, **{k: None for k in DIST_KEYS[1:]}}
    pct = np.percentile(a, PERCENTILES)
    out = {"count": int(a.size), "mean": float(a.mean()), "std": float(a.std())}
    out.update({f"p{p}": float(v) for p, v in zip(PERCENTILES, pct)})
    out["max"] = float(a.max())
    return out


def _ms(series: pd.Series) -> list[float]:
    return (series.dropna() * 1000.0).tolist()


def summarize(
    records: Iterable[RequestRecord | dict], duration_s: float | None = None
) -> dict:
    """Metrics of one phase's records (the Metrics object of run.json).

    duration_s: the phase's measured duration in seconds; if None, max(end_s) -
    min(start_s) over the records given (0.0 when there are none). Throughputs are per
    second of that duration (0.0 when it is 0); latency distributions are in ms.
    """
    recs = _as_records(records)
    df = records_frame(recs)
    ok = df[df["success"]]

    if duration_s is None:
        ends = df["end_s"].dropna()
        duration_s = float(ends.max() - df["start_s"].min()) if len(ends) else 0.0
    else:
        duration_s = float(duration_s)
        if not math.isfinite(duration_s) or duration_s < 0:
            raise ValueError(
                f"duration_s={duration_s} is not allowed; it must be a finite number "
                f">= 0 or None"
            )

    completed = int(len(ok))
    total_in = int(ok["prompt_tokens"].sum())
    total_out = int(ok["completion_tokens"].sum())
    total_cached = int(ok["cached_tokens"].sum())
    sum_e2e = float(ok["e2e_s"].dropna().sum())

    def per_s(x: float) -> float:
        return float(x / duration_s) if duration_s > 0 else 0.0

    itl_ms = itl_samples(r for r in recs if r.success) * 1000.0
    return {
        "completed": completed,
        "failed": int(len(df) - completed),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": total_cached,
        "request_throughput": per_s(completed),
        "input_throughput": per_s(total_in),
        "output_throughput": per_s(total_out),
        "total_throughput": per_s(total_in + total_out),
        "concurrency": per_s(sum_e2e),
        "cache_hit_rate": float(total_cached / total_in) if total_in > 0 else None,
        "ttft_ms": distribution(_ms(ok["ttft_s"])),
        "itl_ms": distribution(itl_ms.tolist()),
        "tpot_ms": distribution(_ms(ok["tpot_s"])),
        "e2e_ms": distribution(_ms(ok["e2e_s"])),
        "dispatch_delay_ms": distribution(_ms(ok["dispatch_delay_s"])),
    }


def load_requests_jsonl(path: str | PathLike) -> list[RequestRecord]:
    """Read requests.jsonl into RequestRecords, in file order.

    A final line that does not parse is skipped with a warning: the client appends one
    line per finished request, so a crash mid-write leaves at most the last line cut
    short. An unparsable line anywhere else raises ValueError naming file and line.
    Blank lines are ignored.
    """
    path = Path(path)
    lines = [
        (i, line)
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if line.strip()
    ]
    out: list[RequestRecord] = []
    for k, (lineno, line) in enumerate(lines):
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            if k == len(lines) - 1:
                log.warning(
                    "%s:%d: skipping a truncated last line (%s)", path, lineno, e
                )
                break
            raise ValueError(
                f"{path}:{lineno}: not valid JSON ({e}); only the last line of "
                f"requests.jsonl may be truncated"
            ) from e
        if not isinstance(d, dict):
            raise ValueError(
                f"{path}:{lineno}: expected a JSON object (one request record), "
                f"got {type(d).__name__}"
            )
        try:
            out.append(RequestRecord.from_dict(d))
        except TypeError as e:
            raise ValueError(f"{path}:{lineno}: not a request record ({e})") from e
    return out


def per_turn(records: Iterable[RequestRecord | dict]) -> list[dict]:
    """Metrics per turn index of session workloads (records with `turn` set), ascending.

    Each: {"turn", "completed", "failed", "mean_prompt_tokens", "cache_hit_rate", "ttft_ms",
    "e2e_ms"}; cache_hit_rate is sum(cached) / sum(prompt) over the turn's completed requests.
    """
    recs = [r for r in _as_records(records) if r.turn is not None]
    out = []
    for turn in sorted({r.turn for r in recs}):
        group = [r for r in recs if r.turn == turn]
        ok = [r for r in group if r.success]
        prompt = sum(r.prompt_tokens for r in ok)
        out.append({
            "turn": int(turn),
            "completed": len(ok),
            "failed": len(group) - len(ok),
            "mean_prompt_tokens": float(prompt / len(ok)) if ok else None,
            "cache_hit_rate": float(sum(r.cached_tokens for r in ok) / prompt) if prompt else None,
            "ttft_ms": distribution([r.ttft_s * 1000.0 for r in ok if r.ttft_s is not None]),
            "e2e_ms": distribution([r.e2e_s * 1000.0 for r in ok if r.e2e_s is not None]),
        })
    return out


#: Distinct errors a run record lists, and the longest message kept of each.
FIRST_ERRORS = 5
ERROR_CHARS = 300


def failure_summary(records: Iterable[RequestRecord | dict], max_share: float) -> dict | None:
    """run.json's `failures`: of the records given (one phase's), how many failed, their
    share, `max_share` (above it the run is degraded) and the first FIRST_ERRORS distinct
    error messages in order of first appearance, each with its count. None when none failed."""
    recs = _as_records(records)
    failed = [r for r in recs if not r.success]
    if not failed:
        return None
    counts: dict[str, int] = {}
    for r in failed:
        message = " ".join((r.error or "failed without an error message").split())
        if len(message) > ERROR_CHARS:
            message = message[: ERROR_CHARS - 3] + "..."
        counts[message] = counts.get(message, 0) + 1
    return {
        "measured": len(recs),
        "failed": len(failed),
        "share": len(failed) / len(recs),
        "max_share": float(max_share),
        "errors": [{"message": m, "count": c} for m, c in list(counts.items())[:FIRST_ERRORS]],
    }


def client_summary(records: Iterable[RequestRecord | dict], duration_s: float, loop_cpu_s: float,
                   process_cpu_s: float, request_rate: float | None, arrival: str, cpu_share_limit: float,
                   dispatch_p99_limit_ms: float) -> dict:
    """run.json's `client`: what the load client itself cost and how late it sent, over one
    phase's records (the measured phase), and whether that made it the bottleneck.

    duration_s: the phase's duration; loop_cpu_s / process_cpu_s: CPU seconds of the event
    loop's thread and of the client process over it. dispatch_delay_ms covers every request
    sent (failed ones too: they were sent late or not); queued_ms (open loop) is how long
    arrivals waited for a free concurrency slot. saturated: the loop's CPU share reached
    cpu_share_limit, or dispatch delay p99 passed dispatch_p99_limit_ms (see saturation_limits).
    """
    recs = _as_records(records)
    delays = [(r.start_s - r.intended_start_s) * 1000.0 for r in recs]
    queued = [(r.intended_start_s - r.scheduled_s) * 1000.0 for r in recs if r.scheduled_s is not None]
    starts = sorted(r.start_s for r in recs)
    span = starts[-1] - starts[0] if len(starts) > 1 else 0.0

    def share(cpu_s: float) -> float:
        return float(cpu_s / duration_s) if duration_s > 0 else 0.0

    out = {
        "loop_cpu_s": float(loop_cpu_s),
        "loop_cpu_share": share(loop_cpu_s),
        "process_cpu_s": float(process_cpu_s),
        "process_cpu_share": share(process_cpu_s),
        "dispatch_delay_ms": distribution(delays),
        "arrival": "closed" if request_rate is None else arrival,
        "request_rate": request_rate,
        "sent_request_rate": float((len(starts) - 1) / span) if span > 0 else None,
        "queued_ms": distribution(queued) if request_rate is not None else None,
        "saturation": {"loop_cpu_share": float(cpu_share_limit), "dispatch_delay_p99_ms": float(dispatch_p99_limit_ms)},
    }
    out["saturated"] = bool(saturation_limits(out))
    return out


def saturation_limits(client: dict) -> list[str]:
    """run.json limits for a saturated client (`client_summary`'s dict): a number it measured
    may be the client's own ceiling, not the server's."""
    limits = []
    bound = client["saturation"]
    if client["loop_cpu_share"] >= bound["loop_cpu_share"]:
        limits.append(f"the load client was saturated: its event loop was busy {client['loop_cpu_share']:.0%} of "
                      f"the measured phase (one core at most; workload.saturation_cpu_share="
                      f"{bound['loop_cpu_share']:g}): throughput and latencies may be the client's, not the server's")
    p99 = client["dispatch_delay_ms"]["p99"]
    if p99 is not None and p99 > bound["dispatch_delay_p99_ms"]:
        limits.append(f"the load client fell behind: dispatch delay p99 {p99:.1f} ms (requests sent that late after "
                      f"they were due; workload.saturation_dispatch_p99_ms={bound['dispatch_delay_p99_ms']:g}): "
                      "TTFT and E2E undercount the wait, and the load offered was lower than configured")
    return limits
