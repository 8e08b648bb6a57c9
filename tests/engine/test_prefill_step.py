"""The batched prefill step (remnant.engine.prefill_step) against the per-sequence torch
reference (decode_path=reference), on the CPU: all three modes, several sequences of
different lengths in one step, chunks that start mid-block and mid-window (chunked
prefill, prefix-cache resumption), chunks longer than the window, prefill and decode mixed,
and the tiles that bound its memory.

Bounds. Both sides compute in float32 and differ by summation order alone (the reference
attends over the union of what its tokens read, the step gathers each token's own keys),
but FP8 records amplify that: a value on a rounding boundary moves one FP8 step (2^-3
relative), which the next layers see. So records must agree to one rounding step
(tests/engine/rings.py) in every layer, and the logits to a relative error (L2 over the
vocabulary) of REL: measured 2.2e-5 to 5.6e-5 over these prompts (logits up to ~4). What
a bug would do, measured on WHOLE (native): a token's window missing its oldest slot moves
them by 1.5e-2, one C128 record hidden from one sequence by 2.3e-3.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import remnant.engine.prefill_step as prefill_step
from remnant.config import ModelConfig
from remnant.engine.model import Model, ModelArgs
from remnant.engine.pools import new_sequence, scratch_pools
from remnant.engine.retention_setup import setup_retention
from tests.engine.rings import assert_same_ring, copy_formats, ring_keep

REL = 5e-4

MODES = [pytest.param(mode, retention, id=name) for name, mode, retention in
         [("native", "native", {}), ("triton", "triton", {"per_layer": [128, 384]}),
          ("kernel", "kernel", {"retention": 256}),
          # The CSA layers' windows packed with their maps (retention.window_records=packed_csa).
          ("triton-packed-window", "triton", {"per_layer": [128, 384], "window_records": "packed_csa"}),
          ("kernel-packed-window", "kernel", {"retention": 256, "window_records": "packed_csa"}),
          # Every layer's window and the C128 records packed, the HCA and window-only layers
          # with maps of their own; and every window packed beside native C128 records.
          ("triton-all-packed", "triton", {"retention": 256, "window_records": "packed", "c128_records": "packed"}),
          ("kernel-all-packed", "kernel", {"retention": 256, "window_records": "packed", "c128_records": "packed"}),
          ("kernel-windows-packed", "kernel", {"retention": 256, "window_records": "packed"})]]


@pytest.fixture(scope="module")
def args() -> ModelArgs:
    return ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig()))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _pair(args: ModelArgs, mode: str, retention: dict) -> tuple[Model, Model]:
    reference = Model(args, decode_path="reference")
    rmap = setup_retention(reference, mode, "tiny", **retention)
    batched = Model(args, decode_path="batched")
    if rmap is not None:
        copy_formats(batched, reference)
    assert batched.batched_prefill and not reference.batched_prefill
    return reference, batched


def _prefill(model: Model, prompts: list[list[int]], schedule: list[list[int]]):
    """Prompts prefilled in steps: schedule[k][i] tokens of prompt i at step k (0: the
    sequence sits the step out; 1: a decode-sized chunk, which joins the step as a decode
    row). Returns every step's logits (float32 [rows, vocab]), the pools and the sequences."""
    pools = scratch_pools(model, max(map(len, prompts)), sequences=len(prompts))
    seqs = [new_sequence(pools, len(p)) for p in prompts]
    done = [0] * len(prompts)
    rows = []
    with torch.inference_mode():
        for sizes in schedule:
            live = [i for i, n in enumerate(sizes) if n]
            chunks = [prompts[i][done[i]: done[i] + sizes[i]] for i in live]
            rows.append(model.forward([seqs[i] for i in live], chunks, pools))
            for i in live:
                done[i] += sizes[i]
    assert done == [len(p) for p in prompts]
    return torch.cat(rows), pools, seqs


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max())


def _records(pool, pages: int) -> torch.Tensor:
    """Every record slot of a paged pool, uint8 [pages * per_page, record_bytes]."""
    index = torch.arange(pages * pool.layout.per_page)
    return pool.read(torch.arange(pages), index)


def _open_rows(seqs: list, ratio: int, ring: int) -> torch.Tensor:
    """The compressor state rows the sequences' open blocks hold (other rows are stale:
    a decode step writes its token's row whether or not the block then closes)."""
    return torch.cat([s.slot * ring + torch.arange(s.length % ratio) for s in seqs])


