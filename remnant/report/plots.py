"""PNG plots of a set of runs (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _measured(run_dir: str) -> pd.DataFrame:
    rows = [json.loads(line) for line in Path(run_dir, "requests.jsonl").read_text().splitlines() if line.strip()]
    df = pd.DataFrame(rows)
    return df[(df["phase"] == "measured") & df["success"]] if len(df) else df


def latency_distributions(runs: pd.DataFrame, out: Path) -> Path | None:
    """Box plots of per-request TTFT and TPOT by workload and mode."""
    done = runs[runs["status"] == "completed"]
    if done.empty:
        return None
    plt = _plt()
    groups = {}
    for _, run in done.iterrows():
        df = _measured(run["run_dir"])
        if df.empty:
            continue
        label = f"{run['workload']}\n{run['mode']} {run['retention']}".strip()
        g = groups.setdefault(label, {"ttft": [], "tpot": []})
        g["ttft"] += (df["ttft_s"] * 1000).dropna().tolist()
        tpot = (df["e2e_s"] - df["ttft_s"]) / (df["completion_tokens"] - 1)
        g["tpot"] += (tpot[df["completion_tokens"] > 1] * 1000).dropna().tolist()
    if not groups:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(groups)), 4.5))
    for ax, key, title in ((axes[0], "ttft", "TTFT (ms)"), (axes[1], "tpot", "TPOT (ms)")):
        ax.boxplot([g[key] or [0] for g in groups.values()], tick_labels=list(groups), showfliers=False)
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _lines_by_mode(df: pd.DataFrame, x: str, y: str, xlabel: str, ylabel: str, out: Path,
                   ylim: tuple[float, float] | None = None) -> Path:
    """One line per mode: the mean of y at each x."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, group in df.groupby("mode"):
        g = group.groupby(x)[y].mean().sort_index()
        ax.plot(g.index, g.values, marker="o", label=mode)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim:
        ax.set_ylim(*ylim)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def throughput_vs_concurrency(runs: pd.DataFrame, out: Path) -> Path | None:
    done = runs[(runs["status"] == "completed") & runs["concurrency"].notna()]
    if done.empty:
        return None
    return _lines_by_mode(done, "concurrency", "output_throughput", "concurrency (requests in flight)",
                          "output throughput (tok/s)", out)


def cache_hit_vs_working_set(runs: pd.DataFrame, out: Path) -> Path | None:
    """Shared-prefix runs: cache-hit rate against the groups' working set, per mode."""
    rows = []
    for _, run in runs[runs["status"] == "completed"].iterrows():
        cfg = json.loads(Path(run["path"]).read_text())["config"]["workload"]
        if "groups" in cfg and "prefix_len" in cfg:
            rows.append({"mode": run["mode"], "working_set": cfg["groups"] * cfg["prefix_len"],
                         "hit": run["cache_hit_rate"], "capacity": run["max_total_num_tokens"]})
    if not rows:
        return None
    return _lines_by_mode(pd.DataFrame(rows), "working_set", "hit", "working set (groups x prefix tokens)",
                          "cache-hit rate", out, ylim=(0, 1))


def capacity_by_mode(runs: pd.DataFrame, out: Path) -> Path | None:
    df = runs[runs["max_total_num_tokens"].notna()]
    if df.empty:
        return None
    g = df.groupby(["mode", "retention"])["max_total_num_tokens"].max()
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"{m} {r}".strip() for m, r in g.index]
    ax.bar(labels, g.values, color="#4878a8")
    ax.set_ylabel("max_total_num_tokens")
    for i, v in enumerate(g.values):
        ax.text(i, v, f"{int(v):,}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
