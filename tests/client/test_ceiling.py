"""The client ceiling benchmark: its stream server, both stream paths, the command's record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from remnant.client.ceiling import _Server, find_sglang_python
from remnant.client.metrics import load_requests_jsonl
from remnant.client.runner import LoadClient
from remnant.records.schema import validate
from remnant.workloads.base import Phase, PlannedRequest


@pytest.fixture(scope="module")
def stream_server(tmp_path_factory):
    work = tmp_path_factory.mktemp("stream-server")
    s = _Server(None, work, work / "server.log", incremental=False)
    yield s
    s.stop()


def _frames(base_url: str, n: int) -> list[dict]:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": n, "ignore_eos": True}, "stream": True}
    with httpx.stream("POST", f"{base_url}/generate", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_the_stream_server_frames_are_shaped_as_remnant_serve_frames(stream_server, server):
    ours, theirs = _frames(stream_server.base_url, 3), _frames(server.base_url, 3)
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs):
        assert list(a) == list(b)  # text, output_ids, meta_info, in that order
        assert set(a["meta_info"]) == set(b["meta_info"])
        assert a["meta_info"]["completion_tokens"] == b["meta_info"]["completion_tokens"]
        assert len(a["output_ids"]) == len(b["output_ids"])  # cumulative, as SGLang's default
    assert ours[-1]["text"].startswith(ours[0]["text"]) and len(ours[-1]["text"]) == 12
    assert ours[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert ours[0]["meta_info"]["prompt_tokens"] == 3


def _run(base_url: str, path: Path, stream: str, n: int = 6, c: int = 3, tokens: int = 40) -> list:
    reqs = [PlannedRequest(f"m-{i}", tokens, input_ids=list(range(5 + i))) for i in range(n)]
    client = LoadClient(base_url, path, progress=False, stream=stream)
    assert client.stream_path == stream
    client.run([Phase("measured", reqs, c)])
    return sorted(load_requests_jsonl(path), key=lambda r: r.id)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["remnant-serve", "stream-server"])
def test_both_stream_paths_record_the_same_requests(which, server, stream_server, tmp_path):
    url = server.base_url if which == "remnant-serve" else stream_server.base_url
    fast, ref = _run(url, tmp_path / "fast.jsonl", "fast"), _run(url, tmp_path / "httpx.jsonl", "httpx")
    keys = ("id", "success", "error", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason",
            "chunk_tokens")
    assert [[getattr(r, k) for k in keys] for r in fast] == [[getattr(r, k) for k in keys] for r in ref]
    for r in fast:
        assert r.success and r.completion_tokens == 40 and sum(r.chunk_tokens) == 40
        assert r.prompt_tokens == 5 + int(r.id.split("-")[1])
        assert r.start_s < r.start_s + r.ttft_s == r.chunk_times_s[0] <= r.chunk_times_s[-1] <= r.end_s
        assert r.chunk_times_s == sorted(r.chunk_times_s)


def test_a_proxy_for_the_url_takes_the_httpx_path(monkeypatch, tmp_path):
    monkeypatch.setenv("http_proxy", "http://proxy.invalid:3128")
    monkeypatch.setenv("no_proxy", "")
    assert LoadClient("http://10.1.2.3:30000", tmp_path / "r.jsonl").stream_path == "httpx"
    monkeypatch.setenv("no_proxy", "10.1.2.3")
    assert LoadClient("http://10.1.2.3:30000", tmp_path / "r.jsonl").stream_path == "fast"
    with pytest.raises(ValueError, match="stream='h2' is not allowed; allowed: fast, httpx"):
        LoadClient("http://x", tmp_path / "r.jsonl", stream="h2")


def _ceiling(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "ceiling.json"
    p = subprocess.run([sys.executable, "-m", "remnant.cli.ceiling", "--concurrency", "2", "--requests", "4",
                        "--input-len", "8", "--output-len", "16", "--out", str(out), *args],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == str(out)
    doc = json.loads(out.read_text())
    validate(doc, str(out))
    return doc


@pytest.mark.slow
def test_the_ceiling_command_writes_a_valid_record(tmp_path):
    doc = _ceiling(tmp_path, "--clients", "remnant", "--rounds", "2", "--plot", str(tmp_path / "c.png"))
    assert [(r["round"], r["client"]) for r in doc["runs"]] == [(0, "remnant"), (1, "remnant")]
    for r in doc["runs"]:
        assert (r["completed"], r["failed"], r["total_output_tokens"]) == (4, 0, 64)
        assert r["output_throughput"] > 0 and r["busy_span_s"] > 0 and r["server_cpu_share"] > 0
    (row,) = doc["summary"]
    assert row["concurrency"] == 2 and row["remnant"]["output_throughput"]["n"] == 2
    assert "sglang" not in row and doc["clients"]["sglang"] is None
    pinning = doc["machine"]["pinning"]
    assert pinning["pinned"] == (len(doc["machine"]["cpus_allowed"]) >= 2)
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_the_ceiling_command_runs_sglang_beside_and_alternates(tmp_path):
    python, why = find_sglang_python(None)
    if python is None:
        pytest.skip(f"SGLang's bench client cannot run here: {why}")
    doc = _ceiling(tmp_path, "--rounds", "2", "--sglang-python", python)
    assert [(r["round"], r["client"]) for r in doc["runs"]] == [
        (0, "remnant"), (0, "sglang"), (1, "sglang"), (1, "remnant")]
    assert all(r["completed"] == 4 and r["total_output_tokens"] == 64 for r in doc["runs"])
    (row,) = doc["summary"]
    assert row["ratio_output_throughput"]["n"] == 2 and doc["clients"]["sglang"]["version"]
