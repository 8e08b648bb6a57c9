"""The fidelity of the KV parts beyond C4 records (remnant.calibration.fidelity_parts), the
remnant-capture/2 files it reads, and what the embedded engine records into them."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from remnant.calibration.capture_recorder import CaptureRecorder, CaptureSettings
from remnant.calibration.captures import (FORMAT, FORMAT_V2, Captures, LayerCapture, OtherLayerCapture,
                                          load_captures, save_captures)
from remnant.calibration.fidelity_parts import PARTS, measure_csa, measure_other, report
from remnant.config import ModelConfig
from remnant.engine.model import Model, ModelArgs
from remnant.engine.pools import new_sequence, scratch_pools
from remnant.records.schema import RecordError, validate

ALL_NOPE = torch.arange(448)


def _csa(gen: torch.Generator, t: int = 6, n: int = 40, heads: int = 4, index_heads: int = 2) -> LayerCapture:
    k = torch.randn(n, 512, generator=gen)
    ik = torch.randn(n, 128, generator=gen)
    return LayerCapture(q=torch.randn(t, heads, 512, generator=gen), k=k, window=torch.randn(24, 512, generator=gen),
                        index_q=torch.randn(t, index_heads, 128, generator=gen),
                        index_w=torch.randn(t, index_heads, generator=gen), index_k=ik,
                        k_bf16=k.bfloat16().float(), index_k_bf16=ik.bfloat16().float())


def _other(gen: torch.Generator, ratio: int, t: int = 6, heads: int = 4) -> OtherLayerCapture:
    k = torch.randn(5, 512, generator=gen) if ratio else None
    return OtherLayerCapture(ratio=ratio, q=torch.randn(t, heads, 512, generator=gen),
                             window=torch.randn(24, 512, generator=gen), k=k,
                             k_bf16=None if k is None else k.bfloat16().float())


def _captures(seed: int, source: str) -> Captures:
    gen = torch.Generator().manual_seed(seed)
    return Captures("m", source, {1: _csa(gen), 3: _csa(gen)}, f"{seed:064x}", {"seed": seed},
                    other_layers={0: _other(gen, 0), 2: _other(gen, 128)})


def test_v2_captures_round_trip_and_v1_ones_stay_v1(tmp_path):
    c = _captures(0, "a")
    path = save_captures(c, tmp_path / "v2.safetensors")
    back = load_captures(path)
    assert c.format == FORMAT_V2 and sorted(back.layers) == [1, 3] and sorted(back.other_layers) == [0, 2]
    for i, cap in c.layers.items():
        for kind in ("q", "k", "window", "index_q", "index_w", "index_k", "k_bf16", "index_k_bf16"):
            assert torch.equal(getattr(back.layers[i], kind), getattr(cap, kind)), (i, kind)
    assert back.other_layers[0].ratio == 0 and back.other_layers[0].k is None
    assert back.other_layers[2].ratio == 128 and torch.equal(back.other_layers[2].k, c.other_layers[2].k)
    assert save_captures(c, tmp_path / "again.safetensors").read_bytes() == path.read_bytes()
    # Nothing beyond q and k: written as v1, so v1-only readers and old fingerprints hold.
    v1 = Captures("m", "a", {1: LayerCapture(q=c.layers[1].q, k=c.layers[1].k)}, "0" * 64)
    assert v1.format == FORMAT
    assert load_captures(save_captures(v1, tmp_path / "v1.safetensors")).other_layers == {}


def test_a_v1_file_with_a_v2_tensor_is_refused_naming_it(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "c.safetensors"
    save_file({"layers.1.q": torch.zeros(2, 3, 512), "layers.1.k": torch.zeros(4, 512),
               "layers.1.window": torch.zeros(4, 512)}, str(path),
              metadata={"format": FORMAT, "model_id": "m", "source": "s", "params": "{}"})
    with pytest.raises(ValueError, match="tensor 'layers.1.window' is not layers.<L>.q or layers.<L>.k "
                                         r"\(remnant-capture/1 holds only those"):
        load_captures(path)


def test_misaligned_extras_are_refused():
    gen = torch.Generator().manual_seed(0)
    cap = _csa(gen)
    with pytest.raises(ValueError, match=r"layers.1.index_k has 39 rows; k has 40"):
        dataclasses.replace(cap, index_k=cap.index_k[:-1], index_k_bf16=None).check("layers.1")
    with pytest.raises(ValueError, match="index_q and index_w come together"):
        dataclasses.replace(cap, index_w=None).check("layers.1")


def test_identity_gives_zero_error_and_full_overlap():
    """Every NoPE coordinate kept, bf16 twins equal to the float32 latents and every record
    selected: each part reads what native reads."""
    gen = torch.Generator().manual_seed(1)
    cap = dataclasses.replace(_csa(gen), k_bf16=None, index_k_bf16=None)
    cap = dataclasses.replace(cap, k_bf16=cap.k, index_k_bf16=cap.index_k)
    rows = {r["part"]: r for r in measure_csa(cap, ALL_NOPE, top_k=8, index_top_k=cap.k.shape[0], window=16)}
    assert set(rows) == {"c4", "window", "mxfp4_index", "bf16_state", "all"}
    for part in ("c4", "window", "bf16_state"):
        assert rows[part]["output_rel_error"]["max"] == 0.0, part
    # The same records, picked in another order (FP8 and MXFP4 scores rank them differently):
    # the softmax sums in another order.
    assert rows["all"]["output_rel_error"]["max"] < 1e-12
    for part in ("c4", "window"):
        assert rows[part]["topk_overlap"] == 1.0 and rows[part]["softmax_kl"] == pytest.approx(0.0, abs=1e-12)
    assert rows["bf16_state"]["latent_rel_error"]["max"] == 0.0
    assert rows["bf16_state"]["index_overlap"]["bf16_vs_float32"]["min"] == 1.0
    assert rows["all"]["index_overlap"]["all_vs_native"]["min"] == 1.0
    # The indexer's top-k of all n keys is all of them, whatever the format.
    assert rows["mxfp4_index"]["index_overlap"]["mxfp4_vs_fp8"]["min"] == 1.0
    other = {r["part"]: r for r in measure_other(_other(gen, 128), ALL_NOPE, top_k=4, window=16)}
    assert set(other) == {"window", "c128", "bf16_state", "all"}
    assert other["c128"]["output_rel_error"]["max"] == 0.0 and other["window"]["output_rel_error"]["max"] == 0.0


def test_known_perturbations_give_their_errors():
    gen = torch.Generator().manual_seed(2)
    cap = _csa(gen)
    # bf16 state: latents 1 % larger give a latent error of exactly 1 %.
    scaled = dataclasses.replace(cap, k_bf16=cap.k * 1.01)
    row = next(r for r in measure_csa(scaled, ALL_NOPE, 8, 512, 16) if r["part"] == "bf16_state")
    assert row["latent_rel_error"]["mean"] == pytest.approx(0.01, rel=1e-5)
    assert row["latent_rel_error"]["max"] == pytest.approx(0.01, rel=1e-5)
    # A window whose energy lies only in dropped coordinates: the packed window's keys are
    # all zero, so its output is zero and the error exactly 1.
    window = torch.zeros(24, 512)
    window[:, :64] = torch.randn(24, 64, generator=gen)
    keep = torch.arange(64, 448)
    row = next(r for r in measure_csa(dataclasses.replace(cap, window=window), keep, 8, 512, 16)
               if r["part"] == "window")
    assert row["output_rel_error"]["mean"] == pytest.approx(1.0) and row["output_rel_error"]["max"] == pytest.approx(1.0)


def test_report_validates_and_refuses_v1_captures(tmp_path):
    doc = report(("a.safetensors", _captures(0, "a")), ("b.safetensors", _captures(1, "b")), "magnitude", 256,
                 top_k=8, index_top_k=16, window=16, progress=False)
    validate(doc)
    assert doc["schema"] == "remnant/fidelity-parts" and doc["schema_version"] == 1
    assert [(r["layer"], r["part"]) for r in doc["results"]] == [
        (0, "window"), (0, "all"), (1, "c4"), (1, "window"), (1, "mxfp4_index"), (1, "bf16_state"), (1, "all"),
        (2, "window"), (2, "c128"), (2, "bf16_state"), (2, "all"), (3, "c4"), (3, "window"), (3, "mxfp4_index"),
        (3, "bf16_state"), (3, "all")]
    assert set(doc["settings"]["parts"]) == set(PARTS)
    bad = json.loads(json.dumps(doc))
    bad["results"][4]["index_overlap"]["mxfp4_vs_fp8"]["mean"] = 1.5
    with pytest.raises(RecordError, match="results\\[4\\].index_overlap.mxfp4_vs_fp8.mean"):
        validate(bad)
    v1 = Captures("m", "c", {1: LayerCapture(q=torch.zeros(2, 4, 512), k=torch.ones(3, 512)),
                             3: LayerCapture(q=torch.zeros(2, 4, 512), k=torch.ones(3, 512))}, "c" * 64)
    with pytest.raises(ValueError, match="v1.safetensors: holds no HCA or window-only layer"):
        report(("a.safetensors", _captures(0, "a")), ("v1.safetensors", v1))
    with pytest.raises(ValueError, match="source is 'a', as --train a.safetensors's"):
        report(("a.safetensors", _captures(0, "a")), ("b.safetensors", _captures(1, "a")))


def test_cli_writes_a_validated_report_and_prints_its_tables(tmp_path):
    train = save_captures(_captures(0, "a"), tmp_path / "a.safetensors")
    ev = save_captures(_captures(1, "b"), tmp_path / "b.safetensors")
    out = tmp_path / "parts.json"
    p = subprocess.run([sys.executable, "-m", "remnant.cli.fidelity", "parts", "--train", str(train), "--eval", str(ev),
                        "--index-top-k", "16", "--window", "16", "--limit", "a test", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(out)
    doc = json.loads(out.read_text())
    validate(doc)
    assert doc["limits"][-1] == "a test" and doc["split"]["eval"][0]["counts"]["c128_latents"] == 5
    assert "| mxfp4_index | 1,3 |" in p.stderr and "| 2 (128) |" in p.stderr
    p = subprocess.run([sys.executable, "-m", "remnant.cli.fidelity", "parts", "--train", str(train), "--eval", str(ev),
                        "--retention", "512", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith(
        "fidelity parts: error: --retention=512 is not allowed")


def _model() -> Model:
    return Model(ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig())))


def _serve(m: Model, prompt: list[int], steps: int, state_dtype: str) -> None:
    pools = scratch_pools(m, 512, 1, state_dtype=state_dtype)
    seq = new_sequence(pools, 512)
    out = m.forward([seq], [prompt], pools)
    for _ in range(steps):
        out = m.forward([seq], [[int(out.argmax())]], pools)


def test_the_engine_records_every_part_and_its_bf16_twin_is_what_bf16_state_computes(tmp_path):
    """The first CSA layer (1) follows a window-only layer, so its compressor's inputs are the
    same under either state dtype: the float32 server's bf16-state twins must equal what a
    bf16-state server computes there, latents and index keys."""
    prompt = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    got = {}
    for dtype in ("float32", "bfloat16"):
        m = _model()
        ratios = dict(enumerate(m.args.compress_ratios))
        rec = CaptureRecorder(CaptureSettings(str(tmp_path / f"{dtype}.safetensors"), tokens=4, records=40),
                              layers=sorted(ratios), ratios=ratios)
        m.recorder = rec
        _serve(m, prompt, 6, dtype)
        got[dtype] = load_captures(rec.close())
    f32, bf16 = got["float32"], got["bfloat16"]
    assert f32.params["complete"] is True and f32.params["counts_all"]["2"]["latents"] == 1  # 200 + 6 tokens: 1 C128
    c = f32.layers[1]
    assert (tuple(c.q.shape), tuple(c.k.shape), tuple(c.window.shape), tuple(c.index_q.shape),
            tuple(c.index_k.shape)) == ((4, 8, 512), (40, 512), (40, 512), (4, 4, 128), (40, 128))
    assert torch.equal(c.k_bf16, bf16.layers[1].k) and torch.equal(c.index_k_bf16, bf16.layers[1].index_k)
    assert not torch.equal(c.k_bf16, c.k)
    assert bf16.layers[1].k_bf16 is None  # a bf16 state has no other twin to record
    assert f32.other_layers[0].ratio == 0 and f32.other_layers[2].k.shape == (1, 512)
