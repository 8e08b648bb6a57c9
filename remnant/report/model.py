"""What remnant-report says about a set of runs, computed once: the tables, the failed runs,
each run with its limits, the plots and the report's own limits. remnant.report.markdown
renders it as report.md and remnant.report.html as report.html, so both say the same."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from remnant.frontier import SloConfig, goodput
from remnant.report import frontier, pareto
from remnant.report.runs import load_runs, workload_label
from remnant.report.stats import DELTA_CI, paired_deltas, seed_deltas, summary
from remnant.report.table import Table, fmt

COLUMNS = ["output_throughput", "ttft_p50_ms", "tpot_p50_ms", "e2e_p50_ms", "cache_hit_rate", "max_total_num_tokens"]

# Section titles, the same in every rendering.
SUMMARY = "Summary (mean ± 95 % CI over repeated runs)"
FRONTIER = "Frontier at the SLO (highest load meeting it; mean ± 95 % CI over seeds)"
DELTAS = ("Paired against native (per request, same request stream; \"mean of N seeds\": each seed's delta averaged, "
          "± over seeds)")
FAILED = "Failed or interrupted runs"
PLOTS = "Plots"
LIMITS = "Limits"
RUNS = "Runs"

FRONTIER_NOTE = ("Each search's steps are runs at different loads: the summary table above lists them by load, "
                 "goodput_vs_load.png plots them (filled: met the SLO, hollow: missed).")


@dataclass(frozen=True)
class RunEntry:
    """One run as the report lists it: where it is, how it ended and the caveats it carries."""

    run_dir: str
    status: str
    error: str | None
    workload: str
    mode: str
    retention: str
    seed: int
    load: str
    output_throughput: str
    tpot_p50_ms: str
    limits: list[str]
    #: Goodput at the report's SLO, requests/s ("" without an SLO or measured requests): a
    #: degraded run's too, which the summary leaves out, its failed requests counted as misses.
    goodput: str = ""

    def goodput_note(self) -> str:
        """What the failed runs' list says of this run's goodput ("" where it has none)."""
        return f"goodput {self.goodput} req/s at the SLO, failed requests as misses" if self.goodput else ""


@dataclass
class Report:
    """A report over `paths`. runs, searches and steps are the loaded tables the plots are
    drawn from; the rest is what the renderers show. `plots` is filled by whoever draws them
    (remnant.report.build.build), in the order they are shown."""

    paths: list[str]
    runs: pd.DataFrame
    searches: pd.DataFrame
    steps: pd.DataFrame
    summary: Table
    frontier: Table | None
    deltas: Table
    failed: list[RunEntry]
    every_run: list[RunEntry]
    limits: list[str]
    plots: list[Path] = field(default_factory=list)
    #: What the summary's goodput column counts, where an SLO was given.
    slo_note: str | None = None

    @property
    def completed(self) -> int:
        return int((self.runs["status"] == "completed").sum())


def summary_rows(table: pd.DataFrame, with_goodput: bool = False) -> Table:
    """stats.summary's table as shown: each metric's mean ± 95 % CI (goodput's too, with
    with_goodput: the column collect adds for an SLO)."""
    head = ["workload", "mode", "retention", "load", "runs", "output tok/s", "TTFT p50 ms", "TPOT p50 ms",
            "E2E p50 ms", "cache hit", "max tokens"] + (["goodput req/s"] if with_goodput else [])
    rows = []
    for _, r in table.iterrows():
        hit = None if pd.isna(r["cache_hit_rate"]) else 100 * r["cache_hit_rate"]
        hit_ci = None if pd.isna(r["cache_hit_rate_ci"]) else 100 * r["cache_hit_rate_ci"]
        rows.append([workload_label(r["workload"], r["variant"]), r["mode"], r["retention"], r["load"],
                     str(r["runs"]),
                     fmt(r["output_throughput"], r["output_throughput_ci"]),
                     fmt(r["ttft_p50_ms"], r["ttft_p50_ms_ci"]), fmt(r["tpot_p50_ms"], r["tpot_p50_ms_ci"]),
                     fmt(r["e2e_p50_ms"], r["e2e_p50_ms_ci"]), fmt(hit, hit_ci) + " %",
                     fmt(r["max_total_num_tokens"], None, 0)]
                    + ([fmt(r["goodput"], r["goodput_ci"], 2)] if with_goodput else []))
    return Table(head, rows, empty="No completed runs.")


def delta_rows(deltas: pd.DataFrame, over_seeds: pd.DataFrame | None = None) -> Table:
    """stats.paired_deltas' table as shown: the mean per-request delta ± 95 % CI, or why the
    pairing was refused; then stats.seed_deltas' rows, "mean of N seeds", each ± over seeds."""
    head = ["workload", "seed", "mode", "retention", "load", "requests joined", "ΔTTFT ms", "ΔTPOT ms", "ΔE2E ms",
            "Δ output tok/s", "note"]
    rows = []

    def cells(r) -> list[str]:
        other = r.get("baseline_variant") != r["variant"]
        return ([str(int(r["joined"]))] + [fmt(r.get(column), r.get(ci)) for column, ci in DELTA_CI.items()]
                + [f"against the native run of {r['baseline_variant'] or 'no variant'}" if other else ""])

    for _, r in deltas.iterrows():
        ident = [workload_label(r["workload"], r["variant"]), str(r["seed"]), r["mode"], r["retention"], r["load"]]
        rows.append(ident + (["-"] * 5 + [f"refused: {r['refused']}"] if r.get("refused") else cells(r)))
    for _, r in (over_seeds if over_seeds is not None else pd.DataFrame()).iterrows():
        rows.append([workload_label(r["workload"], r["variant"]), f"mean of {r['seeds']} seeds", r["mode"],
                     r["retention"], r["load"]] + cells(r))
    return Table(head, rows, empty="No non-native runs to compare.")


