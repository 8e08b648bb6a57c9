"""What a workload hands the client: phases of planned requests, and a fingerprint."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

import numpy as np

from remnant.config import ARRIVALS


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
