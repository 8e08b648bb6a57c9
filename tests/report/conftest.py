"""Real run directories for the report's page and Pareto tests, made once per worker."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent

#: A run limit as hostile as a record can carry: were the page to take it as markup, the
#: element would exist and the handler would log an error.
HOSTILE_LIMIT = '<b id="injected">x</b><img src=x onerror="console.error(1)"> & "quoted" \'single\''


def remnant(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / args[0]), *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=600)


@dataclass(frozen=True)
class ReportInputs:
    sweep: Path    # remnant-run -m mode=native,kernel workload.concurrency=1,4: four cells
    search: Path   # remnant-frontier, concurrency 1 and 2: frontier.json and two step runs
    failed: Path   # a run that failed at serve, carrying HOSTILE_LIMIT


@pytest.fixture(scope="session")
def report_inputs(tmp_path_factory) -> ReportInputs:
    root = tmp_path_factory.mktemp("report-inputs")
    inputs = ReportInputs(root / "sweep", root / "search", root / "failed")
    p = remnant("remnant-run", "-m", "mode=native,kernel", "workload=smoke", "workload.concurrency=1,4",
                f"hydra.sweep.dir={inputs.sweep}", cwd=root)
    assert p.returncode == 0 and len(list(inputs.sweep.glob("*/run.json"))) == 4, p.stderr
    # An SLO every load meets: the search doubles from 1 to search.max=2 and stops there.
    p = remnant("remnant-frontier", "workload=smoke", "slo.ttft_p99_ms=1e9", "search.max=2",
                f"hydra.run.dir={inputs.search}", cwd=root)
    assert p.returncode == 0, p.stderr
    # Nothing listens on port 1: the run fails at serve within the second it waits.
    p = remnant("remnant-run", "workload=smoke", "host=external", "host.base_url=http://127.0.0.1:1",
                "host.health_timeout_s=1", f"limits=[{HOSTILE_LIMIT!r}]", f"hydra.run.dir={inputs.failed}", cwd=root)
    assert p.returncode == 1 and (inputs.failed / "run.json").exists(), p.stderr
    return inputs
