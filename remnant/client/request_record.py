"""One line of requests.jsonl: what the client saw of one request.

Times are seconds on the client's monotonic clock, relative to the start of the run
(`t0` of the client), so records of one run compare directly and a crash loses nothing
already written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """Client-side record of one /generate request.

    id: request id sent to the server (unique within a run).
    phase: "warmup" or "measured".
    intended_start_s / start_s / end_s: when the request should have been sent, when it
        was sent, and when its last byte arrived (s since the client's t0). Intended is
        when its concurrency slot (or its user) became free, and in open loop not before
        scheduled_s, so start_s - intended_start_s (dispatch delay) is the client's lag alone.
    scheduled_s: open loop (workload.request_rate): when it arrived by the schedule; it
        waits from then to intended_start_s while `concurrency` requests are in flight.
        None in closed loop.
    ttft_s: time from send to the first chunk that carried a token (None if none came).
    chunk_times_s: arrival of every chunk that carried new tokens (s since t0).
    chunk_tokens: new tokens in each of those chunks (same length as chunk_times_s).
    prompt_tokens / completion_tokens / cached_tokens: from the server's meta_info.
    """

    id: str
    phase: str
    index: int
    intended_start_s: float
    start_s: float = 0.0
    end_s: float | None = None
    success: bool = False
    error: str | None = None
    ttft_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    expected_output_tokens: int | None = None
    session: str | None = None  # sessions workloads: which session and turn index
    turn: int | None = None
    scheduled_s: float | None = None

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency in seconds, None for a request that never finished."""
        return None if self.end_s is None else self.end_s - self.start_s

    def to_dict(self) -> dict:
        """Every field, lists copied, plus e2e_s: as dataclasses.asdict gives them, without
        its per-element deep copy (a 512-token record held 1024 deep-copied numbers)."""
        d = {f: getattr(self, f) for f in _FIELDS}
        d["chunk_times_s"] = list(self.chunk_times_s)
        d["chunk_tokens"] = list(self.chunk_tokens)
        d["e2e_s"] = self.e2e_s
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RequestRecord":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord))
