"""The batched decode step (remnant.engine.decode_step) against the per-sequence torch
reference (decode_path=reference), on the CPU: all three modes, prefill chunks and decode
tokens mixed in one engine step, sequences of different lengths, prefix-cache hits, a
routed-MoE model with the grouped output projection, padding rows and page-table columns.

Bounds. The reference computes in float32. The batched step in float32 differs from it
by float summation order alone (both break the indexer's ties to the lower record):
measured over these prompts, logits up to ~4.3 differ by at most 2.1e-6 (native, triton)
and 2.8e-5 (kernel) under teacher forcing; the bound is 1e-4. In bfloat16 the step's
logits are within a relative error (L2 over the vocabulary) of 0.016 of the reference's
(measured 0.0126 native, 0.0136 triton, 0.0131 kernel). Top-1 must agree wherever the
reference's own margin between its best two tokens exceeds twice the measured absolute
error of that row: a closer call may flip under any rounding and says nothing about the
step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from remnant.config import ModelConfig
from remnant.engine.decode_step import DecodeBatch, decode_step
from remnant.engine.engine import Engine, Request, SamplingParams
from remnant.engine.model import Model, ModelArgs
from remnant.engine.pools import new_sequence, scratch_pools
from remnant.engine.prefix_cache import PrefixCache
from remnant.engine.retention_setup import setup_retention
from remnant.kv.layout import PageLayout
from tests.engine.rings import assert_same_ring, copy_formats, ring_keep

FLOAT32_ATOL = 1e-4
BF16_REL = 0.016

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


def _pair(args: ModelArgs, mode: str, retention: dict, dtype: str = "float32") -> tuple[Model, Model]:
    """The reference model and the batched one, with the same keep lists. Both prefill
    through the reference, so that their decode steps start from the same KV (the batched
    prefill step has its own tests: test_prefill_step.py)."""
    reference = Model(args, decode_path="reference")
    rmap = setup_retention(reference, mode, "tiny", **retention)
    batched = Model(args, decode_path="batched", dtype=dtype)
    batched.batched_prefill = False
    if rmap is not None:
        copy_formats(batched, reference)
    return reference, batched


def _run(model: Model, prompts: list[list[int]], steps: int, forced: list[list[int]] | None = None):
    """Greedy decoding in one batch, as the engine mixes steps: sequence i prefills (whole)
    at step i while the earlier ones decode. `forced` feeds those tokens instead of the
    model's own. Returns each sequence's tokens, every step's logits (float32 [rows,
    vocab]) and the pools."""
    pools = scratch_pools(model, max(map(len, prompts)) + steps, sequences=len(prompts))
    seqs = [new_sequence(pools, len(p) + steps) for p in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    rows = []
    with torch.inference_mode():
        for step in range(steps):
            live = [i for i in range(len(prompts)) if i <= step]
            chunks = [prompts[i] if i == step else [tokens[i][-1]] for i in live]
            logits = model.forward([seqs[i] for i in live], chunks, pools).float()
            for i, row in zip(live, logits):
                tokens[i].append(forced[i][len(tokens[i])] if forced else int(row.argmax()))
            rows.append(logits)
    return tokens, torch.cat(rows), pools


def _margins(logits: torch.Tensor) -> torch.Tensor:
    top2 = logits.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


PROMPTS = [_ids(600, 2), _ids(300, 3), _ids(7, 4)]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "retention"), MODES)
def test_batched_float32_is_the_reference(args, mode, retention):
    reference, batched = _pair(args, mode, retention)
    want, want_logits, want_pools = _run(reference, PROMPTS, 12)
    got, got_logits, got_pools = _run(batched, PROMPTS, 12, forced=want)
    torch.testing.assert_close(got_logits, want_logits, atol=FLOAT32_ATOL, rtol=0)
    assert (got_logits.argmax(-1) == want_logits.argmax(-1)).all()
    # Layer 0 sees the same tokens on both paths: its ring holds the same records in the
    # same slots, so the step stores each token's record where the reference does.
    assert_same_ring(got_pools.swa[0], want_pools.swa[0], ring_keep(reference, 0))


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "retention"), MODES)
def test_batched_bfloat16_within_the_stated_bound(args, mode, retention):
    reference, batched = _pair(args, mode, retention, dtype="bfloat16")
    assert batched.dtype == torch.bfloat16 and batched.layers[1].wq_b.dtype == torch.bfloat16
    want, want_logits, _ = _run(reference, PROMPTS, 12)
    _, got_logits, _ = _run(batched, PROMPTS, 12, forced=want)
    rel = (got_logits - want_logits).norm(dim=-1) / want_logits.norm(dim=-1)
    assert float(rel.max()) <= BF16_REL, f"relative error {float(rel.max()):.4f} > {BF16_REL}"
    err = (got_logits - want_logits).abs().amax(-1)
    clear = _margins(want_logits) > 2 * err
    assert bool(clear.any())
    assert (got_logits.argmax(-1) == want_logits.argmax(-1))[clear].all()


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "retention"), [MODES[0], MODES[-1]])
def test_prefix_cache_hits_serve_as_the_reference(args, mode, retention):
    # Through the engine: requests sharing a 512-token prefix (two full pages) hit the
    # prefix cache and resume from its window checkpoint (with packed windows: packed ring
    # records, copied per layer); the batched step must answer the reference's greedy
    # tokens for every one of them.
    prefix = _ids(512, 11)
    prompts = [prefix + _ids(n, 20 + n) for n in (5, 40, 130)]

    def serve(model: Model) -> tuple[list[list[int]], list[int]]:
        pools = scratch_pools(model, 700, sequences=3)
        engine = Engine(model, eos_token_id=-1, pools=pools, cache=PrefixCache(pools, True), chunked_prefill_size=256)
        events: dict[str, list] = {}

        def request(i: int, p: list[int]) -> Request:
            return Request(str(i), p, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True),
                           lambda ev, i=i: events.setdefault(str(i), []).append(ev))

        # The first request alone fills the cache; the other two then hit it together.
        for wave in ([0], [1, 2]):
            for i in wave:
                engine._waiting.append(request(i, prompts[i]))
            while engine._waiting or engine._running:
                engine._admit()
                engine._step(list(engine._running))
        return [events[str(i)][-1].output_ids for i in range(len(prompts))], \
            [events[str(i)][-1].cached_tokens for i in range(len(prompts))]

    reference, batched = _pair(args, mode, retention)
    batched.batched_prefill = True  # as the engine runs it
    want, want_hits = serve(reference)
    got, got_hits = serve(batched)
    assert got_hits == want_hits and got_hits[1:] == [512, 512]
    assert got == want


@pytest.mark.slow
def test_moe_model_with_grouped_output_projection(args):
    moe = dataclasses.replace(args, intermediate_size=0, o_lora_rank=128, o_groups=2, n_routed_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
                              expert_dtype="float32")
    reference, batched = Model(moe, decode_path="reference"), Model(moe, decode_path="batched")
    batched.batched_prefill = False
    assert batched.layers[0].moe is not None and batched.layers[0].wo_b.shape == (2 * 128, moe.hidden_size)
    want, want_logits, _ = _run(reference, PROMPTS[1:], 6)
    _, got_logits, _ = _run(batched, PROMPTS[1:], 6, forced=want)
    torch.testing.assert_close(got_logits, want_logits, atol=FLOAT32_ATOL, rtol=0)


def _pool_tensors(pools) -> dict[str, torch.Tensor]:
    """Every pool buffer, without its padding page, block or slot, by name; byte pages as
    4-byte words. A record written in both runs may leave one byte as it was in one run
    and not in the other (a float32 scale's low byte rounding to its old value: 1 in 256),
    which a byte-wise comparison took for a stray write; a word unchanged so is ~1e-9."""
    def words(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int32) if t.dtype == torch.uint8 and t.shape[-1] % 4 == 0 else t

    out = {f"swa{li}": words(buf[: pools.pad_block]) for li, buf in enumerate(pools.swa.bufs)}
    for name in ("c4", "c128", "indexer"):
        out |= {f"{name}{li}": words(p.buf[: pools.num_pages]) for li, p in getattr(pools, name).items()}
    for name, ring in (("c4_state", 8), ("c4_index_state", 8), ("c128_state", 128)):
        out |= {f"{name}{li}": t[: pools.pad_slot * ring] for li, t in getattr(pools, name).items()}
    return out


@pytest.mark.slow
def test_padding_rows_and_pages_write_only_the_padding(args):
    # The same step unpadded and padded to 5 rows and 4 pages: the real rows' logits agree
    # (to float rounding: other shapes, other BLAS blocks) and, outside the padding page,
    # block and slot, the step changes the same elements of every pool.
    model = Model(args, decode_path="batched")
    runs = []
    for rows, pages in ((None, None), (5, 4)):
        pools = scratch_pools(model, 300, sequences=2)
        seqs = [new_sequence(pools, n) for n in (290, 40)]
        with torch.inference_mode():
            for s, p in zip(seqs, (_ids(283, 1), _ids(30, 2))):
                model.forward([s], [p], pools)
            before = {k: v.clone() for k, v in _pool_tensors(pools).items()}
            batch = DecodeBatch.of(seqs, [7, 9], pools, model.device, rows, pages)
            assert batch.ids.shape[0] == (rows or len(seqs))
            logits = decode_step(model, pools, batch, "torch")[:2]
        changed = {k: v != before[k] for k, v in _pool_tensors(pools).items()}
        runs.append((logits, changed))
    (want, a), (got, b) = runs
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert any(bool(m.any()) for m in a.values())
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.slow
def test_a_block_completed_by_a_decode_token_is_written(args):
    # Position 3 completes C4 block 0 and position 127 C128 block 0: the step writes those
    # records where the reference does, and writes none before.
    reference, batched = _pair(args, "native", {})
    out = []
    for model in (reference, batched):
        pools = scratch_pools(model, 200, sequences=1)
        seq = new_sequence(pools, 200)
        with torch.inference_mode():
            model.forward([seq], [_ids(3, 5)], pools)
            for t in _ids(126, 6):
                model.forward([seq], [[t]], pools)
        out.append(pools)
    want, got = out
    page = torch.tensor([0])
    for li in want.c4:  # records 0..31 (positions 0..127), the same to one rounding step
        assert_same_ring(got.c4[li].read(page, torch.arange(64)), want.c4[li].read(page, torch.arange(64)))
    for li in want.c128:
        rec = got.c128[li].read(page, torch.arange(2))
        assert bool(rec[0].any()) and not bool(rec[1].any())
        assert_same_ring(rec, want.c128[li].read(page, torch.arange(2)))


def test_records_round_trip_through_the_page_views():
    layout = PageLayout.sglang(64, 256)
    pages = torch.zeros(3, layout.page_stride, dtype=torch.uint8)
    records = torch.randint(0, 256, (5, layout.record_bytes), dtype=torch.uint8)
    locs = torch.tensor([0, 63, 64, 130, 191])
    layout.write(pages, locs, records)
    assert torch.equal(layout.read(pages, locs), records)
    assert torch.equal(layout.read(pages, locs.view(1, 5)), records[None])
    from remnant.kv.paged import gather

    assert torch.equal(gather(pages, layout, locs), records)


def test_pools_keep_capacity_and_count_padding_apart(args):
    model = Model(args)
    pools = scratch_pools(model, 1000, sequences=2)
    assert pools.pad_page == pools.num_pages and pools.pages.n == pools.num_pages
    allocated, accounted = pools.allocated_bytes(), pools.accounted_bytes()
    assert allocated["padding"] > 0
    for part in ("c4_indexer", "c4_state", "c4_indexer_state", "c128_state"):
        assert allocated[part] == accounted[part], part


def test_decode_path_auto_is_batched_on_cpu(args):
    assert Model(args).decode_path == "batched" and Model(args).native_decode == "torch"
    assert Model(args).graphs is None