def _assert_same_pools(got, want, model: Model, seqs: list) -> None:
    """The same records in the same slots to one rounding step (native records and window
    rings; packed C4 records are compared through the rings and logits), the same open
    compressor state."""
    mode = model.c4_formats[model.csa_layers[0]].mode
    for li in range(len(want.swa.bufs)):
        assert_same_ring(got.swa[li], want.swa[li], ring_keep(model, li))
    for li in want.c128:
        fmt = model.layer_format(li)
        assert_same_ring(_records(got.c128[li], want.num_pages), _records(want.c128[li], want.num_pages),
                         fmt.keep if fmt.records_packed else None)
    for li in want.c4:
        if mode == "native":
            assert_same_ring(_records(got.c4[li], want.num_pages), _records(want.c4[li], want.num_pages))
        rows = _open_rows(seqs, 4, 8)
        torch.testing.assert_close(got.c4_state[li][rows], want.c4_state[li][rows], atol=1e-4, rtol=0)
        torch.testing.assert_close(got.c4_index_state[li][rows], want.c4_index_state[li][rows], atol=1e-4, rtol=0)
    rows = _open_rows(seqs, 128, 128)
    assert rows.numel()
    for li in want.c128_state:
        torch.testing.assert_close(got.c128_state[li][rows], want.c128_state[li][rows], atol=1e-4, rtol=0)


PROMPTS = [_ids(600, 2), _ids(300, 3), _ids(7, 4)]
# Whole prompts in one step; then chunks of other sizes that start mid-block and
# mid-window, sequences joining late, and a one-token chunk (a decode row) in a step.
WHOLE = [[600, 300, 7]]
CHUNKED = [[37, 0, 3], [200, 130, 1], [0, 5, 3], [363, 165, 0]]


@pytest.mark.parametrize(("mode", "retention"), MODES)
@pytest.mark.parametrize("schedule", [WHOLE, CHUNKED], ids=["whole", "chunked"])
def test_batched_prefill_is_the_reference(args, mode, retention, schedule):
    reference, batched = _pair(args, mode, retention)
    want, want_pools, seqs = _prefill(reference, PROMPTS, schedule)
    got, got_pools, _ = _prefill(batched, PROMPTS, schedule)
    assert _rel(got, want) <= REL
    assert (got.argmax(-1) == want.argmax(-1)).all()
    _assert_same_pools(got_pools, want_pools, reference, seqs)


def test_tiles_change_nothing(args, monkeypatch):
    # Tiles of a few tokens (the indexer's and the attention's, whose window spans then
    # start and end inside sequences) give the untiled step's logits and pools, to the
    # rounding of softmax sums of other lengths.
    _, batched = _pair(args, "native", {})
    want, want_pools, seqs = _prefill(batched, PROMPTS, CHUNKED)
    monkeypatch.setattr(prefill_step, "TILE_ELEMENTS", 1 << 15)  # tiles of 8 to 14 tokens
    got, got_pools, _ = _prefill(batched, PROMPTS, CHUNKED)
    assert _rel(got, want) <= REL
    _assert_same_pools(got_pools, want_pools, batched, seqs)


def test_plan_puts_each_window_where_the_ring_holds_it(args):
    # Sequence 0 resumes at position 300 (its ring holds 173..299), sequence 1 starts at 0:
    # each token's window is its previous 127 positions and itself, in the scratch ring.
    model = Model(args)
    pools = scratch_pools(model, 600, sequences=2)
    seqs = [new_sequence(pools, 600), new_sequence(pools, 100)]
    seqs[0].length = 300
    plan = prefill_step.PrefillPlan.of(seqs, [_ids(200, 1), _ids(50, 2)], pools, 128, {4, 128}, model.device)
    W = 128
    assert plan.scratch_records == (W - 1 + 200) + 50
    # Scratch row of position p: p - 173 for sequence 0, 327 + p for sequence 1.
    assert plan.window_locs[0].tolist() == list(range(0, W))  # position 300 sees 173..300
    assert plan.window_locs[199].tolist() == list(range(199, 199 + W))
    assert plan.window_locs[200].tolist() == [-1] * 127 + [327]  # position 0 of sequence 1
    assert plan.window_locs[249, -50:].tolist() == list(range(327, 377))
    assert plan.prev_rows.tolist() == list(range(127))
    assert plan.prev_slots.tolist() == [seqs[0].swa_block * W + p % W for p in range(173, 300)]
    # The ring keeps each chunk's last 128 records.
    assert plan.tail_slots.numel() == 128 + 50 and plan.tail_tokens[:128].tolist() == list(range(72, 200))
    c4 = plan.ratios[4]
    # Sequence 0 completes blocks 75..124 (positions 300..499), sequence 1 blocks 0..11.
    assert c4.block_index.tolist() == list(range(75, 125)) + list(range(12))
    assert c4.counts == [125, 12] and c4.state_rows.numel() == 0
    assert c4.tail_tokens.tolist() == list(range(248, 250))  # positions 48, 49 stay open
    c128 = plan.ratios[128]
    assert c128.counts == [3, 0] and c128.block_index.tolist() == [2]
    # Block 2 (positions 256..383): 256..299 from the state rows, 300..383 new tokens.
    assert c128.gather[0, :44].tolist() == list(range(44))
    assert c128.gather[0, 44:].tolist() == [44 + t for t in range(84)]
