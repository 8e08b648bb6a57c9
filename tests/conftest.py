"""Shared fixtures: a generated tiny model directory and a real remnant-serve on loopback."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

# Without a GPU, Triton kernels (ours and SGLang's) run under Triton's interpreter. It must
# be chosen before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from remnant.config import ModelConfig
from remnant.engine.model_dir import write_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_model_dir(dataclasses.asdict(ModelConfig()), tmp_path_factory.mktemp("tiny"))


@dataclasses.dataclass
class Server:
    base_url: str
    proc: subprocess.Popen
    log_path: Path


def start_server(model_dir: Path, workdir: Path, *extra: str, timeout_s: float = 60, env: dict | None = None) -> Server:
    """Start `remnant-serve` as a real child process on a free port; wait for /health.
    env: the server's environment (default: this process's)."""
    port_file = workdir / "port"
    log_path = workdir / "server.log"
    cmd = [sys.executable, "-m", "remnant.cli.serve", "--model-dir", str(model_dir),
           "--port", "0", "--port-file", str(port_file), "--threads", "1", *extra]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"remnant-serve did not start:\n{log_path.read_text()}")
        time.sleep(0.05)
    base_url = f"http://127.0.0.1:{port_file.read_text()}"
    while True:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return Server(base_url, proc, log_path)
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"remnant-serve never became healthy:\n{log_path.read_text()}")
        time.sleep(0.1)


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory):
    """One shared real server for API tests (session scope: starting one costs ~2 s)."""
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("server"))
    yield s
    stop_server(s)
