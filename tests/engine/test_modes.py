"""The three modes in the embedded engine: packed storage at the KV write, triton and
kernel give the same tokens for the same map, and keeping everything gives native's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from remnant.config import ModelConfig
from remnant.engine.model import C4Format, Model, ModelArgs
from remnant.engine.retention_setup import calibration_captures, setup_retention
from remnant.engine.sequence import SequenceState
from remnant.kv.policies import build_map
from remnant.kv.retention import RetentionMap


@pytest.fixture(scope="module")
def args() -> ModelArgs:
    return ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig()))


def _greedy(model: Model, prompt: list[int], n: int = 24) -> tuple[list[int], SequenceState]:
    state = SequenceState.empty(model.args.compress_ratios, model.args.index_head_dim, model.record_bytes())
    logits = model.forward([state], [prompt])
    out = []
    for _ in range(n):
        token = int(logits[0].argmax())
        out.append(token)
        logits = model.forward([state], [[token]])
    return out, state


PROMPTS = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (97, 300, 517)]


@pytest.mark.parametrize("retention", [128, 256, 448])
def test_triton_and_kernel_give_the_same_tokens(args, retention):
    model = Model(args)
    rmap = setup_retention(model, "triton", "tiny", retention=retention)
    triton = [_greedy(model, p)[0] for p in PROMPTS]
    model.set_c4_formats({i: C4Format("kernel", rmap.keep_tensor(i)) for i in model.csa_layers})
    kernel = [_greedy(model, p)[0] for p in PROMPTS]
    assert triton == kernel


@pytest.mark.parametrize("mode", ["triton", "kernel"])
def test_keeping_everything_gives_native_tokens(args, mode):
    model = Model(args)
    native = [_greedy(model, p)[0] for p in PROMPTS]
    model.set_c4_formats({i: C4Format(mode, torch.arange(448)) for i in model.csa_layers})
    assert [_greedy(model, p)[0] for p in PROMPTS] == native


def test_records_are_stored_packed(args):
    model = Model(args)
    setup_retention(model, "kernel", "tiny", per_layer=[128, 384])
    _, state = _greedy(model, PROMPTS[2], n=1)
    widths = [layer.records.shape[1] for layer in state.layers]
    assert widths == [584, 200, 584, 456]  # ratios [0, 4, 128, 4]: C4 packed, C128 native
    assert model.record_bytes() == [0, 200, 584, 456]
    assert state.layers[1].records.shape[0] == (517 + 1) // 4


def test_map_file_round_trip_and_mismatch(args, tmp_path):
    model = Model(args)
    rmap = build_map(calibration_captures(model, "tiny"), "magnitude", [192, 320])
    path = rmap.save(tmp_path / "map.json")
    used = setup_retention(model, "triton", "tiny", map_path=str(path))
    assert [model.c4_formats[i].retention for i in model.csa_layers] == [192, 320]
    assert torch.equal(used.keep_tensor(1), rmap.keep_tensor(1))
    with pytest.raises(ValueError, match=r"keeps R=\[192, 320\] per CSA layer; the run asks for \[256, 256\]"):
        setup_retention(model, "triton", "tiny", retention=256, map_path=str(path))
    wrong = RetentionMap.from_dict({**rmap.to_dict(), "layers": rmap.to_dict()["layers"][:1]})
    wrong_path = wrong.save(tmp_path / "wrong.json")
    with pytest.raises(ValueError, match="retention map has 1 CSA layers"):
        setup_retention(model, "triton", "tiny", map_path=str(wrong_path))


def test_calibration_is_deterministic_and_native_is_untouched(args):
    model = Model(args)
    a = setup_retention(model, "kernel", "tiny", retention=256)
    b = setup_retention(Model(args), "kernel", "tiny", retention=256)
    assert a.calibration == b.calibration and [x.keep for x in a.layers] == [x.keep for x in b.layers]
    assert setup_retention(model, "native", "tiny") is None
    assert all(f.mode == "native" for f in model.c4_formats.values())


@pytest.mark.parametrize(("mode", "keep", "message"), [
    ("fast", None, "mode=fast is not a mode"),
    ("native", torch.arange(192), "mode=native takes no retention keep list"),
    ("kernel", None, "mode=kernel needs a retention keep list"),
    ("triton", torch.arange(10), "has 10 indices"),
])
def test_c4_format_rejects(mode, keep, message):
    with pytest.raises(ValueError, match=message):
        C4Format(mode, keep)
