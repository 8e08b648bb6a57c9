"""`remnant-report PATH...`: tables, paired comparisons and plots of run or sweep directories.

    remnant-report multirun/2026-11-29/18-00-00 --out report/

Per workload, mode and retention: the mean and 95 % confidence interval of each metric over
repeated runs; per non-native run, per-request deltas against the native run of the same
request stream (equal workload fingerprints; otherwise refused with the reason); capacity
and cache-hit columns; a Markdown report with the limits the runs carry, and PNG plots.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from remnant.report import frontier, plots
from remnant.report.runs import load_runs
from remnant.report.stats import paired_deltas, summary

COLUMNS = ["output_throughput", "ttft_p50_ms", "tpot_p50_ms", "e2e_p50_ms", "cache_hit_rate", "max_total_num_tokens"]


def _fmt(value, ci=None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return "-"
    text = f"{value:,.{digits}f}"
    if ci is not None and not (isinstance(ci, float) and pd.isna(ci)):
        text += f" ± {ci:,.{digits}f}"
    return text


def summary_markdown(table: pd.DataFrame) -> str:
    head = ["workload", "mode", "retention", "runs", "output tok/s", "TTFT p50 ms", "TPOT p50 ms",
            "E2E p50 ms", "cache hit", "max tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in table.iterrows():
        lines.append("| " + " | ".join([
            r["workload"], r["mode"], r["retention"], str(r["runs"]),
            _fmt(r["output_throughput"], r["output_throughput_ci"]),
            _fmt(r["ttft_p50_ms"], r["ttft_p50_ms_ci"]), _fmt(r["tpot_p50_ms"], r["tpot_p50_ms_ci"]),
            _fmt(r["e2e_p50_ms"], r["e2e_p50_ms_ci"]),
            _fmt(None if pd.isna(r["cache_hit_rate"]) else 100 * r["cache_hit_rate"],
                 None if pd.isna(r["cache_hit_rate_ci"]) else 100 * r["cache_hit_rate_ci"]) + " %",
            _fmt(r["max_total_num_tokens"], None, 0),
        ]) + " |")
    return "\n".join(lines)


def deltas_markdown(deltas: pd.DataFrame) -> str:
    if deltas.empty:
        return "No non-native runs to compare."
    lines = ["| workload | seed | mode | retention | requests joined | ΔTTFT ms | ΔE2E ms | note |",
             "|---|---|---|---|---|---|---|---|"]
    for _, r in deltas.iterrows():
        if r.get("refused"):
            lines.append(f"| {r['workload']} | {r['seed']} | {r['mode']} | {r['retention']} | - | - | - | refused: {r['refused']} |")
        else:
            lines.append(f"| {r['workload']} | {r['seed']} | {r['mode']} | {r['retention']} | {int(r['joined'])} | "
                         f"{_fmt(r['delta_ttft_ms'], r['delta_ttft_ci_ms'])} | {_fmt(r['delta_e2e_ms'], r['delta_e2e_ci_ms'])} | |")
    return "\n".join(lines)


def build(paths: list[Path], out: Path) -> tuple[Path, str]:
    runs = load_runs(paths)
    table = summary(runs, COLUMNS)
    deltas = paired_deltas(runs)
    out.mkdir(parents=True, exist_ok=True)
    made = [p for p in (
        plots.latency_distributions(runs, out / "latency.png"),
        plots.throughput(runs, out),
        plots.cache_hits(runs, out),
        plots.capacity_by_mode(runs, out / "capacity_by_mode.png"),
    ) if p is not None]
    searches, steps = frontier.load_searches(paths)
    if not searches.empty:
        made.append(frontier.goodput_plot(steps, searches, out / "goodput_vs_load.png"))
        made = [p for p in made if p is not None]
    failed = runs[runs["status"] != "completed"]
    repeated = not table.empty and table["runs"].min() >= 2
    # Each run says it is a single run; the report says it once, for the set: answered
    # where every cell has repeated runs, a caveat of the whole report where not.
    every = list(runs["limits"]) + (list(searches["limits"]) if not searches.empty else [])
    limits = sorted({limit for ls in every for limit in ls
                     if not limit.startswith(("a single run", "one search:"))})
    if not repeated:
        limits.insert(0, "one run per cell: no confidence interval (± appears with repeated runs: sweep seed=0,1,2)")
    sections = []
    if not searches.empty:
        # Each search's steps are runs at different loads: the summary above averages over them.
        sections = ["## Frontier at the SLO (highest load meeting it; mean ± 95 % CI over seeds)",
                    frontier.frontier_markdown(frontier.frontier_table(searches)),
                    "The summary table above averages each search's steps, which ran at different loads; "
                    "goodput_vs_load.png shows them by load (filled: met the SLO, hollow: missed)."]
        if searches.groupby(["workload", "slo", "mode", "retention"]).size().max() < 2:
            limits.insert(0, "one frontier search per mode: no interval over seeds (remnant-frontier -m ... seed=0,1,2)")
    text = "\n\n".join([
        "# Remnant report",
        f"{len(runs)} runs ({len(runs) - len(failed)} completed) from {', '.join(map(str, paths))}.",
        "## Summary (mean ± 95 % CI over repeated runs)", summary_markdown(table),
        *sections,
        "## Paired against native (per request, same request stream)", deltas_markdown(deltas),
        "## Failed or interrupted runs",
        "\n".join(f"- {r['run_dir']}: {r['status']}" for _, r in failed.iterrows()) or "None.",
        "## Plots", "\n".join(f"![{p.stem}]({p.name})" for p in made) or "None.",
        "## Limits", "\n".join(f"- {limit}" for limit in limits),
    ]) + "\n"
    path = out / "report.md"
    path.write_text(text)
    return path, summary_markdown(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="remnant-report", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", type=Path, help="run directories, sweep directories or run.json files")
    p.add_argument("--out", type=Path, default=Path("report"), help="directory for report.md and the plots")
    a = p.parse_args(argv)
    try:
        path, table = build(a.paths, a.out)
    except ValueError as exc:
        print(f"remnant-report: error: {exc}", file=sys.stderr)
        return 2
    print(table)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
