"""The Pareto view of a sweep: tokens/s per user against per GPU, from real run directories
(tests/report/conftest.py: four cells, native and kernel at concurrency 1 and 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remnant.report.pareto import optimal, pareto_plot, points
from remnant.report.runs import load_runs, server_devices
from tests.report.conftest import remnant

PNG = b"\x89PNG\r\n\x1a\n"
CPU = "the embedded engine on CPU counted as 1 device"


def test_optimal_by_hand():
    # (per GPU, per user): (2, 8) is beaten by (3, 9); (1, 10) and (4, 5) trade off;
    # a duplicate of an optimal point is optimal too (neither is better).
    x, y = [1, 2, 3, 4, 3], [10, 8, 9, 5, 9]
    assert optimal(x, y) == [True, False, True, True, True]
    assert optimal([1.0], [1.0]) == [True] and optimal([], []) == []


@pytest.mark.slow
def test_devices_from_what_the_record_says(report_inputs):
    doc = json.loads(next(report_inputs.sweep.glob("*/run.json")).read_text())
    assert server_devices(doc) == (1, CPU)
    on_gpu = {**doc, "server_info": {**doc["server_info"], "device": "cuda"}}
    assert server_devices(on_gpu) == (1, None)
    # SGLang's /server_info carries its ServerArgs: tp x pp GPUs, times dp replicas unless
    # DP attention splits the same GPUs.
    for args, gpus in (({"tp_size": 4}, 4), ({"tp_size": 4, "pp_size": 2}, 8),
                       ({"tp_size": 4, "dp_size": 2}, 8),
                       ({"tp_size": 4, "dp_size": 4, "enable_dp_attention": True}, 4)):
        assert server_devices({**doc, "server_info": {"version": "0.5.18", **args}}) == (gpus, None)
    no_info = {**doc, "server_info": None, "config": {**doc["config"], "model": {"tp_size": 4}}}
    assert server_devices(no_info) == (4, "the server did not report tp_size: model.tp_size=4 from the config")
    assert server_devices({"server_info": None, "config": {}})[0] == 1


@pytest.mark.slow
def test_points_and_plot_from_a_sweep(report_inputs, tmp_path):
    runs = load_runs([report_inputs.sweep])
    pts = points(runs)
    assert sorted(zip(pts["mode"], pts["concurrency"])) == [("kernel", 1), ("kernel", 4), ("native", 1), ("native", 4)]
    for _, run in runs.iterrows():
        m = json.loads(Path(run["path"]).read_text())["metrics"]
        row = pts[(pts["mode"] == run["mode"]) & (pts["concurrency"] == run["concurrency"])].iloc[0]
        assert row["per_user"] == pytest.approx(1000 / m["tpot_ms"]["p50"])
        assert row["per_gpu"] == pytest.approx(m["output_throughput"])  # one device
        assert row["assumed"] == [CPU] and row["runs"] == 1
    png = pareto_plot(runs, tmp_path / "pareto.png")
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 5000
    # One cell has no trade-off to show.
    assert pareto_plot(runs[runs["run_dir"] == runs["run_dir"].iloc[0]], tmp_path / "one.png") is None
    assert not (tmp_path / "one.png").exists()


@pytest.mark.slow
def test_report_lists_the_pareto_plot_and_its_assumption(report_inputs, tmp_path):
    out = tmp_path / "report"
    p = remnant("remnant-report", str(report_inputs.sweep), "--out", str(out), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    text = (out / "report.md").read_text()
    assert "![pareto](pareto.png)" in text and (out / "pareto.png").read_bytes()[:8] == PNG
    assert f"- pareto.png, output tok/s per GPU: {CPU}" in text
    # Cells at different loads are rows of their own, not repeats of one another: one run
    # each, so the report says it has no interval.
    for mode in ("native | -", "kernel | r256"):
        for load in ("c=1", "c=4"):
            assert f"| smoke | {mode} | {load} | 1 |" in text
    assert "- one run per cell: no confidence interval" in text
    one = next(report_inputs.sweep.glob("*/run.json")).parent
    p = remnant("remnant-report", str(one), "--out", str(tmp_path / "one"), cwd=tmp_path)
    assert p.returncode == 0 and not (tmp_path / "one" / "pareto.png").exists()
    assert "pareto" not in (tmp_path / "one" / "report.md").read_text()
