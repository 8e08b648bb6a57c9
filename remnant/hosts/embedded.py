"""Embedded host: `remnant-serve` in a child process on a free loopback port.

The child binds port 0 itself and reports the port through a file, so parallel runs never
clash. It runs in its own process group and gets SIGTERM if this process dies (Linux
PR_SET_PDEATHSIG), so no server outlives its run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from remnant.api_key import SERVER_ENV
from remnant.config_errors import at_least, positive_finite
from remnant.engine.args import EngineArgs, RetentionArgs, capture_argv
from remnant.hosts.base import (HOSTS, Endpoint, HostConfig, HostError, ServerSpec, fetch_server_info, log_tail, lost_log,
                                wait_healthy)
from remnant.records.files import writing

_STOP_GRACE_S = 10.0


@dataclass
class _HostFields(HostConfig):
    """The embedded host's own fields, ahead of the engine's in EmbeddedHostConfig (the
    order `--cfg job` and run.json show them in)."""

    kind: str = "embedded"
    startup_timeout_s: float = 120.0
    #: torch threads of the server process.
    threads: int = 2
    log_tail_lines: int = 40


@HOSTS.register
@dataclass
class EmbeddedHostConfig(EngineArgs, _HostFields):
    """remnant-serve in a child process on a free loopback port. The engine's settings
    (remnant.engine.args.EngineArgs: host.kv_budget_mib, host.device, ...) are fields of
    this config too, and go to remnant-serve whole."""

    def validate(self) -> None:
        super().validate()
        positive_finite(self.startup_timeout_s, "host.startup_timeout_s")
        at_least(self, "host.", ("threads",), 1)
        self.check("host.")

    def limits(self) -> list[str]:
        return ["embedded reference engine with random weights: text output is meaningless; "
                "timing is the CPU/GPU reference engine's, not SGLang's"]

    def make(self) -> EmbeddedHost:
        return EmbeddedHost(self)


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the finally-stop still covers normal exits and Ctrl-C


def server_env(api_key: str | None) -> dict[str, str]:
    """remnant-serve's environment: this process's, with the run's API key (or none: a
    REMNANT_API_KEY set here for another server must not secure this one). The key goes
    through the environment, not the command line, which run.json records and ps shows."""
    env = {k: v for k, v in os.environ.items() if k != SERVER_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    if api_key is not None:
        env[SERVER_ENV] = api_key
    return env


class EmbeddedHost:
    def __init__(self, cfg: EmbeddedHostConfig):
        self.cfg = cfg
        self._proc: subprocess.Popen | None = None
        self._info: dict = {"kind": "embedded"}

    def describe(self) -> dict:
        return dict(self._info)

    def _model_dir(self, spec: ServerSpec) -> Path:
        if spec.model.path:
            path = Path(spec.model.path)
            if not (path / "config.json").is_file():
                raise HostError(f"model.path={path} has no config.json")
            return path
        from remnant.engine.model_dir import write_model_dir

        return write_model_dir(dataclasses.asdict(spec.model), spec.run_dir / "model")

    @contextlib.contextmanager
    def serve(self, spec: ServerSpec) -> Iterator[Endpoint]:
        model_dir = self._model_dir(spec)
        port_file = spec.run_dir / "server.port"
        port_file.unlink(missing_ok=True)
        cmd = [
            sys.executable, "-m", "remnant.cli.serve",
            "--model-dir", str(model_dir),
            "--host", "127.0.0.1",
            "--port", "0",
            "--port-file", str(port_file),
            "--mode", spec.mode,
            "--threads", str(self.cfg.threads),
            *self.cfg.engine_args().to_argv(),
        ]
        if spec.retention is not None:
            cmd += RetentionArgs.of(spec.retention).to_argv()
        cmd += capture_argv(spec.capture)
        with writing(spec.log_path):
            log = open(spec.log_path, "ab")
        env = server_env(spec.api_key)
        self._proc = proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_die_with_parent, env=env,
        )
        self._info.update({"command": cmd, "pid": proc.pid, "model_dir": str(model_dir)})

        def failure() -> str | None:
            code = proc.poll()
            if code is None:
                return None
            lost = lost_log(spec.log_path)
            if lost:
                return f"remnant-serve exited with code {code}, its error lost: {lost}"
            return (
                f"remnant-serve exited with code {code}; last lines of {spec.log_path.name}:\n"
                + log_tail(spec.log_path, self.cfg.log_tail_lines)
            )

        try:
            base_url = self._wait_port(port_file, failure)
            self._info.update({"base_url": base_url})
            try:
                wait_healthy(base_url, self.cfg.startup_timeout_s, failure, api_key=spec.api_key,
                             key_env=self.cfg.api_key_env)
            except HostError as exc:
                if proc.poll() is None:
                    raise HostError(f"{exc}; last lines of {spec.log_path.name}:\n"
                                    + log_tail(spec.log_path, self.cfg.log_tail_lines)) from None
                raise
            info = fetch_server_info(base_url, spec.api_key, self.cfg.api_key_env)
            # remnant-serve collects its environment itself, where the work runs.
            env = (info or {}).get("environment")
            yield Endpoint(base_url, environment=env, failure=failure, server_info=info)
        finally:
            try:
                self._stop(proc)
            finally:
                log.close()
                port_file.unlink(missing_ok=True)
                self._info["exit_code"] = proc.returncode

    def _wait_port(self, port_file: Path, failure) -> str:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while not port_file.exists():
            why = failure()
            if why:
                raise HostError(why)
            if time.monotonic() > deadline:
                raise HostError(f"remnant-serve did not bind a port within {self.cfg.startup_timeout_s:g}s")
            time.sleep(0.05)
        return f"http://127.0.0.1:{int(port_file.read_text())}"

    @staticmethod
    def _stop(proc: subprocess.Popen) -> None:
        """SIGTERM the server's process group (and SIGCONT, so a stopped server gets it),
        then SIGKILL after a grace period, or at once on a second Ctrl-C or SIGTERM."""
        if proc.poll() is not None:
            return

        def kill(sig: int) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)

        try:
            kill(signal.SIGTERM)
            kill(signal.SIGCONT)
            proc.wait(timeout=_STOP_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            pass
        except KeyboardInterrupt:
            # A second signal: no grace; the caller still records what it can.
            kill(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5.0)
            raise
        kill(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
