"""Retention maps: JSON round trip, schema and keep checks naming file and layer; profiles."""

from __future__ import annotations

import json

import pytest
import torch

from remnant.calibration.retention import LayerKeep, RetentionMap, profile_values
from remnant.records.schema import RecordError, validate

FINGERPRINT = "ab" * 32


def _map(**over) -> RetentionMap:
    fields = dict(
        model_id="synthetic", policy="magnitude", policy_params={},
        calibration={"fingerprint": FINGERPRINT, "source": "synthetic", "queries": 4, "records": 16},
        layers=[LayerKeep(2, 64, []), LayerKeep(4, 128, list(range(10, 74)))])
    fields.update(over)
    return RetentionMap(**fields)


def _write(tmp_path, doc, name="map.json"):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_round_trip(tmp_path):
    m = _map(policy="random", policy_params={"seed": 3})
    path = m.save(tmp_path / "map.json")
    doc = json.loads(path.read_text())
    validate(doc)
    assert doc["schema"] == "remnant/retention-map" and doc["schema_version"] == 1
    assert doc["sources"]["remnant_version"] and doc["created_at"].endswith("+00:00")
    back = RetentionMap.load(path)
    assert back.to_dict() == doc
    assert (back.model_id, back.policy, back.policy_params, back.calibration) == (
        m.model_id, m.policy, m.policy_params, m.calibration)
    assert back.layers == m.layers
    assert back.csa_layers == [2, 4]
    assert back.retention(4) == 128
    keep = back.keep_tensor(4)
    assert keep.dtype == torch.int64 and torch.equal(keep, torch.arange(10, 74))
    assert back.keep_tensor(2).shape == (0,)
    with pytest.raises(KeyError, match="layer 3"):
        back.retention(3)


def test_check_against_model_layers():
    m = _map(layers=[LayerKeep(2, 64, []), LayerKeep(4, 64, []), LayerKeep(6, 64, [])])
    m.check([2, 4, 6])
    with pytest.raises(ValueError) as info:
        m.check([2, 4])
    assert str(info.value) == "retention map has 3 CSA layers [2, 4, 6]; the model has 2: [2, 4]"


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda d: d["policy"].__setitem__("name", "topk"), "policy.name"),
    (lambda d: d["layers"][1].__setitem__("retention", 100), "layers[1].retention"),
    (lambda d: d["calibration"].pop("fingerprint"), "calibration.fingerprint"),
    (lambda d: d.pop("model_id"), "model_id"),
])
def test_schema_invalid_file_names_file_and_field(tmp_path, mutate, field):
    doc = _map().to_dict()
    mutate(doc)
    path = _write(tmp_path, doc)
    with pytest.raises(RecordError) as info:
        RetentionMap.load(path)
    assert info.value.field == field
    assert str(path) in str(info.value)


@pytest.mark.parametrize(("keep", "words"), [
    (list(range(63)) + [62], "repeat"),
    (list(range(1, 64)) + [0], "not sorted"),
    (list(range(63)) + [448], "448"),
    (list(range(63)), "63 indices"),
    (list(range(65)), "65 indices"),
])
def test_bad_keep_names_file_and_layer(tmp_path, keep, words):
    doc = _map().to_dict()
    doc["layers"][1]["keep"] = keep
    path = _write(tmp_path, doc)
    with pytest.raises(ValueError) as info:
        RetentionMap.load(path)
    msg = str(info.value)
    assert str(path) in msg and "layer 4" in msg and words in msg, msg


def test_repeated_layer(tmp_path):
    doc = _map().to_dict()
    doc["layers"][1]["layer"] = 2
    with pytest.raises(ValueError, match=r"layers\[1\]: layer 2 is listed twice"):
        RetentionMap.load(_write(tmp_path, doc))


def test_save_refuses_a_bad_keep(tmp_path):
    m = _map(layers=[LayerKeep(2, 128, list(range(64, 0, -1)))])
    with pytest.raises(ValueError, match="layer 2"):
        m.save(tmp_path / "map.json")
    assert not (tmp_path / "map.json").exists()


def test_missing_and_malformed_file(tmp_path):
    with pytest.raises(RecordError, match="cannot read"):
        RetentionMap.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(RecordError, match="invalid JSON"):
        RetentionMap.load(bad)


def test_profile_values():
    assert profile_values(256, None, 3) == [256, 256, 256]
    assert profile_values(None, [64, 448], 2) == [64, 448]


@pytest.mark.parametrize(("retention", "per_layer", "n", "words"), [
    (512, None, 2, "retention=512 is not allowed"),
    (100, None, 2, "retention=100 is not allowed; allowed: 64, 128"),
    (None, [64, 100], 2, "per_layer[1]=100"),
    (None, [64], 2, "per_layer has 1 values; the model has 2 CSA layers"),
    (256, [256, 256], 2, "got both"),
    (None, None, 2, "got neither"),
    (256, None, 0, "n_csa_layers=0"),
])
def test_profile_value_errors(retention, per_layer, n, words):
    with pytest.raises(ValueError) as info:
        profile_values(retention, per_layer, n)
    assert words in str(info.value)
