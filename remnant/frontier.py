"""The capacity frontier at an SLO: the highest load whose latencies meet it.

For one mode and workload, `run_frontier` finds the highest load (`workload.concurrency`,
closed loop, or `workload.request_rate`, open loop: `search.load`) whose measured TTFT p99
and TPOT p99 meet `slo.ttft_p99_ms` and `slo.tpot_p99_ms`, by a bounded
search: double the load from `search.start` until a step misses the SLO or
`search.max` is reached, then bisect between the last passing and the first missing load
down to `search.resolution`. Each step is a full run directory written by
`remnant.run.execute_run` (run.json, requests.jsonl, server.log), named by its load
(`c0004/`, `r2.5/`), so a search run again in the same directory reuses every step whose run.json
is completed with the same config and request stream, as a resumed sweep does
(`remnant.run_dir.make_way`), and only judges it anew: a changed SLO costs no run.

The search's own record, frontier.json (schema `remnant/frontier`), sits beside the step
directories and is rewritten after every step, so Ctrl-C or a crash leaves a valid record
of the steps so far. The search assumes latency grows with load (bisection needs a
monotone pass/fail); frontier.json keeps every step, so a non-monotone result is visible.

This module takes plain dataclasses; Hydra stays in remnant.cli (`remnant-frontier`).
The load axes are a table (LOADS); a new axis is a row there, the search is the same.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from remnant.config import RunConfig
from remnant.config_errors import ConfigError
from remnant.kv.modes import mode_of

log = logging.getLogger(__name__)

FRONTIER_JSON = "frontier.json"
#: How a step's run.json limits begin where the load client, not the server, may have set
#: its numbers (remnant.client.metrics.saturation_limits); frontier.json repeats them.
CLIENT_LIMIT = "the load client"


# ---------------------------------------------------------------------------------------
# Configs (light: no heavy import)


@dataclass
class SloConfig:
    """The service-level objective each step is judged by: a step passes when every bound
    given holds (milliseconds, p99 over the measured phase's completed requests). An unset
    bound (null) is not checked; at least one must be set."""

    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None

    def bounds(self) -> dict[str, float]:
        """The bounds that are set, by name."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def validate(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"slo.{name}={value} is not allowed; it must be a number of milliseconds > 0, or null")
        if not self.bounds():
            raise ConfigError("slo.ttft_p99_ms and slo.tpot_p99_ms are both null; set at least one "
                              "(e.g. slo.ttft_p99_ms=2000) or pick slo=interactive / slo=cpu_smoke")


@dataclass(frozen=True)
class LoadAxis:
    """A workload field the search varies. integer: levels are whole numbers (bisection
    floors its midpoints); minimum: the smallest level the field takes (0 with integer
    false: any level above 0); unit: what search.start, max and resolution count."""

    field: str
    prefix: str
    integer: bool = True
    minimum: float = 1
    unit: str = "requests in flight"


#: The load axes a search can vary: closed loop (concurrency: each user sends as its last
#: request ends) and open loop (request_rate: arrivals per second, as SGLang's
#: bench_serving --request-rate; workload.concurrency still caps the requests in flight).
LOADS: dict[str, LoadAxis] = {
    "concurrency": LoadAxis("concurrency", "c"),
    "request_rate": LoadAxis("request_rate", "r", integer=False, minimum=0, unit="requests/s"),
}


@dataclass
class SearchConfig:
    """Bounds of the search. load: the axis (LOADS); start: the first level; max: the
    highest level tried (the frontier is reported as >= max when max passes); resolution:
    bisection stops when the passing and missing levels are this close; max_steps: the
    most steps run (counting reused ones), whatever the bracket."""

    load: str = "concurrency"
    start: float = 1
    max: float = 64
    resolution: float = 1
    max_steps: int = 12

    def axis(self) -> LoadAxis:
        return LOADS[self.load]

    def validate(self) -> None:
        if self.load not in LOADS:
            raise ConfigError(f"search.load={self.load} is not a load axis; allowed: {', '.join(LOADS)}")
        axis = self.axis()
        for name in ("start", "max", "resolution"):
            value = getattr(self, name)
            if not math.isfinite(value) or (axis.integer and value != int(value)):
                kind = "a whole number" if axis.integer else "a finite number"
                raise ConfigError(f"search.{name}={value} is not allowed; with search.load={self.load} it must be {kind}")
        if self.start < axis.minimum or (self.start == 0 and axis.minimum == 0):
            floor = "> 0" if axis.minimum == 0 else f">= {axis.minimum:g}"
            raise ConfigError(f"search.start={self.start:g} is not allowed; workload.{axis.field} must be {floor}")
        if self.max < self.start:
            raise ConfigError(f"search.max={self.max:g} is less than search.start={self.start:g}; it must be >= start")
        if self.resolution <= 0:
            raise ConfigError(f"search.resolution={self.resolution:g} is not allowed; it must be > 0")
        if self.max_steps < 1:
            raise ConfigError(f"search.max_steps={self.max_steps} is not allowed; it must be >= 1")


@dataclass
class FrontierConfig(RunConfig):
    """remnant-frontier's config: a run config (every step's, but for its load) plus the
    SLO and the search bounds."""

    slo: SloConfig = field(default_factory=SloConfig)
    search: SearchConfig = field(default_factory=SearchConfig)

    def run_config(self) -> RunConfig:
        """The run config the steps share, as plain RunConfig (what run.json records)."""
        return RunConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RunConfig)})


