"""What a workload hands the client: phases of planned requests, and a fingerprint."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field


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


@dataclass
class WorkloadPlan:
    name: str
    seed: int
    phases: list[Phase]
    params: dict = field(default_factory=dict)
    dataset: dict | None = None  # {"path", "sha256"} when read from a file

    def fingerprint(self) -> str:
        """sha256 of the exact request stream: equal fingerprints mean identical requests."""
        h = hashlib.sha256()
        for phase in self.phases:
            h.update(json.dumps([phase.name, phase.concurrency, phase.flush_before]).encode())
            for r in phase.requests:
                h.update(json.dumps(asdict(r), sort_keys=True).encode())
            for session in phase.sessions or []:
                h.update(json.dumps([r.id for r in session]).encode())
        return h.hexdigest()

    def counts(self) -> dict:
        counts = {"warmup": 0, "measured": 0}
        for phase in self.phases:
            counts[phase.name] = counts.get(phase.name, 0) + len(phase.requests)
        return counts
