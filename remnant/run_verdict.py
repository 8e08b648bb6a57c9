"""A run's verdict: its status, error and limits, from what the run found out.

remnant.run gathers the facts stage by stage (RunFacts: what ended the run early, what
the server said of itself, what the client measured); `verdict` turns them into run.json's
`status`, `error` and `limits` and does nothing else, so every rule of how a run ends and
which caveats its record carries is here and tested on facts built by hand, without a
server (tests/test_run_verdict.py).

Status (docs/records.md): completed; degraded where more measured requests failed than
workload.max_failed_share; failed, with the stage and reason (no measured request
completed, a stalled server, the deadline, over-saturation, an error); interrupted by
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from remnant.config import RunConfig
from remnant.hosts.base import HostError
from remnant.signals import describe as describe_signal
from remnant.signals import signum_of

#: A gap this long between two tokens of one request (a server that paused, short of a
#: stall) is named in run.json's limits.
PAUSE_NOTE_S = 10.0
#: Errors a run expects and records in the user's words (a server that will not start, a
#: bad dataset, a full disk); anything else is a bug, still recorded, with its repr.
FORESEEN = (HostError, ValueError, OSError, RuntimeError)


@dataclass
class RunFacts:
    """What a run found out, stage by stage; a field keeps its default where the run never
    got that far. remnant.run fills it; `verdict` and run.json read it.

    stage: the stage entered last (setup, workload, serve, client, capture, metrics): where a
        failure happened.
    ended_by: what ended the run before its end: a signal (KeyboardInterrupt), the client's
        stop (remnant.client.runner.ClientStopped) or an error; None for a run that got through.
    plan_limits: what the workload's plan says of itself (dataset records skipped, reused
        conversations).
    served: a server answered; environment and server_info are then its own word (either
        may be None: a server with no /server_info).
    results: the client's phases as it returned them (remnant.client.runner.PhaseResult);
        None where it did not return. phases: every phase that ended, the one the client
        was stopped in included.
    metrics, client, failures: the measured phase's summaries (remnant.client.metrics
        summarize, client_summary, failure_summary).
    capture, capture_limits: a capture run's record of its capture file and what it calls
        for (remnant.run.capture_record).
    retention_map: the map a packed run served with (remnant.run.retention_map_record).
    server_metrics, scrape_limits: the summary of the server's /metrics as the client
        scraped them, and the caveats of the scrape.
    artifacts: the run's files with their sha256, listed when run.json is written.
    """

    stage: str = "setup"
    ended_by: BaseException | None = None
    plan_limits: list[str] = field(default_factory=list)
    served: bool = False
    environment: dict | None = None
    server_info: dict | None = None
    results: list | None = None
    phases: list = field(default_factory=list)
    metrics: dict | None = None
    client: dict | None = None
    failures: dict | None = None
    capture: dict | None = None
    capture_limits: list[str] = field(default_factory=list)
    retention_map: dict | None = None
    server_metrics: dict | None = None
    scrape_limits: list[str] = field(default_factory=list)
    artifacts: list = field(default_factory=list)


@dataclass(frozen=True)
class Verdict:
    """How a run ended, as run.json records it.

    status: completed | degraded | failed | interrupted.
    error: run.json's error (stage, type, message); None for a completed run.
    limits: every caveat a reader must see, in words.
    client_stop: why and when the client stopped, where it did (ClientStopped.stop).
    signum: the signal that interrupted the run.
    """

    status: str
    error: dict | None
    limits: list[str]
    client_stop: dict | None = None
    signum: int | None = None

    @property
    def measured(self) -> bool:
        """The run's metrics stand (completed, or degraded: they cover what completed)."""
        return self.status in ("completed", "degraded")