def validate_frontier(cfg: FrontierConfig) -> None:
    """The SLO, the search bounds and what the workload allows of them; ConfigError names
    the field. The run rules (remnant.config.validate) are checked apart, on the steps'
    config."""
    cfg.slo.validate()
    cfg.search.validate()
    axis = cfg.search.axis()
    w = cfg.workload
    if not hasattr(w, axis.field):
        raise ConfigError(f"search.load={cfg.search.load} needs workload.{axis.field}, which workload "
                          f"(kind {w.kind}) does not have")
    if getattr(w, "at_ceiling", False):
        raise ConfigError("workload.at_ceiling=true sets the concurrency from the server's capacity, so a search "
                          "over it measures one load; give workload.at_ceiling=false")
    rate = getattr(w, "request_rate", None)
    if axis.field == "concurrency" and rate is not None:
        raise ConfigError(f"workload.request_rate={rate:g} sends open loop, where concurrency only caps the requests "
                          "in flight; a search over concurrency is closed loop: give workload.request_rate=null, "
                          "or search the rate (search.load=request_rate)")
    sessions = getattr(w, "num_sessions", None)
    if axis.field == "concurrency" and isinstance(sessions, int) and cfg.search.max > sessions:
        raise ConfigError(f"search.max={cfg.search.max:g} is more than workload.num_sessions={sessions}: active users "
                          f"beyond the sessions would idle; give search.max<={sessions} or more workload.num_sessions")


def with_load(cfg: RunConfig, axis: LoadAxis, level: float) -> RunConfig:
    """`cfg` with the workload's load field set to `level` (a copy; `cfg` is unchanged)."""
    value = int(level) if axis.integer else float(level)
    return dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, **{axis.field: value}))


# ---------------------------------------------------------------------------------------
# The search itself: levels and brackets, independent of what a step is


@dataclass
class SearchResult:
    """What a search found. frontier: the highest level that passed (None when none did);
    bracket: [highest passing, lowest missing] (either None where not found);
    stopped: why the search ended (one of STOP_REASONS); probed: levels in order."""

    frontier: float | None
    bracket: tuple[float | None, float | None]
    stopped: str
    probed: list[float]


#: Why a search ends: the bracket is as narrow as the resolution asks; the start missed
#: (nothing below it is tried); max passed (the frontier is at least max); the step budget
#: ran out; a step failed to run (no verdict); the search was interrupted.
STOP_REASONS = ("resolved", "start_missed", "max_passed", "max_steps", "step_failed", "interrupted")


