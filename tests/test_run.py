"""remnant.run's records from real runs: where a server's decode ran, the client's own load, a full disk."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from tests.conftest import start_server, stop_server


@pytest.mark.slow
def test_the_server_reports_which_kernel_decodes_native_records(tiny_model_dir, tmp_path, monkeypatch):
    for name, extra, want in (("batched", (), ("torch", "decode steps attend in torch, batched "
                                                            "(decode_path=batched, the CPU's default)")),
                              ("kernels", ("--decode-path", "kernels"),
                               ("triton", "FlashMLA runs on CUDA GPUs, not on device=cpu"))):
        (tmp_path / name).mkdir()
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        server = start_server(tiny_model_dir, tmp_path / name, *extra)
        try:
            info = httpx.get(f"{server.base_url}/server_info", timeout=10).json()
        finally:
            stop_server(server)
        native = info["remnant_native_decode"]
        assert info["remnant_packed_decode"] == {"kernel": None, "reason": None}  # native mode: no packed layer
        assert (native["kernel"], native["reason"], native["flashmla_version"]) == (*want, None)


def _stream_server_run(tmp_path, **workload):
    """A run of remnant-run's code against the model-free stream server (host external): the
    server answers at once, so the client is the one working."""
    from remnant.client.ceiling import _Server
    from remnant.config import ModelConfig, RunConfig
    from remnant.hosts.external import ExternalHostConfig
    from remnant.run import execute_run
    from remnant.workloads.random import RandomWorkloadConfig

    srv = _Server(None, tmp_path, tmp_path / "stream-server.log", incremental=False)
    try:
        cfg = RunConfig(workload=RandomWorkloadConfig(**{"input_len": 16, **workload}),
                        host=ExternalHostConfig(base_url=srv.base_url), model=ModelConfig())
        cfg.workload.validate()
        outcome = execute_run(cfg, tmp_path / "run", progress=False)
    finally:
        srv.stop()
    return outcome, json.loads(outcome.path.read_text())


def test_a_client_bound_run_says_so_in_limits(tmp_path):
    """A client kept busy: 32 streams of 256 tokens from a server that computes nothing. Its
    own CPU use and dispatch delay are recorded; with the CPU threshold forced below what
    such a run uses (on a shared machine its share of one core varies), the limit appears."""
    outcome, doc = _stream_server_run(tmp_path, output_len=256, concurrency=32, measured_requests=64,
                                      saturation_cpu_share=0.05)
    assert outcome.status == "completed", doc["error"]
    client = doc["client"]
    assert client["arrival"] == "closed" and client["request_rate"] is None and client["queued_ms"] is None
    assert client["loop_cpu_share"] >= 0.05 and client["saturated"] is True
    assert client["dispatch_delay_ms"]["count"] == 64
    assert any(limit.startswith("the load client was saturated: its event loop was busy") for limit in doc["limits"])


def test_an_open_loop_run_records_its_schedule_and_an_unsaturated_client(tmp_path):
    outcome, doc = _stream_server_run(tmp_path, output_len=4, concurrency=4, measured_requests=20,
                                      request_rate=40.0, arrival="constant", saturation_dispatch_p99_ms=1000.0)
    assert outcome.status == "completed", doc["error"]
    client = doc["client"]
    assert (client["arrival"], client["request_rate"]) == ("constant", 40.0)
    assert client["sent_request_rate"] == pytest.approx(40.0, rel=0.2)
    assert client["queued_ms"]["count"] == 20
    assert client["saturated"] is False and not any("load client" in limit for limit in doc["limits"])
    lines = [json.loads(line) for line in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    measured = [r for r in lines if r["phase"] == "measured"]
    assert all(r["scheduled_s"] is not None and r["start_s"] >= r["intended_start_s"] >= r["scheduled_s"]
               for r in measured)


def test_saturation_limits_name_each_threshold_passed():
    from remnant.client.metrics import client_summary, saturation_limits
    from remnant.client.request_record import RequestRecord

    recs = [RequestRecord(id=f"m-{i}", phase="measured", index=i, intended_start_s=i * 0.1,
                          start_s=i * 0.1 + 0.02 * (i == 9)) for i in range(10)]

    def summary(cpu_s: float, p99_ms: float) -> dict:
        return client_summary(recs, 1.0, cpu_s, cpu_s, None, "poisson", 0.9, p99_ms)

    assert summary(0.5, 30.0)["saturated"] is False and saturation_limits(summary(0.5, 30.0)) == []
    (cpu,) = saturation_limits(summary(0.95, 30.0))
    assert cpu.startswith("the load client was saturated: its event loop was busy 95% of the measured phase")
    (late,) = saturation_limits(summary(0.5, 10.0))  # one request 20 ms late: p99 18.2 ms
    assert late.startswith("the load client fell behind: dispatch delay p99 18.2 ms")
    assert summary(0.95, 10.0)["saturated"] is True and len(saturation_limits(summary(0.95, 10.0))) == 2


def test_a_disk_that_fills_while_the_model_is_written_still_gets_run_json(tmp_path):
    """A real tmpfs with room for the space a run holds for run.json and one 4 KB page
    more: the model directory does not fit. The run fails at serve naming the file, and
    run.json, written into the space held for it, says the same."""
    from remnant.config import ModelConfig, RunConfig
    from remnant.hosts.embedded import EmbeddedHostConfig
    from remnant.records.schema import validate
    from remnant.run import execute_run
    from remnant.run_dir import RESERVE_BYTES
    from remnant.workloads.random import RandomWorkloadConfig
    from tests.tmpfs import tmpfs

    with tmpfs(tmp_path / "disk", f"{RESERVE_BYTES // 1024 + 4}k") as disk:
        run_dir = disk / "run"
        cfg = RunConfig(workload=RandomWorkloadConfig(name="smoke", input_len=16, output_len=2),
                        host=EmbeddedHostConfig(), model=ModelConfig())
        outcome = execute_run(cfg, run_dir, progress=False)
        assert outcome.path == run_dir / "run.json" and outcome.write_error is None
        doc = json.loads(outcome.path.read_text())
    validate(doc)
    assert (doc["status"], doc["error"]["stage"], doc["error"]["type"]) == ("failed", "serve", "WriteError")
    m = re.fullmatch(r"cannot write (\S+): No space left on device", doc["error"]["message"])
    assert m and Path(m.group(1)).parent == run_dir / "model", doc["error"]["message"]
