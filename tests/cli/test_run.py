"""remnant-run end to end: Hydra composes, a real server starts on loopback, a real client
drives it, and run.json records what happened, on success, failure, kill and Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from tests.loopback import GenerateServer, generate_request, loopback_server, stream_generate
from tests.signals import default_sigint

BIN = Path(sys.executable).parent


def remnant_run(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "remnant-run"), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def check(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "remnant-check"), *map(str, paths)], capture_output=True, text=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) is not a running server.
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "State:\tZ" in status.read_text())


@pytest.mark.slow
def test_smoke_run_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    p = remnant_run("workload=smoke", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    last = p.stdout.strip().splitlines()[-1]
    assert Path(last) == run_dir / "run.json"
    doc = json.loads(Path(last).read_text())
    assert doc["status"] == "completed" and doc["error"] is None
    assert doc["config"]["mode"]["name"] == "native" and doc["config"]["retention"] is None
    assert doc["workload"]["counts"] == {"warmup": 2, "measured": 6}
    assert [ph["name"] for ph in doc["phases"]] == ["warmup", "measured"]
    assert all(ph["flush"]["ok"] for ph in doc["phases"])
    m = doc["metrics"]
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (6, 0, 6 * 8)
    assert m["ttft_ms"]["count"] == 6 and m["ttft_ms"]["p50"] > 0
    lines = (run_dir / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 8 and all(json.loads(line)["success"] for line in lines)
    assert doc["server_info"]["engine"] == "remnant-embedded"
    assert doc["environment"]["cpu_count"] >= 1
    assert {a["path"] for a in doc["artifacts"]} == {"requests.jsonl", "server_metrics.jsonl", "server.log"}
    assert doc["server_metrics"]["interval_s"] == 1.0 and doc["server_metrics"]["scrapes"] >= 1
    assert not _pid_alive(doc["host"]["pid"])
    assert "measured: 6 ok" in p.stderr
    assert doc["schema_version"] == 5 and doc["failures"] is None and doc["client_stop"] is None
    assert doc["capture"] is None and doc["retention_map"] is None
    # Hydra's config is kept; no empty cli.log, no port of a server that is gone.
    assert "output_len: 8" in (run_dir / ".hydra" / "config.yaml").read_text()
    assert not (run_dir / "cli.log").exists() and not (run_dir / "server.port").exists()

    assert check(last).returncode == 0
    broken = json.loads(Path(last).read_text())
    broken["metrics"]["ttft_ms"]["p50"] = "fast"
    bad = tmp_path / "broken.json"
    bad.write_text(json.dumps(broken))
    r = check(bad)
    assert r.returncode == 1 and str(bad) in r.stdout + r.stderr and "metrics.ttft_ms.p50" in r.stdout + r.stderr


def test_rule_violation_is_one_line_without_traceback(tmp_path):
    p = remnant_run("mode=kernel", "retention=r192", cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip() == (
        "remnant-run: error: retention=192 is not allowed with mode=kernel; kernel supports retention=256"
    )
    assert "Traceback" not in p.stdout + p.stderr


@pytest.mark.slow
def test_sweep_of_modes_gives_three_run_dirs(tmp_path):
    p = remnant_run("-m", "mode=native,triton,kernel", "workload=smoke", f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    docs = {json.loads(f.read_text())["config"]["mode"]["name"]: json.loads(f.read_text())
            for f in sorted((tmp_path / "sweep").glob("*/run.json"))}
    assert set(docs) == {"native", "triton", "kernel"}
    assert all(d["status"] == "completed" for d in docs.values())
    assert len({d["host"]["base_url"] for d in docs.values()}) == 3  # each cell had its own server
    assert docs["native"]["server_info"]["c4_record_bytes"] == [584, 584]
    assert docs["native"]["server_info"]["remnant_retention"] is None
    for mode in ("triton", "kernel"):
        info = docs[mode]["server_info"]
        assert info["remnant_mode"] == mode and info["c4_record_bytes"] == [328, 328]
        assert info["remnant_retention"]["per_layer"] == {"1": 256, "3": 256}
        assert info["remnant_retention"]["policy"] == "attention"
        assert docs[mode]["config"]["retention"]["retention"] == 256
    # Same request stream in every cell, so modes compare request by request.
    assert len({d["workload"]["fingerprint"] for d in docs.values()}) == 1
    # native ignores retention, and its cell's name says none.
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == [
        "0-native-smoke-s0", "1-triton-r256-smoke-s0", "2-kernel-r256-smoke-s0"]
    assert check(tmp_path / "sweep").returncode == 0
    # stdout is the cells' run.json paths and nothing else (Hydra's logs go to stderr).
    assert sorted(p.stdout.splitlines()) == sorted(str(f) for f in (tmp_path / "sweep").glob("*/run.json"))


def _start_long_run(tmp_path: Path, run_dir: Path, *extra: str, lines: int = 5,
                    sweep: bool = False) -> tuple[subprocess.Popen, dict]:
    """remnant-run on 2000 smoke requests, once `lines` of them are recorded; the server's
    port and pid. sweep: run_dir is a sweep directory (extra holds -m and the cells)."""
    where = f"hydra.sweep.dir={run_dir}" if sweep else f"hydra.run.dir={run_dir}"
    proc = subprocess.Popen(
        [str(BIN / "remnant-run"), *extra, "workload=smoke", "workload.measured_requests=2000", where],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint,
    )
    cell = run_dir / "0-native-smoke-s0" if sweep else run_dir
    requests = cell / "requests.jsonl"
    deadline = time.monotonic() + 60
    while not (requests.exists() and len(requests.read_text().splitlines()) >= lines):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.1)
    port = int((cell / "server.port").read_text())
    server_pid = int(subprocess.run(["pgrep", "-f", "--", f"--port-file {cell}/server.port"],
                                    capture_output=True, text=True).stdout.split()[0])
    return proc, {"port": port, "pid": server_pid}


@pytest.mark.slow
def test_server_killed_mid_run(tmp_path):
    run_dir = tmp_path / "run"
    proc, server = _start_long_run(tmp_path, run_dir)
    os.kill(server["pid"], signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    doc = json.loads((run_dir / "run.json").read_text())
    assert doc["status"] == "failed" and doc["metrics"] is None
    assert "exited with code -9" in doc["error"]["message"]
    records = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert sum(r["success"] for r in records) >= 5  # every finished request kept
    assert check(run_dir / "run.json").returncode == 0
    assert not _pid_alive(server["pid"])


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupt_stops_server_and_records(tmp_path, sig):
    run_dir = tmp_path / "run"
    proc, server = _start_long_run(tmp_path, run_dir)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err  # 130 for Ctrl-C, 143 for SIGTERM, as shells report them
    assert out.strip().splitlines()[-1] == str(run_dir / "run.json")
    doc = json.loads((run_dir / "run.json").read_text())
    assert doc["status"] == "interrupted" and doc["error"]["stage"] == "client"
    assert len((run_dir / "requests.jsonl").read_text().splitlines()) >= 5
    assert check(run_dir / "run.json").returncode == 0
    deadline = time.monotonic() + 15
    while _pid_alive(server["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _pid_alive(server["pid"])


def test_external_host_attaches_and_never_stops(server, tmp_path):
    p = remnant_run("host=external", f"host.base_url={server.base_url}", "workload=smoke",
                    f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "run" / "run.json").read_text())
    assert doc["status"] == "completed"
    assert doc["host"] == {"kind": "external", "base_url": server.base_url}
    assert doc["environment"] is None  # unknown where an external server runs
    assert server.proc.poll() is None  # still running


def test_external_host_refuses_a_server_in_another_mode(server, tmp_path):
    p = remnant_run("host=external", f"host.base_url={server.base_url}", "mode=kernel", "workload=smoke",
                    f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert p.returncode == 1, p.stderr
    doc = json.loads((tmp_path / "run" / "run.json").read_text())
    assert doc["status"] == "failed" and doc["error"]["stage"] == "serve"
    assert "reports remnant_mode='native'" in doc["error"]["message"] and "give mode=native" in p.stderr
    assert not (tmp_path / "run" / "requests.jsonl").exists() or not (tmp_path / "run" / "requests.jsonl").read_text()
    assert check(tmp_path / "run" / "run.json").returncode == 0


class _ModelessServer(GenerateServer):
    """SGLang's HTTP surface as far as a run needs it, with a /server_info that, like
    SGLang's, does not say which Remnant mode it serves."""


