"""The server's /metrics while a run drives it: the parser on SGLang's exposition, the
scraper against real servers on loopback, and run.json's summary from real runs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest

from remnant.client.server_metrics import (
    CACHE_HIT_RATE,
    KV_USAGE,
    QUEUE,
    RUNNING,
    ServerMetricsScraper,
    flatten,
    parse_prometheus,
    summarize,
)
from remnant.client.runner import PhaseResult
from tests.loopback import GenerateServer, loopback_server

BIN = Path(sys.executable).parent

# What SGLang 0.5.18 answers on /metrics (--enable-metrics), as prometheus_client's
# MultiProcessCollector writes it: the names, help texts and labels of its
# SchedulerMetricsCollector and TokenizerMetricsCollector (sglang/srt/observability/
# metrics_collector.py), rendered by prometheus_client with a few values set (its label
# order is alphabetical; here the extra label comes first, which the format allows).
_LABELS = 'engine_type="unified",model_name="deepseek-ai/DeepSeek-V4-Flash",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
SGLANG_METRICS = f"""\
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{{{_LABELS}}} 0.3
sglang:time_to_first_token_seconds_bucket{{le="0.1",{_LABELS}}} 0.0
sglang:time_to_first_token_seconds_bucket{{le="+Inf",{_LABELS}}} 1.0
sglang:time_to_first_token_seconds_count{{{_LABELS}}} 1.0
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{{_LABELS}}} 8.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{{_LABELS}}} 3.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{{{_LABELS}}} 0.42
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{{{_LABELS}}} 0.25
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{{is_streaming="true",{_LABELS}}} 4096.0
sglang:prompt_tokens_total{{is_streaming="false",{_LABELS}}} 1024.0
# HELP sglang:cached_tokens_total Number of cached prompt tokens by source (device/host/storage).
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{{cache_source="device",{_LABELS}}} 300.0
sglang:cached_tokens_total{{cache_source="host",{_LABELS}}} 100.0
sglang:cached_tokens_total{{cache_source="total",{_LABELS}}} 400.0
# HELP sglang:num_requests_total Number of requests processed.
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{{is_streaming="true",{_LABELS}}} 12.0
"""


def test_sglangs_exposition_becomes_one_value_per_gauge_and_counter():
    samples, types = parse_prometheus(SGLANG_METRICS)
    assert types[QUEUE] == "gauge" and types["sglang:time_to_first_token_seconds"] == "histogram"
    running = next(s for s in samples if s.name == RUNNING)
    assert running.value == 8.0 and running.labels["tp_rank"] == "0"
    assert running.labels["model_name"] == "deepseek-ai/DeepSeek-V4-Flash"
    # Counters summed over is_streaming; cached tokens by cache_source="total" alone (not
    # device + host + total); the histogram's series left out.
    assert flatten(samples, types) == {
        RUNNING: 8.0, QUEUE: 3.0, KV_USAGE: 0.42, CACHE_HIT_RATE: 0.25, "sglang:prompt_tokens_total": 5120.0,
        "sglang:cached_tokens_total": 400.0, "sglang:num_requests_total": 12.0}


def test_data_parallel_ranks_sum_counts_and_average_shares():
    text = "\n".join(f'{name}{{dp_rank="{r}",tp_rank="0"}} {value}' for r in (0, 1) for name, value in (
        (RUNNING, 4 + r), (KV_USAGE, 0.2 + 0.2 * r), (CACHE_HIT_RATE, 0.5)))
    assert flatten(*parse_prometheus(text)) == pytest.approx({RUNNING: 9.0, KV_USAGE: 0.3, CACHE_HIT_RATE: 0.5})


def test_the_parser_takes_the_texts_corners_and_names_a_bad_line():
    text = "\n".join([
        "# a comment, then a blank line", "",
        'm_escaped{path="C:\\\\x",quote="a \\"b\\"",nl="1\\n2",brace="}{,",} 1.5 1700000000000',
        "m_plain 2",
        "m_inf +Inf", "m_nan NaN",
        "m_exemplar_total 3 # {trace_id=\"abc\"} 1.0",
        "# TYPE m_requests_total counter", "m_requests_total 4", "# TYPE m_requests_created gauge",
        "m_requests_created 1.7e9",
        "# EOF",
    ])
    samples, types = parse_prometheus(text)
    escaped = samples[0]
    assert escaped.labels == {"path": "C:\\x", "quote": 'a "b"', "nl": "1\n2", "brace": "}{,"}
    assert escaped.value == 1.5
    # +Inf and NaN parse, and are left out of the series (JSON has neither); a counter's
    # _created gauge (prometheus_client writes one) is no metric of the server's.
    assert flatten(samples, types) == {"m_escaped": 1.5, "m_plain": 2.0, "m_exemplar_total": 3.0,
                                      "m_requests_total": 4.0}
    for bad, where in (("m{a=1} 2", "line 1: label a has no"), ("m 1\n{a=\"1\"} 2", "line 2 is not a metric sample"),
                       ("m two", "line 1: m's value 'two' is not a number"), ('m{a="1} 2', "not closed"),
                       ("m", "line 1: m has no value")):
        with pytest.raises(ValueError, match=where):
            parse_prometheus(bad)


class _Metrics(BaseHTTPRequestHandler):
    """/metrics as SGLang answers it, its queue one deeper per scrape; a Bearer key required."""

    scrapes = 0
    key = "k-123"

    def do_GET(self):  # noqa: N802
        if self.path != "/metrics" or self.headers.get("Authorization") != f"Bearer {self.key}":
            self.send_error(404 if self.path != "/metrics" else 401)
            return
        type(self).scrapes += 1
        body = SGLANG_METRICS.replace(f"sglang:num_queue_reqs{{{_LABELS}}} 3.0",
                                      f"sglang:num_queue_reqs{{{_LABELS}}} {type(self).scrapes}").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_scraper_writes_each_scrape_as_it_comes_and_stops_at_once(tmp_path):
    path = tmp_path / "server_metrics.jsonl"
    with loopback_server(_Metrics) as url:
        scraper = ServerMetricsScraper(url, path, 0.05, time.perf_counter(), api_key=_Metrics.key).start()
        deadline = time.monotonic() + 10
        while len(path.read_text().splitlines() if path.exists() else []) < 4:
            assert time.monotonic() < deadline, "no four scrapes in 10 s"
            time.sleep(0.02)
        on_disk = len(path.read_text().splitlines())  # flushed line by line while it runs
        assert on_disk >= 4 and scraper.latest() is not None
        t = time.monotonic()
        scraper.stop()
        assert time.monotonic() - t < 1.0 and not scraper._thread.is_alive()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == scraper.samples and scraper.failed == 0
    assert [s[QUEUE] for s in lines] == list(range(1, len(lines) + 1))
    ts = [s["t"] for s in lines]
    assert ts == sorted(ts) and 0.03 < (ts[-1] - ts[0]) / (len(ts) - 1) < 0.5
    assert lines[0][RUNNING] == 8.0 and lines[0]["sglang:prompt_tokens_total"] == 5120.0


def _phase(name: str, start: float, duration: float) -> PhaseResult:
    return PhaseResult(name, None, start, duration, 0, 0, [])


def test_the_summary_covers_the_measured_phase():
    samples = [{"t": float(t), KV_USAGE: t / 10, QUEUE: float(t % 3), RUNNING: 2.0, CACHE_HIT_RATE: t / 20,
                "sglang:prompt_tokens_total": 100.0 * t} for t in range(10)]
    summary, limits = summarize(samples, [_phase("warmup", 0, 2.5), _phase("measured", 3.0, 4.0)],
                                source="http://x/metrics", interval_s=1.0, path="server_metrics.jsonl")
    assert limits == []
    assert (summary["phase"], summary["from_s"], summary["to_s"], summary["samples"], summary["scrapes"]) == (
        "measured", 3.0, 7.0, 5, 10)
    assert summary["kv_usage"] == pytest.approx({"peak": 0.7, "mean": 0.5})
    assert summary["queue_depth"] == pytest.approx({"peak": 2.0, "mean": (0 + 1 + 2 + 0 + 1) / 5})
    assert summary["cache_hit_rate"] == pytest.approx({"last": 0.35, "mean": 0.25})
    # The counter's increase from the last scrape before the phase to its last within it.
    assert summary["counters"] == {"sglang:prompt_tokens_total": 500.0}
    # No measured phase (a run stopped in its warm-up): the whole series.
    summary, _ = summarize(samples, [], source="http://x/metrics", interval_s=1.0, path=None)
    assert (summary["phase"], summary["samples"], summary["to_s"]) == (None, 10, 9.0)


class _NoMetrics(GenerateServer):
    """A server with SGLang's routes but no /metrics (SGLang without --enable-metrics)."""

    routes = ("/health", "/server_info")


