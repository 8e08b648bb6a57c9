"""Calibration captures: safetensors round trip, fingerprints, bad files, the synthetic generator."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from remnant.calibration.captures import (
    FORMAT,
    Captures,
    LayerCapture,
    load_captures,
    save_captures,
    synthetic_captures,
    synthetic_planted,
)

SMALL = dict(heads=4, queries=3, records=40)


def _meta(**over):
    meta = {"format": FORMAT, "model_id": "m", "source": "s", "params": "{}"}
    meta.update(over)
    return meta


def test_round_trip_is_bit_exact(tmp_path):
    c = synthetic_captures(layers=(4, 2), **SMALL)
    path = save_captures(c, tmp_path / "c.safetensors")
    back = load_captures(path)
    assert (back.model_id, back.source, back.params) == (c.model_id, c.source, c.params)
    assert list(back.layers) == [2, 4]
    for layer in (2, 4):
        assert back.layers[layer].q.dtype == torch.float32
        assert back.layers[layer].q.shape == (3, 4, 512) and back.layers[layer].k.shape == (40, 512)
        assert torch.equal(back.layers[layer].q, c.layers[layer].q)
        assert torch.equal(back.layers[layer].k, c.layers[layer].k)
    assert back.fingerprint == hashlib.sha256(path.read_bytes()).hexdigest()
    # Any safetensors reader sees the documented names and metadata.
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == ["layers.2.k", "layers.2.q", "layers.4.k", "layers.4.q"]
        meta = f.metadata()
    assert meta["format"] == "remnant-capture/1" and json.loads(meta["params"]) == c.params


def test_same_captures_give_the_same_file(tmp_path):
    c = synthetic_captures(**SMALL)
    a = load_captures(save_captures(c, tmp_path / "a.safetensors"))
    b = load_captures(save_captures(synthetic_captures(**SMALL), tmp_path / "b.safetensors"))
    assert a.fingerprint == b.fingerprint
    other = load_captures(save_captures(synthetic_captures(seed=1, **SMALL), tmp_path / "o.safetensors"))
    assert other.fingerprint != a.fingerprint


def test_synthetic_is_deterministic_and_fingerprinted_by_params():
    a, b = synthetic_captures(**SMALL), synthetic_captures(**SMALL)
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 64
    assert a.fingerprint == hashlib.sha256(
        json.dumps(a.params, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    for layer in a.layers:
        assert torch.equal(a.layers[layer].q, b.layers[layer].q)
        assert torch.equal(a.layers[layer].k, b.layers[layer].k)
    c = synthetic_captures(seed=1, **SMALL)
    assert c.fingerprint != a.fingerprint
    assert not torch.equal(c.layers[2].k, a.layers[2].k)
    assert a.source == "synthetic"
    # Each layer depends only on (seed, layer), not on which other layers are generated.
    only4 = synthetic_captures(layers=(4,), **SMALL)
    assert torch.equal(only4.layers[4].k, a.layers[4].k)


def test_synthetic_planted_channels_are_spread_and_strong():
    c = synthetic_captures()
    k = c.layers[2].k
    planted = synthetic_planted(c.params, 2)
    assert planted.shape == (16,) and planted.max() > 224  # not bunched at the start
    energy = k[:, :448].pow(2).mean(0)
    rest = torch.ones(448, dtype=torch.bool)
    rest[planted] = False
    assert energy[planted].min() > energy[rest].median() * 16


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.safetensors: capture file does not exist"):
        load_captures(tmp_path / "nope.safetensors")


def test_not_safetensors(tmp_path):
    path = tmp_path / "c.safetensors"
    path.write_bytes(b"this is not a safetensors file at all")
    with pytest.raises(ValueError, match="not a readable safetensors file") as info:
        load_captures(path)
    assert str(path) in str(info.value)


def test_wrong_format(tmp_path):
    path = tmp_path / "c.safetensors"
    save_file({"layers.2.q": torch.zeros(1, 1, 512), "layers.2.k": torch.zeros(1, 512)}, str(path),
              metadata=_meta(format="other/1"))
    with pytest.raises(ValueError, match="metadata format is 'other/1'"):
        load_captures(path)


@pytest.mark.parametrize(("tensors", "words"), [
    ({"layers.2.q": torch.zeros(2, 512), "layers.2.k": torch.zeros(3, 512)}, "tensor layers.2.q must have shape [T, H, 512]"),
    ({"layers.2.q": torch.zeros(2, 1, 512), "layers.2.k": torch.zeros(3, 448)}, "tensor layers.2.k must have shape [n, 512]"),
    ({"layers.2.q": torch.zeros(2, 1, 512), "layers.2.k": torch.zeros(0, 512)}, "tensor layers.2.k must have shape"),
    ({"layers.2.q": torch.zeros(2, 1, 512)}, "tensor layers.2.k is missing"),
    ({"layers.2.q": torch.zeros(2, 1, 512), "layers.2.k": torch.zeros(3, 512, dtype=torch.float16)},
     "tensor layers.2.k is torch.float16; expected float32"),
    ({"layers.2.q": torch.zeros(2, 1, 512), "layers.2.k": torch.zeros(3, 512), "extra": torch.zeros(1)},
     "tensor 'extra' is not layers.<L>.q or layers.<L>.k"),
])
def test_bad_tensors_name_file_and_tensor(tmp_path, tensors, words):
    path = tmp_path / "c.safetensors"
    save_file(tensors, str(path), metadata=_meta())
    with pytest.raises(ValueError) as info:
        load_captures(path)
    assert str(path) in str(info.value) and words in str(info.value), str(info.value)


def test_nan_names_file_and_tensor(tmp_path):
    c = synthetic_captures(layers=(2,), **SMALL)
    path = save_captures(c, tmp_path / "c.safetensors")
    with safe_open(str(path), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
        meta = f.metadata()
    tensors["layers.2.q"][1, 2, 3] = float("nan")
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ValueError, match=r"c\.safetensors: tensor layers\.2\.q has 1 non-finite"):
        load_captures(path)


def test_save_refuses_bad_shapes(tmp_path):
    c = Captures("m", "s", {3: LayerCapture(q=torch.zeros(2, 512), k=torch.zeros(3, 512))}, "0" * 64)
    with pytest.raises(ValueError, match=r"layers\.3\.q must have shape"):
        save_captures(c, tmp_path / "c.safetensors")


def test_command_writes_synthetic_file(tmp_path):
    out = tmp_path / "c.safetensors"
    done = subprocess.run([sys.executable, "-m", "remnant.cli.captures", "--synthetic", "--seed", "3",
                           "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    c = load_captures(out)
    assert c.params["seed"] == 3 and c.source == "synthetic" and list(c.layers) == [2, 4]
