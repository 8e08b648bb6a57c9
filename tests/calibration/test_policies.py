"""Training-free retention policies, build_map, and the build_map command."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys

import pytest
import torch

from remnant.calibration.captures import LayerCapture, save_captures, synthetic_captures, synthetic_planted
from remnant.calibration.policies import POLICIES, attention_score, build_map, choose
from remnant.calibration.retention import RetentionMap
from remnant.cli.build_map import main as build_map_main
from remnant.kv.formats import RETENTION_VALUES
from remnant.records.schema import validate


@pytest.fixture(scope="module")
def small():
    return synthetic_captures(heads=4, queries=3, records=40)


@pytest.fixture(scope="module")
def full():
    return synthetic_captures()


@pytest.mark.parametrize("retention", RETENTION_VALUES)
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_keeps_sorted_unique_nope_indices(small, policy, retention):
    keep = choose(policy, small.layers[2], retention, layer=2)
    assert keep.dtype == torch.int64 and keep.shape == (retention - 64,)
    if keep.numel():
        assert keep.min() >= 0 and keep.max() < 448
        assert (keep[1:] > keep[:-1]).all()
    assert torch.equal(choose(policy, small.layers[2], retention, layer=2), keep)


def test_prefix_is_arange(small):
    assert torch.equal(choose("prefix", small.layers[2], 256), torch.arange(192))


def test_random_is_seeded_by_seed_and_layer(small):
    cap = small.layers[2]
    a = choose("random", cap, 256, seed=1, layer=2)
    assert torch.equal(a, choose("random", cap, 256, seed=1, layer=2))
    assert not torch.equal(a, choose("random", cap, 256, seed=2, layer=2))
    assert not torch.equal(a, choose("random", cap, 256, seed=1, layer=4))
    g = torch.Generator().manual_seed(3)
    assert torch.equal(a, torch.randperm(448, generator=g)[:192].sort().values)


def test_ties_go_to_the_lower_index():
    cap = LayerCapture(q=torch.ones(2, 3, 512), k=torch.ones(5, 512))
    for policy in ("magnitude", "attention"):
        assert torch.equal(choose(policy, cap, 192), torch.arange(128))


@pytest.mark.parametrize("policy", ["magnitude", "attention"])
def test_informed_policies_find_the_planted_channels(full, policy):
    for layer, cap in full.layers.items():
        planted = set(synthetic_planted(full.params, layer).tolist())
        kept = set(choose(policy, cap, 256, layer=layer).tolist())
        assert len(planted & kept) >= 0.9 * len(planted), (layer, sorted(planted - kept))


def test_prefix_does_not_find_them(full):
    for layer, cap in full.layers.items():
        planted = set(synthetic_planted(full.params, layer).tolist())
        kept = set(choose("prefix", cap, 256, layer=layer).tolist())
        assert len(planted & kept) < 0.9 * len(planted)


def test_attention_score_by_hand():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, 512, generator=g, dtype=torch.float64) * 3
    k = torch.randn(2, 512, generator=g, dtype=torch.float64)
    s = 1 / math.sqrt(512)
    qs, ks = q[0, 0].tolist(), k.tolist()
    logits = [s * sum(qs[d] * ks[j][d] for d in range(512)) for j in range(2)]
    z = sum(math.exp(x) for x in logits)
    p = [math.exp(x) / z for x in logits]
    o = [sum(p[j] * ks[j][d] for j in range(2)) for d in range(512)]
    spread = sum(p[j] * sum((ks[j][d] - o[d]) ** 2 for d in range(512)) for j in range(2))
    expected = [s * s * qs[i] ** 2 * (ks[0][i] ** 2 + ks[1][i] ** 2) / 2 * spread + o[i] ** 2
                for i in range(448)]
    got = attention_score(LayerCapture(q=q, k=k))
    assert got.dtype == torch.float64 and got.shape == (448,)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)


def test_attention_score_is_chunk_independent(small, monkeypatch):
    from remnant.calibration import policies

    whole = attention_score(small.layers[2])
    monkeypatch.setattr(policies, "_ATTENTION_BLOCK", 1)  # one query token per block
    torch.testing.assert_close(attention_score(small.layers[2]), whole, rtol=1e-12, atol=0)


@pytest.mark.parametrize(("args", "words"), [
    (("lottery", 256), "policy='lottery' is not allowed; allowed: magnitude, attention, prefix, random"),
    (("magnitude", 512), "retention=512 is not allowed"),
    (("magnitude", 100), "retention=100 is not allowed"),
])
def test_choose_errors(small, args, words):
    with pytest.raises(ValueError) as info:
        choose(args[0], small.layers[2], args[1])
    assert words in str(info.value)


def test_build_map(small, tmp_path):
    m = build_map(small, "random", [128, 448], seed=9)
    assert m.csa_layers == [2, 4] and m.policy_params == {"seed": 9}
    assert [m.retention(2), m.retention(4)] == [128, 448]
    assert torch.equal(m.keep_tensor(4), choose("random", small.layers[4], 448, seed=9, layer=4))
    assert m.calibration == {"fingerprint": small.fingerprint, "source": "synthetic",
                             "queries": 3, "records": 40}
    back = RetentionMap.load(m.save(tmp_path / "map.json"))
    assert back.layers == m.layers
    assert build_map(small, "attention", [256, 256]).policy_params == {}
    with pytest.raises(ValueError, match=r"retention_values has 1 values; the captures have 2 CSA layers \[2, 4\]"):
        build_map(small, "attention", [256])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "remnant.cli.build_map", *args],
                          capture_output=True, text=True, timeout=120)


def test_command_end_to_end(tmp_path):
    out = tmp_path / "out" / "map.json"
    done = _cli("--synthetic", "--policy", "attention", "--retention", "256", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    doc = json.loads(out.read_text())
    validate(doc, source=str(out))
    assert doc["policy"] == {"name": "attention", "params": {}}
    assert [(e["layer"], e["retention"], len(e["keep"])) for e in doc["layers"]] == [(2, 256, 192), (4, 256, 192)]


def test_command_bad_retention_is_one_line(tmp_path):
    out = tmp_path / "map.json"
    done = _cli("--synthetic", "--policy", "attention", "--retention", "100", "--out", str(out))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "build_map: error: retention=100 is not allowed; allowed: 64, 128, 192, 256, 320, 384, 448"]
    assert not out.exists()


def test_command_from_a_capture_file(small, tmp_path, capsys):
    captures = save_captures(small, tmp_path / "c.safetensors")
    out = tmp_path / "map.json"
    assert build_map_main(["--captures", str(captures), "--policy", "random", "--per-layer", "128,448",
                           "--seed", "4", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    m = RetentionMap.load(out)
    assert [m.retention(2), m.retention(4)] == [128, 448] and m.policy_params == {"seed": 4}
    assert m.calibration["fingerprint"] == hashlib.sha256(captures.read_bytes()).hexdigest()


@pytest.mark.parametrize(("args", "words"), [
    (("--synthetic", "--policy", "attention", "--per-layer", "256,x"), "--per-layer value 1 is 'x'"),
    (("--synthetic", "--policy", "attention", "--per-layer", "256"), "per_layer has 1 values"),
    (("--captures", "missing.safetensors", "--policy", "prefix", "--retention", "64"),
     "missing.safetensors: capture file does not exist"),
    (("--synthetic", "--policy", "lottery", "--retention", "64"), "argument --policy: invalid choice"),
    (("--synthetic", "--policy", "prefix"), "one of the arguments --retention --per-layer is required"),
])
def test_command_errors_are_one_line(tmp_path, capsys, args, words):
    out = tmp_path / "map.json"
    with pytest.raises(SystemExit) as info:
        build_map_main([*args, "--out", str(out)])
    assert info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("build_map: error: ") and words in lines[0], captured.err
    assert not out.exists()
