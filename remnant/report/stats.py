"""Means with 95 % confidence intervals (Student t) and paired per-request deltas."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

# Two-sided 95 % Student t quantiles for 1..30 degrees of freedom; beyond, the normal 1.96.
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042]


def t975(df: int) -> float:
    return _T975[df - 1] if 1 <= df <= len(_T975) else 1.96


def mean_ci(values) -> tuple[float | None, float | None, int]:
    """(mean, 95 % CI half-width, n) of the finite values; half-width None for n < 2."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    if v.size == 0:
        return None, None, 0
    if v.size == 1:
        return float(v[0]), None, 1
    return float(v.mean()), float(t975(v.size - 1) * v.std(ddof=1) / math.sqrt(v.size)), int(v.size)


PAIRED_METRICS = ("ttft", "tpot", "e2e")
# Each delta column of paired_deltas and seed_deltas, and its 95 % CI's column.
DELTA_CI = {**{f"delta_{m}_ms": f"delta_{m}_ci_ms" for m in PAIRED_METRICS}, "delta_throughput": "delta_throughput_ci"}


def _requests(run_dir: str) -> pd.DataFrame:
    """The measured, successful requests' ttft_s, tpot_s and e2e_s by id; tpot_s as
    remnant.client.metrics defines it ((e2e - ttft) / (completion_tokens - 1)), NaN for a
    one-token request or a record without completion_tokens."""
    rows = [json.loads(line) for line in Path(run_dir, "requests.jsonl").read_text().splitlines() if line.strip()]
    df = pd.DataFrame(rows)
    df = df[(df["phase"] == "measured") & df["success"]]
    tokens = df["completion_tokens"] if "completion_tokens" in df else pd.Series(np.nan, index=df.index)
    df = df.assign(tpot_s=(df["e2e_s"] - df["ttft_s"]) / (tokens - 1).where(tokens > 1))
    return df.set_index("id")[[f"{m}_s" for m in PAIRED_METRICS]]


def paired_deltas(runs: pd.DataFrame, baseline: str = "native") -> pd.DataFrame:
    """Per-request deltas of each completed run against the baseline-mode run with the same
    workload fingerprint (an identical request stream), joined by request id.

    Returns one row per compared run: its identity, the requests joined, mean TTFT, TPOT
    and E2E deltas (ms, run - baseline) with 95 % CIs over its requests, the output
    throughput's delta (tok/s, one figure a run), or `refused` with the reason.
    """
    done = runs[runs["status"] == "completed"]
    out = []
    for _, run in done[done["mode"] != baseline].iterrows():
        row = {"mode": run["mode"], "retention": run["retention"], "workload": run["workload"],
               "variant": run["variant"], "seed": run["seed"], "load": run["load"]}
        base = done[(done["mode"] == baseline) & (done["workload"] == run["workload"]) & (done["seed"] == run["seed"])]
        same = base[base["fingerprint"] == run["fingerprint"]]
        # The native run of the same cell where several share a stream (a host or model axis);
        # where none has the run's variant (an axis only packed runs vary, or a native cell that
        # failed), another of the same stream, whose variant the row names.
        same = same[same["variant"] == run["variant"]] if (same["variant"] == run["variant"]).any() else same
        if base.empty:
            row["refused"] = f"no completed {baseline} run of {run['workload']} seed {run['seed']}"
        elif same.empty:
            row["refused"] = (f"request streams differ: fingerprint {run['fingerprint'][:12]} vs "
                              f"{baseline} {base.iloc[0]['fingerprint'][:12]}")
        else:
            a, b = _requests(run["run_dir"]), _requests(same.iloc[0]["run_dir"])
            joined = a.merge(b, left_index=True, right_index=True, suffixes=("_run", "_base"))
            row["joined"] = len(joined)
            row["baseline_variant"] = same.iloc[0]["variant"]
            for metric in PAIRED_METRICS:
                d = (joined[f"{metric}_s_run"] - joined[f"{metric}_s_base"]) * 1000.0
                row[f"delta_{metric}_ms"], row[DELTA_CI[f"delta_{metric}_ms"]], _ = mean_ci(d.tolist())
            ours, theirs = run.get("output_throughput"), same.iloc[0].get("output_throughput")
            row["delta_throughput"] = None if pd.isna(ours) or pd.isna(theirs) else float(ours - theirs)
            row["refused"] = None
        out.append(row)
    return pd.DataFrame(out)


def seed_deltas(deltas: pd.DataFrame) -> pd.DataFrame:
    """paired_deltas' rows of one cell (workload, variant, mode, retention, load, and the
    native variant paired with) over its seeds, where two or more paired: each delta the
    mean of the seeds' deltas, with a 95 % CI over seeds (n - 1 degrees of freedom). A
    seed's per-request interval says how sure one run's mean is; this one says how much the
    delta moves from run to run, which a single run cannot show. A delta missing in a seed
    (no request with a TPOT, no throughput) is averaged over the seeds that have it."""
    if deltas.empty or "joined" not in deltas:
        return pd.DataFrame()
    paired = deltas[deltas["refused"].isna()]
    keys = ["workload", "variant", "mode", "retention", "load", "baseline_variant"]
    rows = []
    for key, group in paired.groupby(keys, sort=False, dropna=False):
        if group["seed"].nunique() < 2:
            continue
        row = dict(zip(keys, key))
        row.update(seeds=int(group["seed"].nunique()), joined=int(group["joined"].sum()), refused=None)
        for column, ci_column in DELTA_CI.items():
            row[column], row[ci_column], _ = mean_ci(group[column].tolist())
        rows.append(row)
    return pd.DataFrame(rows)


def summary(runs: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """Per (workload, variant, mode, retention, load): mean and 95 % CI of each column over
    repeated runs. Runs at different loads or variants (remnant.report.runs.variant_labels)
    are different cells, never averaged as if repeats."""
    rows = []
    done = runs[runs["status"] == "completed"]
    keys = ["workload", "variant", "mode", "retention", "load"]
    for key, group in done.groupby(keys, sort=True):
        row = dict(zip(keys, key))
        row["runs"] = len(group)
        for column in columns:
            mean, ci, _ = mean_ci(group[column].tolist())
            row[column], row[f"{column}_ci"] = mean, ci
        rows.append(row)
    return pd.DataFrame(rows)
