"""The load client against real servers on loopback: flush retries, phases, records."""

from __future__ import annotations

import gc
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler

import httpx
import pytest

from remnant.client.metrics import load_requests_jsonl
from remnant.client.runner import LoadClient
from remnant.workloads.base import Phase, PlannedRequest
from tests.conftest import start_server, stop_server
from tests.loopback import loopback_server, stream_generate


def _phase(name: str, n: int, c: int, tokens: int = 4) -> Phase:
    reqs = [PlannedRequest(f"{name}-{i}", tokens, input_ids=list(range(10 + i))) for i in range(n)]
    return Phase(name, reqs, c)


def test_phases_record_every_request(server, tmp_path):
    path = tmp_path / "requests.jsonl"
    client = LoadClient(server.base_url, path, progress=False)
    results = client.run([_phase("warmup", 2, 2), _phase("measured", 6, 3)])
    assert [r.name for r in results] == ["warmup", "measured"]
    assert all(r.flush.ok and r.flush.status_code == 200 for r in results)
    recs = load_requests_jsonl(path)
    assert len(recs) == 8 and all(r.success for r in recs)
    for r in recs:
        assert r.completion_tokens == 4 and sum(r.chunk_tokens) == 4
        assert r.prompt_tokens == 10 + int(r.id.split("-")[1])
        assert r.start_s >= r.intended_start_s and r.end_s > r.start_s
        assert r.ttft_s == pytest.approx(r.chunk_times_s[0] - r.start_s)
    measured = [r for r in recs if r.phase == "measured"]
    assert min(r.start_s for r in measured) > max(r.end_s for r in recs if r.phase == "warmup")


@pytest.mark.parametrize("stream", LoadClient.STREAMS)
def test_every_request_carries_the_api_key(tiny_model_dir, tmp_path, stream):
    key = "sk-client-test-key-42"
    secured = start_server(tiny_model_dir, tmp_path, env={**os.environ, "REMNANT_API_KEY": key})
    try:
        client = LoadClient(secured.base_url, tmp_path / "r.jsonl", progress=False, stream=stream, api_key=key)
        (res,) = client.run([_phase("measured", 3, 2)])
        assert res.flush.ok and res.failed == 0
        anonymous = LoadClient(secured.base_url, tmp_path / "anon.jsonl", progress=False, stream=stream)
        (res,) = anonymous.run([_phase("measured", 1, 1)])
    finally:
        stop_server(secured)
    assert res.flush.status_code == 401 and res.failed == 1
    assert res.records[0].error.startswith("HTTP 401: Unauthorized: no API key")


def test_concurrency_limit_is_respected(server, tmp_path):
    client = LoadClient(server.base_url, tmp_path / "r.jsonl", progress=False)
    (res,) = client.run([_phase("measured", 9, 3, tokens=6)])
    spans = [(r.start_s, r.end_s) for r in res.records]
    in_flight = [sum(1 for s, e in spans if s <= t < e) for t, _ in spans]
    assert max(in_flight) == 3  # the limit is reached, never passed


def test_flush_retries_while_requests_run(server, tmp_path):
    long = threading.Thread(target=lambda: httpx.post(
        f"{server.base_url}/generate",
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 150, "ignore_eos": True}},
        timeout=120))
    long.start()
    deadline = time.monotonic() + 10
    while httpx.post(f"{server.base_url}/flush_cache").status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    client = LoadClient(server.base_url, tmp_path / "r.jsonl", flush_timeout_s=120, progress=False)
    import asyncio

    async def flush():
        async with httpx.AsyncClient() as c:
            return await client.flush(c)

    result = asyncio.run(flush())
    long.join()
    assert result.ok and result.attempts > 1 and result.status_code == 200