def bounded_search(search: SearchConfig, probe: Callable[[float], bool | None]) -> SearchResult:
    """Doubling from search.start up to search.max, then bisection of the bracket.

    probe(level) -> True (the level meets the SLO), False (it misses), or None (the step
    could not be judged: the search stops there). Levels of an integer axis are whole
    numbers; bisection floors its midpoint. At most search.max_steps probes; no level is
    probed twice.
    """
    axis = search.axis()
    lo: float | None = None   # highest level that passed
    hi: float | None = None   # lowest level that missed
    probed: list[float] = []

    def result(stopped: str) -> SearchResult:
        return SearchResult(lo, (lo, hi), stopped, probed)

    def step(level: float) -> bool | None:
        probed.append(level)
        return probe(level)

    # An integer axis's levels are ints, so records show 4, not 4.0.
    whole = (lambda x: int(x)) if axis.integer else float
    level, top = whole(search.start), whole(search.max)
    while True:  # doubling
        if len(probed) >= search.max_steps:
            return result("max_steps")
        verdict = step(level)
        if verdict is None:
            return result("step_failed")
        if not verdict:
            hi = level
            break
        lo = level
        if level >= top:
            return result("max_passed")
        level = min(level * 2, top)
    if lo is None:
        return result("start_missed")
    while hi - lo > search.resolution:  # bisection
        if len(probed) >= search.max_steps:
            return result("max_steps")
        mid = whole(math.floor((lo + hi) / 2)) if axis.integer else (lo + hi) / 2
        if mid <= lo or mid >= hi:  # an integer bracket of width 1 has no level inside
            break
        verdict = step(mid)
        if verdict is None:
            return result("step_failed")
        if verdict:
            lo = mid
        else:
            hi = mid
    return result("resolved")


# ---------------------------------------------------------------------------------------
# Judging a step


def judge(metrics: dict | None, status: str, slo: SloConfig, client_stop: dict | None = None) -> tuple[bool | None, str]:
    """(verdict, reason) for one step's run.json metrics, status and client_stop.

    completed: pass when every SLO bound holds; degraded (more failed requests than the
    workload allows) misses, as requests that never finish miss any latency bound; so does
    a run the client stopped as over-saturated (workload.oversaturation: the server's
    queue grew without bound, so its latencies would too); any other status (failed,
    interrupted) gives no verdict.
    """
    if status == "degraded":
        return False, "degraded: more measured requests failed than workload.max_failed_share allows"
    if status == "failed" and (client_stop or {}).get("reason") == "oversaturated":
        return False, "over-saturated: the client stopped the run as the server fell behind (run.json client_stop)"
    if status != "completed" or not metrics:
        return None, f"the run {status}"
    parts, ok = [], True
    for name, bound in slo.bounds().items():
        dist, stat = name.rsplit("_", 2)[0], name.rsplit("_", 2)[1]   # ttft_p99_ms -> ttft, p99
        value = (metrics.get(f"{dist}_ms") or {}).get(stat)
        if value is None:
            # No sample (TPOT needs two tokens): the bound cannot be checked, so it is not met.
            parts.append(f"{dist.upper()} {stat} has no sample")
            ok = False
            continue
        met = value <= bound
        ok = ok and met
        parts.append(f"{dist.upper()} {stat} {value:.1f} ms {'<=' if met else '>'} {bound:g}")
    return ok, ", ".join(parts)


def goodput(run_dir: Path, slo: SloConfig, duration_s: float | None) -> float | None:
    """Requests per second of the measured phase that met every SLO bound on their own
    (TTFT and TPOT of that request), as sglang.bench_serving's --goodput counts them.
    None where the run has no measured duration."""
    path = Path(run_dir) / "requests.jsonl"
    if not duration_s or not path.exists():
        return None
    good = 0
    for line in path.read_text().splitlines():
        # Read as plain JSON lines (the fields remnant.client writes), as remnant.report does;
        # a last line cut by a crash is skipped.
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("phase") != "measured" or not r.get("success") or r.get("ttft_s") is None:
            continue
        ttft_ms = r["ttft_s"] * 1000.0
        n = r.get("completion_tokens") or 0
        # TPOT as remnant.client.metrics defines it; a one-token request has none to miss.
        tpot_ms = (r["end_s"] - r["start_s"] - r["ttft_s"]) / (n - 1) * 1000.0 if n > 1 else None
        if slo.ttft_p99_ms is not None and ttft_ms > slo.ttft_p99_ms:
            continue
        if slo.tpot_p99_ms is not None and tpot_ms is not None and tpot_ms > slo.tpot_p99_ms:
            continue
        good += 1
    return good / duration_s


# ---------------------------------------------------------------------------------------
# Steps as run directories, and the search's record


