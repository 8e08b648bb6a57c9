"""Fidelity report: exact at full retention, policies ranked as the planted structure
demands, and the command writes a schema-valid report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from remnant.calibration.captures import synthetic_captures
from remnant.calibration.fidelity import report, split
from remnant.calibration.fidelity_metrics import measure
from remnant.kv import RETENTION_VALUES, quantize
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


@pytest.mark.slow
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
    from remnant.calibration.captures import LayerCapture

    with pytest.raises(ValueError, match="needs >= 2 query tokens"):
        split(LayerCapture(captures.layers[2].q[:1], captures.layers[2].k))


@pytest.mark.slow
def test_command(tmp_path):
    out = tmp_path / "fidelity.json"
    p = subprocess.run([sys.executable, "-m", "remnant.cli.fidelity", "--synthetic", "--retention", "128,256",
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
    p = subprocess.run([sys.executable, "-m", "remnant.cli.fidelity", "--synthetic", *args, "--out", str(tmp_path / "f.json")],
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


# --- the comparison across every policy on a split by capture source (fidelity v2) ---

from remnant.calibration.captures import Captures, save_captures  # noqa: E402
from remnant.calibration.fidelity_compare import (check_split, evaluate_split, synthetic_split,  # noqa: E402
                                                  table_markdown)
from remnant.calibration.learned import Hyperparameters, train  # noqa: E402

SMALL = dict(heads=8, queries=16, records=256)


@pytest.fixture(scope="module")
def two_sources():
    return synthetic_split(**SMALL)


def test_synthetic_split_shares_structure_not_data(two_sources):
    from remnant.calibration.captures import synthetic_planted

    tr, ev = two_sources
    assert (tr.source, ev.source) == ("synthetic-train", "synthetic-eval") and tr.fingerprint != ev.fingerprint
    whole = synthetic_captures(**SMALL)
    for layer in (2, 4):
        assert tr.layers[layer].q.shape == (8, 8, 512) and tr.layers[layer].k.shape == (128, 512)
        assert torch.equal(torch.cat([tr.layers[layer].k, ev.layers[layer].k]), whole.layers[layer].k)
        assert torch.equal(torch.cat([tr.layers[layer].q, ev.layers[layer].q]), whole.layers[layer].q)
    assert torch.equal(synthetic_planted(tr.params, 2), synthetic_planted(ev.params, 2))


def test_evaluate_split_ranks_policies_on_the_unseen_source(two_sources):
    tr, ev = two_sources
    scorer = train([("train", tr)], Hyperparameters(steps=30, queries_per_step=8, records_per_step=128),
                   progress=False)
    policies = ["magnitude", "attention", "prefix", "random", "learned"]
    results = evaluate_split([("train", tr)], ("eval", ev), scorer, policies, list(RETENTION_VALUES), top_k=16,
                             progress=False)
    assert [(x["layer"], x["retention"], x["policy"]) for x in results] == [
        (layer, r, p) for layer in (2, 4) for r in RETENTION_VALUES for p in policies]
    err = {(x["layer"], x["retention"], x["policy"]): x["output_rel_error"]["mean"] for x in results}
    # measured on the eval source: all its query tokens over its own records
    assert {(x["queries"], x["records"]) for x in results} == {(8, 128)}
    for layer in (2, 4):
        assert len({err[layer, 64, p] for p in policies}) == 1  # RoPE only: all tie
        for r in RETENTION_VALUES[1:-1]:
            baseline = min(err[layer, r, "prefix"], err[layer, r, "random"])
            for p in ("magnitude", "attention", "learned"):
                assert err[layer, r, p] < baseline, (layer, r, p)


def _relabel(c: Captures, **over) -> Captures:
    fields = dict(model_id=c.model_id, source=c.source, layers=c.layers, fingerprint=c.fingerprint, params=c.params)
    fields.update(over)
    return Captures(**fields)


@pytest.mark.parametrize(("change", "words"), [
    ({"source": "synthetic-train", "fingerprint": "ef" * 32},
     "ev.safetensors: source is 'synthetic-train', as --train tr.safetensors's; the split is by capture source"),
    ({"model_id": "other"}, "ev.safetensors: model_id is 'other'; the training captures tr.safetensors have 'synthetic'"),
    ({"layers": "drop"}, "ev.safetensors: layers are [2]; the training captures tr.safetensors have [2, 4]"),
])
def test_check_split_refuses(two_sources, change, words):
    tr, ev = two_sources
    if change.get("layers") == "drop":
        change = {"layers": {2: ev.layers[2]}}
    with pytest.raises(ValueError) as info:
        check_split([("tr.safetensors", tr)], ("ev.safetensors", _relabel(ev, **change)))
    assert str(info.value).startswith(words), str(info.value)


def _compare(*args):
    return subprocess.run([sys.executable, "-m", "remnant.cli.fidelity", "compare", *args], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_compare_command_end_to_end(two_sources, tmp_path):
    from remnant.records.provenance import sha256_file

    tr = save_captures(two_sources[0], tmp_path / "train.safetensors")
    ev = save_captures(two_sources[1], tmp_path / "eval.safetensors")
    out = tmp_path / "report" / "cmp.json"
    p = _compare("--train", str(tr), "--eval", str(ev), "--steps", "5", "--retention", "64,192,448",
                 "--top-k", "16", "--limit", "a test of the command", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(out)
    doc = json.loads(out.read_text())
    validate(doc, str(out))
    assert doc["schema_version"] == 2 and doc["model_id"] == "synthetic"
    assert [c["fingerprint"] for c in doc["split"]["train"]] == [sha256_file(tr)]
    assert [c["fingerprint"] for c in doc["split"]["eval"]] == [sha256_file(ev)]
    assert doc["split"]["eval"][0]["source"] == "synthetic-eval" and doc["split"]["by"] == "capture source"
    assert doc["settings"]["policies"] == ["magnitude", "attention", "prefix", "random", "learned"]
    assert len(doc["results"]) == 2 * 3 * 5  # layers x R x policies
    scorer = out.parent / doc["scorer"]["file"]
    validate(json.loads(scorer.read_text()), str(scorer))
    assert doc["scorer"]["fingerprint"] == sha256_file(scorer) and doc["scorer"]["hyperparameters"]["steps"] == 5
    assert [x["file"] for x in doc["plots"]] == ["cmp.error-vs-r.png", "cmp.heatmap.png"]
    for plot in doc["plots"]:
        png = out.parent / plot["file"]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and sha256_file(png) == plot["sha256"]
    assert "a test of the command" in doc["limits"]
    assert any("synthetic-eval" in x and "no policy read" in x for x in doc["limits"])
    assert table_markdown(doc) in p.stderr and "| 192 |" in p.stderr


def test_compare_synthetic_in_process(tmp_path, monkeypatch, capsys):
    from remnant.cli import fidelity as command

    monkeypatch.setattr(command, "synthetic_split", lambda seed=0: synthetic_split(seed=seed, **SMALL))
    out = tmp_path / "syn.json"
    assert command.compare_main(["--synthetic", "--steps", "2", "--retention", "128", "--policies",
                                 "learned,prefix", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [x["policy"] for x in doc["results"]] == ["learned", "prefix"] * 2
    assert any("synthetic" in x and "not captures of DeepSeek-V4" in x for x in doc["limits"])


@pytest.mark.parametrize(("args", "words"), [
    (["--synthetic", "--policies", "magnitude"], "--policies=magnitude must include learned"),
    (["--synthetic", "--policies", "oracle,learned"], "--policies=oracle,learned must name distinct policies"),
    (["--synthetic", "--retention", "100"], "--retention=100 must be distinct values of 64, 128"),
    (["--synthetic", "--steps", "0"], "steps=0 must be an integer >= 1"),
    (["--train", "a.safetensors"], "--train needs --eval FILE"),
    (["--train", "missing.safetensors", "--eval", "b.safetensors"], "missing.safetensors: capture file does not exist"),
])
def test_compare_errors_are_one_line(tmp_path, args, words):
    out = tmp_path / "c.json"
    p = _compare(*args, "--out", str(out))
    assert p.returncode == 2
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fidelity compare: error: ") and words in lines[0], p.stderr
    assert not out.exists() and not list(tmp_path.iterdir())


def test_compare_refuses_a_shared_source(two_sources, tmp_path):
    tr = save_captures(two_sources[0], tmp_path / "a.safetensors")
    same = save_captures(_relabel(two_sources[1], source="synthetic-train"), tmp_path / "b.safetensors")
    p = _compare("--train", str(tr), "--eval", str(same), "--out", str(tmp_path / "c.json"))
    assert p.returncode == 2 and p.stderr.startswith(f"fidelity compare: error: {same}: source is 'synthetic-train'")
    assert not (tmp_path / "c.json").exists() and not (tmp_path / "c.scorer.json").exists()


def test_curated_comparison_is_consistent():
    """benchmarks/fidelity/tiny-sharegpt-to-longswe.json: the curated cross-source comparison."""
    from pathlib import Path

    from remnant.records.provenance import sha256_file

    path = Path(__file__).parents[2] / "benchmarks" / "fidelity" / "tiny-sharegpt-to-longswe.json"
    doc = json.loads(path.read_text())
    validate(doc, str(path))
    assert [c["source"] for c in doc["split"]["train"]] == ["sharegpt"]
    assert [c["source"] for c in doc["split"]["eval"]] == ["longswe"]
    assert doc["settings"]["retention_values"] == list(RETENTION_VALUES)
    assert set(doc["settings"]["policies"]) == {"magnitude", "attention", "prefix", "random", "learned"}
    scorer = json.loads((path.parent / doc["scorer"]["file"]).read_text())
    validate(scorer)
    assert sha256_file(path.parent / doc["scorer"]["file"]) == doc["scorer"]["fingerprint"]
    assert [c["fingerprint"] for c in scorer["training"]["captures"]] == [c["fingerprint"] for c in doc["split"]["train"]]
    for plot in doc["plots"]:
        assert sha256_file(path.parent / plot["file"]) == plot["sha256"]
    assert any("not DeepSeek-V4" in x for x in doc["limits"])
