"""The over-saturation stop: a run that drives its server past what it sustains ends early.

Past saturation a benchmark measures its own backlog: requests wait longer the longer the
run goes, so its latencies say how long it ran, not how the server serves. The client's
watchdog (`remnant.client.runner.LoadClient._watch`) takes a `Point` of each phase about
every `window_s / 30` s (at most 1 s apart) and `Detector.add` checks two rules over the
trailing `window_s` (workload.oversaturation; docs/workloads.md has the why):

- queue: the waiting requests, the server's queue (sglang:num_queue_reqs from its
  /metrics, the latest scrape) plus arrivals past due that the client holds for a free
  slot (open loop), rise at `queue_slope` req/s or more (least-squares slope over the
  window) and the mean of each quarter of the window is above the quarter before (rising
  throughout, not one burst);
- goodput: the client kept its load up (every slot busy or arrivals waiting) through at
  least 90 % of the window, and the output tokens/s it received over the window fell
  below `goodput_drop` of the best window of the phase so far (the best holding at least
  `MIN_BEST_TOKENS` tokens, so that a few slow requests at small counts are no collapse).

Neither rule looks before the phase has run `window_s`. `oversaturated(points, rule)` is
the same check as a pure function over a whole series.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from remnant.workloads.base import OversaturationConfig

#: The goodput rule compares against a best window of at least this many output tokens.
MIN_BEST_TOKENS = 64
#: Share of a window's points in which the client must have held its load (goodput rule).
HELD_SHARE = 0.9
#: Points per window (the watchdog's cadence), and the longest gap between two points.
POINTS_PER_WINDOW = 30
MAX_POINT_GAP_S = 1.0


def point_step_s(rule: OversaturationConfig) -> float:
    """How often the watchdog takes a point for `rule`."""
    return min(MAX_POINT_GAP_S, rule.window_s / POINTS_PER_WINDOW)


@dataclass(frozen=True)
class Point:
    """What the client and the server held at `t` (s since the client started).

    server_queue / running: sglang:num_queue_reqs / num_running_reqs of the latest scrape
    (None: no /metrics). client_backlog: arrivals past due still waiting for a slot.
    in_flight: requests sent and not answered. tokens: output tokens received in the phase
    so far. held: the client offered all it could (every slot busy or arrivals waiting).
    """

    t: float
    server_queue: float | None
    client_backlog: int
    running: float | None
    in_flight: int
    tokens: int
    held: bool

    @property
    def waiting(self) -> float:
        return (self.server_queue or 0.0) + self.client_backlog


def _slope(ts: list[float], ys: list[float]) -> float:
    n = len(ts)
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    return 0.0 if var == 0 else sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var


class Detector:
    """The rules over one phase's points, fed in time order; `add` returns the measured
    values of the first rule that holds (client_stop.oversaturation), else None."""

    def __init__(self, rule: OversaturationConfig, phase_start_s: float):
        self.rule = rule
        self.phase_start_s = phase_start_s
        self._points: deque[Point] = deque()
        self._best: float | None = None  # best output tokens/s over one window of the phase
        self._best_tokens = 0

    def add(self, p: Point) -> dict | None:
        w = self.rule.window_s
        self._points.append(p)
        # Keep one point at or before the window's start: the base of its token count.
        while len(self._points) >= 2 and self._points[1].t <= p.t - w:
            self._points.popleft()
        base = self._points[0]
        if p.t - self.phase_start_s < w or base.t > p.t - w + w / POINTS_PER_WINDOW:
            return None  # the phase has not run a whole window yet
        span = p.t - base.t
        tokens = p.tokens - base.tokens
        rate = tokens / span if span > 0 else 0.0
        window = [q for q in self._points if q.t >= p.t - w]
        held = sum(q.held for q in window) / len(window)
        ts, ys = [q.t for q in window], [q.waiting for q in window]
        slope = _slope(ts, ys)
        quarters = []
        for k in range(4):
            lo, hi = p.t - w + k * w / 4, p.t - w + (k + 1) * w / 4
            qs = ys[bisect_left(ts, lo): bisect_left(ts, hi) if k < 3 else len(ts)]
            quarters.append(sum(qs) / len(qs) if qs else None)
        rising = None not in quarters and all(a < b for a, b in zip(quarters, quarters[1:]))
        best = self._best
        values = {
            "rule": None, "window_s": w, "from_s": p.t - w, "to_s": p.t,
            "waiting_slope": slope, "queue_slope": self.rule.queue_slope,
            "waiting_quarters": quarters if None not in quarters else None,
            "server_queue": p.server_queue, "client_backlog": p.client_backlog, "running": p.running,
            "in_flight": p.in_flight, "held_share": held,
            "output_tok_s": rate, "best_output_tok_s": best, "goodput_drop": self.rule.goodput_drop,
        }
        if slope >= self.rule.queue_slope and rising:
            return {**values, "rule": "queue"}
        if (self.rule.goodput_drop > 0 and best is not None and self._best_tokens >= MIN_BEST_TOKENS
                and held >= HELD_SHARE and rate < self.rule.goodput_drop * best):
            return {**values, "rule": "goodput"}
        if best is None or rate > best:
            self._best, self._best_tokens = rate, tokens
        return None


def oversaturated(points: Iterable[Point], rule: OversaturationConfig, phase_start_s: float = 0.0) -> dict | None:
    """The first stop `rule` makes over a phase's series of points, or None."""
    detector = Detector(rule, phase_start_s)
    for p in points:
        stop = detector.add(p)
        if stop is not None:
            return stop
    return None


def describe(values: dict) -> str:
    """The rule that stopped the run and what it measured, in one line."""
    w = values["window_s"]
    if values["rule"] == "queue":
        q = ", ".join(f"{v:.1f}" for v in values["waiting_quarters"])
        server = "an unknown number (no /metrics)" if values["server_queue"] is None else f"{values['server_queue']:g}"
        return (f"the requests waiting rose {values['waiting_slope']:.2f} req/s over the last {w:g}s, at least "
                f"workload.oversaturation.queue_slope={values['queue_slope']:g}, each quarter above the one before "
                f"(means {q}); at the stop {server} waited in the server's queue and {values['client_backlog']} "
                "past their arrival time in the client's, not yet sent")
    return (f"the output the client received fell to {values['output_tok_s']:.1f} tok/s over the last {w:g}s, "
            f"below workload.oversaturation.goodput_drop={values['goodput_drop']:g} of the phase's best window "
            f"({values['best_output_tok_s']:.1f} tok/s), its load held {values['held_share']:.0%} of the window")


def stop_limit(stop: dict) -> list[str]:
    """run.json's limits line for a client stopped by the over-saturation rule ([] for
    another stop)."""
    if stop.get("reason") != "oversaturated":
        return []
    return [f"the run was stopped early at {stop['at_s']:.1f}s in its {stop['phase']} phase, the server "
            f"over-saturated: {describe(stop['oversaturation'])}. Past saturation latencies measure the backlog, so "
            "run.json has no metrics; lower workload.request_rate or workload.concurrency"]
