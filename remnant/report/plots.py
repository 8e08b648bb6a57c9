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


def save_figure(fig, out: Path) -> None:
    """Write `fig` to `out` as a PNG and close it. A write that fails (a full disk) raises
    remnant.records.files.WriteError naming `out`, and leaves no partial file."""
    from remnant.records.files import writing

    try:
        with writing(out):
            fig.savefig(out, dpi=110)
    except OSError:
        Path(out).unlink(missing_ok=True)
        raise
    finally:
        _plt().close(fig)


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
    save_figure(fig, out)
    return out


#: What sets a plot's lines apart: runs that differ in any of these are never averaged as
#: repeats (their variant: remnant.report.runs.variant_labels).
LINE_KEYS = ("workload", "variant", "mode", "retention")


def line_keys(df: pd.DataFrame, x: str) -> list[str]:
    """The LINE_KEYS columns _lines_by_mode draws a line per value of: mode, and each other
    one whose runs differ in it, x excepted."""
    return [k for k in LINE_KEYS if k in df and k != x and (k == "mode" or df[k].nunique() > 1)]


def _lines_by_mode(df: pd.DataFrame, x: str, y: str, xlabel: str, ylabel: str, out: Path,
                   ylim: tuple[float, float] | None = None) -> Path:
    """One line per mode and each other LINE_KEYS column of df whose runs differ in it (x
    itself excepted: a working set on x is also the variant): the mean of y at each x,
    labelled by the keys that differ."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, group in df.groupby(line_keys(df, x)):
        g = group.groupby(x)[y].mean().sort_index()
        ax.plot(g.index, g.values, marker="o", label=" ".join(str(v) for v in key if v not in ("", "-")))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim:
        ax.set_ylim(*ylim)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out)
    return out


def _bars_by_mode(df: pd.DataFrame, y: str, ylabel: str, title: str, out: Path,
                  ylim: tuple[float, float] | None = None) -> Path:
    """One bar per mode and retention (and variant, where runs have several:
    remnant.report.runs.variant_labels): the mean of y over its runs (seeds), with the 95 %
    confidence interval where a cell has repeated runs."""
    from remnant.report.stats import mean_ci

    plt = _plt()
    variants = "variant" in df and df["variant"].astype(bool).any()
    keys = ["variant", "mode", "retention"] if variants else ["mode", "retention"]
    cells = [("\n".join(filter(None, (f"{k[-2]} {k[-1]}".strip(), k[0] if variants else ""))),
              *mean_ci(g[y].dropna().tolist())) for k, g in df.groupby(keys)]
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(cells)), 4))
    labels, means = [c[0] for c in cells], [c[1] for c in cells]
    errors = [c[2] or 0.0 for c in cells]
    ax.bar(labels, means, yerr=errors if any(errors) else None, capsize=4, color="#4878a8")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if ylim:
        ax.set_ylim(*ylim)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out)
    return out


def throughput(runs: pd.DataFrame, out_dir: Path) -> Path | None:
    """Output throughput per mode: against concurrency where the runs have several
    concurrencies (throughput_vs_concurrency.png), else as bars at the one they share
    (throughput_by_mode.png): a line through one x value says nothing."""
    done = runs[(runs["status"] == "completed") & runs["concurrency"].notna() & runs["output_throughput"].notna()]
    if done.empty:
        return None
    levels = sorted(done["concurrency"].unique())
    if len(levels) >= 2:
        return _lines_by_mode(done, "concurrency", "output_throughput", "concurrency (requests in flight)",
                              "output throughput (tok/s)", out_dir / "throughput_vs_concurrency.png")
    return _bars_by_mode(done, "output_throughput", "output throughput (tok/s)",
                         f"output throughput at concurrency {levels[0]:g}", out_dir / "throughput_by_mode.png")


def cache_hits(runs: pd.DataFrame, out_dir: Path) -> Path | None:
    """Prefix-cache hit rate per mode, where the runs hit the cache at all: against the
    working set of shared-prefix runs that have several (cache_hit_vs_working_set.png),
    else as bars (cache_hit_by_mode.png); no plot when no run hit the cache."""
    done = runs[(runs["status"] == "completed") & runs["cache_hit_rate"].notna()]
    if done.empty or not (done["cache_hit_rate"] > 0).any():
        return None
    rows = []
    for _, run in done.iterrows():
        cfg = json.loads(Path(run["path"]).read_text())["config"]["workload"]
        if "groups" in cfg and "prefix_len" in cfg:
            rows.append({"workload": run["workload"], "mode": run["mode"], "retention": run["retention"],
                         "working_set": cfg["groups"] * cfg["prefix_len"], "hit": run["cache_hit_rate"]})
    if len({r["working_set"] for r in rows}) >= 2:
        return _lines_by_mode(pd.DataFrame(rows), "working_set", "hit", "working set (groups x prefix tokens)",
                              "cache-hit rate", out_dir / "cache_hit_vs_working_set.png", ylim=(0, 1))
    return _bars_by_mode(done, "cache_hit_rate", "cache-hit rate", "prefix-cache hit rate",
                         out_dir / "cache_hit_by_mode.png", ylim=(0, 1))


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
    save_figure(fig, out)
    return out
