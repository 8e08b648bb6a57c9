"""What a workload is and what it hands the client.

WorkloadConfig holds the fields every workload has; each kind's config class in
remnant/workloads/<kind>.py extends it and registers in WORKLOADS. Its plan() is a
WorkloadPlan: phases of planned requests, and a fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from remnant.config import MISSING, Kinds, ModelConfig
from remnant.config_errors import ConfigError, at_least, positive_finite

#: Open-loop arrival processes (workload.arrival): exponential gaps (Poisson arrivals, as
#: sglang.bench_serving draws them) or equal gaps.
ARRIVALS = ("poisson", "constant")


@dataclass
class PlannedRequest:
    """One request to send. Exactly one of input_ids / text is set."""

    id: str
    max_new_tokens: int
    input_ids: list[int] | None = None
    text: str | None = None
    session: str | None = None
    turn: int | None = None
    think_time_s: float | None = None  # wait after the previous turn's answer (sessions)
    not_before_s: float | None = None  # recorded time since the phase start (sessions)


@dataclass
class Phase:
    """Requests sent with at most `concurrency` in flight, after flushing the prefix cache."""

    name: str
    requests: list[PlannedRequest]
    concurrency: int
    flush_before: bool = True
    #: When set, the phase replays sessions: `concurrency` users each send one session's
    #: turns in order (a turn after the previous answer), then take the next session.
    sessions: list[list[PlannedRequest]] | None = None
    #: Open loop (workload.request_rate): when each request (each session, for a sessions
    #: phase) is due, in s since the phase started; `concurrency` still caps those in
    #: flight, as SGLang's --max-concurrency does. None: closed loop, each request sent as
    #: soon as a slot frees.
    arrivals_s: list[float] | None = None


def arrival_times(n: int, rate: float, arrival: str, seed: int, phase: int) -> list[float]:
    """When n requests arriving at `rate` per second are due, s since the phase start; the
    first at 0, as sglang.bench_serving sends its first at once. poisson: gaps drawn
    exponential with mean 1/rate from (seed, phase); constant: gaps of 1/rate."""
    if arrival not in ARRIVALS:
        raise ValueError(f"workload.arrival={arrival} is not allowed; allowed: {', '.join(ARRIVALS)}")
    if n == 0:
        return []
    if arrival == "constant":
        gaps = np.full(n - 1, 1.0 / rate)
    else:
        gaps = np.random.default_rng([seed, phase]).exponential(1.0 / rate, size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)]).tolist()


@dataclass
class WorkloadPlan:
    name: str
    seed: int
    phases: list[Phase]
    params: dict = field(default_factory=dict)
    #: When read from a file: path, sha256, and its records: usable, skipped and the first
    #: skipped with why (remnant.workloads.dataset_file.Tally.dataset).
    dataset: dict | None = None

    def fingerprint(self) -> str:
        """sha256 of the exact request stream: equal fingerprints mean identical requests."""
        h = hashlib.sha256()
        for phase in self.phases:
            h.update(json.dumps([phase.name, phase.concurrency, phase.flush_before]).encode())
            for r in phase.requests:
                h.update(json.dumps(asdict(r), sort_keys=True).encode())
            for session in phase.sessions or []:
                h.update(json.dumps([r.id for r in session]).encode())
            if phase.arrivals_s is not None:  # only then: closed-loop fingerprints stay as they were
                h.update(json.dumps(["arrivals_s", phase.arrivals_s]).encode())
        return h.hexdigest()

    def counts(self) -> dict:
        counts = {"warmup": 0, "measured": 0}
        for phase in self.phases:
            counts[phase.name] = counts.get(phase.name, 0) + len(phase.requests)
        return counts


@dataclass
class OversaturationConfig:
    """The over-saturation stop (docs/workloads.md, "Over-saturation stop"): off unless
    enabled. Over the trailing `window_s` of a phase it stops the run when the requests
    waiting (the server's queue, from its /metrics, plus arrivals the client holds for a
    free slot) rise at `queue_slope` req/s or more, each quarter of the window above the
    one before; or when, with the client's load held, the output tokens/s the client
    received fall below `goodput_drop` of the phase's best window."""

    enabled: bool = False
    #: The trailing window each check reads; a phase runs this long before its first check.
    window_s: float = 30.0
    #: Least-squares slope of the waiting requests over the window, in requests per second.
    queue_slope: float = 0.5
    #: Output tokens/s over the window below this share of the phase's best window; 0: no
    #: goodput rule.
    goodput_drop: float = 0.5

    def validate(self) -> None:
        positive_finite(self.window_s, "workload.oversaturation.window_s")
        positive_finite(self.queue_slope, "workload.oversaturation.queue_slope")
        if not (isinstance(self.goodput_drop, (int, float)) and 0 <= self.goodput_drop < 1):
            raise ConfigError(f"workload.oversaturation.goodput_drop={self.goodput_drop} must be a share in [0, 1) "
                              "(0: no goodput rule)")


#: Shortest workload.server_metrics_interval_s: one scrape takes a few ms of the server's time.
SERVER_METRICS_MIN_INTERVAL_S = 0.05


