"""Curating a sweep into benchmarks/, and the benchmarks/ tree itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from remnant.records.provenance import sha256_file
from remnant.records.schema import validate
from remnant.report.curate import curate

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
BIN = Path(sys.executable).parent


@pytest.mark.slow
def test_curate_a_sweep(tmp_path):
    root = tmp_path / "w"
    root.mkdir()
    p = subprocess.run([str(BIN / "remnant-run"), "-m", "mode=native,kernel", "workload=smoke",
                        f"hydra.sweep.dir={root}/sweep"], cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    bench = tmp_path / "benchmarks"
    path = curate(root / "sweep", "two-modes", "native and kernel, smoke", bench)
    doc = json.loads(path.read_text())
    validate(doc)
    assert doc["what_ran"]["modes"] == ["kernel", "native"] and doc["what_ran"]["runs"] == 2
    for member in doc["members"]:
        assert sha256_file(path.parent / member["path"]) == member["sha256"]
    assert "| smoke | kernel |" in doc["summary"]
    index = json.loads((bench / "index.json").read_text())
    validate(index)
    assert index["entries"] == [{"path": "two-modes/collection.json", "kind": "remnant/collection",
                                 "sha256": sha256_file(path), "description": "native and kernel, smoke"}]


def test_benchmarks_tree_is_valid_and_indexed():
    p = subprocess.run([str(BIN / "remnant-check"), str(BENCHMARKS)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    index = json.loads((BENCHMARKS / "index.json").read_text())
    validate(index)
    listed = {e["path"]: e for e in index["entries"]}
    for entry in listed.values():
        assert sha256_file(BENCHMARKS / entry["path"]) == entry["sha256"], entry["path"]
    curated = {str(p.relative_to(BENCHMARKS)) for p in BENCHMARKS.rglob("*.json")
               if "runs" not in p.parts and p.name != "index.json"}
    assert curated == set(listed)  # every curated file is indexed
    for entry in listed.values():
        if entry["kind"] == "remnant/collection":
            doc = json.loads((BENCHMARKS / entry["path"]).read_text())
            for member in doc["members"]:
                assert sha256_file((BENCHMARKS / entry["path"]).parent / member["path"]) == member["sha256"]