def verdict(cfg: RunConfig, facts: RunFacts) -> Verdict:
    """Status, error and limits of a run of `cfg` that found out `facts`."""
    from remnant.client.metrics import saturation_limits
    from remnant.client.oversaturation import stop_limit
    from remnant.client.runner import ClientStopped

    limits = base_limits(cfg) + facts.plan_limits
    mode = cfg.mode.name
    if facts.served:
        limits += served_mode_limits(mode, facts.server_info, cfg.host.starts_server())
        if reported_mode(facts.server_info) in (None, mode):
            # A server in another mode ended the run (served_mode_error): its kernels are not this run's.
            limits += native_decode_limits(facts.server_info) + packed_decode_limits(facts.server_info)
    if facts.metrics is not None:
        limits += pause_limits(facts.metrics)
    if facts.client is not None:
        limits += saturation_limits(facts.client)
    for r in facts.results or []:
        if r.flush is not None and not r.flush.ok:
            limits.append(f"prefix cache flush before {r.name} failed: {r.flush.message}")
    limits += facts.capture_limits

    status, error, client_stop, signum = "completed", None, None, None
    exc = facts.ended_by
    if exc is None:
        metrics, failures = facts.metrics, facts.failures
        if metrics["failed"]:
            limits.append(f"{metrics['failed']} measured requests failed; metrics cover the {metrics['completed']} "
                          "that completed")
        if metrics["completed"] == 0:
            first = f"; first error: {failures['errors'][0]['message']}" if failures and failures["errors"] else ""
            status, error = "failed", {"stage": "client", "type": "NoCompletedRequests",
                                       "message": f"no measured request completed{first}; see requests.jsonl"}
        elif failures and failures["share"] > failures["max_share"]:
            status = "degraded"
            error = {"stage": "client", "type": "FailedRequests",
                     "message": f"{failures['failed']} of {failures['measured']} measured requests failed "
                                f"({failures['share']:.0%}, more than workload.max_failed_share="
                                f"{failures['max_share']:g}); first error: {failures['errors'][0]['message']}"}
    elif isinstance(exc, ClientStopped):
        status, client_stop = "failed", exc.stop
        error = {"stage": "client", "type": exc.stop["reason"].capitalize(), "message": str(exc)}
        limits += stop_limit(exc.stop)
    elif isinstance(exc, KeyboardInterrupt):
        status, signum = "interrupted", signum_of(exc)
        error = {"stage": facts.stage, "type": "KeyboardInterrupt", "message": f"interrupted by {describe_signal(signum)}"}
    else:
        status = "failed"
        message = str(exc) if isinstance(exc, FORESEEN) else f"unexpected error: {exc!r}"
        error = {"stage": facts.stage, "type": type(exc).__name__, "message": message}
    limits += facts.scrape_limits
    return Verdict(status, error, limits, client_stop, signum)


def base_limits(cfg: RunConfig) -> list[str]:
    """What every run of `cfg` must say: one run, and its host's, workload's and model's caveats."""
    limits = ["a single run: its variance is not measured (sweep seed=0,1,2 and remnant-report for a confidence interval)"]
    return limits + cfg.host.limits() + cfg.workload.limits() + list(cfg.model.limits) + list(cfg.limits)


def reported_mode(server_info: dict | None) -> str | None:
    """The mode the server says it serves in (the embedded engine's /server_info has
    remnant_mode; SGLang's has none)."""
    return (server_info or {}).get("remnant_mode")


def served_mode_error(mode: str, server_info: dict | None, base_url: str) -> str | None:
    """Why the run must stop where the server reports another mode than the run's (an
    external server started in one mode and driven as another would file its numbers under
    the wrong mode); None where it reports this mode or none."""
    served = reported_mode(server_info)
    if served is None or served == mode:
        return None
    return (f"mode={mode}, but the server at {base_url} reports remnant_mode={served!r}: "
            f"give mode={served} or drive a server started in {mode} mode")


def served_mode_limits(mode: str, server_info: dict | None, started_here: bool) -> list[str]:
    """A server this run started got the run's mode; an external one that does not say
    (SGLang's /server_info has no remnant_mode) is taken at the config's word, and run.json
    says so."""
    if started_here or reported_mode(server_info) is not None:
        return []
    return [f"the external server did not report its mode (no remnant_mode in /server_info): mode={mode} is as "
            "configured, not checked"]


def native_decode_limits(server_info: dict | None) -> list[str]:
    """The embedded engine on a GPU says which kernel decoded native records: a run whose
    native attention was not FlashMLA's (SGLang's stock decode) must say so, in the words of
    remnant.kernels.decode.served_limits."""
    info = server_info or {}
    if info.get("device") != "cuda" or not info.get("remnant_native_decode"):
        return []
    from remnant.kernels.decode import served_limits  # imports torch: only for a GPU server's record

    return served_limits(False, info["remnant_native_decode"])


def packed_decode_limits(server_info: dict | None) -> list[str]:
    """The embedded engine on a GPU says which kernel kernel mode's packed decode ran on: the
    SM90 Gluon kernel, or the Triton kernel and why not the SM90 one (benchmarks measure
    them apart: benchmarks/kernels/NOTES.md)."""
    info = server_info or {}
    if info.get("device") != "cuda" or not info.get("remnant_packed_decode"):
        return []
    from remnant.kernels.decode import served_limits  # imports torch: only for a GPU server's record

    return served_limits(True, info["remnant_packed_decode"])


def pause_limits(metrics: dict) -> list[str]:
    """A pause of the server shorter than a stall still shapes the latencies: say so."""
    longest = (metrics.get("itl_ms") or {}).get("max")
    if longest is None or longest < PAUSE_NOTE_S * 1000:
        return []
    return [f"a request waited {longest / 1000:.1f}s between two tokens (itl_ms.max): the server paused "
            "(short of workload.stall_timeout_s); TPOT, ITL and E2E include the pause"]
