"""CaptureRecorder: budgets, the single atomic write, and the settings' environment round trip."""

import pytest
import torch

from remnant.calibration.capture_recorder import CaptureRecorder, CaptureSettings, write_request, write_requested
from remnant.calibration.captures import load_captures
from remnant.config_errors import ConfigError


def _settings(tmp_path, **kw):
    return CaptureSettings(path=str(tmp_path / "cap.safetensors"), tokens=3, records=5, source="sharegpt",
                           model_id="m", **kw)


def test_writes_once_when_every_layer_has_its_budget(tmp_path):
    rec = CaptureRecorder(_settings(tmp_path), params={"server": "test"}, layers=[2, 5])
    q = torch.randn(2, 4, 512, dtype=torch.bfloat16)
    for layer in (2, 5):
        rec.add_latents(layer, torch.randn(4, 512))
        rec.add_queries(layer, q)
    assert not rec.done
    rec.add_latents(2, torch.randn(4, 512))   # 8 offered, 5 kept
    rec.add_queries(2, q)
    rec.add_queries(5, q)
    assert not rec.done                       # layer 5 still short of latents
    last = torch.randn(3, 512)
    rec.add_latents(5, last)
    assert rec.done
    caps = load_captures(rec.written)
    assert caps.model_id == "m" and caps.source == "sharegpt" and caps.params["server"] == "test"
    assert caps.params["complete"] is True
    assert {i: (c.q.shape[0], c.k.shape[0]) for i, c in caps.layers.items()} == {2: (3, 5), 5: (3, 5)}
    assert torch.equal(caps.layers[5].k[4], last[0])
    assert torch.equal(caps.layers[2].q[:2], q.float())
    before = rec.written.read_bytes()
    rec.add_queries(2, torch.randn(1, 4, 512))   # after the write: ignored
    assert rec.close() == rec.written and rec.written.read_bytes() == before


def test_close_writes_a_short_capture_or_nothing(tmp_path):
    rec = CaptureRecorder(_settings(tmp_path), layers=[1, 3])
    rec.add_queries(1, torch.randn(1, 2, 512))
    rec.add_latents(1, torch.randn(1, 512))
    assert rec.close() is None                  # layer 3 has nothing: no file
    assert not (tmp_path / "cap.safetensors").exists()
    rec.add_queries(3, torch.randn(1, 2, 512))
    rec.add_latents(3, torch.randn(2, 512))
    caps = load_captures(rec.close())
    assert caps.params["complete"] is False
    assert caps.params["counts"] == {"1": {"queries": 1, "latents": 1}, "3": {"queries": 1, "latents": 2}}


def test_rejects_wrong_shapes(tmp_path):
    rec = CaptureRecorder(_settings(tmp_path))
    with pytest.raises(ValueError, match=r"layer 4: queries must be \[n, H, 512\]"):
        rec.add_queries(4, torch.randn(2, 512))
    assert rec.wants(4, "latents")


def test_settings_round_trip_and_errors(tmp_path):
    s = _settings(tmp_path)
    assert CaptureSettings.from_env(s.to_env()) == s
    assert CaptureSettings.from_env({}) is None
    with pytest.raises(ConfigError, match="REMNANT_CAPTURE_TOKENS='x' is not an integer"):
        CaptureSettings.from_env({**s.to_env(), "REMNANT_CAPTURE_TOKENS": "x"})
    with pytest.raises(ConfigError, match="is a directory"):
        CaptureSettings.from_env({"REMNANT_CAPTURE": str(tmp_path)})
    with pytest.raises(ConfigError, match="capture.records=0 must be an integer >= 1"):
        CaptureRecorder(CaptureSettings(path="x", records=0))


def test_a_write_is_made_only_where_the_run_asks_for_it(tmp_path):
    rec = CaptureRecorder(_settings(tmp_path), layers=[1])
    rec.add_queries(1, torch.randn(1, 2, 512))
    rec.add_latents(1, torch.randn(2, 512))
    assert write_requested(rec) is None and not rec.done   # an ordinary /flush_cache
    write_request(rec.settings.path).touch()
    path = write_requested(rec)
    assert path == tmp_path / "cap.safetensors" and rec.done
    assert load_captures(path).params["complete"] is False
    assert write_requested(None) is None
