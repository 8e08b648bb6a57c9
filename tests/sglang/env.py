"""Whether this environment can import the real sglang package, and running probes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _sglang_missing() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (pip install --no-deps sglang==0.5.18)"
    if importlib.util.find_spec("torchvision") is None:
        # sglang/__init__ -> sglang/srt/utils/common.py: `from torchvision.io import decode_jpeg`.
        return ("sglang 0.5.18 imports torchvision when the package loads (sglang/srt/utils/common.py), and "
                "PyPI has no CPU torchvision for torch 2.13.0; these run where torch 2.14.1 + torchvision 0.29.1 "
                "+ transformers 5.12.1 are installed (README, SGLang plugin)")
    return None


SGLANG_MISSING = _sglang_missing()
needs_sglang = pytest.mark.skipif(SGLANG_MISSING is not None, reason=SGLANG_MISSING or "")


def probe(check: str, *args: object, **env: str) -> dict:
    """Run tests/sglang/probe.py CHECK in a fresh interpreter with REMNANT_* `env`; its JSON."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("REMNANT_") and k != "SGLANG_PLUGINS"}
    proc = subprocess.run([sys.executable, "-m", "tests.sglang.probe", check, *map(str, args)],
                          cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"probe {check} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("PROBE "):])


def run_loader(**env: str) -> subprocess.CompletedProcess:
    """SGLang's plugin loader, nothing else, in a fresh interpreter."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("REMNANT_") and k != "SGLANG_PLUGINS"}
    code = "from sglang.srt.plugins import load_plugins; load_plugins(); print('LOADED')"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**clean, **env},
                          capture_output=True, text=True, timeout=600)
