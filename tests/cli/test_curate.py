"""python -m remnant.cli.curate: the command's flags (curation itself:
tests/report/test_curate.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remnant.cli.curate import main
from remnant.records.provenance import sha256_file

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_index_only_rebuilds_the_index_without_a_sweep(tmp_path):
    # As the benchmarks README says to run it: no sweep, --name or --description.
    bench = tmp_path / "benchmarks"
    (bench / "kernels").mkdir(parents=True)
    record = BENCHMARKS / "kernels" / "h200-2026-12-03-r18.json"
    (bench / "kernels" / record.name).write_bytes(record.read_bytes())
    assert main(["--index-only", "--benchmarks", str(bench)]) == 0
    index = json.loads((bench / "index.json").read_text())
    assert index["entries"] == [{"path": f"kernels/{record.name}", "kind": "remnant/kernel-bench",
                                 "sha256": sha256_file(record), "description": "kernel benchmark"}]


def test_curating_names_what_it_lacks(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["some-sweep"])
    assert exc.value.code == 2
    assert "to curate, give --name, --description (or --index-only)" in capsys.readouterr().err