def test_external_server_that_does_not_report_its_mode_is_recorded_unchecked(tmp_path):
    with loopback_server(_ModelessServer) as url:
        p = remnant_run("host=external", f"host.base_url={url}", "mode=kernel", "workload=smoke",
                        f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "run" / "run.json").read_text())
    assert doc["status"] == "completed" and doc["metrics"]["completed"] > 0
    assert any("did not report its mode" in line and "mode=kernel is as configured" in line for line in doc["limits"])


def test_external_host_unreachable_fails_cleanly(tmp_path):
    p = remnant_run("host=external", "host.base_url=http://127.0.0.1:9", "host.health_timeout_s=1",
                    "workload=smoke", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert p.returncode == 1
    doc = json.loads((tmp_path / "run" / "run.json").read_text())
    assert doc["status"] == "failed" and doc["error"]["stage"] == "serve"
    assert "did not answer 200 within 1s" in doc["error"]["message"]
    assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_sweep_records_a_cell_that_breaks_a_rule(tmp_path):
    args = ("-m", "mode=native,kernel", "retention=r192", "workload=smoke", f"hydra.sweep.dir={tmp_path}/sweep")
    p = remnant_run(*args, cwd=tmp_path)
    # The sweep runs every cell, then exits 1 naming the one that did not complete, so a
    # script or CI sees it.
    assert p.returncode == 1, p.stderr
    docs = {json.loads(f.read_text())["config"]["mode"]["name"]: json.loads(f.read_text())
            for f in (tmp_path / "sweep").glob("*/run.json")}
    assert docs["native"]["status"] == "completed"
    assert docs["kernel"]["status"] == "failed" and docs["kernel"]["error"]["stage"] == "config"
    assert "kernel supports retention=256" in docs["kernel"]["error"]["message"]
    assert "retention=192 is not allowed with mode=kernel" in p.stderr
    assert p.stderr.rstrip().splitlines()[-1] == (
        "remnant-run: error: 1 cell(s) did not complete: 1-kernel-r192-smoke-s0 (failed) (--exit-zero exits 0 all "
        "the same)")
    assert len(p.stdout.split()) == 2  # both records' paths, as ever
    assert check(tmp_path / "sweep").returncode == 0
    # --exit-zero keeps the old status; the completed cell is skipped, the failed one tried again.
    p = remnant_run("--exit-zero", *args, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "1 cell(s) did not complete: 1-kernel-r192-smoke-s0 (failed); exit 0 (--exit-zero)" in p.stderr


@pytest.mark.slow
def test_packed_capacity_holds_a_working_set_native_cannot(tmp_path):
    """At one budget, 9 groups x 1024-token prefixes (36 pages + 4 running) exceed native's
    35 pages but fit packed's 40: the packed run's cache-hit rate is higher."""
    p = remnant_run("-m", "mode=native,kernel", "workload=shared_prefix", "workload.groups=9",
                    "workload.prefix_len=1024", "workload.suffix_len=32", "workload.output_len=4",
                    "workload.requests_per_group=3", "workload.concurrency=4", "host.kv_budget_mib=13",
                    "host.swa_ratio=0.2", "host.max_running_requests=4", f"hydra.sweep.dir={tmp_path}/sweep",
                    cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    docs = {json.loads(f.read_text())["config"]["mode"]["name"]: json.loads(f.read_text())
            for f in (tmp_path / "sweep").glob("*/run.json")}
    native, kernel = docs["native"], docs["kernel"]
    assert native["server_info"]["capacity"]["max_total_num_tokens"] == 35 * 256
    assert kernel["server_info"]["capacity"]["max_total_num_tokens"] == 40 * 256
    assert native["phases"][1]["flush"] is None  # measured on the warm cache
    hit_native, hit_kernel = native["metrics"]["cache_hit_rate"], kernel["metrics"]["cache_hit_rate"]
    assert hit_kernel > 0.9 and hit_kernel > hit_native + 0.2, (hit_native, hit_kernel)
    assert check(tmp_path / "sweep").returncode == 0


SMOKE_EXPERIMENTS = sorted(p.stem for p in (Path(__file__).parents[2] / "conf" / "experiment").glob("*_smoke.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("experiment", SMOKE_EXPERIMENTS)
def test_smoke_experiments_run(tmp_path, experiment):
    p = remnant_run(f"experiment={experiment}", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "run" / "run.json").read_text())
    assert doc["status"] == "completed" and doc["workload"]["name"] == experiment
    if "ceiling" in experiment:
        ceiling = doc["workload"]["params"]["ceiling_concurrency"]
        assert ceiling == doc["workload"]["counts"]["measured"] and ceiling > 1
    assert check(tmp_path / "run" / "run.json").returncode == 0


def test_sharegpt_run_from_the_environment(tmp_path):
    sample = Path(__file__).resolve().parents[3] / "shared" / "data" / "sharegpt" / "sharegpt_test.json"
    if not sample.is_file():
        pytest.skip(f"the shared ShareGPT sample is not at {sample}")
    env = {**os.environ, "BENCH_DATASET_PATH": str(sample)}
    p = subprocess.run([str(BIN / "remnant-run"), "workload=sharegpt", "workload.num_prompts=4",
                        "workload.max_input_len=200", "workload.max_output_len=8", f"hydra.run.dir={tmp_path}/run"],
                       cwd=tmp_path, capture_output=True, text=True, env=env, timeout=180)
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "run" / "run.json").read_text())
    assert doc["workload"]["dataset"]["path"] == str(sample) and doc["metrics"]["completed"] == 4
    env.pop("BENCH_DATASET_PATH")
    p = subprocess.run([str(BIN / "remnant-run"), "workload=sharegpt"], cwd=tmp_path, capture_output=True,
                       text=True, env=env, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    # It names the variable the config reads, not only the field.
    assert p.stderr.strip().splitlines()[-1] == (
        "remnant-run: error: workload.dataset_path has no value: set BENCH_DATASET_PATH in the environment, "
        "or give it on the command line (workload.dataset_path=...)")


def test_longswe_replays_the_mooncake_trace(tmp_path):
    """The public Mooncake trace, unchanged, replayed by 4 users with lengths scaled to the
    tiny engine (multi-turn sessions only): later turns hit the cache."""
    trace = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake" / "synthetic_trace.jsonl"
    if not trace.is_file():
        pytest.skip(f"the shared Mooncake trace is not at {trace}")
    p = remnant_run("workload=longswe", f"workload.trace_path={trace}", "workload.token_scale=0.1",
                    "workload.min_turns=2", "workload.num_sessions=8", "workload.warmup_sessions=1",
                    "workload.concurrency=4",
                    f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "run" / "run.json").read_text())
    assert doc["workload"]["dataset"]["path"] == str(trace)
    records = [json.loads(line) for line in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    measured = [r for r in records if r["phase"] == "measured"]
    assert all(r["session"] and r["turn"] is not None for r in measured)
    per_turn = {t["turn"]: t for t in doc["metrics"]["per_turn"]}
    assert per_turn[1]["cache_hit_rate"] > 0.3
    assert check(tmp_path / "run" / "run.json").returncode == 0


@pytest.mark.slow
def test_longswe_later_turns_hit_the_cache(tmp_path):
    p = remnant_run("experiment=longswe_c24_smoke", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    per_turn = json.loads((tmp_path / "run" / "run.json").read_text())["metrics"]["per_turn"]
    assert [t["turn"] for t in per_turn] == [0, 1, 2]
    assert per_turn[0]["cache_hit_rate"] == 0.0
    assert all(t["cache_hit_rate"] > 0.3 for t in per_turn[1:])  # the second turn on extends a cached prompt
    assert all(t["mean_prompt_tokens"] > per_turn[0]["mean_prompt_tokens"] for t in per_turn[1:])


# ---------------------------------------------------------------------------------------
# Faults a long sweep meets (issue 36): each on real processes, each bounded in time.


def _stop_server(pid: int) -> None:
    """Leave no server behind when a test fails midway (it may be stopped with SIGSTOP)."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


def _wait_gone(pid: int, timeout_s: float = 15) -> bool:
    deadline = time.monotonic() + timeout_s
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _pid_alive(pid)


def test_help_names_remnant_run_and_what_it_composes(tmp_path):
    p = remnant_run("--help", cwd=tmp_path, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: remnant-run")
    assert "powered by Hydra" not in p.stdout and "base_" not in p.stdout
    for text in ("workload", "smoke", "r256 (default)", "native (default)", "longswe_c24_smoke", "-m (--multirun)",
                 "outputs/", "remnant-check", "remnant-report", "remnant-serve", "remnant-kernels", "130 / 143"):
        assert text in p.stdout, text
    assert not list(tmp_path.iterdir())  # nothing composed, nothing written


@pytest.mark.parametrize(("args", "line"), [
    (["workload.concurency=3"], "workload.concurency is not a field of workload; did you mean workload.concurrency?"),
    (["+workload.concurency=3"], "workload.concurency is not a field of workload (kind random); did you mean "
                                 "workload.concurrency?"),
    (["workload.output_len=${oc.env:REMNANT_TEST_UNSET}"],
     "workload.output_len=${oc.env:REMNANT_TEST_UNSET}: environment variable REMNANT_TEST_UNSET is not set; set it, "
     "or give workload.output_len=... on the command line"),
    (["mode=kernel", "retention=r192"],
     "retention=192 is not allowed with mode=kernel; kernel supports retention=256"),
], ids=["typo", "plus-key", "unset-env", "rule"])
def test_config_mistakes_exit_2_in_one_line_and_leave_no_directory(tmp_path, args, line):
    p = remnant_run(*args, f"hydra.run.dir={tmp_path}/run", cwd=tmp_path, timeout=60)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == f"remnant-run: error: {line}"
    assert p.stdout == "" and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_signal_stops_a_sweep_after_the_running_cell(tmp_path):
    """SIGTERM (a scheduler's) stops the sweep: the running cell is recorded as interrupted,
    no later cell starts, and the exit status says SIGTERM."""
    sweep = tmp_path / "sweep"
    proc, server = _start_long_run(tmp_path, sweep, "-m", "mode=native,triton,kernel", lines=3, sweep=True)
    try:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        _stop_server(server["pid"])
    assert proc.returncode == 143, err
    cell = sweep / "0-native-smoke-s0"
    assert out.splitlines() == [str(cell / "run.json")]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == [cell.name]
    doc = json.loads((cell / "run.json").read_text())
    assert doc["status"] == "interrupted" and doc["error"]["message"] == "interrupted by SIGTERM (signal 15)"
    assert "sweep stopped by SIGTERM (signal 15)" in err
    assert _wait_gone(server["pid"])


@pytest.mark.slow
def test_a_stalled_server_fails_the_run_with_the_stall_and_its_times(tmp_path):
    """SIGSTOP of the real server: the watchdog sees no token for stall_timeout_s, stops
    sending, records the stall and ends the run failed; the stopped server is stopped."""
    run_dir = tmp_path / "run"
    proc, server = _start_long_run(tmp_path, run_dir, "workload.stall_timeout_s=2", lines=3)
    try:
        os.kill(server["pid"], signal.SIGSTOP)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=40)
        elapsed = time.monotonic() - t0
    finally:
        proc.kill()
        _stop_server(server["pid"])
    assert proc.returncode == 1, err
    assert elapsed < 15, elapsed
    doc = json.loads((run_dir / "run.json").read_text())
    assert doc["status"] == "failed" and doc["metrics"] is None
    assert (doc["error"]["stage"], doc["error"]["type"]) == ("client", "Stall")
    stop = doc["client_stop"]
    assert stop["reason"] == "stall" and stop["limit_s"] == 2 and stop["in_flight"] == 2 and stop["phase"] == "measured"
    assert stop["at_s"] - stop["last_progress_s"] >= 2
    records = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert sum(r["success"] for r in records) >= 3
    assert [r["error"] for r in records if not r["success"]] == ["stopped: no answer from the server for 2s (stall)"] * 2
    assert "run failed at client: the server stalled" in err and "Traceback" not in err
    assert check(run_dir / "run.json").returncode == 0
    assert _wait_gone(server["pid"])


class _GenerateNotImplemented(BaseHTTPRequestHandler):
    """/health says 200; /generate (and /flush_cache) answer 501 with an HTML page:
    http.server has no POST handler."""

    def do_GET(self):  # noqa: N802
        body = b"{}" if self.path == "/server_info" else b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _FailsHalf(_GenerateNotImplemented):
    """/health says 200; every other /generate answers http.server's 501 HTML page."""

    calls = 0

    def do_POST(self):  # noqa: N802
        req = generate_request(self)
        if req is None:
            return
        type(self).calls += 1
        if type(self).calls % 2:
            self.send_error(501, "Unsupported method ('POST')")
            return
        stream_generate(self, req["sampling_params"]["max_new_tokens"], prompt_tokens=len(req["input_ids"]),
                        incremental=False)


@pytest.mark.parametrize(("handler", "status"), [(_FailsHalf, "degraded"), (_GenerateNotImplemented, "failed")],
                         ids=["half-fail", "all-fail"])
def test_mostly_failed_requests_are_not_completed(tmp_path, handler, status):
    with loopback_server(handler) as url:
        p = remnant_run("host=external", f"host.base_url={url}", "workload=smoke", f"hydra.run.dir={tmp_path}/run",
                        cwd=tmp_path, timeout=60)
    assert p.returncode == 1, p.stderr
    doc = json.loads((tmp_path / "run" / "run.json").read_text())
    assert doc["status"] == status and doc["error"]["stage"] == "client"
    failures = doc["failures"]
    assert failures["measured"] == 6 and failures["max_share"] == 0.1
    assert failures["share"] == (0.5 if status == "degraded" else 1.0)
    (first,) = failures["errors"]
    assert first["message"].startswith("HTTP 501: Error response Error code: 501 Message: Unsupported method")
    assert first["count"] == failures["failed"]
    if status == "degraded":
        assert doc["metrics"]["completed"] == 3 and "3 of 6 measured requests failed (50%" in doc["error"]["message"]
    # Errors are a status code and a snippet: no HTML page anywhere in the record.
    text = (tmp_path / "run" / "run.json").read_text()
    assert "<html" not in text.lower() and "<p>" not in text.lower()
    assert all(len(limit) < 400 for limit in doc["limits"])
    assert check(tmp_path / "run" / "run.json").returncode == 0


def _snapshot(directory: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(directory)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_resume_skips_only_an_unchanged_cell_and_reruns_a_changed_one(tmp_path):
    sweep = tmp_path / "sweep"
    args = ("-m", "workload=smoke", "workload.warmup_requests=0", "workload.measured_requests=2",
            f"hydra.sweep.dir={sweep}")
    assert remnant_run(*args, cwd=tmp_path, timeout=60).returncode == 0
    cell = sweep / "0-native-smoke-s0"
    before = _snapshot(cell)

    again = remnant_run(*args, cwd=tmp_path, timeout=60)
    assert again.returncode == 0, again.stderr
    assert "is complete; skipped (the same config and request stream" in again.stderr
    assert _snapshot(cell) == before  # a skipped cell's files, .hydra/ included, are untouched

    changed = remnant_run(*args, "workload.output_len=4", cwd=tmp_path, timeout=60)
    assert changed.returncode == 0, changed.stderr
    assert "its config differs (workload.output_len: 8 -> 4); running it again" in changed.stderr
    doc = json.loads((cell / "run.json").read_text())
    assert doc["status"] == "completed" and doc["config"]["workload"]["output_len"] == 4
    assert doc["metrics"]["total_output_tokens"] == 2 * 4
    assert "output_len: 4" in (cell / ".hydra" / "config.yaml").read_text()
    # The earlier attempt is set aside whole, not overwritten.
    aside = {p.name.split(".completed-")[0] for p in cell.iterdir() if ".completed-" in p.name}
    assert aside == {"run", "requests", "server_metrics", "server", ".hydra"}
    old = next(cell.glob("run.completed-*.json"))
    assert json.loads(old.read_text())["config"]["workload"]["output_len"] == 8
    assert check(sweep).returncode == 0


@pytest.mark.slow
def test_a_killed_run_is_reported_and_its_files_set_aside_on_the_next_run(tmp_path):
    """SIGKILL of remnant-run: its server goes (PDEATHSIG), but no run.json is written and a
    stale server.port stays. remnant-check says so; the next run keeps the killed attempt's
    requests and log apart from its own."""
    run_dir = tmp_path / "run"
    proc, server = _start_long_run(tmp_path, run_dir, lines=3)
    proc.kill()
    proc.communicate(timeout=30)
    assert _wait_gone(server["pid"])
    assert not (run_dir / "run.json").exists() and (run_dir / "server.port").exists()
    killed_lines = (run_dir / "requests.jsonl").read_text().splitlines()
    killed_log = (run_dir / "server.log").read_text()

    r = check(tmp_path)
    assert r.returncode == 1 and f"FAIL {run_dir}: run directory without run.json" in r.stdout

    p = remnant_run("workload=smoke", "workload.warmup_requests=0", "workload.measured_requests=2",
                    f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "its files are set aside as *.killed-*" in p.stderr
    assert next(run_dir.glob("requests.killed-*.jsonl")).read_text().splitlines() == killed_lines
    assert next(run_dir.glob("server.killed-*.log")).read_text() == killed_log
    assert len((run_dir / "requests.jsonl").read_text().splitlines()) == 2
    assert killed_log not in (run_dir / "server.log").read_text()
    assert not (run_dir / "server.port").exists()
    assert check(tmp_path).returncode == 0


@pytest.mark.slow
def test_a_full_disk_keeps_every_line_whole_and_still_writes_run_json(tmp_path, tiny_model_dir):
    """A real 1 MB tmpfs filled up mid-run: the request line that no longer fits is not
    written at all, the run ends failed in one line naming requests.jsonl, and run.json is
    written into the space the run held for it."""
    from tests.tmpfs import fill, tmpfs

    with tmpfs(tmp_path / "disk", "1m") as disk:
        run_dir = disk / "run"
        proc, server = _start_long_run(tmp_path, run_dir, f"model.path={tiny_model_dir}", lines=3)
        try:
            fill(disk)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
            _stop_server(server["pid"])
        assert proc.returncode == 1, err
        assert "Traceback" not in err
        assert f"No space left on device: could not append a line to {run_dir / 'requests.jsonl'}" in err
        lines = (run_dir / "requests.jsonl").read_bytes().split(b"\n")
        assert lines[-1] == b"" and all(json.loads(line) for line in lines[:-1])  # whole lines only
        doc = json.loads((run_dir / "run.json").read_text())
        assert doc["status"] == "failed" and doc["error"]["stage"] == "client"
        assert "No space left on device" in doc["error"]["message"]
        assert out.splitlines() == [str(run_dir / "run.json")]
        assert check(run_dir / "run.json").returncode == 0


def test_an_unwritable_run_directory_is_one_line(tmp_path):
    from tests.tmpfs import tmpfs

    with tmpfs(tmp_path / "ro", "64k", read_only=True) as ro:
        p = remnant_run("workload=smoke", f"hydra.run.dir={ro}/run", cwd=tmp_path, timeout=60)
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip() == (f"remnant-run: error: cannot write {ro}/run: Read-only file system; "
                                "run.json could not be written")


def test_a_16_kb_run_directory_fails_in_one_line_naming_the_file(tmp_path):
    """A 16 KB tmpfs as the run directory fills while the model directory is written (no
    room even for the space a run holds for run.json): one line names the file and says
    run.json could not be written either; no traceback, exit status 1."""
    from tests.tmpfs import tmpfs

    with tmpfs(tmp_path / "disk", "16k") as disk:
        run_dir = disk / "run"
        p = remnant_run("workload=smoke", f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr and p.stdout == ""
    (line,) = p.stderr.splitlines()
    m = re.fullmatch(r"remnant-run: error: run failed at serve: cannot write (\S+): No space left on device; "
                     r"run.json could not be written to (\S+): No space left on device", line)
    assert m, line
    assert Path(m.group(1)).parent == run_dir / "model" and m.group(2) == str(run_dir / "run.json")


def test_a_sweep_directory_on_a_full_disk_is_one_line(tmp_path):
    from tests.tmpfs import fill, tmpfs

    with tmpfs(tmp_path / "disk", "64k") as disk:
        fill(disk)
        p = remnant_run("-m", "workload=smoke", f"hydra.sweep.dir={disk}/sweep", cwd=tmp_path, timeout=60)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == (f"remnant-run: error: cannot write {disk}/sweep: No space left on "
                                                 "device; run.json could not be written")