class _NoFlush(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's naming
        self.send_response(404)
        self.end_headers()
        self.wfile.write(b"not found")

    def log_message(self, *args):
        pass


def test_flush_404_is_recorded_not_retried(tmp_path):
    with loopback_server(_NoFlush) as url:
        client = LoadClient(url, tmp_path / "r.jsonl", progress=False)
        (res,) = client.run([_phase("measured", 2, 1)])
    assert res.flush.ok is False and res.flush.status_code == 404 and res.flush.attempts == 1
    assert res.failed == 2
    recs = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert all(r["error"].startswith("HTTP 404") for r in recs)


class _IncrementalSSE(BaseHTTPRequestHandler):
    """A /generate that streams like SGLang with --incremental-streaming-output: each
    frame's output_ids holds only the new ids; completion_tokens counts them all."""

    def do_POST(self):  # noqa: N802
        if self.path == "/flush_cache":
            self.send_response(200)
            self.end_headers()
            return
        stream_generate(self, 5, prompt_tokens=3, incremental=True, delay_s=0.01)

    def log_message(self, *args):
        pass


def test_tokens_counted_by_completion_tokens(tmp_path):
    with loopback_server(_IncrementalSSE) as url:
        client = LoadClient(url, tmp_path / "r.jsonl", progress=False)
        (res,) = client.run([_phase("measured", 1, 1, tokens=5)])
    rec = res.records[0]
    assert rec.success and rec.chunk_tokens == [1, 1, 1, 1, 1] and rec.completion_tokens == 5


def test_dispatch_delay_counts_from_when_the_slot_freed(server, tmp_path):
    client = LoadClient(server.base_url, tmp_path / "r.jsonl", progress=False)
    (res,) = client.run([_phase("measured", 4, 1, tokens=3)])
    recs = sorted(res.records, key=lambda r: r.start_s)
    for prev, rec in zip(recs, recs[1:]):
        # One slot: each request was due when the previous one ended.
        assert rec.intended_start_s >= prev.end_s and rec.start_s >= rec.intended_start_s


def test_a_failed_turn_records_the_rest_of_its_session_as_skipped(tmp_path):
    session = [PlannedRequest(f"s-t{k}", 2, input_ids=[1, 2, 3], session="s", turn=k) for k in range(3)]
    phase = Phase("measured", session, 1, sessions=[session])
    with loopback_server(_NoFlush) as url:
        client = LoadClient(url, tmp_path / "r.jsonl", progress=False)
        (res,) = client.run([phase])
    recs = load_requests_jsonl(tmp_path / "r.jsonl")
    assert [(r.turn, r.success) for r in recs] == [(0, False), (1, False), (2, False)]
    assert recs[0].error.startswith("HTTP 404")
    assert all(r.error == "skipped: turn 0 of the session failed" for r in recs[1:])
    assert res.requests == 3 and res.failed == 3


class _SignalledClient(LoadClient):
    """Sends itself `signals` as its third record is written: inside a request's task,
    where Python runs the signal handlers."""

    def __init__(self, *args, signals: tuple[int, ...], **kwargs):
        super().__init__(*args, **kwargs)
        self.signals = signals

    def _append(self, rec) -> None:
        super()._append(rec)
        if len(self.requests_path.read_text().splitlines()) == 3:
            for sig in self.signals:
                os.kill(os.getpid(), sig)


@pytest.mark.parametrize("sig, message", [(signal.SIGTERM, "signal 15"), (signal.SIGINT, "")], ids=["sigterm", "ctrl-c"])
def test_a_signal_cancels_the_run_and_leaves_no_task_behind(server, tmp_path, caplog, sig, message):
    """remnant-run turns SIGTERM into KeyboardInterrupt; raised inside a request's task, that
    left a task's exception unretrieved and asyncio logged its traceback when the task was
    collected, after remnant-run had printed the run.json path (seen in CI)."""
    from remnant.run import _sigterm_as_interrupt

    path = tmp_path / "r.jsonl"
    client = _SignalledClient(server.base_url, path, progress=False, signals=(sig,))
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    sigint_before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(KeyboardInterrupt) as raised:
            client.run([_phase("measured", 40, 2)])
        assert str(raised.value) == message
        del raised  # its traceback would keep a stray task alive past gc.collect()
        # The caller's handlers are back.
        assert signal.getsignal(signal.SIGTERM) is _sigterm_as_interrupt
        assert signal.getsignal(signal.SIGINT) is sigint_before
    finally:
        signal.signal(signal.SIGTERM, previous)
    gc.collect()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
    recs = load_requests_jsonl(path)
    assert 3 <= len(recs) < 40 and all(r.success for r in recs)


def test_a_second_signal_breaks_out_at_once(server, tmp_path):
    path = tmp_path / "r.jsonl"
    sigint_before, sigterm_before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    client = _SignalledClient(server.base_url, path, progress=False, signals=(signal.SIGINT, signal.SIGTERM))
    with pytest.raises(KeyboardInterrupt):
        client.run([_phase("measured", 40, 2)])
    assert signal.getsignal(signal.SIGINT) is sigint_before and signal.getsignal(signal.SIGTERM) is sigterm_before
    assert 3 <= len(load_requests_jsonl(path)) < 40


class _SlowStream(BaseHTTPRequestHandler):
    """A /generate that streams 200 tokens, one every 50 ms (10 s a request)."""

    def do_POST(self):  # noqa: N802
        if self.path == "/flush_cache":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        try:
            stream_generate(self, 200, prompt_tokens=3, incremental=False, delay_s=0.05)
        except OSError:
            pass  # the client hung up

    def log_message(self, *args):
        pass


def test_the_deadline_stops_the_run_and_records_what_was_in_flight(tmp_path):
    from remnant.client.runner import ClientStopped

    with loopback_server(_SlowStream) as url:
        client = LoadClient(url, tmp_path / "r.jsonl", progress=False, deadline_s=1.0, stall_timeout_s=30)
        t0 = time.monotonic()
        with pytest.raises(ClientStopped) as stopped:
            client.run([_phase("measured", 6, 2, tokens=200)])
        elapsed = time.monotonic() - t0
    assert elapsed < 5, elapsed  # not the 30 s the two requests would take
    stop = stopped.value.stop
    assert stop["reason"] == "deadline" and stop["limit_s"] == 1.0 and stop["in_flight"] == 2
    assert 1.0 <= stop["at_s"] < 2 and 0 < stop["last_progress_s"] <= stop["at_s"]
    assert "workload.deadline_s=1" in str(stopped.value)
    phase = stopped.value.phase
    assert (phase.name, phase.requests, phase.failed) == ("measured", 2, 2)
    recs = load_requests_jsonl(tmp_path / "r.jsonl")
    assert [r.error for r in recs] == ["stopped: workload.deadline_s=1 passed"] * 2
    assert all(r.chunk_times_s for r in recs)  # the tokens that came before are kept


class _Hangs(BaseHTTPRequestHandler):
    """Answers /flush_cache; takes /generate and never answers it (a hung server)."""

    def do_POST(self):  # noqa: N802
        if self.path == "/flush_cache":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        time.sleep(5)

    def log_message(self, *args):
        pass


def test_a_stalled_server_stops_the_client_with_the_stall_times(tmp_path):
    from remnant.client.runner import ClientStopped

    with loopback_server(_Hangs) as url:
        client = LoadClient(url, tmp_path / "r.jsonl", progress=False, stall_timeout_s=0.5)
        with pytest.raises(ClientStopped) as stopped:
            client.run([_phase("measured", 4, 2)])
    stop = stopped.value.stop
    assert (stop["reason"], stop["in_flight"], stop["last_progress_s"], stop["phase"]) == ("stall", 2, None, "measured")
    assert 0.5 <= stop["at_s"] < 2
    assert "no token or response for 0.5s with requests in flight" in str(stopped.value)
    assert "it never answered" in str(stopped.value)
    recs = load_requests_jsonl(tmp_path / "r.jsonl")
    assert len(recs) == 2 and all(r.error == "stopped: no answer from the server for 0.5s (stall)" for r in recs)


def test_requests_that_time_out_one_after_another_do_not_hide_a_stall(tmp_path):
    """One request at a time, each timing out before the stall limit: the server never
    answers, so the quiet time adds up across them and the stall is still found."""
    from remnant.client.runner import ClientStopped

    with loopback_server(_Hangs) as url:
        client = LoadClient(url, tmp_path / "r.jsonl", progress=False, request_timeout_s=0.3, stall_timeout_s=1.0)
        with pytest.raises(ClientStopped) as stopped:
            client.run([_phase("measured", 20, 1)])
    assert stopped.value.stop["reason"] == "stall" and stopped.value.stop["at_s"] < 3
    recs = load_requests_jsonl(tmp_path / "r.jsonl")
    assert len(recs) >= 3 and [r.error for r in recs[:3]] == [
        "ReadTimeout: no data for 0.3s (workload.request_timeout_s)"] * 3


def test_a_read_timeout_says_which_limit_it_hit(tmp_path):
    with loopback_server(_Hangs) as url:
        client = LoadClient(url, tmp_path / "r.jsonl", progress=False, request_timeout_s=0.3)
        (res,) = client.run([_phase("measured", 1, 1)])
    assert res.records[0].error == "ReadTimeout: no data for 0.3s (workload.request_timeout_s)"


class _NotImplemented(BaseHTTPRequestHandler):
    """http.server's own answer to a POST it has no handler for: 501 with an HTML page."""

    def log_message(self, *args):
        pass


def test_an_html_error_page_becomes_its_status_and_a_short_snippet(tmp_path):
    from remnant.client.runner import SNIPPET_CHARS, snippet

    with loopback_server(_NotImplemented) as url:
        client = LoadClient(url, tmp_path / "r.jsonl", progress=False)
        (res,) = client.run([_phase("measured", 1, 1)])
    error = res.records[0].error
    assert error.startswith("HTTP 501: Error response Error code: 501 Message: Unsupported method ('POST')")
    assert "<" not in error and len(error) <= len("HTTP 501: ") + SNIPPET_CHARS
    assert res.flush.message.startswith("Error response Error code: 501") and "<" not in res.flush.message
    assert snippet('{"error": {"message": "bad rid", "type": "x"}}') == "bad rid"
    assert snippet('{"detail": "Not Found"}') == "Not Found"
    assert snippet("a\n  b " + "c" * 500).endswith("...") and len(snippet("c" * 500)) == SNIPPET_CHARS


def _open_phase(n: int, c: int, arrivals: list[float], tokens: int = 4) -> Phase:
    phase = _phase("measured", n, c, tokens)
    phase.arrivals_s = arrivals
    return phase


def test_open_loop_sends_each_request_at_its_arrival(server, tmp_path):
    """Constant arrivals 50 ms apart, more slots than requests: each request is due at its
    arrival, sent then, and the record says when it was scheduled, intended and sent."""
    arrivals = [0.05 * i for i in range(8)]
    client = LoadClient(server.base_url, tmp_path / "r.jsonl", progress=False)
    (res,) = client.run([_open_phase(8, 8, arrivals)])
    recs = sorted(res.records, key=lambda r: r.index)
    assert all(r.success for r in recs)
    for r, a in zip(recs, arrivals):
        assert r.scheduled_s == pytest.approx(res.started_at_s + a)
        assert r.intended_start_s == r.scheduled_s  # a slot was free: no wait for the cap
        # Late by the event loop's wake-up at most, never early.
        assert 0 <= r.start_s - r.scheduled_s < 0.05
    assert res.loop_cpu_s > 0 and res.process_cpu_s >= res.loop_cpu_s * 0.5


def test_open_loop_arrivals_wait_for_the_concurrency_cap(server, tmp_path):
    """Four requests arriving at once with one slot: sent one after another, each intended
    when the previous ended (not at its arrival), so the wait is queueing, not client lag."""
    client = LoadClient(server.base_url, tmp_path / "r.jsonl", progress=False)
    (res,) = client.run([_open_phase(4, 1, [0.0] * 4, tokens=6)])
    recs = sorted(res.records, key=lambda r: r.start_s)
    for before, after in zip(recs, recs[1:]):
        assert after.start_s >= before.end_s
        assert after.intended_start_s >= before.end_s > after.scheduled_s
        assert after.start_s - after.intended_start_s < 0.05


def test_open_loop_sessions_start_at_their_arrivals(server, tmp_path):
    """Sessions phases take arrivals per session: a session's first turn is due at its
    arrival (recorded as scheduled_s), later turns after the previous answer (no schedule)."""
    sessions = [[PlannedRequest(f"s{s}-t{t}", 3, input_ids=list(range(8 + t)), session=f"s{s}", turn=t)
                 for t in range(2)] for s in range(3)]
    phase = Phase("measured", [r for s in sessions for r in s], 3, sessions=sessions, arrivals_s=[0.0, 0.3, 0.6])
    client = LoadClient(server.base_url, tmp_path / "r.jsonl", progress=False)
    (res,) = client.run([phase])
    recs = {r.id: r for r in res.records}
    assert all(r.success for r in recs.values())
    for s, arrival in enumerate((0.0, 0.3, 0.6)):
        first, second = recs[f"s{s}-t0"], recs[f"s{s}-t1"]
        assert first.scheduled_s == pytest.approx(res.started_at_s + arrival)
        # Intended when its user was free, not before its arrival: here at the arrival, or
        # for the first (due at the phase start) when the user started, a moment after.
        assert 0 <= first.intended_start_s - first.scheduled_s < 0.05
        assert 0 <= first.start_s - first.intended_start_s < 0.05
        assert second.scheduled_s is None and second.intended_start_s >= first.end_s
