"""The KV parts beyond C4 the engine serves: the compressor state in bfloat16
(host.compressor_state_dtype=bfloat16, SGLang's SGLANG_DSV4_COMPRESS_STATE_DTYPE=bfloat16:
every token's content, gate and index-key part rounded to bf16 before its block is
compressed), MXFP4 indexer keys (host.index_key_format=mxfp4, SGLang's
--enable-deepseek-v4-fp4-indexer), both as SGLang can store them, and the CSA layers'
window records packed with their C4 maps (retention.window_records=packed_csa, Remnant's
own). The pools hold and count them, the batched steps agree with the per-sequence
reference with them (the packed windows: tests/engine/test_decode_step.py and its
siblings' *-packed-window modes), and what each changes is measured."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from remnant.config import ModelConfig
from remnant.engine.model import C4Format, Model, ModelArgs
from remnant.engine.pools import new_sequence, scratch_pools
from remnant.engine.retention_setup import setup_retention

PROMPTS = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (301, 77)]
STEPS = 6


@pytest.fixture(scope="module")
def args() -> ModelArgs:
    return ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig()))


def _run(model: Model, state_dtype: str = "float32") -> torch.Tensor:
    """Both prompts prefilled in one step, then STEPS decode steps teacher-forced by the
    prompts' first tokens: float32 logits [(1 + STEPS) * 2, vocab]."""
    pools = scratch_pools(model, 320 + STEPS, sequences=2, state_dtype=state_dtype)
    seqs = [new_sequence(pools, len(p) + STEPS) for p in PROMPTS]
    rows = []
    with torch.inference_mode():
        rows.append(model.forward(seqs, PROMPTS, pools))
        for step in range(STEPS):
            rows.append(model.forward(seqs, [[p[step]] for p in PROMPTS], pools))
    return torch.cat(rows).float()


def test_pools_hold_bf16_state_and_count_it(args):
    model = Model(args, decode_path="batched")
    pools = {dtype: scratch_pools(model, 600, sequences=2, state_dtype=dtype) for dtype in ("float32", "bfloat16")}
    bf16 = pools["bfloat16"]
    for table in (bf16.c4_state, bf16.c4_index_state, bf16.c128_state):
        assert {t.dtype for t in table.values()} == {torch.bfloat16}
    for p in pools.values():
        allocated, accounted = p.allocated_bytes(), p.accounted_bytes()
        for part in ("c4_state", "c4_indexer_state", "c128_state"):
            assert allocated[part] == accounted[part], part
    assert pools["bfloat16"].accounted_bytes()["c4_state"] * 2 == pools["float32"].accounted_bytes()["c4_state"]
    with pytest.raises(ValueError, match="compressor_state_dtype='float16' is not allowed; allowed: float32, bfloat16"):
        scratch_pools(model, 600, state_dtype="float16")


@pytest.mark.slow
def test_batched_steps_are_the_reference_with_bf16_state(args):
    got = _run(Model(args, decode_path="batched"), "bfloat16")
    want = _run(Model(args, decode_path="reference"), "bfloat16")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_what_bf16_state_changes(args):
    """Measured on the tiny model (random weights, float32 compute, native records, 14
    rows): the logits of bf16 state against float32 state differ by a relative error (L2
    over the vocabulary) of 3.6e-3 in the worst row, 1.0e-3 on average, and the top-1 token
    is the same in every row; the bound is 1e-2, below what bf16 compute itself costs the
    batched step (test_decode_step's BF16_REL, 0.016). (Batched against reference at bf16
    state: 1.9e-6.)"""
    model = Model(args, decode_path="batched")
    fp32, bf16 = _run(model, "float32"), _run(model, "bfloat16")
    rel = ((bf16 - fp32).norm(dim=-1) / fp32.norm(dim=-1)).max().item()
    assert 0 < rel < 1e-2, rel
    assert torch.equal(bf16.argmax(-1), fp32.argmax(-1))


@pytest.mark.slow
def test_batched_steps_are_the_reference_with_mxfp4_keys(args):
    """Both parts on (measured 1.8e-6). The kernels path reads MXFP4 keys through
    remnant.kernels.indexer, tested against its reference in tests/kernels/test_indexer.py
    (a whole run of this model on the kernels path under Triton's interpreter takes two
    minutes here: measured once, 0.016 from the reference on logits up to ~4)."""
    got = _run(Model(args, decode_path="batched", index_key_format="mxfp4"), "bfloat16")
    want = _run(Model(args, decode_path="reference", index_key_format="mxfp4"), "bfloat16")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_what_mxfp4_keys_change(args):
    """Measured on the tiny model (random weights, top-64 of up to 76 records, no Hadamard
    rotation of the keys, as the engine runs; docs/kv.md has the top-512 overlap on
    synthetic keys): logits of MXFP4 keys against FP8 keys differ by a relative error of
    9.7e-3 in the worst of 14 rows, 2.1e-3 on average, the top-1 token the same in every
    row; the bound is 0.05."""
    fp8 = _run(Model(args, decode_path="batched"))
    mxfp4 = _run(Model(args, decode_path="batched", index_key_format="mxfp4"))
    rel = ((mxfp4 - fp8).norm(dim=-1) / fp8.norm(dim=-1)).max().item()
    assert 0 < rel < 0.05, rel
    assert torch.equal(mxfp4.argmax(-1), fp8.argmax(-1))


