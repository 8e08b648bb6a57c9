"""The over-saturation stop: its rule over series, and a run it stops against a real
loopback server whose queue (as its /metrics report it) grows."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

from remnant.client.oversaturation import Point, oversaturated
from remnant.workloads.base import OversaturationConfig
from tests.loopback import loopback_server

RULE = OversaturationConfig(enabled=True, window_s=30.0, queue_slope=0.5, goodput_drop=0.5)


def _series(seconds: float, waiting, tokens_per_s=lambda t: 100.0, held=lambda t: True, step: float = 0.5):
    """Points every `step` s: the server's queue, the client's cumulative output tokens."""
    points, tokens = [], 0.0
    for k in range(int(seconds / step) + 1):
        t = k * step
        points.append(Point(t, float(waiting(t)), 0, 8.0, 16, int(tokens), held(t)))
        tokens += tokens_per_s(t) * step
    return points


def _noise(t: float) -> float:
    return 2.0 * math.sin(7.3 * t) + math.sin(1.9 * t)


def test_a_queue_that_keeps_rising_stops_the_run_once_a_window_has_run():
    stop = oversaturated(_series(60, lambda t: max(0.0, 0.8 * t + _noise(t))), RULE)
    assert stop is not None and stop["rule"] == "queue"
    assert stop["to_s"] == pytest.approx(30.0) and stop["from_s"] == pytest.approx(0.0)
    assert stop["waiting_slope"] == pytest.approx(0.8, abs=0.1) and stop["queue_slope"] == 0.5
    quarters = stop["waiting_quarters"]
    assert all(a < b for a, b in zip(quarters, quarters[1:]))
    assert stop["server_queue"] > 15 and stop["client_backlog"] == 0 and stop["running"] == 8.0
    # The same queue, open loop with no /metrics: the client's own backlog carries it.
    held_back = [Point(p.t, None, int(p.server_queue), None, 16, p.tokens, True)
                 for p in _series(60, lambda t: max(0.0, 0.8 * t))]
    stop = oversaturated(held_back, RULE)
    assert stop["rule"] == "queue" and stop["server_queue"] is None and stop["client_backlog"] >= 23


@pytest.mark.parametrize("waiting", [
    lambda t: 5 + _noise(t),                                   # steady, noisy
    lambda t: min(t, 12.0) + _noise(t) / 2,                    # a ramp-up, then steady
    lambda t: 20.0 if 40 <= t < 46 else 0.0,                   # one burst, drained
    lambda t: 0.3 * t,                                         # rising, slower than queue_slope
    lambda t: 0.0,
], ids=["steady", "ramp-then-steady", "burst", "slow-rise", "empty"])
def test_a_queue_that_does_not_keep_rising_never_stops_the_run(waiting):
    assert oversaturated(_series(180, waiting), RULE) is None


def test_nothing_is_judged_before_the_phase_has_run_a_window():
    assert oversaturated(_series(29, lambda t: 5.0 * t), RULE) is None
    # Times since the client started: a phase that started at 100 s is judged from 130 s.
    points = [Point(p.t + 100, p.server_queue, 0, None, 1, p.tokens, True) for p in _series(40, lambda t: t)]
    assert oversaturated(points, RULE, phase_start_s=100.0)["to_s"] == pytest.approx(130.0)


def test_goodput_that_collapses_under_held_load_stops_the_run():
    stop = oversaturated(_series(120, lambda t: 4.0, tokens_per_s=lambda t: 100.0 if t < 50 else 20.0), RULE)
    assert stop is not None and stop["rule"] == "goodput"
    assert stop["best_output_tok_s"] == pytest.approx(100.0, rel=0.05)
    assert stop["output_tok_s"] < 50.0 and stop["held_share"] == 1.0 and stop["goodput_drop"] == 0.5
    # Off with goodput_drop=0; and a slower phase within the share is no collapse.
    off = OversaturationConfig(enabled=True, goodput_drop=0.0)
    assert oversaturated(_series(120, lambda t: 4.0, tokens_per_s=lambda t: 100.0 if t < 50 else 20.0), off) is None
    assert oversaturated(_series(120, lambda t: 4.0, tokens_per_s=lambda t: 100.0 if t < 50 else 60.0), RULE) is None


def test_goodput_that_falls_as_the_workload_runs_out_is_no_collapse():
    """The phase's last requests drain: the client no longer holds its load."""
    series = _series(120, lambda t: 0.0, tokens_per_s=lambda t: 100.0 if t < 80 else 10.0, held=lambda t: t < 80)
    assert oversaturated(series, RULE) is None


