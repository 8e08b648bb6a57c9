"""Learned retention policy: training finds structure, is deterministic, saves its provenance,
refuses captures of another model or other layers, and builds retention maps."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch

from remnant.calibration.captures import Captures, save_captures, synthetic_captures, synthetic_planted
from remnant.calibration.fidelity_compare import synthetic_split
from remnant.calibration.learned import Hyperparameters, LearnedScorer, batch_loss, build_map, soft_top_n_mask, train
from remnant.calibration.policies import POLICIES, choose, top
from remnant.calibration.retention import MAP_POLICIES, RetentionMap
from remnant.cli.build_map import main as build_map_main
from remnant.records.schema import RecordError, validate

FAST = Hyperparameters(steps=40, queries_per_step=8, records_per_step=128)


@pytest.fixture(scope="module")
def split():
    return synthetic_split(heads=8, queries=32, records=512)


@pytest.fixture(scope="module")
def scorer(split):
    return train([("train.safetensors", split[0])], FAST, seed=0, progress=False)


def test_learned_is_not_a_serving_policy():
    assert "learned" not in POLICIES and MAP_POLICIES == (*POLICIES, "learned")


@pytest.mark.slow
def test_from_nothing_it_finds_the_planted_channels_as_well_as_magnitude(split):
    """Started from zero logits (every coordinate tied), training alone must find them."""
    tr = split[0]
    hp = Hyperparameters(steps=60, queries_per_step=16, records_per_step=256, init="zero")
    s = train([("train", tr)], hp, seed=0, progress=False)
    for layer in tr.layers:
        planted = set(synthetic_planted(tr.params, layer).tolist())
        for r in (128, 192):
            learned = len(planted & set(s.keep(layer, r).tolist()))
            magnitude = len(planted & set(choose("magnitude", tr.layers[layer], r, layer=layer).tolist()))
            assert learned >= magnitude and learned >= 0.9 * len(planted), (layer, r, learned, magnitude)
        curve = s.training["loss_curves"][str(layer)]
        assert curve[-1]["loss"] < 0.5 * curve[0]["loss"], curve


def test_training_is_deterministic_for_a_seed(split, scorer):
    again = train([("train.safetensors", split[0])], FAST, seed=0, progress=False)
    other = train([("train.safetensors", split[0])], FAST, seed=1, progress=False)
    for layer in scorer.csa_layers:
        assert torch.equal(again.layers[layer], scorer.layers[layer])
        assert not torch.equal(other.layers[layer], scorer.layers[layer])
    assert again.training == scorer.training


def test_threads_are_restored(split):
    before = torch.get_num_threads()
    train([("t", split[0])], Hyperparameters(steps=1, queries_per_step=2, records_per_step=8), progress=False)
    assert torch.get_num_threads() == before


def test_keep_is_top_of_the_logits(scorer):
    for layer in scorer.csa_layers:
        for r in (64, 128, 256, 448):
            keep = scorer.keep(layer, r)
            assert keep.dtype == torch.int64 and keep.shape == (r - 64,)
            assert torch.equal(keep, top(scorer.layers[layer], r - 64))
        # one scorer serves every R: the kept sets are nested
        assert set(scorer.keep(layer, 128).tolist()) <= set(scorer.keep(layer, 256).tolist())
    with pytest.raises(ValueError, match="retention=100 is not allowed"):
        scorer.keep(2, 100)


def test_soft_mask_spends_the_budget_and_ranks_by_logit():
    g = torch.Generator().manual_seed(0)
    logit = torch.randn(448, generator=g, dtype=torch.float64, requires_grad=True)
    for n in (0, 1, 64, 200, 447, 448):
        m = soft_top_n_mask(logit, n, 0.5)
        assert float(m.detach().sum()) == pytest.approx(n, abs=1e-6)
        if 0 < n < 448:
            assert torch.equal(m.detach().argsort(descending=True, stable=True)[:n].sort().values,
                               top(logit.detach(), n))
    # implicit threshold: raising every logit alike moves nothing, so the gradients sum to zero
    m = soft_top_n_mask(logit, 128, 0.5)
    (m * torch.arange(448, dtype=torch.float64)).sum().backward()
    assert float(logit.grad.sum()) == pytest.approx(0.0, abs=1e-9)


def test_batch_loss_by_hand():
    """With a mask far from soft (large logit gaps), the loss is the relative output error of
    attention over the kept coordinates, as remnant.kv.attention defines it."""
    import math

    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(4, 512, generator=g, dtype=torch.float64), torch.randn(16, 512, generator=g, dtype=torch.float64)
    logit = torch.where(torch.arange(448) < 64, 100.0, -100.0).double()
    s = 1 / math.sqrt(512)

    def attend(keys):
        return torch.softmax(q @ keys.T * s, dim=1) @ keys

    kept = k.clone()
    kept[:, 64:448] = 0
    o, o_kept = attend(k), attend(kept)
    want = ((o_kept - o).norm(dim=1) / o.norm(dim=1)).mean()
    got = batch_loss(logit, q, k, (128,), 0.5)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=0)


def test_save_load_round_trip_and_provenance(split, scorer, tmp_path):
    path = scorer.save(tmp_path / "s" / "scorer.json")
    assert scorer.fingerprint == hashlib.sha256(path.read_bytes()).hexdigest()
    doc = json.loads(path.read_text())
    validate(doc, str(path))
    assert doc["schema"] == "remnant/learned-scorer" and doc["schema_version"] == 1
    assert doc["model_id"] == "synthetic" and doc["seed"] == 0
    assert doc["hyperparameters"]["steps"] == FAST.steps and doc["hyperparameters"]["init"] == "attention"
    assert doc["training"]["captures"] == [{"fingerprint": split[0].fingerprint, "source": "synthetic-train",
                                            "model_id": "synthetic", "queries": 16, "records": 256}]
    assert set(doc["training"]["loss_curves"]) == {"2", "4"}
    assert doc["sources"]["remnant_version"] and doc["created_at"].endswith("+00:00")
    back = LearnedScorer.load(path)
    assert back.fingerprint == scorer.fingerprint and back.to_dict() == doc
    for layer in scorer.csa_layers:
        assert torch.equal(back.layers[layer], scorer.layers[layer])  # float64 exact through JSON


def test_load_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(RecordError, match="bad.json: <root>: invalid JSON"):
        LearnedScorer.load(bad)
    with pytest.raises(RecordError, match="missing.json: <root>: cannot read"):
        LearnedScorer.load(tmp_path / "missing.json")


def test_refuses_captures_of_another_model_or_other_layers(scorer, split):
    other_model = synthetic_captures(layers=(2, 4), heads=8, queries=4, records=32, model_id="other")
    with pytest.raises(ValueError) as info:
        scorer.check(other_model, "b.safetensors")
    assert str(info.value).startswith("b.safetensors: model_id is 'other'") and "'synthetic'" in str(info.value)
    other_layers = synthetic_captures(layers=(2, 6), heads=8, queries=4, records=32)
    with pytest.raises(ValueError, match=r"^c.safetensors: layers are \[2, 6\]; .* has layers \[2, 4\]"):
        scorer.check(other_layers, "c.safetensors")
    scorer.check(split[1], "eval")  # same model and layers


def test_training_set_must_agree(split):
    other = synthetic_captures(layers=(2, 4), heads=8, queries=4, records=32, model_id="other")
    with pytest.raises(ValueError, match="^b: model_id is 'other'; a has 'synthetic'"):
        train([("a", split[0]), ("b", other)], FAST, progress=False)
    with pytest.raises(ValueError, match="^b: the same captures"):
        train([("a", split[0]), ("b", split[0])], FAST, progress=False)


@pytest.mark.parametrize(("over", "words"), [
    ({"steps": 0}, "steps=0 must be an integer >= 1"),
    ({"lr": -1.0}, "lr=-1.0 must be a number > 0"),
    ({"retentions": (64, 256)}, "retentions=[64, 256] must be"),
    ({"init": "oracle"}, "init='oracle' is not allowed; allowed: attention, magnitude, zero"),
])
def test_hyperparameter_errors(over, words):
    import dataclasses

    with pytest.raises(ValueError) as info:
        dataclasses.replace(FAST, **over).check()
    assert words in str(info.value)


def test_two_training_files(split):
    a, b = synthetic_split(heads=8, queries=8, records=64, seed=3)
    b = Captures(model_id=b.model_id, source="other-source", layers=b.layers, fingerprint=b.fingerprint, params={})
    s = train([("a", a), ("b", b)], Hyperparameters(steps=3, queries_per_step=2, records_per_step=16),
              progress=False)
    s.fingerprint = "cd" * 32
    cal = s.calibration()
    assert cal["source"] == "synthetic-train+other-source"
    assert cal["fingerprint"] == hashlib.sha256(f"{a.fingerprint}\n{b.fingerprint}".encode()).hexdigest()
    assert [c["fingerprint"] for c in cal["captures"]] == [a.fingerprint, b.fingerprint]
    m = build_map(s, [128, 256])
    validate(m.to_dict())


def test_build_map_from_a_scorer(scorer, split, tmp_path):
    scorer.save(tmp_path / "scorer.json")
    m = build_map(scorer, [128, 448])
    assert m.policy == "learned" and m.model_id == "synthetic"
    assert m.policy_params == {"scorer": {"fingerprint": scorer.fingerprint, "method": scorer.to_dict()["method"],
                                          "seed": 0},
                               "training_captures": [{"fingerprint": split[0].fingerprint,
                                                      "source": "synthetic-train"}]}
    assert m.calibration == {"fingerprint": split[0].fingerprint, "source": "synthetic-train",
                             "queries": 16, "records": 256}
    assert torch.equal(m.keep_tensor(2), scorer.keep(2, 128))
    path = m.save(tmp_path / "map.json")
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == 2  # v1 cannot name the learned policy
    back = RetentionMap.load(path)
    assert back.layers == m.layers and back.policy == "learned"
    # training-free maps are still written (and read) as v1
    prefix = RetentionMap(model_id="x", policy="prefix", policy_params={}, calibration=m.calibration,
                          layers=m.layers).save(tmp_path / "p.json")
    assert json.loads(prefix.read_text())["schema_version"] == 1
    with pytest.raises(ValueError, match="retention_values has 1 values; the scorer has 2 CSA layers"):
        build_map(scorer, [128])
    with pytest.raises(ValueError, match="^eval.safetensors: model_id is 'other'"):
        build_map(scorer, [128, 128], synthetic_captures(heads=2, queries=2, records=8, model_id="other"),
                  "eval.safetensors")


def test_a_scorer_needs_a_fingerprint_for_a_map(split):
    s = train([("t", split[0])], Hyperparameters(steps=1, queries_per_step=2, records_per_step=8), progress=False)
    with pytest.raises(ValueError, match="save or load it"):
        build_map(s, [128, 128])


def test_build_map_command_with_learned(scorer, split, tmp_path, capsys):
    scorer_path = scorer.save(tmp_path / "scorer.json")
    captures = save_captures(split[1], tmp_path / "eval.safetensors")
    out = tmp_path / "map.json"
    assert build_map_main(["--policy", "learned", "--scorer", str(scorer_path), "--per-layer", "192,256",
                           "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    m = RetentionMap.load(out)
    assert m.policy_params["scorer"]["fingerprint"] == hashlib.sha256(scorer_path.read_bytes()).hexdigest()
    assert [m.retention(2), m.retention(4)] == [192, 256]
    out2 = tmp_path / "map2.json"
    assert build_map_main(["--policy", "learned", "--scorer", str(scorer_path), "--captures", str(captures),
                           "--retention", "256", "--out", str(out2)]) == 0
    assert RetentionMap.load(out2).layers[1] == RetentionMap.load(out).layers[1]


@pytest.mark.parametrize(("args", "words"), [
    (("--policy", "learned", "--retention", "256"), "--policy learned needs --scorer FILE"),
    (("--policy", "magnitude", "--synthetic", "--scorer", "s.json", "--retention", "256"),
     "--scorer is for --policy learned only"),
    (("--policy", "magnitude", "--retention", "256"), "--policy magnitude needs --captures FILE or --synthetic"),
    (("--policy", "learned", "--scorer", "nope.json", "--retention", "256"), "nope.json: <root>: cannot read"),
    (("--policy", "learned", "--scorer", "SCORER", "--synthetic", "--retention", "256"),
     "--synthetic: model_id is 'synthetic'; the scorer"),
])
def test_build_map_command_errors(tmp_path, capsys, args, words):
    s = synthetic_captures(layers=(1, 3), heads=2, queries=4, records=16, model_id="tiny")
    scorer_path = train([("t", s)], Hyperparameters(steps=1, queries_per_step=2, records_per_step=8),
                        progress=False).save(tmp_path / "s.json")
    args = [str(scorer_path) if a == "SCORER" else a for a in args]
    out = tmp_path / "map.json"
    with pytest.raises(SystemExit) as info:
        build_map_main([*args, "--out", str(out)])
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("build_map: error: ") and words in lines[0], lines
    assert not out.exists()


def _learned(*args):
    return subprocess.run([sys.executable, "-m", "remnant.cli.learned", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_train_command(split, tmp_path):
    captures = save_captures(synthetic_captures(heads=4, queries=8, records=64), tmp_path / "a.safetensors")
    out = tmp_path / "scorer.json"
    done = _learned("train", "--captures", str(captures), "--steps", "3", "--seed", "7", "--init", "magnitude",
                    "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    s = LearnedScorer.load(out)
    assert s.seed == 7 and s.hyperparameters.steps == 3 and s.hyperparameters.init == "magnitude"
    assert s.training["captures"][0]["fingerprint"] == hashlib.sha256(captures.read_bytes()).hexdigest()


@pytest.mark.parametrize(("args", "words"), [
    (("train", "--captures", "missing.safetensors"), "missing.safetensors: capture file does not exist"),
    (("train", "--synthetic", "--steps", "0"), "steps=0 must be an integer >= 1"),
    (("train", "--synthetic", "--init", "oracle"), "argument --init: invalid choice"),
])
def test_train_command_errors_are_one_line(tmp_path, args, words):
    out = tmp_path / "scorer.json"
    done = _learned(*args, "--out", str(out))
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("learned: error: ") and words in lines[0], done.stderr
    assert not out.exists()