def test_a_server_without_metrics_is_a_limit_not_a_failure(tmp_path):
    from remnant.config import ModelConfig, RunConfig
    from remnant.hosts.external import ExternalHostConfig
    from remnant.records.schema import validate
    from remnant.run import execute_run
    from remnant.workloads.random import RandomWorkloadConfig

    with loopback_server(_NoMetrics) as url:
        cfg = RunConfig(workload=RandomWorkloadConfig(input_len=8, output_len=4, concurrency=2,
                                                      server_metrics_interval_s=0.05),
                        host=ExternalHostConfig(base_url=url), model=ModelConfig())
        cfg.workload.validate()
        outcome = execute_run(cfg, tmp_path / "run", progress=False)
        assert httpx.get(f"{url}/metrics").status_code == 404
    doc = json.loads(outcome.path.read_text())
    validate(doc)
    assert doc["status"] == "completed" and doc["server_metrics"] is None
    (limit,) = [line for line in doc["limits"] if "server metrics" in line]
    assert limit == (f"no server metrics: GET {url}/metrics answered HTTP 404 (SGLang serves it only when started "
                     "with --enable-metrics); run.json's server_metrics is null")
    assert not (tmp_path / "run" / "server_metrics.jsonl").exists()
    assert "server_metrics.jsonl" not in {a["path"] for a in doc["artifacts"]}