@dataclass
class WorkloadConfig:
    """Common fields of every workload; `kind` picks the implementation (WORKLOADS)."""

    name: str = MISSING
    kind: str = MISSING
    seed: int = 0
    concurrency: int = 4
    flush_timeout_s: float = 60.0
    #: Per read: the longest one request may wait for its next bytes.
    request_timeout_s: float = 600.0
    #: The no-progress watchdog: while requests are in flight and none of them has given a
    #: token (or ended) for this long, the server has stalled: the run stops sending,
    #: cancels what is in flight and ends failed (stage client, stall).
    stall_timeout_s: float = 120.0
    #: The longest the client may drive the server, all phases and flushes together; past
    #: it the run ends failed (stage client, deadline). null: no deadline.
    deadline_s: float | None = None
    #: A run whose measured requests failed at more than this share (0..1) ends degraded,
    #: not completed.
    max_failed_share: float = 0.1
    #: Open loop: requests (sessions, for session workloads) arrive at this rate per second,
    #: and `concurrency` caps those in flight. null: closed loop, each sent as a slot frees.
    request_rate: float | None = None
    #: How open-loop arrivals are spaced: poisson (exponential gaps, seeded) or constant.
    arrival: str = "poisson"
    #: The client was saturated, and run.json's limits say so, when its event loop was busy
    #: for at least this share of the measured phase (of one core: the loop is one thread)...
    saturation_cpu_share: float = 0.9
    #: ...or when its dispatch delay (sent after it meant to) had a p99 above this.
    saturation_dispatch_p99_ms: float = 10.0
    #: Scrape the server's Prometheus /metrics this often (s) while the client drives it,
    #: into server_metrics.jsonl and run.json's server_metrics; 0: no scrape.
    server_metrics_interval_s: float = 1.0
    #: Stop a run that drives the server past saturation (off by default).
    oversaturation: OversaturationConfig = field(default_factory=OversaturationConfig)

    def validate(self) -> None:
        """ConfigError naming the first field out of its range; a kind adds its own fields."""
        if self.request_rate is not None:
            positive_finite(self.request_rate, "workload.request_rate")
        if self.arrival not in ARRIVALS:
            raise ConfigError(f"workload.arrival={self.arrival} is not allowed; allowed: {', '.join(ARRIVALS)}")
        positive_finite(self.saturation_cpu_share, "workload.saturation_cpu_share")
        positive_finite(self.saturation_dispatch_p99_ms, "workload.saturation_dispatch_p99_ms")
        positive_finite(self.request_timeout_s, "workload.request_timeout_s")
        positive_finite(self.flush_timeout_s, "workload.flush_timeout_s")
        positive_finite(self.stall_timeout_s, "workload.stall_timeout_s")
        if self.deadline_s is not None:
            positive_finite(self.deadline_s, "workload.deadline_s")
        interval = self.server_metrics_interval_s
        if not (isinstance(interval, (int, float)) and math.isfinite(interval)
                and (interval == 0 or interval >= SERVER_METRICS_MIN_INTERVAL_S)):
            raise ConfigError(f"workload.server_metrics_interval_s={interval} must be 0 (no scrape) or a finite "
                              f"number >= {SERVER_METRICS_MIN_INTERVAL_S}")
        self.oversaturation.validate()
        if not (math.isfinite(self.max_failed_share) and 0 <= self.max_failed_share <= 1):
            raise ConfigError(f"workload.max_failed_share={self.max_failed_share} must be a share in [0, 1]")
        at_least(self, "workload.", ("seed",), 0)
        at_least(self, "workload.", ("concurrency",), 1)

    def request_tokens(self) -> tuple[int, str] | None:
        """The most tokens (prompt + output) one request can need, as far as the config fixes
        it, and the fields that set it; None where only the data does. Checked against the
        model's context when the config is composed."""
        return None

    def check_model(self, model: ModelConfig) -> None:
        """ConfigError where one request, as far as the config fixes it, is longer than
        `model`'s context: every server would refuse it; say so before a plan of millions of
        tokens is drawn."""
        need = self.request_tokens()
        if need is not None and need[0] > model.max_position_embeddings:
            raise ConfigError(
                f"{need[1]} = {need[0]} tokens per request is more than model={model.name}'s context length "
                f"(model.max_position_embeddings={model.max_position_embeddings}); shorten the requests or "
                f"choose a model with a longer context")

    def needs_server_info(self) -> bool:
        """Whether the plan depends on the server (planned again once it answers)."""
        return False

    def limits(self) -> list[str]:
        """Caveats of this workload that every run.json of it carries."""
        return []

    def plan(self, model: ModelConfig, server_info: dict | None = None) -> WorkloadPlan:
        """The request stream for `model` (remnant.workloads.plan_workload checks it against
        the model's context). server_info: the server's /server_info, for workloads sized
        by the server; None plans without it."""
        raise NotImplementedError(f"workload kind {self.kind} has no plan()")


#: Workload kinds: remnant/workloads/<kind>.py registers its WorkloadConfig subclass.
WORKLOADS = Kinds("workload", "remnant.workloads")
