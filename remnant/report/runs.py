"""Load run.json files into a pandas table, one row per run."""

from __future__ import annotations

import hashlib
import json
from dataclasses import fields
from pathlib import Path

import pandas as pd

from remnant.config import RetentionConfig
from remnant.kv.modes import mode_of
from remnant.records.schema import validate

METRIC_COLUMNS = {
    "ttft_p50_ms": ("ttft_ms", "p50"),
    "ttft_p99_ms": ("ttft_ms", "p99"),
    "tpot_p50_ms": ("tpot_ms", "p50"),
    "itl_p50_ms": ("itl_ms", "p50"),
    "e2e_p50_ms": ("e2e_ms", "p50"),
}



def retention_label(ret: dict) -> str:
    """A packed run's retention (run.json's config.retention) as the report groups it:
    RetentionConfig.label (records from before the window and C128 options pack neither)."""
    known = {f.name for f in fields(RetentionConfig)}
    return RetentionConfig(**{k: v for k, v in ret.items() if k in known}).label()


def server_devices(doc: dict) -> tuple[int, str | None]:
    """(devices, assumption): the GPUs the run's server used, and None where the record
    says so, else the sentence that names what was assumed.

    SGLang's /server_info carries its ServerArgs: a server spans tp_size x pp_size GPUs,
    times dp_size replicas unless DP attention splits the same GPUs. The embedded engine
    serves on one device: a GPU, or the CPU, counted as one device. Otherwise the config's
    model.tp_size (what host=local and host=modal start the server with), else 1.
    """
    info = doc.get("server_info") or {}
    if info.get("engine") == "remnant-embedded":
        if info.get("device") == "cpu":
            return 1, "the embedded engine on CPU counted as 1 device"
        return 1, None
    if isinstance(info.get("tp_size"), int) and info["tp_size"] >= 1:
        n = info["tp_size"] * int(info.get("pp_size") or 1)
        if not info.get("enable_dp_attention"):
            n *= int(info.get("dp_size") or 1)
        return n, None
    tp = ((doc.get("config") or {}).get("model") or {}).get("tp_size")
    if isinstance(tp, int) and tp >= 1:
        return tp, f"the server did not report tp_size: model.tp_size={tp} from the config"
    return 1, "neither the server nor the config gives a GPU count: 1 assumed"


def cell_key(config: dict) -> str:
    """The run's config without its seeds, hashed: runs of one sweep cell share it, so
    seeds of a cell are repeats and cells differ in what the sweep varied."""
    cfg = json.loads(json.dumps(config))
    cfg.pop("seed", None)
    cfg.pop("force", None)
    (cfg.get("workload") or {}).pop("seed", None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]


#: Config keys the report shows in columns of their own (mode, retention: retention_details,
#: seed, load), or that do not change what a run measures (which GPUs and ports a local
#: server took, from the environment): never part of a run's variant, so that a packed run
#: and the native run it is paired with share theirs.
_NOT_VARIANT = ("mode.", "retention", "seed", "force", "workload.seed", "workload.concurrency",
                "workload.request_rate", "host.gpus", "host.port", "host.master_port")