@pytest.mark.slow
def test_an_embedded_run_records_the_servers_metrics(tmp_path):
    """A real run of remnant-run on the embedded engine, scraping every 0.1 s."""
    run_dir = tmp_path / "run"
    p = subprocess.run([str(BIN / "remnant-run"), "workload=smoke", "workload.output_len=16",
                        "workload.server_metrics_interval_s=0.1", f"hydra.run.dir={run_dir}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    doc = json.loads((run_dir / "run.json").read_text())
    lines = [json.loads(line) for line in (run_dir / "server_metrics.jsonl").read_text().splitlines()]
    sm = doc["server_metrics"]
    assert sm["source"].startswith("http://127.0.0.1:") and sm["source"].endswith("/metrics")
    assert sm["interval_s"] == 0.1 and sm["path"] == "server_metrics.jsonl"
    assert sm["scrapes"] == len(lines) >= 5 and sm["failed"] == 0 and sm["first_error"] is None
    assert {KV_USAGE, QUEUE, RUNNING, CACHE_HIT_RATE, "sglang:generation_tokens_total"} <= set(lines[0])
    measured = next(ph for ph in doc["phases"] if ph["name"] == "measured")
    assert sm["phase"] == "measured" and sm["from_s"] == measured["started_at_s"]
    assert sm["samples"] == sum(sm["from_s"] <= s["t"] <= sm["to_s"] for s in lines) >= 1
    # The engine ran its requests two at a time (concurrency 2) and held their KV.
    assert 1 <= max(s[RUNNING] for s in lines) <= 2 and max(s[KV_USAGE] for s in lines) > 0
    assert sm["running_requests"]["peak"] <= 2 and 0 < sm["kv_usage"]["peak"] <= 1
    # Every output token the measured phase received, as the server counted it (a
    # scrape before the phase and after its last token bound the increase).
    tokens = sm["counters"]["sglang:generation_tokens_total"]
    assert 0 < tokens <= doc["metrics"]["total_output_tokens"] + 2 * 16
    artifact = next(a for a in doc["artifacts"] if a["path"] == "server_metrics.jsonl")
    assert artifact["bytes"] == (run_dir / "server_metrics.jsonl").stat().st_size
    assert not any("server metrics" in line for line in doc["limits"])
    assert subprocess.run([str(BIN / "remnant-check"), str(run_dir / "run.json")]).returncode == 0


class _InterruptedClient:
    """A LoadClient that sends itself Ctrl-C as its fourth record is written."""

    @staticmethod
    def make(*args, **kwargs):
        import os
        import signal

        from remnant.client.runner import LoadClient

        class Client(LoadClient):
            def _append(self, rec) -> None:
                super()._append(rec)
                if len(self.requests_path.read_text().splitlines()) == 4:
                    os.kill(os.getpid(), signal.SIGINT)

        return Client(*args, **kwargs)


def test_ctrl_c_stops_the_scraper_with_every_scrape_on_disk(server, tmp_path):
    from remnant.workloads.base import Phase, PlannedRequest

    path = tmp_path / "server_metrics.jsonl"
    client = _InterruptedClient.make(server.base_url, tmp_path / "requests.jsonl", progress=False,
                                     server_metrics_interval_s=0.05, server_metrics_path=path)
    phase = Phase("measured", [PlannedRequest(f"m-{i}", 8, input_ids=list(range(16))) for i in range(40)], 2)
    with pytest.raises(KeyboardInterrupt):
        client.run([phase])
    scraper = client.scraper
    assert not scraper._thread.is_alive()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) >= 2 and lines == scraper.samples
    time.sleep(0.2)  # nothing is appended after the client returned
    assert len(path.read_text().splitlines()) == len(lines)
