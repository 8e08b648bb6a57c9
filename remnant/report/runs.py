"""Load run.json files into a pandas table, one row per run."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from remnant.records.schema import validate

METRIC_COLUMNS = {
    "ttft_p50_ms": ("ttft_ms", "p50"),
    "ttft_p99_ms": ("ttft_ms", "p99"),
    "tpot_p50_ms": ("tpot_ms", "p50"),
    "itl_p50_ms": ("itl_ms", "p50"),
    "e2e_p50_ms": ("e2e_ms", "p50"),
}


def find_runs(paths: list[Path]) -> list[Path]:
    """run.json files under the given files or directories, sorted."""
    found = []
    for path in paths:
        if not path.exists():
            raise ValueError(f"{path} does not exist")
        found.extend([path] if path.is_file() else sorted(path.rglob("run.json")))
    if not found:
        raise ValueError(f"no run.json under {', '.join(map(str, paths))}")
    return found


def load_runs(paths: list[Path]) -> pd.DataFrame:
    """One row per run: identity (mode, retention, workload, seed, fingerprint), status, metrics."""
    rows = []
    for path in find_runs(paths):
        doc = json.loads(path.read_text())
        validate(doc, str(path))
        cfg = doc["config"]
        ret = cfg.get("retention") or {}
        m = doc.get("metrics") or {}
        info = doc.get("server_info") or {}
        cap = info.get("capacity") or {}
        row = {
            "path": str(path),
            "run_dir": str(path.parent),
            "run_id": doc["run_id"],
            "status": doc["status"],
            "mode": cfg["mode"]["name"],
            "retention": "-" if cfg["mode"]["name"] == "native" else ret.get("name", "?"),
            "workload": doc["workload"]["name"],
            "seed": doc["workload"]["seed"],
            "fingerprint": doc["workload"]["fingerprint"],
            "concurrency": (cfg.get("workload") or {}).get("concurrency"),
            "host": doc["host"].get("kind"),
            "output_throughput": m.get("output_throughput"),
            "request_throughput": m.get("request_throughput"),
            "cache_hit_rate": m.get("cache_hit_rate"),
            "completed": m.get("completed"),
            "failed": m.get("failed"),
            "max_total_num_tokens": cap.get("max_total_num_tokens"),
            "limits": doc["limits"],
        }
        for column, (dist, stat) in METRIC_COLUMNS.items():
            row[column] = (m.get(dist) or {}).get(stat)
        rows.append(row)
    return pd.DataFrame(rows)
