"""Frontier searches in a report: each mode's frontier at its SLO (with the interval over
seeds), and goodput against load per mode.

Reads the frontier.json records remnant-frontier writes (schema remnant/frontier) under the
report's paths; the step runs beside them are ordinary run directories and appear in the
report's other tables too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from remnant.records.schema import validate
from remnant.report.stats import mean_ci
from remnant.report.table import Table

FRONTIER_JSON = "frontier.json"


def find_searches(paths: list[Path]) -> list[Path]:
    """frontier.json files given or under the given directories, sorted."""
    found: list[Path] = []
    for path in paths:
        if path.is_file():
            found += [path] if path.name == FRONTIER_JSON else []
        elif path.is_dir():
            found += sorted(path.rglob(FRONTIER_JSON))
    return found


def _slo_label(slo: dict) -> str:
    parts = [f"{name.replace('_ms', '').replace('_', ' ').upper()} <= {value:g} ms"
             for name, value in slo.items() if value is not None]
    return ", ".join(parts).replace(" P99", " p99")


def load_searches(paths: list[Path]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(searches, steps): one row per search (its identity, SLO, status, frontier) and one
    per step (the search's identity, the load, goodput, throughput, pass or miss)."""
    searches, steps = [], []
    for path in find_searches(paths):
        doc = json.loads(path.read_text())
        validate(doc, str(path))
        front = doc.get("frontier") or {}
        ident = {"workload": doc["workload"], "mode": doc["mode"], "retention": doc["retention"] or "-",
                 "seed": doc["seed"], "load_axis": doc["load"], "slo": _slo_label(doc["slo"])}
        searches.append({**ident, "path": str(path), "status": doc["status"], "frontier": front.get("load"),
                         "at_least": bool(front.get("at_least")), "stopped": front.get("stopped"),
                         "start": doc["search"]["start"], "steps": len(doc["steps"]), "limits": doc["limits"]})
        for s in doc["steps"]:
            m = s["metrics"]
            steps.append({**ident, "load": s["load"], "passed": s["passed"], "goodput": m.get("goodput"),
                          "output_throughput": m.get("output_throughput"),
                          "request_throughput": m.get("request_throughput")})
    return pd.DataFrame(searches), pd.DataFrame(steps)


def _value(row: pd.Series) -> str:
    if row["frontier"] is None or pd.isna(row["frontier"]):
        return f"none (<{row['start']:g})" if row["stopped"] == "start_missed" else "none"
    return f"{'>=' if row['at_least'] else ''}{row['frontier']:g}"


def frontier_table(searches: pd.DataFrame) -> pd.DataFrame:
    """Per (workload, SLO, load axis, mode, retention): the searches, each seed's frontier,
    and the mean with its 95 % CI over the seeds whose search found one. A mean over a
    search capped at search.max is a lower bound (">="); searches that ended early
    (failed, interrupted) are listed but left out of the mean."""
    rows = []
    if searches.empty:
        return pd.DataFrame(rows)
    keys = ["workload", "slo", "load_axis", "mode", "retention"]
    for key, group in searches.sort_values("seed").groupby(keys, sort=True):
        done = group[group["status"] == "completed"]
        found = [v for v in done["frontier"].tolist() if v is not None and not pd.isna(v)]
        mean, ci, n = mean_ci(found)
        rows.append({**dict(zip(keys, key)), "searches": len(group), "with_frontier": n, "mean": mean, "ci": ci,
                     "lower_bound": bool(done["at_least"].any()),
                     "per_seed": ", ".join(f"s{r['seed']}: {_value(r)}"
                                           + ("" if r["status"] == "completed" else f" ({r['status']})")
                                           for _, r in group.iterrows())})
    return pd.DataFrame(rows)


def frontier_rows(table: pd.DataFrame) -> Table:
    """frontier_table's rows as the report shows them: the mean frontier with its interval
    and unit (">=" where a search was capped at search.max), and each seed's."""
    head = ["workload", "SLO", "mode", "retention", "searches", "frontier (mean ± 95 % CI)", "per seed"]
    rows = []
    for _, r in table.iterrows():
        if r["mean"] is None or pd.isna(r["mean"]):
            shown = "none met the SLO"
        else:
            shown = f"{'>=' if r['lower_bound'] else ''}{r['mean']:.1f}"
            if r["ci"] is not None and not pd.isna(r["ci"]):
                shown += f" ± {r['ci']:.1f}"
            shown += f" {r['load_axis']}"
        rows.append([r["workload"], r["slo"], r["mode"], r["retention"], str(r["searches"]), shown, r["per_seed"]])
    return Table(head, rows, empty="No frontier searches.")


def frontier_markdown(table: pd.DataFrame) -> str:
    return frontier_rows(table).markdown()


def goodput_plot(steps: pd.DataFrame, searches: pd.DataFrame, out: Path) -> Path | None:
    """Goodput (requests/s meeting the SLO) against load, one panel per workload and SLO,
    one line per mode (the mean over seeds at each load probed); filled markers passed the
    SLO, hollow ones missed; a dotted line at each mode's mean frontier."""
    from remnant.report.plots import _plt, save_figure

    done = steps[steps["goodput"].notna()] if not steps.empty else steps
    if done.empty:
        return None
    plt = _plt()
    panels = sorted(done.groupby(["workload", "slo"]).groups)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (workload, slo) in zip(axes[0], panels):
        panel = done[(done["workload"] == workload) & (done["slo"] == slo)]
        for i, ((mode, retention), g) in enumerate(panel.groupby(["mode", "retention"], sort=True)):
            color = colors[i % len(colors)]
            label = f"{mode} {retention}".replace(" -", "")
            line = g.groupby("load")["goodput"].mean().sort_index()
            ax.plot(line.index, line.values, color=color, label=label)
            for passed, marker_face in ((True, color), (False, "none")):
                pts = g[g["passed"] == passed]  # noqa: E712 - None (no verdict) is neither
                ax.scatter(pts["load"], pts["goodput"], edgecolors=color, facecolors=marker_face, zorder=3)
            mine = searches[(searches["workload"] == workload) & (searches["slo"] == slo) & (searches["mode"] == mode)
                            & (searches["retention"] == retention) & searches["frontier"].notna()]
            if not mine.empty:
                ax.axvline(float(mine["frontier"].mean()), color=color, linestyle=":", alpha=0.8)
        # Doubling spaces the loads by powers of two: a log axis spaces them evenly; ticks at
        # the loads probed, as plain numbers.
        ax.set_xscale("log", base=2)
        loads = sorted(panel["load"].unique())
        ax.set_xticks(loads, [f"{x:g}" for x in loads])
        ax.minorticks_off()
        ax.set_xlabel(f"load ({panel['load_axis'].iloc[0]})")
        ax.set_ylabel("goodput (requests/s meeting the SLO)")
        ax.set_title(f"{workload}\nSLO: {slo}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out)
    return out