class _SlowQueue(BaseHTTPRequestHandler):
    """A server that runs two requests at a time, 4 tokens 0.1 s apart each (5 requests/s at
    most), queues the rest, and reports both on /metrics in SGLang's names."""

    lock = threading.Lock()
    slots = threading.Semaphore(2)
    closed = threading.Event()
    waiting = running = 0

    def _reply(self, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        cls = type(self)
        if self.path == "/metrics":
            with cls.lock:
                w, r = cls.waiting, cls.running
            self._reply((f"# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{{tp_rank=\"0\"}} {w}\n"
                         f"# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{{tp_rank=\"0\"}} {r}\n"
                         f"sglang:token_usage{{tp_rank=\"0\"}} {r / 2}\n").encode(), "text/plain; version=0.0.4")
        else:
            self._reply(b"{}")

    def do_POST(self):  # noqa: N802
        cls = type(self)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path != "/generate":
            self._reply(b"")
            return
        with cls.lock:
            cls.waiting += 1
        while not cls.slots.acquire(timeout=0.05):
            if cls.closed.is_set():
                with cls.lock:
                    cls.waiting -= 1
                return
        with cls.lock:
            cls.waiting -= 1
            cls.running += 1
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(4):
                time.sleep(0.1)
                frame = {"text": "x", "output_ids": [i], "meta_info": {
                    "prompt_tokens": 8, "completion_tokens": i + 1, "cached_tokens": 0,
                    "finish_reason": {"type": "length"} if i == 3 else None}}
                self.wfile.write(b"data: " + json.dumps(frame).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        except OSError:
            pass  # the client stopped and closed its connection
        finally:
            with cls.lock:
                cls.running -= 1
            cls.slots.release()

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_a_run_past_saturation_ends_early_saying_which_rule_and_what_it_measured(tmp_path):
    """Open loop at 25 requests/s against a server that serves 5/s: its queue, as its
    /metrics give it, grows some 20 a second, and the run stops after one 1.5 s window."""
    from remnant.config import ModelConfig, RunConfig
    from remnant.hosts.external import ExternalHostConfig
    from remnant.records.schema import validate
    from remnant.run import execute_run
    from remnant.workloads.random import RandomWorkloadConfig

    with loopback_server(_SlowQueue) as url:
        w = RandomWorkloadConfig(input_len=8, output_len=4, concurrency=256, warmup_requests=0, measured_requests=400,
                                 request_rate=25.0, arrival="constant", server_metrics_interval_s=0.1,
                                 oversaturation=OversaturationConfig(enabled=True, window_s=1.5, queue_slope=2.0))
        cfg = RunConfig(workload=w, host=ExternalHostConfig(base_url=url), model=ModelConfig())
        cfg.workload.validate()
        t = time.monotonic()
        try:
            outcome = execute_run(cfg, tmp_path / "run", progress=False)
        finally:
            _SlowQueue.closed.set()
        took = time.monotonic() - t
    doc = json.loads(outcome.path.read_text())
    validate(doc)
    assert took < 10, "the stop came late"  # 400 arrivals at 25/s would take 16 s
    assert doc["status"] == "failed" and doc["metrics"] is None
    assert doc["error"]["stage"] == "client" and doc["error"]["type"] == "Oversaturated"
    stop = doc["client_stop"]
    assert stop["reason"] == "oversaturated" and stop["limit_s"] == 1.5 and stop["phase"] == "measured"
    measured = stop["oversaturation"]
    assert measured["rule"] == "queue" and measured["waiting_slope"] >= 2.0
    assert measured["server_queue"] >= 10 and measured["running"] == 2
    assert measured["client_backlog"] <= 1  # an arrival due that instant; slots were free
    assert measured["to_s"] == stop["at_s"] and measured["from_s"] == pytest.approx(stop["at_s"] - 1.5)
    assert doc["error"]["message"].startswith("the server was over-saturated in the measured phase: the requests "
                                              "waiting rose")
    (limit,) = [line for line in doc["limits"] if "over-saturated" in line]
    assert limit.startswith(f"the run was stopped early at {stop['at_s']:.1f}s in its measured phase, the server "
                            "over-saturated: the requests waiting rose")
    assert "at least workload.oversaturation.queue_slope=2, each quarter above the one before (means " in limit
    # The requests in flight were recorded as stopped; the server's series is kept,
    # summarized over the measured phase as far as it ran.
    recs = [json.loads(line) for line in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert sum(r["error"] == "stopped: the server was over-saturated (workload.oversaturation)" for r in recs) \
        == stop["in_flight"] > 10
    sm = doc["server_metrics"]
    assert sm["phase"] == "measured" and sm["to_s"] == pytest.approx(stop["at_s"], abs=0.1)
    assert sm["queue_depth"]["peak"] >= measured["server_queue"] and sm["running_requests"]["peak"] == 2