def step_dir(out_dir: Path, axis: LoadAxis, level: float) -> Path:
    """A step's directory, named by its load so that a resumed search finds it again
    whatever order the levels come in: c0004/."""
    return Path(out_dir) / (f"{axis.prefix}{int(level):04d}" if axis.integer else f"{axis.prefix}{level:g}")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _say(message: str) -> None:
    print(f"remnant-frontier: {message}", file=sys.stderr, flush=True)


@dataclass
class FrontierOutcome:
    """How a search ended: path of frontier.json (None where it could not be written, then
    write_error says why), its status, the frontier, and the signal that stopped it."""

    path: Path | None
    status: str
    frontier: float | None
    stopped: str
    signum: int | None = None
    write_error: str | None = None


def _step_metrics(doc: dict, run_dir: Path, slo: SloConfig) -> dict:
    m = doc.get("metrics") or {}

    def p(dist: str, stat: str) -> float | None:
        return (m.get(dist) or {}).get(stat)

    return {
        "completed": m.get("completed"), "failed": m.get("failed"),
        "ttft_p50_ms": p("ttft_ms", "p50"), "ttft_p99_ms": p("ttft_ms", "p99"),
        "tpot_p50_ms": p("tpot_ms", "p50"), "tpot_p99_ms": p("tpot_ms", "p99"),
        "output_throughput": m.get("output_throughput"), "request_throughput": m.get("request_throughput"),
        "goodput": goodput(run_dir, slo, m.get("duration_s")) if m else None,
    }