def _packed(args: ModelArgs, window_records: str, c128_records: str = "native", **kw) -> Model:
    model = Model(args, decode_path="batched", **kw)
    setup_retention(model, "kernel", "tiny", 256, window_records=window_records, c128_records=c128_records)
    return model


def test_pools_hold_packed_windows_and_count_them(args):
    model = _packed(args, "packed_csa")
    pools = scratch_pools(model, 600, sequences=2)
    want = [328 if r == 4 else 584 for r in args.compress_ratios]
    assert [layout.record_bytes for layout in pools.swa.layouts] == want
    assert pools.geometry.window_record_bytes() == want
    # Allocated: per layer, its blocks' pages of 128 records padded to whole data rows
    # (584 -> 130 x 576 bytes a page, 328 -> 132 x 320).
    page = {584: 130 * 576, 328: 132 * 320}
    assert pools.allocated_bytes()["swa"] == pools.swa_blocks.n * sum(page[b] for b in want)
    with pytest.raises(ValueError, match="mode=native stores native records: it packs no window records"):
        C4Format("native", pack_window=True)


@pytest.mark.slow
def test_what_packed_windows_change(args):
    """Measured on the tiny model (random weights, kernel mode at R = 256, the engine's
    calibrated attention-policy map, 14 rows): packing the CSA layers' windows too moves the
    logits from C4-only packing by a relative error of 7.5e-2 in the worst row, 6.0e-2 on
    average, and changes the top-1 token in 1 of 14 rows; C4 packing alone moves them from
    native by 3.7e-2 worst, 3.0e-2 on average (top-1 the same). So on this model the window
    costs about as much again as the C4 records: its tokens carry much of the attention.
    Bounds: 0.15, and at least 12 of 14 top-1 tokens kept."""
    c4 = _run(_packed(args, "native"))
    windows = _run(_packed(args, "packed_csa"))
    rel = ((windows - c4).norm(dim=-1) / c4.norm(dim=-1)).max().item()
    assert 0 < rel < 0.15, rel
    assert int((windows.argmax(-1) == c4.argmax(-1)).sum()) >= 12


def test_pools_hold_every_packed_part(args):
    model = _packed(args, "packed", "packed")
    pools = scratch_pools(model, 600, sequences=2)
    assert [layout.record_bytes for layout in pools.swa.layouts] == [328] * len(args.compress_ratios)
    assert {p.record_bytes for p in pools.c128.values()} == {328}
    # The HCA and window-only layers' maps: calibrated at load, at the CSA layers' R.
    assert sorted(model.other_formats) == [i for i, r in enumerate(args.compress_ratios) if r != 4]
    assert {model.other_map.retention(i) for i in model.other_formats} == {256}
    assert model.other_map.calibration["source"] == "engine-calibration"


@pytest.mark.slow
def test_what_every_window_and_c128_records_change(args):
    """Measured as test_what_packed_windows_change (the tiny model has one window-only, two
    CSA and one HCA layer): from C4-only packing, the C128 records packed too move the
    logits by 8.8e-3 in the worst row (2.7e-3 mean), top-1 the same in every row; every
    layer's window packed, by 0.132 (0.109 mean), top-1 changed in 2 of 14 rows; both, the
    same. With MXFP4 keys and bf16 state as well (1.8291x at V4-Flash's shapes), 0.133 from
    native, top-1 changed in 3 rows. Bounds: 0.05 for C128 records, 0.25 for the windows."""
    c4 = _run(_packed(args, "native"))
    c128 = _run(_packed(args, "native", "packed"))
    windows = _run(_packed(args, "packed", "packed"))

    def rel(a: torch.Tensor) -> float:
        return ((a - c4).norm(dim=-1) / c4.norm(dim=-1)).max().item()

    assert 0 < rel(c128) < 0.05 and torch.equal(c128.argmax(-1), c4.argmax(-1))
    assert rel(c128) < rel(windows) < 0.25


def test_other_layers_take_one_r_and_native_packs_nothing(args):
    model = Model(args, decode_path="batched")
    with pytest.raises(ValueError, match=r"take one R; the CSA layers keep \[128, 384\]"):
        setup_retention(model, "triton", "tiny", per_layer=[128, 384], window_records="packed")
    assert setup_retention(model, "native", "tiny", window_records="packed", c128_records="packed") is None
    assert model.other_formats == {} and model.other_map is None
    with pytest.raises(ValueError, match="c128_records='all' is not allowed; allowed: native, packed"):
        setup_retention(model, "kernel", "tiny", 256, c128_records="all")
