"""Fidelity report: exact at full retention, policies ranked as the planted structure
demands, and the command writes a schema-valid report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from remnant.kv import RETENTION_VALUES, quantize
from remnant.kv.captures import synthetic_captures
from remnant.kv.fidelity import measure, report, split
from remnant.records.schema import validate


@pytest.fixture(scope="module")
def captures():
    return synthetic_captures(layers=(2, 4), heads=8, queries=16, records=256, seed=0)


def test_everything_kept_is_exact(captures):
    _, evaluation = split(captures.layers[2])
    m = measure(evaluation, quantize(captures.layers[2].k), torch.arange(448), top_k=16)
    assert m["output_rel_error"] == {"mean": 0.0, "p50": 0.0, "p95": 0.0, "max": 0.0}
    assert m["topk_overlap"] == 1.0 and m["softmax_kl"] == pytest.approx(0.0, abs=1e-15)
    assert (m["queries"], m["heads"], m["records"]) == (8, 8, 256)


def test_informed_policies_beat_baselines(captures):
    doc = report(captures, ["magnitude", "attention", "prefix", "random"], list(RETENTION_VALUES), top_k=16,
                 progress=False)
    validate(doc)
    err = {(r["layer"], r["retention"], r["policy"]): r["output_rel_error"]["mean"] for r in doc["results"]}
    for layer in (2, 4):
        # R = 64 keeps RoPE only: every policy keeps the same coordinates, so they tie.
        assert len({err[layer, 64, p] for p in ("magnitude", "attention", "prefix", "random")}) == 1
        for r in RETENTION_VALUES[1:]:
            best_baseline = min(err[layer, r, "prefix"], err[layer, r, "random"])
            assert err[layer, r, "magnitude"] < best_baseline, (layer, r)
            assert err[layer, r, "attention"] < best_baseline, (layer, r)
    assert any("synthetic" in limit for limit in doc["limits"])


def test_split_needs_two_queries(captures):
    from remnant.kv.captures import LayerCapture

    with pytest.raises(ValueError, match="needs >= 2 query tokens"):
        split(LayerCapture(captures.layers[2].q[:1], captures.layers[2].k))


def test_command(tmp_path):
    out = tmp_path / "fidelity.json"
    p = subprocess.run([sys.executable, "-m", "remnant.kv.fidelity", "--synthetic", "--retention", "128,256",
                        "--policies", "magnitude,random", "--out", str(out)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(out)
    doc = json.loads(out.read_text())
    validate(doc)
    assert len(doc["results"]) == 2 * 2 * 2  # layers x R x policies
    assert "magnitude" in p.stderr  # the table


@pytest.mark.parametrize(("args", "message"), [
    (["--policies", "oracle"], "--policies has oracle; allowed: magnitude, attention, prefix, random"),
    (["--retention", "100"], "--retention has 100; allowed: 64, 128"),
    (["--retention", "abc"], "--retention=abc must be comma-separated integers"),
])
def test_command_errors_are_one_line(tmp_path, args, message):
    p = subprocess.run([sys.executable, "-m", "remnant.kv.fidelity", "--synthetic", *args, "--out", str(tmp_path / "f.json")],
                       capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.strip().startswith("fidelity: error: ") and message in p.stderr
    assert "Traceback" not in p.stderr


def test_curated_report_shows_the_ranking():
    """benchmarks/fidelity/synthetic-seed0.json: the curated evidence for the policies."""
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "fidelity" / "synthetic-seed0.json"
    doc = json.loads(path.read_text())
    validate(doc, str(path))
    assert doc["captures"]["source"] == "synthetic" and doc["captures"]["params"]["heads"] == 64
    err = {(r["layer"], r["retention"], r["policy"]): r["output_rel_error"]["mean"] for r in doc["results"]}
    layers = {r["layer"] for r in doc["results"]}
    for layer in layers:
        for r in RETENTION_VALUES[1:]:
            assert max(err[layer, r, "magnitude"], err[layer, r, "attention"]) < min(
                err[layer, r, "prefix"], err[layer, r, "random"])
