"""remnant-report over a real sweep: tables with CIs, paired deltas, plots; sweeps resume."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remnant.report.stats import mean_ci, t975

BIN = Path(sys.executable).parent


def _run(*args, cwd):
    return subprocess.run([str(BIN / args[0]), *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_mean_ci_by_hand():
    mean, half, n = mean_ci([1.0, 2.0, 3.0])
    assert (mean, n) == (2.0, 3) and half == pytest.approx(4.303 * 1.0 / 3 ** 0.5)
    assert mean_ci([5.0]) == (5.0, None, 1) and mean_ci([]) == (None, None, 0)
    assert t975(1) == 12.706 and t975(100) == 1.96


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    p = _run("remnant-run", "-m", "mode=native,triton,kernel", "seed=0,1", "workload=smoke",
             f"hydra.sweep.dir={root}/sweep", cwd=root)
    assert p.returncode == 0, p.stderr
    assert "6 of 6 cells completed" in p.stderr
    return root


@pytest.mark.slow
def test_report_tables_deltas_and_plots(sweep):
    out = sweep / "report"
    p = _run("remnant-report", str(sweep / "sweep"), "--out", str(out), cwd=sweep)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == str(out / "report.md")
    text = (out / "report.md").read_text()
    for mode in ("native", "triton", "kernel"):
        assert f"| smoke | {mode} |" in text
    assert text.count("| smoke | 0 |") == 2 and text.count("| smoke | 1 |") == 2  # paired rows per seed
    for mode in ("triton", "kernel"):  # and each mode's over both seeds, every delta with its interval
        (row,) = [line for line in text.splitlines() if line.startswith(f"| smoke | mean of 2 seeds | {mode} |")]
        assert row.count("±") == 4, row
    assert "refused" not in text and "±" in text
    assert "a single run" not in text and "one run per cell" not in text  # two seeds per cell answer that caveat
    # One concurrency in the sweep: throughput as bars by mode, not a line through one x;
    # random prompts hit no cache: no cache plot.
    for png in ("latency.png", "throughput_by_mode.png", "capacity_by_mode.png"):
        assert (out / png).stat().st_size > 5000
    assert not (out / "throughput_vs_concurrency.png").exists()
    assert not list(out.glob("cache_hit*.png"))
    limits = text.split("## Limits", 1)[1]
    assert len(limits.strip().splitlines()) == len(set(limits.strip().splitlines()))


def _runs(tmp_path, cells) -> "pd.DataFrame":
    """A runs table as remnant.report.runs.load_runs makes it, one row per (mode, concurrency,
    cache_hit_rate, workload config) cell, each with a run.json holding its config."""
    import json

    import pandas as pd

    rows = []
    for i, (mode, concurrency, hit, workload) in enumerate(cells):
        path = tmp_path / f"{i}.json"
        path.write_text(json.dumps({"config": {"workload": workload}}))
        rows.append({"workload": "w", "variant": "", "mode": mode, "retention": "-" if mode == "native" else "r256",
                     "status": "completed",
                     "concurrency": concurrency, "output_throughput": 10.0 + i, "cache_hit_rate": hit,
                     "path": str(path), "run_dir": str(tmp_path)})
    return pd.DataFrame(rows)


def test_plots_fit_the_data_they_have(tmp_path):
    from remnant.report import plots

    several = _runs(tmp_path, [("native", 2, 0.0, {}), ("native", 8, 0.0, {}), ("kernel", 2, 0.0, {}),
                               ("kernel", 8, 0.0, {})])
    assert plots.throughput(several, tmp_path).name == "throughput_vs_concurrency.png"
    assert plots.cache_hits(several, tmp_path) is None  # no run hit the cache
    one = _runs(tmp_path, [("native", 4, 0.3, {}), ("kernel", 4, 0.9, {})])
    assert plots.throughput(one, tmp_path).name == "throughput_by_mode.png"
    assert plots.cache_hits(one, tmp_path).name == "cache_hit_by_mode.png"
    shared = [{"groups": g, "prefix_len": 1024} for g in (9, 23)]
    working_sets = _runs(tmp_path, [(m, 16, h, w) for m, h in (("native", 0.7), ("kernel", 0.9)) for w in shared])
    assert plots.cache_hits(working_sets, tmp_path).name == "cache_hit_vs_working_set.png"
    for png in tmp_path.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    # A line per mode, and per retention, variant or workload where runs differ in one;
    # never per the x axis (a working set is also the shared-prefix runs' variant).
    assert plots.line_keys(several, "concurrency") == ["mode", "retention"]  # "-" and r256
    r128 = several.assign(retention=["-", "-", "r256", "r128"], variant=["groups=9"] * 2 + ["groups=23"] * 2)
    assert plots.line_keys(r128, "concurrency") == ["variant", "mode", "retention"]
    assert plots.line_keys(r128.rename(columns={"variant": "working_set"}), "working_set") == ["mode", "retention"]


@pytest.mark.slow
def test_rerunning_the_sweep_runs_nothing_new(sweep):
    before = {f: f.stat().st_mtime for f in (sweep / "sweep").glob("*/run.json")}
    t0 = time.monotonic()
    p = _run("remnant-run", "-m", "mode=native,triton,kernel", "seed=0,1", "workload=smoke",
             f"hydra.sweep.dir={sweep}/sweep", cwd=sweep)
    assert p.returncode == 0 and time.monotonic() - t0 < 30
    assert p.stderr.count("is complete; skipped") == 6
    assert {f: f.stat().st_mtime for f in (sweep / "sweep").glob("*/run.json")} == before


@pytest.mark.slow
def test_paired_comparison_refused_for_different_streams(tmp_path):
    for mode, length in (("native", 64), ("kernel", 72)):
        p = _run("remnant-run", f"mode={mode}", "workload=smoke", f"workload.input_len={length}",
                 f"hydra.run.dir={tmp_path}/{mode}", cwd=tmp_path)
        assert p.returncode == 0, p.stderr
    p = _run("remnant-report", str(tmp_path / "native"), str(tmp_path / "kernel"), "--out", str(tmp_path / "r"),
             cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "refused: request streams differ" in (tmp_path / "r" / "report.md").read_text()


@pytest.mark.slow
def test_a_full_disk_is_one_line_naming_the_file(sweep, tmp_path):
    """remnant-report into a directory on a full disk (a real tmpfs, filled): one line
    naming the file it could not write, exit status 1, and that file not left half-written."""
    from tests.tmpfs import fill, tmpfs

    with tmpfs(tmp_path / "disk", "64k") as disk:
        fill(disk)
        out = disk / "report"
        p = _run("remnant-report", str(sweep / "sweep"), "--out", str(out), cwd=tmp_path)
        left = [f.name for f in out.iterdir()] if out.is_dir() else []
    assert p.returncode == 1 and "Traceback" not in p.stderr and p.stdout == ""
    (line,) = p.stderr.splitlines()
    m = re.fullmatch(r"remnant-report: error: cannot write (\S+): No space left on device", line)
    assert m and Path(m.group(1)).parent == out, line
    assert Path(m.group(1)).name not in left


def test_report_errors(tmp_path):
    p = _run("remnant-report", str(tmp_path / "nothing"), cwd=tmp_path)
    assert p.returncode == 2 and "does not exist" in p.stderr
    (tmp_path / "empty").mkdir()
    p = _run("remnant-report", str(tmp_path / "empty"), cwd=tmp_path)
    assert p.returncode == 2 and "no run.json under" in p.stderr


def test_packed_windows_are_their_own_retention_cell():
    from remnant.report.runs import retention_label

    assert retention_label({"name": "r256"}) == "r256"
    assert retention_label({"name": "r256", "window_records": "native"}) == "r256"
    assert retention_label({"name": "r256", "window_records": "packed_csa"}) == "r256+csa_swa"
    assert retention_label({"name": "r256", "window_records": "packed", "c128_records": "packed"}) == "r256+swa+c128"


def test_variants_tell_a_sweeps_other_axes_apart():
    # A shared-prefix study's cells differ by mode and workload.groups: groups is the
    # variant; mode, retention, seed and load have columns of their own. A key two
    # sections share a last part with is named whole.
    from remnant.report.runs import variant_labels, workload_label

    def cfg(mode, groups, seed=0, concurrency=16, budget=2250):
        return {"mode": {"name": mode}, "retention": None if mode == "native" else {"name": "r256"}, "seed": seed,
                "workload": {"name": "sp", "groups": groups, "concurrency": concurrency, "seed": seed},
                "host": {"kv_budget_mib": budget}}

    configs = [cfg("native", 16), cfg("kernel", 16, seed=1, concurrency=8), cfg("native", 32), cfg("kernel", 40)]
    assert variant_labels(configs, ["sp"] * 4) == ["groups=16", "groups=16", "groups=32", "groups=40"]
    assert variant_labels(configs[:2], ["sp"] * 2) == ["", ""]  # only mode, seed and load differ
    two = [cfg("native", 16, budget=1), {**cfg("native", 32, budget=2), "model": {"groups": 3}}]
    assert variant_labels(two, ["sp", "sp"]) == ["kv_budget_mib=1, model.groups=unset, workload.groups=16",
                                                 "kv_budget_mib=2, model.groups=3, workload.groups=32"]
    assert variant_labels(two, ["a", "b"]) == ["", ""]  # each workload on its own
    # Which GPUs and ports a local server took (from the environment) is no variant.
    ports = [{**cfg("native", 16), "host": {"gpus": "0,1", "port": 3000}}, {**cfg("native", 16), "host": {"gpus": "2,3"}}]
    assert variant_labels(ports, ["sp", "sp"]) == ["", ""]
    assert workload_label("sp", "groups=16") == "sp (groups=16)" and workload_label("sp", "") == "sp"


def test_retention_labels_name_what_else_differs():
    # Packed runs of one retention label but another policy or map are not repeats of one
    # cell; native runs have no retention to tell apart.
    from remnant.report.runs import retention_details

    configs = [{"retention": {"name": "r256", "retention": 256, "policy": policy, "map_path": None}}
               for policy in ("attention", "prefix")] + [{"retention": {"name": "r256", "policy": "x"}},
                                                         {"retention": {"name": "r128", "policy": "prefix"}}]
    labels = ["r256", "r256", "-", "r128"]
    assert retention_details(configs, labels, ["w"] * 4) == [
        "r256 (policy=attention)", "r256 (policy=prefix)", "-", "r128"]
    assert retention_details(configs, labels, ["a", "b", "a", "a"]) == labels  # each workload on its own


def test_summary_keeps_variants_apart():
    import pandas as pd

    from remnant.report.stats import summary

    runs = pd.DataFrame([{"workload": "sp", "variant": f"groups={g}", "mode": "native", "retention": "-",
                          "load": "c=16", "status": "completed", "output_throughput": float(g)} for g in (16, 32)])
    table = summary(runs, ["output_throughput"])
    assert list(table["variant"]) == ["groups=16", "groups=32"] and list(table["runs"]) == [1, 1]
    assert list(table["output_throughput"]) == [16.0, 32.0]


@pytest.mark.slow
def test_goodput_at_an_slo(sweep, tmp_path):
    # A bound every request meets counts every measured request (goodput = request
    # throughput); one none meets counts none; a bound that is no bound is refused.
    import json

    loose = _run("remnant-report", str(sweep / "sweep"), "--out", str(tmp_path / "a"), "--slo-ttft-ms", "1e9",
                 "--slo-tpot-ms", "1e9", cwd=sweep)
    assert loose.returncode == 0, loose.stderr
    text = (tmp_path / "a" / "report.md").read_text()
    assert "goodput req/s |" in text and "TTFT <= 1e+09 ms and TPOT <= 1e+09 ms each" in text
    native = [json.loads(p.read_text())["metrics"] for p in (sweep / "sweep").glob("*native*/run.json")]
    assert len(native) == 2  # two seeds: the column is their mean
    want = sum(m["completed"] / m["duration_s"] for m in native) / 2
    row = next(line for line in text.splitlines() if line.startswith("| smoke | native |"))
    assert row.split("|")[-2].strip().startswith(f"{want:.2f} ± ")
    tight = _run("remnant-report", str(sweep / "sweep"), "--out", str(tmp_path / "b"), "--slo-ttft-ms", "0.001",
                 cwd=sweep)
    assert tight.returncode == 0 and "| 0.00 ± 0.00 |" in (tmp_path / "b" / "report.md").read_text()
    assert "TPOT" not in (tmp_path / "b" / "report.md").read_text().split("Goodput:", 1)[1].splitlines()[0]
    bad = _run("remnant-report", str(sweep / "sweep"), "--slo-tpot-ms", "0", cwd=sweep)
    assert bad.returncode == 2 and "--slo-tpot-ms=0 is not allowed; it must be milliseconds > 0" in bad.stderr


def test_a_degraded_run_gets_its_goodput_in_the_failed_list(sweep, tmp_path):
    # The summary averages completed runs only; a degraded one (too many requests failed)
    # is listed with its goodput at the SLO, its failed requests counted as misses.
    import json
    import shutil

    runs = tmp_path / "runs"
    for i, src in enumerate(sorted((sweep / "sweep").glob("*native*"))):
        shutil.copytree(src, runs / src.name)
        if i == 0:  # half its measured requests failed, as the run would record them
            requests = [json.loads(line) for line in (runs / src.name / "requests.jsonl").read_text().splitlines()]
            measured = [r for r in requests if r["phase"] == "measured"]
            for r in measured[: len(measured) // 2]:
                r.update(success=False, error="HTTP 503: overloaded")
            (runs / src.name / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
            record = json.loads((runs / src.name / "run.json").read_text())
            failed = len(measured) // 2
            record.update(status="degraded",
                          error={"stage": "client", "type": "FailedRequests", "message": f"{failed} failed"},
                          failures={"measured": len(measured), "failed": failed, "share": failed / len(measured),
                                    "max_share": 0.05, "errors": [{"message": "HTTP 503: overloaded", "count": failed}]})
            (runs / src.name / "run.json").write_text(json.dumps(record))
            want = (len(measured) - failed) / record["metrics"]["duration_s"]
            degraded = src.name
    p = _run("remnant-report", str(runs), "--out", str(tmp_path / "out"), "--html", "--slo-ttft-ms", "1e9", cwd=sweep)
    assert p.returncode == 0, p.stderr
    text = (tmp_path / "out" / "report.md").read_text()
    line = next(line for line in text.split("## Failed or interrupted runs", 1)[1].splitlines() if degraded in line)
    assert f": degraded (client: {failed} failed); goodput {want:.2f} req/s at the SLO, failed requests as misses" in line
    assert f"goodput {want:.2f}" in (tmp_path / "out" / "report.html").read_text()
    plain = _run("remnant-report", str(runs), "--out", str(tmp_path / "plain"), cwd=sweep)
    assert plain.returncode == 0, plain.stderr
    assert "goodput" not in (tmp_path / "plain" / "report.md").read_text().split("## Failed or interrupted runs")[1]


def test_pairs_take_the_native_run_of_the_same_variant(tmp_path):
    # Two native cells on one request stream (a host axis: the fingerprint is the same):
    # each packed run is compared with the native run of its own variant.
    import json

    import pandas as pd

    from remnant.report.stats import paired_deltas

    rows = []
    for name, mode, variant, ttft in (("n1", "native", "kv=1", 1.0), ("n2", "native", "kv=2", 3.0),
                                      ("k2", "kernel", "kv=2", 2.5)):
        run = tmp_path / name
        run.mkdir()
        run.joinpath("requests.jsonl").write_text("".join(
            json.dumps({"id": i, "phase": "measured", "success": True, "ttft_s": ttft, "e2e_s": ttft + 1}) + "\n"
            for i in range(3)))
        rows.append({"mode": mode, "retention": "-" if mode == "native" else "r256", "workload": "w",
                     "variant": variant, "seed": 0, "load": "c=1", "fingerprint": "f", "status": "completed",
                     "run_dir": str(run)})
    (delta,) = paired_deltas(pd.DataFrame(rows)).to_dict("records")
    assert delta["variant"] == "kv=2" and delta["joined"] == 3 and delta["baseline_variant"] == "kv=2"
    assert delta["delta_ttft_ms"] == pytest.approx(-500.0)  # against n2 (3.0 s), not n1 (1.0 s)
    # With no native run of its variant (n2 failed), another native run of the stream, named.
    from remnant.report.model import delta_rows

    deltas = paired_deltas(pd.DataFrame([rows[0], rows[2]]))
    assert deltas.iloc[0]["baseline_variant"] == "kv=1" and deltas.iloc[0]["delta_ttft_ms"] == pytest.approx(1500.0)
    assert delta_rows(deltas).rows[0][-1] == "against the native run of kv=1"
    assert delta_rows(paired_deltas(pd.DataFrame(rows))).rows[0][-1] == ""


def test_seed_deltas_average_the_seeds_and_bound_them_over_seeds(tmp_path):
    # Three seeds of a native and a kernel run; four of each kernel run's requests are
    # faster by the seed's own amount, a one-token request is unchanged. Per seed the TPOT
    # delta's per-request interval is 0 (every request with a TPOT moved alike); over seeds
    # each interval is the seeds' spread, by hand.
    import json

    import pandas as pd

    from remnant.report.model import delta_rows
    from remnant.report.stats import paired_deltas, seed_deltas, t975

    rows, shift = [], {0: 0.10, 1: 0.20, 2: 0.60}
    for seed in shift:
        for mode in ("native", "kernel"):
            run = tmp_path / f"{mode}-{seed}"
            run.mkdir()
            d = shift[seed] if mode == "kernel" else 0.0
            # 9 tokens: TPOT = (e2e - ttft) / 8; the kernel run's decode is d faster in all.
            run.joinpath("requests.jsonl").write_text("".join(json.dumps(
                {"id": i, "phase": "measured", "success": True, "ttft_s": 1.0 - d, "e2e_s": 3.0 - 2 * d,
                 "completion_tokens": 9}) + "\n" for i in range(4)) + json.dumps(
                {"id": 9, "phase": "measured", "success": True, "ttft_s": 1.0, "e2e_s": 1.0, "completion_tokens": 1}))
            rows.append({"mode": mode, "retention": "-" if mode == "native" else "r256", "workload": "w",
                         "variant": "", "seed": seed, "load": "c=4", "fingerprint": f"f{seed}", "status": "completed",
                         "output_throughput": 100.0 + (10 * seed if mode == "kernel" else 0), "run_dir": str(run)})
    deltas = paired_deltas(pd.DataFrame(rows))
    first = deltas[deltas["seed"] == 0].iloc[0]
    assert first["joined"] == 5 and first["delta_ttft_ms"] == pytest.approx(-100.0 * 4 / 5)
    assert first["delta_tpot_ms"] == pytest.approx(-100.0 / 8)  # the one-token request has no TPOT
    assert first["delta_tpot_ci_ms"] == pytest.approx(0.0, abs=1e-9)
    assert first["delta_throughput"] == 0.0 and deltas.iloc[2]["delta_throughput"] == 20.0
    (over,) = seed_deltas(deltas).to_dict("records")
    assert over["seeds"] == 3 and over["joined"] == 15
    ttft = [-80.0, -160.0, -480.0]  # each seed's mean over 5 requests, one unchanged
    mean = sum(ttft) / 3
    sd = (sum((x - mean) ** 2 for x in ttft) / 2) ** 0.5
    assert over["delta_ttft_ms"] == pytest.approx(mean)
    assert over["delta_ttft_ci_ms"] == pytest.approx(t975(2) * sd / 3 ** 0.5)
    assert over["delta_throughput"] == pytest.approx(10.0) and over["delta_throughput_ci"] == pytest.approx(
        t975(2) * 10.0 / 3 ** 0.5)
    table = delta_rows(deltas, seed_deltas(deltas))
    assert [r[1] for r in table.rows] == ["0", "1", "2", "mean of 3 seeds"]
    # One seed paired, another refused (its kernel run on another request stream): no row
    # over seeds, the refused row does not count as one.
    rows[3] = {**rows[3], "fingerprint": "other"}
    refused = paired_deltas(pd.DataFrame(rows[:4]))
    assert refused["refused"].notna().tolist() == [False, True]
    assert seed_deltas(refused).empty