def _flat(config: dict, prefix: str = "") -> dict[str, str]:
    """config's leaves by dotted key, each value as JSON text (lists and null comparable)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value, sort_keys=True)
    return out


#: A key a run's config lacks, as a flattened value.
UNSET = json.dumps("unset")


def _shown(text: str) -> str:
    """A flattened value as a label shows it: strings without their JSON quotes."""
    value = json.loads(text)
    return value if isinstance(value, str) else text


def _varying(flats: list[dict[str, str]]) -> list[str]:
    """The keys whose values (a missing key counted as one) differ among `flats`, sorted."""
    return [k for k in sorted({k for f in flats for k in f}) if len({f.get(k) for f in flats}) > 1]


def variant_labels(configs: list[dict], workloads: list[str]) -> list[str]:
    """What tells runs of one workload apart besides mode, retention, seed and load: the
    config values that differ among that workload's runs (a sweep's other axes, e.g. a
    shared-prefix study's workload.groups), as "groups=32" ("" where nothing differs).
    Each key is named by its last part, or whole where two varying keys share it. Without
    it, the runs of several working sets would be averaged as if repeats of one cell."""
    flat = [{k: v for k, v in _flat(c).items() if not k.startswith(_NOT_VARIANT)} for c in configs]
    labels = [""] * len(configs)
    for workload in set(workloads):
        members = [i for i, w in enumerate(workloads) if w == workload]
        varying = _varying([flat[i] for i in members])
        last = [k.rsplit(".", 1)[-1] for k in varying]
        names = [part if last.count(part) == 1 else key for key, part in zip(varying, last)]
        for i in members:
            labels[i] = ", ".join(f"{name}={_shown(flat[i].get(key, UNSET))}" for key, name in zip(varying, names))
    return labels


def retention_details(configs: list[dict], labels: list[str], workloads: list[str]) -> list[str]:
    """Packed runs' retention labels with what else sets apart runs of one workload and
    label: their retention fields beyond the label's (its value, per-layer values, map,
    policy) where these differ, as "r256 (policy=prefix)". Runs of one label but another
    map or policy would otherwise be averaged as repeats. Native runs ("-") keep theirs."""
    shown = ("name", "window_records", "c128_records")
    flat = [_flat((c.get("retention") or {}) if label != "-" else {}) for c, label in zip(configs, labels)]
    flat = [{k: v for k, v in f.items() if k not in shown} for f in flat]
    out = list(labels)
    for group in {(w, label) for w, label in zip(workloads, labels) if label != "-"}:
        members = [i for i, key in enumerate(zip(workloads, labels)) if key == group]
        varying = _varying([flat[i] for i in members])
        for i in members:
            if varying:
                out[i] = f"{labels[i]} (" + ", ".join(f"{k}={_shown(flat[i].get(k, UNSET))}" for k in varying) + ")"
    return out


def workload_label(workload: str, variant: str) -> str:
    """A workload as the report's tables name it: with its variant, where it has one."""
    return f"{workload} ({variant})" if variant else workload


def load_label(concurrency, request_rate) -> str:
    """The load a run offered, as the report shows it: "2 req/s" open loop, "c=8" closed."""
    if request_rate is not None and not pd.isna(request_rate):
        return f"{request_rate:g} req/s"
    if concurrency is not None and not pd.isna(concurrency):
        return f"c={concurrency:g}"
    return "-"


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
    """One row per run: identity (mode, retention, workload and its variant, load, seed,
    fingerprint, sweep cell), status and error, metrics, the devices its server used
    (server_devices)."""
    rows, configs = [], []
    for path in find_runs(paths):
        doc = json.loads(path.read_text())
        validate(doc, str(path))
        cfg = doc["config"]
        configs.append(cfg)
        ret = cfg.get("retention") or {}
        m = doc.get("metrics") or {}
        info = doc.get("server_info") or {}
        cap = info.get("capacity") or {}
        devices, devices_assumed = server_devices(doc)
        error = doc.get("error") or {}
        row = {
            "path": str(path),
            "run_dir": str(path.parent),
            "run_id": doc["run_id"],
            "status": doc["status"],
            "error": f"{error['stage']}: {error['message']}" if error else None,
            "cell": cell_key(cfg),
            "mode": cfg["mode"]["name"],
            "retention": retention_label(ret) if mode_of(cfg["mode"]["name"]).keeps_retention else "-",
            "workload": doc["workload"]["name"],
            "seed": doc["workload"]["seed"],
            "fingerprint": doc["workload"]["fingerprint"],
            "concurrency": (cfg.get("workload") or {}).get("concurrency"),
            "request_rate": (cfg.get("workload") or {}).get("request_rate"),
            "load": load_label((cfg.get("workload") or {}).get("concurrency"),
                               (cfg.get("workload") or {}).get("request_rate")),
            "host": doc["host"].get("kind"),
            "duration_s": m.get("duration_s"),
            "output_throughput": m.get("output_throughput"),
            "request_throughput": m.get("request_throughput"),
            "cache_hit_rate": m.get("cache_hit_rate"),
            "completed": m.get("completed"),
            "failed": m.get("failed"),
            "max_total_num_tokens": cap.get("max_total_num_tokens"),
            # KV tokens over SGLang's defaults' in the same budget (engine runs; None elsewhere).
            "capacity_ratio": cap.get("capacity_ratio"),
            "devices": devices,
            "devices_assumed": devices_assumed,
            "limits": doc["limits"],
        }
        for column, (dist, stat) in METRIC_COLUMNS.items():
            row[column] = (m.get(dist) or {}).get(stat)
        rows.append(row)
    workloads = [r["workload"] for r in rows]
    for row, variant, retention in zip(rows, variant_labels(configs, workloads),
                                       retention_details(configs, [r["retention"] for r in rows], workloads)):
        row["variant"], row["retention"] = variant, retention
    return pd.DataFrame(rows)
