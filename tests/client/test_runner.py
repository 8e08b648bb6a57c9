"""The load client against real servers on loopback: flush retries, phases, records."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from remnant.client.metrics import load_requests_jsonl
from remnant.client.runner import LoadClient
from remnant.workloads.base import Phase, PlannedRequest


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


def test_concurrency_limit_is_respected(server, tmp_path):
    client = LoadClient(server.base_url, tmp_path / "r.jsonl", progress=False)
    (res,) = client.run([_phase("measured", 9, 3, tokens=6)])
    spans = [(r.start_s, r.end_s) for r in res.records]
    for t, _ in spans:
        in_flight = sum(1 for s, e in spans if s <= t < e)
        assert in_flight <= 3


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
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _NoFlush)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        client = LoadClient(f"http://127.0.0.1:{srv.server_port}", tmp_path / "r.jsonl", progress=False)
        (res,) = client.run([_phase("measured", 2, 1)])
    finally:
        srv.shutdown()
    assert res.flush.ok is False and res.flush.status_code == 404 and res.flush.attempts == 1
    assert res.failed == 2
    recs = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert all(r["error"].startswith("HTTP 404") for r in recs)