def run_frontier(cfg: FrontierConfig, out_dir: Path, prepare_step: Callable[[Path, RunConfig], None] | None = None,
                 progress: bool | None = None) -> FrontierOutcome:
    """Search `cfg`'s frontier with its steps and frontier.json in `out_dir`.

    prepare_step(run_dir, step_cfg) runs before a step runs (not before one reused): the
    CLI writes the step's .hydra/ there. Ctrl-C or SIGTERM during a step lets the step
    record itself as interrupted (remnant.run), then frontier.json is written as
    interrupted and the KeyboardInterrupt is not raised again: outcome.signum says which
    signal came. Steps already written stay.
    """
    from remnant.records.kinds import FRONTIER
    from remnant.records.provenance import sources
    from remnant.records.schema import RecordError, write_validated
    from remnant.run import execute_run
    from remnant.run_dir import KILLED, RUN_JSON, make_way
    from remnant.signals import signum_of

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = cfg.run_config()
    axis = cfg.search.axis()
    started_at = _now()
    steps: list[dict] = []
    client_limits: list[tuple[str, str]] = []
    state = {"status": "running", "error": None, "signum": None}
    search_record = dataclasses.asdict(cfg.search)
    if axis.integer:  # Hydra gives the float fields as 1.0; an integer axis's record says 1
        search_record.update({k: int(search_record[k]) for k in ("start", "max", "resolution")})

    def document(result: SearchResult | None) -> dict:
        frontier = None
        if result is not None:
            frontier = {"load": result.frontier, "bracket": list(result.bracket), "stopped": result.stopped,
                        "at_least": result.stopped == "max_passed"}
        limits = [
            "one search: latency varies run to run, so a step near the SLO may pass or miss again "
            "(search several seeds: remnant-frontier -m seed=0,1,2, and remnant-report for the interval)",
            "bisection assumes latency grows with load: a step that passes above one that missed is kept in steps, "
            "not searched around",
        ] + base.host.limits() + base.workload.limits() + list(base.limits)
        if axis.field == "request_rate":
            # Past the cap, arrivals queue in the client, not the server: the rate the server
            # saw is lower than the step's level, and its TTFT counts the client's wait.
            limits.append(f"open loop with workload.concurrency={base.workload.concurrency} capping the requests in "
                          "flight: at rates the cap holds back, requests wait in the client and TTFT counts the wait")
        # A step whose client was the bottleneck measured the client (run.json says so where
        # remnant.client found it saturated): the search's reader must see it too.
        limits += [f"step {name}: {limit}" for name, limit in client_limits]
        if result is not None and result.stopped == "max_passed":
            limits.append(f"search.max={cfg.search.max:g} passed: the frontier is at least that, not measured above it")
        return {
            **FRONTIER.header(),
            "status": state["status"], "error": state["error"], "started_at": started_at, "ended_at": _now(),
            "mode": base.mode.name, "retention": base.retention.label() if mode_of(base.mode.name).keeps_retention else None,
            "workload": base.workload.name, "seed": base.seed, "load": cfg.search.load,
            "slo": dataclasses.asdict(cfg.slo), "search": search_record,
            "sources": sources(), "steps": steps, "frontier": frontier, "limits": limits,
        }

    def write(result: SearchResult | None) -> tuple[Path | None, str | None]:
        try:
            return write_validated(out_dir / FRONTIER_JSON, document(result)), None
        except OSError as exc:
            return None, f"frontier.json could not be written to {out_dir}: {exc.strerror or exc}"
        except RecordError as exc:
            # A record that breaks its own schema is a bug: keep it beside, for the post-mortem.
            (out_dir / "frontier.invalid.json").write_text(json.dumps(document(result), indent=2, default=str) + "\n")
            return None, f"frontier.json failed its schema (a bug; kept as frontier.invalid.json): {exc}"

    def probe(level: float) -> bool | None:
        step_cfg = with_load(base, axis, level)
        run_dir = step_dir(out_dir, axis, level)
        label = f"step {len(steps) + 1} {cfg.search.load}={level:g}"
        earlier = make_way(run_dir, step_cfg)
        reused = earlier.reuse
        if earlier.outcome not in (None, KILLED) and not reused:
            _say(f"{label}: {run_dir}: {earlier.why}; running it again (earlier files set aside as "
                 f"*.{earlier.outcome}-*)")
        if not reused:
            _say(f"{label}: running in {run_dir}")
            run_dir.mkdir(parents=True, exist_ok=True)
            if prepare_step is not None:
                prepare_step(run_dir, step_cfg)
            t0 = time.monotonic()
            outcome = execute_run(step_cfg, run_dir, progress=progress)
            elapsed = time.monotonic() - t0
            if outcome.path is None:
                raise OSError(outcome.write_error)
            if outcome.status == "interrupted":
                state["signum"] = outcome.signum
        doc = json.loads((run_dir / RUN_JSON).read_text())
        verdict, reason = judge(doc.get("metrics"), doc["status"], cfg.slo, doc.get("client_stop"))
        client_limits.extend((run_dir.name, limit) for limit in doc.get("limits") or []
                             if limit.startswith(CLIENT_LIMIT))
        steps.append({
            "index": len(steps), "load": level, "run_dir": run_dir.name, "run_id": doc["run_id"],
            "status": doc["status"], "reused": reused, "passed": verdict, "reason": reason,
            "metrics": _step_metrics(doc, run_dir, cfg.slo),
        })
        shown = {True: "pass", False: "miss", None: "no verdict"}[verdict]
        how = "reused" if reused else f"ran {elapsed:.0f}s"
        _say(f"{label}: {shown} ({reason}) [{how}]")
        if state["signum"] is not None:
            raise KeyboardInterrupt
        write(None)
        return verdict

    result: SearchResult | None = None
    try:
        result = bounded_search(cfg.search, probe)
        if result.stopped == "step_failed":
            last = steps[-1]
            state.update(status="failed", error={"stage": "step", "message": f"step {last['run_dir']}: {last['reason']}"})
        else:
            state["status"] = "completed"
    except KeyboardInterrupt as exc:
        signum = state["signum"] if state["signum"] is not None else signum_of(exc)
        state.update(status="interrupted", signum=signum,
                     error={"stage": "step", "message": "interrupted; the steps written stay, and the same command "
                                                       "resumes the search"})
        result = _so_far(steps, "interrupted")
    except OSError as exc:
        state.update(status="failed", error={"stage": "step", "message": str(exc)})
        result = _so_far(steps, "step_failed")
    path, write_error = write(result)
    return FrontierOutcome(path, state["status"], result.frontier, result.stopped, state["signum"], write_error)


def _so_far(steps: list[dict], stopped: str) -> SearchResult:
    """The bracket the steps recorded so far give, for a search that stopped early."""
    passed = [s["load"] for s in steps if s["passed"] is True]
    missed = [s["load"] for s in steps if s["passed"] is False]
    lo = max(passed) if passed else None
    hi = min(missed) if missed else None
    return SearchResult(lo, (lo, hi), stopped, [s["load"] for s in steps])
