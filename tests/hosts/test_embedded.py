"""Embedded host: starts remnant-serve, hands out a live endpoint, always stops it, and
explains a failed start with the server log's tail."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import httpx
import pytest

from remnant.config import ModelConfig, RetentionConfig
from remnant.hosts import HostError, ServerSpec, make_host
from remnant.hosts.embedded import EmbeddedHostConfig, server_env


def _spec(tmp_path: Path, mode: str = "native", **model) -> ServerSpec:
    return ServerSpec(mode, None if mode == "native" else RetentionConfig(), ModelConfig(**model),
                      tmp_path, tmp_path / "server.log")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return "State:\tZ" in Path(f"/proc/{pid}/status").read_text()


def test_serve_and_stop(tmp_path):
    host = make_host(EmbeddedHostConfig(threads=1))
    with host.serve(_spec(tmp_path)) as ep:
        assert ep.failure() is None
        assert httpx.get(f"{ep.base_url}/health").status_code == 200
        assert ep.environment["python"]
        pid = host.describe()["pid"]
    assert host.describe()["exit_code"] is not None
    assert _gone(pid)
    assert (tmp_path / "model" / "config.json").is_file()
    assert not (tmp_path / "server.port").exists()


@pytest.mark.slow
def test_the_key_reaches_the_server_through_its_environment_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("REMNANT_API_KEY", "sk-meant-for-another-server")  # not this run's
    host = make_host(EmbeddedHostConfig(threads=1))
    with host.serve(_spec(tmp_path)) as ep:
        assert httpx.get(f"{ep.base_url}/server_info").status_code == 200  # no key: not secured
    spec = dataclasses.replace(_spec(tmp_path), api_key="sk-embedded-test-key")
    with host.serve(spec) as ep:
        assert httpx.get(f"{ep.base_url}/server_info").status_code == 401
        assert ep.server_info["remnant_mode"] == "native"  # the host's probe sent the key
        assert "sk-embedded-test-key" not in " ".join(host.describe()["command"])
    assert server_env("sk-x-12345678")["REMNANT_API_KEY"] == "sk-x-12345678"
    assert "REMNANT_API_KEY" not in server_env(None)


@pytest.mark.slow
def test_stopped_on_error_inside(tmp_path):
    host = make_host(EmbeddedHostConfig(threads=1))
    with pytest.raises(RuntimeError, match="boom"):
        with host.serve(_spec(tmp_path)):
            raise RuntimeError("boom")
    assert _gone(host.describe()["pid"])


def test_failed_start_shows_log_tail(tmp_path):
    host = make_host(EmbeddedHostConfig(threads=1))
    spec = _spec(tmp_path, mode="triton")
    spec.retention = RetentionConfig(map_path=str(tmp_path / "missing-map.json"))
    with pytest.raises(HostError) as err:
        with host.serve(spec):
            pass
    msg = str(err.value)
    assert "remnant-serve exited with code 2" in msg
    assert "missing-map.json" in msg  # the server's own error line, from server.log


def test_startup_timeout_shows_log_tail(tmp_path):
    host = make_host(EmbeddedHostConfig(threads=1, startup_timeout_s=0.01))
    t0 = time.monotonic()
    with pytest.raises(HostError) as err:
        with host.serve(_spec(tmp_path)):
            pass
    assert time.monotonic() - t0 < 30
    assert "within 0.01s" in str(err.value)
    assert _gone(host.describe()["pid"])


def test_model_path_without_config(tmp_path):
    host = make_host(EmbeddedHostConfig())
    with pytest.raises(HostError, match=r"model.path=.* has no config.json"):
        with host.serve(_spec(tmp_path, path=str(tmp_path / "nowhere"))):
            pass


def test_given_model_dir_is_used(tmp_path, tiny_model_dir):
    host = make_host(EmbeddedHostConfig(threads=1))
    with host.serve(_spec(tmp_path, path=str(tiny_model_dir))) as ep:
        info = httpx.get(f"{ep.base_url}/model_info").json()
    assert info["model_path"] == str(tiny_model_dir)


def test_unknown_kind():
    @dataclasses.dataclass
    class Odd:
        kind: str = "moon"

    with pytest.raises(ValueError, match="host.kind=moon is not a host; allowed: embedded, external"):
        make_host(Odd())


def _session(*code: str) -> "subprocess.Popen":
    """A real child in its own process group, as the embedded host starts remnant-serve."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "\n".join(code)], start_new_session=True,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_stopped_server_is_stopped_within_the_grace_period():
    """A server frozen with SIGSTOP (a stalled one) that handles SIGTERM, as uvicorn does,
    gets SIGCONT with it, so it shuts down at once instead of after the grace period and a
    SIGKILL (a stopped process keeps a handled signal pending)."""
    import signal

    from remnant.hosts.embedded import EmbeddedHost

    proc = _session("import signal, sys, time", "signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))",
                    "print('ready', flush=True)", "time.sleep(60)")
    os.kill(proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        EmbeddedHost._stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - t0 < 5
    assert proc.returncode == 3  # its own SIGTERM handler ran


def test_a_second_signal_kills_the_server_at_once():
    """A server that ignores SIGTERM has a 10 s grace period; a second Ctrl-C or SIGTERM of
    remnant-run during it kills the server at once and still reaches the caller."""
    import signal
    import threading

    from remnant.hosts.embedded import EmbeddedHost
    from remnant.signals import Interrupted, raise_interrupted

    proc = _session("import signal, time", "signal.signal(signal.SIGTERM, signal.SIG_IGN)",
                    "print('ready', flush=True)", "time.sleep(60)")
    previous = signal.signal(signal.SIGTERM, raise_interrupted)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(Interrupted) as err:
            EmbeddedHost._stop(proc)
        assert time.monotonic() - t0 < 5
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            proc.kill()
    assert err.value.signum == signal.SIGTERM
    assert proc.returncode == -signal.SIGKILL
