"""The Pareto view of a sweep: what one user gets against what the hardware gives.

Per sweep cell (runs of one config, seeds averaged; remnant.report.runs.cell_key):

- output tokens/s per user = 1000 / TPOT p50 (ms): the decode speed the median request
  sees once its first token arrived (TTFT is left to the latency plots);
- output tokens/s per GPU = output_throughput / the devices the server used
  (remnant.report.runs.server_devices; the embedded engine on CPU counts as 1 device).

A cell is Pareto-optimal in its series (one per mode and retention, one panel per workload)
when no other cell of the series is at least as good on both axes and better on one.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

PER_USER = "output tok/s per user (1000 / TPOT p50)"
PER_GPU = "output tok/s per GPU (output throughput / GPUs)"


def points(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (workload, mode, retention, cell) of the completed runs with a TPOT:
    per_user and per_gpu (means over the cell's runs), runs, load, concurrency,
    request_rate and the device assumptions of its runs (a sorted list, empty where the
    records said)."""
    cols = ["workload", "mode", "retention", "cell", "per_user", "per_gpu", "runs", "load", "concurrency",
            "request_rate", "assumed"]
    if runs.empty or "devices" not in runs:
        return pd.DataFrame(columns=cols)
    done = runs[(runs["status"] == "completed") & runs["output_throughput"].notna()
                & runs["tpot_p50_ms"].notna()].copy()
    done = done[done["tpot_p50_ms"] > 0]
    if done.empty:
        return pd.DataFrame(columns=cols)
    done["per_user"] = 1000.0 / done["tpot_p50_ms"]
    done["per_gpu"] = done["output_throughput"] / done["devices"]
    rows = []
    for (workload, mode, retention, cell), g in done.groupby(["workload", "mode", "retention", "cell"], sort=True):
        rows.append({"workload": workload, "mode": mode, "retention": retention, "cell": cell,
                     "per_user": float(g["per_user"].mean()), "per_gpu": float(g["per_gpu"].mean()),
                     "runs": len(g), "load": g["load"].iloc[0], "concurrency": g["concurrency"].iloc[0], "request_rate": g["request_rate"].iloc[0],
                     "assumed": sorted({a for a in g["devices_assumed"] if a})})
    return pd.DataFrame(rows, columns=cols)


def optimal(per_gpu: list[float], per_user: list[float]) -> list[bool]:
    """Whether each point is Pareto-optimal (higher is better on both axes): no other point
    is at least as high on both and higher on one."""
    pts = list(zip(per_gpu, per_user))
    return [not any(ox >= x and oy >= y and (ox > x or oy > y) for ox, oy in pts) for x, y in pts]


def limits(runs: pd.DataFrame) -> list[str]:
    """What pareto.png assumed about GPU counts, one line per assumption, where it is drawn."""
    pts = points(runs)
    if pts["cell"].nunique() < 2:
        return []
    assumed = sorted({a for row in pts["assumed"] for a in row})
    return [f"pareto.png, output tok/s per GPU: {a}" for a in assumed]


def pareto_plot(runs: pd.DataFrame, out: Path) -> Path | None:
    """Output tok/s per user against per GPU, one panel per workload, one series per mode
    and retention, each cell a point labelled by its load, the Pareto-optimal cells of a
    series joined. None where the runs hold fewer than two cells: one point has no trade-off."""
    from remnant.report.plots import _plt, save_figure

    pts = points(runs)
    if pts["cell"].nunique() < 2:
        return None
    plt = _plt()
    workloads = sorted(pts["workload"].unique())
    fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 5), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, workload in zip(axes[0], workloads):
        panel = pts[pts["workload"] == workload]
        for i, ((mode, retention), g) in enumerate(panel.groupby(["mode", "retention"], sort=True)):
            color = colors[i % len(colors)]
            label = f"{mode} {retention}".replace(" -", "")
            ax.scatter(g["per_gpu"], g["per_user"], color=color, alpha=0.5, zorder=3)
            best = g[optimal(g["per_gpu"].tolist(), g["per_user"].tolist())].sort_values("per_gpu")
            ax.plot(best["per_gpu"], best["per_user"], color=color, marker="o", label=f"{label} (Pareto)", zorder=4)
            for _, row in g.iterrows():
                ax.annotate(row["load"], (row["per_gpu"], row["per_user"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=color)
        ax.set_xlabel(PER_GPU)
        ax.set_ylabel(PER_USER)
        ax.set_title(workload, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    assumed = sorted({a for row in pts["assumed"] for a in row})
    if assumed:
        # Said on the figure itself: a PNG attached alone must not claim GPUs it did not count.
        fig.text(0.01, 0.01, "GPUs: " + "; ".join(assumed), fontsize=7, ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.04 if assumed else 0, 1, 1))
    save_figure(fig, out)
    return out