def run_entries(runs: pd.DataFrame) -> list[RunEntry]:
    return [RunEntry(run_dir=r["run_dir"], status=r["status"], error=r["error"],
                     workload=workload_label(r["workload"], r["variant"]),
                     mode=r["mode"], retention=r["retention"], seed=int(r["seed"]), load=r["load"],
                     output_throughput=fmt(r["output_throughput"]), tpot_p50_ms=fmt(r["tpot_p50_ms"]),
                     limits=list(r["limits"]),
                     goodput="" if pd.isna(r.get("goodput")) else fmt(r["goodput"], None, 2))
            for _, r in runs.iterrows()]


def slo_note(slo: SloConfig) -> str:
    bounds = " and ".join(f"{name.split('_')[0].upper()} <= {value:g} ms" for name, value in slo.bounds().items())
    return (f"Goodput: measured requests per second that completed with {bounds} each "
            f"(as sglang.bench_serving's --goodput counts them).")


def collect(paths: list[Path], slo: SloConfig | None = None) -> Report:
    """Load the runs and frontier searches under `paths` and compute every table and caveat;
    with an SLO, each completed run's goodput (remnant.frontier.goodput) in the summary too,
    and a degraded run's in the failed runs' list (the summary averages completed runs only;
    under overload a mode's runs may degrade, and its goodput is then the figure to compare).
    Raises ValueError naming the path where there is nothing to report."""
    runs = load_runs(paths)
    if slo is not None:
        slo.validate()
        runs["goodput"] = [goodput(Path(r["run_dir"]), slo, r["duration_s"])
                           if r["status"] in ("completed", "degraded") else None for _, r in runs.iterrows()]
    table = summary(runs, COLUMNS + (["goodput"] if slo is not None else []))
    searches, steps = frontier.load_searches(paths)
    done = runs[runs["status"] == "completed"]
    repeated = not done.empty and done.groupby("cell").size().min() >= 2
    # Each run says it is a single run; the report says it once, for the set: answered
    # where every sweep cell has repeated runs (seeds), a caveat of the whole report where not.
    every = list(runs["limits"]) + (list(searches["limits"]) if not searches.empty else [])
    limits = sorted({limit for ls in every for limit in ls
                     if not limit.startswith(("a single run", "one search:"))} | set(pareto.limits(runs)))
    if not repeated:
        limits.insert(0, "one run per cell: no confidence interval (± appears with repeated runs: sweep seed=0,1,2)")
    front = None
    if not searches.empty:
        front = frontier.frontier_rows(frontier.frontier_table(searches))
        if searches.groupby(["workload", "slo", "mode", "retention"]).size().max() < 2:
            limits.insert(0, "one frontier search per mode: no interval over seeds (remnant-frontier -m ... seed=0,1,2)")
    entries = run_entries(runs)
    deltas = paired_deltas(runs)
    return Report(paths=[str(p) for p in paths], runs=runs, searches=searches, steps=steps,
                  summary=summary_rows(table, with_goodput=slo is not None), frontier=front,
                  deltas=delta_rows(deltas, seed_deltas(deltas)), failed=[e for e in entries if e.status != "completed"],
                  every_run=entries, limits=limits, slo_note=None if slo is None else slo_note(slo))
