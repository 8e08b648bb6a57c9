"""Secured servers end to end: runs send the key that host.api_key_env names, a missing or
wrong key fails the run at serve in one line, and no file a run, a frontier, a report or a
curated collection writes holds the key (remnant.api_key)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from remnant.api_key import REDACTED, read_key, redact, redact_file, redact_inline_keys, refuse_inline_keys
from remnant.config_errors import ConfigError
from remnant.run import record_config_error
from tests.conftest import start_server, stop_server
from tests.loopback import loopback_server, stream_generate

BIN = Path(sys.executable).parent
KEY = "sk-remnant-test-7d3e91c0b2"
KEY_ENV = "REMNANT_TEST_SERVER_KEY"


def files_holding(root: Path, key: str = KEY) -> list[str]:
    """Every file under `root` whose bytes hold `key`, relative to root."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and key.encode() in p.read_bytes())


def _env(**extra: str) -> dict:
    """This process's environment without a REMNANT_API_KEY of its own, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("REMNANT_API_KEY", KEY_ENV)}
    return {**env, **extra}


def _cli(prog: str, *args: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / prog), *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_a_secured_embedded_capture_run_completes_and_no_file_holds_the_key(tmp_path):
    run_dir = tmp_path / "run"
    p = _cli("remnant-capture", "workload=smoke", "capture.tokens=8", "capture.records=16",
             f"host.api_key_env={KEY_ENV}", f"hydra.run.dir={run_dir}", cwd=tmp_path, env=_env(**{KEY_ENV: KEY}))
    assert p.returncode == 0, p.stderr
    doc = json.loads((run_dir / "run.json").read_text())
    assert doc["status"] == "completed" and doc["metrics"]["completed"] == 6 and doc["capture"]["complete"]
    assert doc["config"]["host"]["api_key_env"] == KEY_ENV
    assert all(phase["flush"]["ok"] for phase in doc["phases"])
    log = (run_dir / "server.log").read_text()
    assert "API key required" in log and "refused" not in log  # secured, and every request had the key
    assert log.count("flush_cache done") == 3  # before each phase, and the capture's write request
    assert "--api-key" not in doc["host"]["command"]  # the key went through the environment
    assert files_holding(run_dir) == [] and KEY not in p.stdout + p.stderr


@pytest.mark.slow
def test_a_secured_external_server_through_run_frontier_report_and_curation(tiny_model_dir, tmp_path):
    server = start_server(tiny_model_dir, tmp_path, env=_env(REMNANT_API_KEY=KEY))
    out = tmp_path / "out"
    external = ["host=external", f"host.base_url={server.base_url}", "workload=smoke"]
    try:
        run = _cli("remnant-run", *external, f"host.api_key_env={KEY_ENV}", f"hydra.run.dir={out}/run",
                   cwd=tmp_path, env=_env(**{KEY_ENV: KEY}))
        frontier = _cli("remnant-frontier", *external, f"host.api_key_env={KEY_ENV}", "slo.ttft_p99_ms=1e9",
                        "search.max=1", f"hydra.run.dir={out}/frontier", cwd=tmp_path, env=_env(**{KEY_ENV: KEY}))
    finally:
        stop_server(server)
    assert run.returncode == 0, run.stderr
    assert frontier.returncode == 0, frontier.stderr
    assert json.loads((out / "run" / "run.json").read_text())["status"] == "completed"
    report = _cli("remnant-report", str(out / "run"), str(out / "frontier"), "--out", str(out / "report"),
                  cwd=tmp_path, env=_env())
    assert report.returncode == 0, report.stderr
    curate = subprocess.run([sys.executable, "-m", "remnant.cli.curate", str(out / "frontier"), "--name", "secured",
                             "--description", "a secured server", "--benchmarks", str(out / "benchmarks")],
                            capture_output=True, text=True, timeout=120, env=_env())
    assert curate.returncode == 0, curate.stderr
    assert (out / "frontier" / "frontier.json").is_file() and (out / "benchmarks" / "secured" / "collection.json").is_file()
    assert files_holding(out) == []


@pytest.mark.slow
@pytest.mark.parametrize(("key_env", "line"), [
    (None, "wants an API key: GET /server_info answered HTTP 401 (Unauthorized: no API key; send the header "
           "'Authorization: Bearer <key>'); put the key in an environment variable and name it: host.api_key_env=VAR"),
    ("WRONG_KEY", "refused the API key in host.api_key_env=WRONG_KEY: GET /server_info answered HTTP 401 "
                  "(Unauthorized: wrong API key); check the key that WRONG_KEY holds"),
])
def test_a_missing_or_wrong_key_fails_the_run_at_serve_in_one_line(tiny_model_dir, tmp_path, key_env, line):
    server = start_server(tiny_model_dir, tmp_path, env=_env(REMNANT_API_KEY=KEY))
    run_dir = tmp_path / "run"
    given = [] if key_env is None else [f"host.api_key_env={key_env}"]
    try:
        p = _cli("remnant-run", "host=external", f"host.base_url={server.base_url}", "workload=smoke", *given,
                 f"hydra.run.dir={run_dir}", cwd=tmp_path, env=_env(WRONG_KEY="sk-not-the-key-0000"))
    finally:
        stop_server(server)
    assert p.returncode == 1
    assert p.stderr.strip() == f"remnant-run: run failed at serve: the server at {server.base_url} {line}"
    doc = json.loads((run_dir / "run.json").read_text())
    assert doc["status"] == "failed" and doc["error"]["stage"] == "serve" and doc["phases"] == []
    assert not (run_dir / "requests.jsonl").exists()  # stopped before the warm-up
    refused = [x for x in server.log_path.read_text().splitlines() if "refused" in x]
    assert len(refused) == 1 and "GET /server_info" in refused[0]


class _EchoesItsKey(BaseHTTPRequestHandler):
    """A server that, as SGLang does, returns its key in /server_info (its ServerArgs)."""

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {KEY}":
            return True
        self.send_response(401)
        self.end_headers()
        return False

    def do_GET(self):  # noqa: N802
        if self.path == "/health" or self._authorized():
            body = json.dumps({"api_key": KEY, "version": "0.5.18"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        if not self._authorized():
            return
        if self.path == "/flush_cache":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        stream_generate(self, 3, prompt_tokens=4, incremental=False)

    def log_message(self, *args):
        pass


def test_a_key_the_server_echoes_is_redacted_from_run_json(tmp_path):
    run_dir = tmp_path / "run"
    with loopback_server(_EchoesItsKey) as url:
        p = _cli("remnant-run", "host=external", f"host.base_url={url}", "workload=smoke",
                 f"host.api_key_env={KEY_ENV}", f"hydra.run.dir={run_dir}", cwd=tmp_path, env=_env(**{KEY_ENV: KEY}))
    assert p.returncode == 0, p.stderr
    doc = json.loads((run_dir / "run.json").read_text())
    assert doc["server_info"]["api_key"] == REDACTED and doc["metrics"]["completed"] == 6
    assert files_holding(run_dir) == []


@pytest.mark.parametrize(("value", "message"), [
    (None, f"host.api_key_env={KEY_ENV}, but environment variable {KEY_ENV} is not set or empty; "
           f"export {KEY_ENV}=<the server's API key>"),
    ("short", f"host.api_key_env={KEY_ENV}: the key in {KEY_ENV} has 5 characters; allowed: at least 8"),
    ("sk-with\nnewline", f"host.api_key_env={KEY_ENV}: the key in {KEY_ENV} cannot travel in an HTTP header"),
    (" sk-padded-key", f"host.api_key_env={KEY_ENV}: the key in {KEY_ENV} cannot travel in an HTTP header"),
])
def test_read_key_names_the_field_and_variable_never_the_key(monkeypatch, value, message):
    monkeypatch.delenv(KEY_ENV, raising=False)
    if value is not None:
        monkeypatch.setenv(KEY_ENV, value)
    with pytest.raises(ConfigError, match=message) as err:
        read_key(KEY_ENV)
    assert value is None or value not in str(err.value)


def test_read_key():
    assert read_key(None) is None
    with pytest.raises(ConfigError, match="host.api_key_env=sk-abc def is not an environment variable name"):
        read_key("sk-abc def")


def test_a_key_given_in_the_config_is_refused_and_its_record_keeps_none(tmp_path):
    with pytest.raises(ConfigError, match="host.server_args holds --api-key: a key there would be recorded"):
        refuse_inline_keys(["--tp", "4", f"--api-key={KEY}"], {}, "host.server_args", "host.env")
    with pytest.raises(ConfigError, match="host.env sets REMNANT_API_KEY: a key there would be recorded"):
        refuse_inline_keys([], {"REMNANT_API_KEY": KEY}, "host.server_args", "host.env")
    config = {"host": {"kind": "local", "server_args": ["--admin-api-key", KEY, "--api-key", KEY, "--tp", "4"],
                       "env": {"REMNANT_API_KEY": KEY, "HF_TOKEN": "x"}},
              "model": {"server_args": [f"--api-key={KEY}"]}, "workload": {"name": "smoke", "seed": 0}}
    assert redact_inline_keys(config)["host"] == {
        "kind": "local", "server_args": ["--admin-api-key", REDACTED, "--api-key", REDACTED, "--tp", "4"],
        "env": {"REMNANT_API_KEY": REDACTED, "HF_TOKEN": "x"}}
    record_config_error(tmp_path, config, "host.server_args holds --api-key")
    assert files_holding(tmp_path) == []


def test_a_local_run_refuses_a_key_in_its_server_args(tmp_path):
    p = _cli("remnant-run", "host=local", "host.server=embedded", f"host.server_args=[--api-key,{KEY}]",
             f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env=_env())
    assert p.returncode == 2
    assert "host.server_args holds --api-key: a key there would be recorded with the config" in p.stderr
    assert KEY not in p.stderr and files_holding(tmp_path) == []


def test_redact_and_redact_file(tmp_path):
    assert redact({"a": [KEY, 3, {"b": f"api_key='{KEY}'"}]}, KEY) == {"a": [REDACTED, 3, {"b": f"api_key='{REDACTED}'"}]}
    assert redact({"a": KEY}, None) == {"a": KEY}
    log = tmp_path / "server.log"
    text = f"start\nserver_args=ServerArgs(api_key='{KEY}', tp_size=4) {KEY}\nend without newline {KEY}"
    log.write_text(text)
    assert redact_file(log, KEY) is True
    assert log.read_text() == text.replace(KEY, "*" * len(KEY))
    assert redact_file(log, KEY) is False and redact_file(tmp_path / "absent.log", KEY) is False
