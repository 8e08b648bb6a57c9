"""Curate a sweep into a collection under benchmarks/ and index it (the command:
remnant.cli.curate).

Copies every run.json of the sweep (with its requests.jsonl) into
benchmarks/<name>/runs/<cell>/, writes benchmarks/<name>/collection.json (schema
remnant/collection: what ran, provenance, the runs' limits, members with sha256, the
report table) and rebuilds benchmarks/index.json over every curated file.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from pathlib import Path

from remnant.kv.modes import mode_of
from remnant.records import kinds
from remnant.records.provenance import sha256_file, sources
from remnant.records.schema import validate, write_validated

INDEX = "index.json"
_DESCRIBE = {kinds.FIDELITY.name: "fidelity report", kinds.CAPACITY.name: "capacity report",
             kinds.KERNEL_BENCH.name: "kernel benchmark", kinds.CLIENT_BENCH.name: "client ceiling benchmark",
             kinds.LEARNED_SCORER.name: "learned coordinate scorer", kinds.ENGINE_BENCH.name: "engine benchmark",
             kinds.FIDELITY_PARTS.name: "fidelity of the KV parts beyond C4 records"}


def curate(sweep: Path, name: str, description: str, benchmarks: Path) -> Path:
    from remnant.report.model import COLUMNS, summary_rows
    from remnant.report.runs import find_runs, load_runs
    from remnant.report.stats import summary

    runs = find_runs([sweep])
    target = benchmarks / name
    if target.exists():
        raise ValueError(f"{target} exists: a collection is curated once (choose another --name)")
    members, limits, workloads, hosts, modes, env = [], set(), set(), set(), set(), None
    for path in runs:
        doc = json.loads(path.read_text())
        validate(doc, str(path))
        cell = path.parent.name
        dest = target / "runs" / cell
        dest.mkdir(parents=True)
        shutil.copy2(path, dest / "run.json")
        if (path.parent / "requests.jsonl").exists():
            shutil.copy2(path.parent / "requests.jsonl", dest / "requests.jsonl")
        cfg = doc["config"]
        members.append({
            "path": f"runs/{cell}/run.json", "sha256": sha256_file(dest / "run.json"), "run_id": doc["run_id"],
            "status": doc["status"], "mode": cfg["mode"]["name"],
            "retention": ((cfg.get("retention") or {}).get("name", "?") if mode_of(cfg["mode"]["name"]).keeps_retention
                          else "-"),
            "workload": doc["workload"]["name"], "seed": doc["workload"]["seed"],
        })
        limits.update(doc["limits"])
        workloads.add(doc["workload"]["name"])
        hosts.add(doc["host"].get("kind", "?"))
        modes.add(cfg["mode"]["name"])
        env = env or doc.get("environment")
    table = summary(load_runs([target / "runs"]), COLUMNS)
    collection = {
        **kinds.COLLECTION.header(), "name": name, "description": description,
        "created_at": datetime.now(timezone.utc).isoformat(), "sources": sources(),
        "what_ran": {"modes": sorted(modes), "workloads": sorted(workloads), "hosts": sorted(hosts),
                     "runs": len(members), "environment": env},
        "limits": sorted(limits), "members": members, "summary": summary_rows(table).markdown(),
    }
    path = write_validated(target / "collection.json", collection)
    write_index(benchmarks)
    return path


def write_index(benchmarks: Path) -> Path:
    """benchmarks/index.json over every schema'd JSON file there (collections' members excluded)."""
    entries = []
    for path in sorted(benchmarks.rglob("*.json")):
        rel = path.relative_to(benchmarks)
        if rel.name == INDEX or "runs" in rel.parts:
            continue
        doc = json.loads(path.read_text())
        kind = doc.get("schema")
        if kind not in (kinds.COLLECTION.name, *_DESCRIBE):
            continue
        description = doc.get("description") or _DESCRIBE[kind]
        entries.append({"path": str(rel), "kind": kind, "sha256": sha256_file(path), "description": description})
    return write_validated(benchmarks / INDEX, {**kinds.INDEX.header(), "entries": entries})
