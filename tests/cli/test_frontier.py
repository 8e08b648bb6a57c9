"""remnant-frontier end to end on the embedded engine: each step a real server on loopback
and a run directory; the search's record; resume that reuses steps; Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.signals import default_sigint

BIN = Path(sys.executable).parent


def frontier(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "remnant-frontier"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def check(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "remnant-check"), *map(str, paths)], capture_output=True, text=True)


def _doc(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.slow
def test_search_to_its_end_then_resume_reuses_steps(tmp_path):
    out = tmp_path / "search"
    # An SLO every load meets on any machine: doubling runs 1, 2, 4 and stops at max.
    p = frontier("workload=smoke", "slo.ttft_p99_ms=1e9", "search.max=4", f"hydra.run.dir={out}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines() == [str(out / "frontier.json")]
    doc = _doc(out / "frontier.json")
    assert doc["status"] == "completed" and doc["error"] is None
    assert [s["load"] for s in doc["steps"]] == [1, 2, 4]
    assert [s["run_dir"] for s in doc["steps"]] == ["c0001", "c0002", "c0004"]
    assert all(s["passed"] is True and s["reused"] is False for s in doc["steps"])
    assert doc["frontier"] == {"load": 4, "bracket": [4, None], "stopped": "max_passed", "at_least": True}
    assert any("search.max=4 passed" in limit for limit in doc["limits"])
    first_ids = []
    for step in doc["steps"]:
        run = _doc(out / step["run_dir"] / "run.json")
        first_ids.append(run["run_id"])
        assert run["status"] == "completed" and run["run_id"] == step["run_id"]
        assert run["config"]["workload"]["concurrency"] == step["load"]
        assert run["metrics"]["completed"] == 3 * step["load"]  # smoke: 3C measured requests
        m = step["metrics"]
        assert m["ttft_p99_ms"] == run["metrics"]["ttft_ms"]["p99"] and m["goodput"] == run["metrics"]["request_throughput"]
        assert f"concurrency: {step['load']}" in (out / step["run_dir"] / ".hydra" / "config.yaml").read_text()
    # Progress: one line as each step starts and one as it ends.
    assert p.stderr.count("remnant-frontier: step ") == 6 and "[ran " in p.stderr
    assert check(out).returncode == 0
    report = subprocess.run([str(BIN / "remnant-report"), str(out), "--out", str(tmp_path / "report")],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    text = (tmp_path / "report" / "report.md").read_text()
    assert "| smoke | TTFT p99 <= 1e+09 ms | native | - | 1 | >=4.0 concurrency | s0: >=4 |" in text
    assert (tmp_path / "report" / "goodput_vs_load.png").stat().st_size > 5000

    # The same steps judged against an SLO no load meets: nothing runs again, the search
    # stops at its start, and the record says the step was reused.
    p = frontier("workload=smoke", "slo.tpot_p99_ms=0.001", "search.max=4", f"hydra.run.dir={out}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = _doc(out / "frontier.json")
    assert [(s["load"], s["reused"], s["passed"]) for s in doc["steps"]] == [(1, True, False)]
    assert doc["steps"][0]["run_id"] == first_ids[0] and "TPOT p99" in doc["steps"][0]["reason"]
    assert doc["frontier"]["load"] is None and doc["frontier"]["stopped"] == "start_missed"
    assert "[reused]" in p.stderr and "running in" not in p.stderr
    assert [_doc(out / d / "run.json")["run_id"] for d in ("c0001", "c0002", "c0004")] == first_ids
    assert not list(out.glob("*/run.*-*.json"))  # nothing set aside

    # A changed step config (another workload length) runs the step again and keeps the
    # earlier one. A client bound no client meets: the step's run.json says the client was
    # saturated, and frontier.json repeats it, naming the step.
    p = frontier("workload=smoke", "workload.output_len=4", "workload.saturation_cpu_share=1e-9",
                 "slo.ttft_p99_ms=1e9", "search.max=1", f"hydra.run.dir={out}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = _doc(out / "frontier.json")
    assert [(s["load"], s["reused"]) for s in doc["steps"]] == [(1, False)]
    assert "its config differs (workload." in p.stderr
    assert any(limit.startswith("step c0001: the load client was saturated") for limit in doc["limits"])
    assert len(list((out / "c0001").glob("run.completed-*.json"))) == 1


@pytest.mark.slow
def test_open_loop_search_varies_the_request_rate(tmp_path):
    out = tmp_path / "rate"
    p = frontier("workload=smoke", "slo.ttft_p99_ms=1e9", "search.load=request_rate", "search.start=4",
                 "search.max=8", "workload.arrival=constant", f"hydra.run.dir={out}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = _doc(out / "frontier.json")
    assert doc["load"] == "request_rate" and doc["search"]["start"] == 4.0
    assert [(s["load"], s["run_dir"], s["passed"]) for s in doc["steps"]] == [(4.0, "r4", True), (8.0, "r8", True)]
    assert doc["frontier"] == {"load": 8.0, "bracket": [8.0, None], "stopped": "max_passed", "at_least": True}
    assert any("workload.concurrency=2 capping the requests in flight" in limit for limit in doc["limits"])
    for step in doc["steps"]:
        run = _doc(out / step["run_dir"] / "run.json")
        assert run["config"]["workload"]["request_rate"] == step["load"]
        # The client recorded when each request was due: arrivals at the step's rate.
        assert run["client"]["request_rate"] == step["load"]
        assert "request_rate: " + f"{step['load']}" in (out / step["run_dir"] / ".hydra" / "config.yaml").read_text()
    assert check(out).returncode == 0


def test_config_mistake_exits_2_and_leaves_no_directory(tmp_path):
    out = tmp_path / "search"
    p = frontier("workload=smoke", "search.max=4", f"hydra.run.dir={out}", cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip() == ("remnant-frontier: error: slo.ttft_p99_ms and slo.tpot_p99_ms are both null; set at "
                                "least one (e.g. slo.ttft_p99_ms=2000) or pick slo=interactive / slo=cpu_smoke")
    p = frontier("workload=smoke", "slo=cpu_smok", f"hydra.run.dir={out}", cwd=tmp_path)
    assert p.returncode == 2 and "did you mean slo=cpu_smoke?" in p.stderr
    assert not out.exists()


@pytest.mark.slow
def test_ctrl_c_records_the_step_and_the_search(tmp_path):
    out = tmp_path / "search"
    args = ["workload=smoke", "slo.ttft_p99_ms=1e9", f"hydra.run.dir={out}"]
    proc = subprocess.Popen([str(BIN / "remnant-frontier"), *args, "workload.measured_requests=2000"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    requests = out / "c0001" / "requests.jsonl"
    deadline = time.monotonic() + 90
    while not (requests.exists() and len(requests.read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert stdout.strip().splitlines() == [str(out / "frontier.json")]
    doc = _doc(out / "frontier.json")
    assert doc["status"] == "interrupted" and "resumes" in doc["error"]["message"]
    assert [(s["load"], s["status"], s["passed"]) for s in doc["steps"]] == [(1, "interrupted", None)]
    assert doc["frontier"]["stopped"] == "interrupted"
    assert _doc(out / "c0001" / "run.json")["status"] == "interrupted"
    assert check(out).returncode == 0

    # Resumed: the interrupted step runs again, its attempt kept beside it.
    p = frontier(*args, "search.max=1", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert _doc(out / "frontier.json")["frontier"]["load"] == 1
    assert len(list((out / "c0001").glob("run.interrupted-*.json"))) == 1
