"""server_metrics.png: the server's /metrics beside the client's latency, from real runs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from remnant.report.build import build
from remnant.report.runs import load_runs
from remnant.report.server_metrics import QUEUE, series, server_metrics_plot

BIN = Path(sys.executable).parent
SCHEMAS = Path(str(resources.files("remnant.schemas"))) / "run" / "examples"


@pytest.mark.slow
def test_the_report_plots_the_servers_series_beside_the_clients_latency(tmp_path):
    """A real run on the embedded engine, scraping every 0.1 s."""
    run_dir = tmp_path / "runs" / "scraped"
    p = subprocess.run([str(BIN / "remnant-run"), "workload=smoke", "workload.server_metrics_interval_s=0.1",
                        f"hydra.run.dir={run_dir}"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    # Beside it, the record of a run that scraped nothing (server_metrics null).
    quiet = tmp_path / "runs" / "quiet"
    quiet.mkdir()
    shutil.copy(SCHEMAS / "valid" / "v5-completed-sharegpt-skipped.json", quiet / "run.json")
    runs = load_runs([tmp_path / "runs"])
    (d,) = series(runs)
    assert d["label"] == "native" and d["seed"] == 0 and d["status"] == "completed"
    # Shifted to the measured phase: the warm-up's scrapes before 0, the phase's after.
    assert d["scrapes"][0]["t"] < 0 < d["scrapes"][-1]["t"] and QUEUE in d["scrapes"][0]
    assert len(d["ttft"]) == 8 and all(ms > 0 for _, ms in d["ttft"])
    written, _ = build([run_dir], tmp_path / "report")
    png = tmp_path / "report" / "server_metrics.png"
    assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 10_000
    assert "![server_metrics](server_metrics.png)" in written[0].read_text()
    # Runs that scraped nothing draw no plot.
    assert server_metrics_plot(runs[runs["run_dir"] == str(quiet)], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
