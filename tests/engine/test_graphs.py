"""CUDA graphs of the batched decode step (remnant.engine.graphs): buckets on the CPU; replay
against eager steps, the kernel per mode and capacity on a GPU (marked `gpu`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from remnant.config import ModelConfig
from remnant.engine.decode_step import DecodeBatch, decode_step
from remnant.engine.graphs import batch_buckets, page_bucket
from remnant.engine.model import C4Format, Model, ModelArgs
from remnant.engine.pools import new_sequence, scratch_pools
from tests.engine.rings import assert_same_ring, live_ring, ring_keep

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_batch_buckets_cover_every_batch_up_to_the_largest():
    buckets = batch_buckets(128)
    assert buckets[:5] == [1, 2, 4, 8, 16] and buckets[-1] == 128 and buckets == sorted(set(buckets))
    assert all(any(b >= n for b in buckets) for n in range(1, 129))
    assert batch_buckets(5) == [1, 2, 4, 5] and batch_buckets(1) == [1]
    assert [page_bucket(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]


def _args(heads: int = 8) -> ModelArgs:
    return dataclasses.replace(ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig())), num_attention_heads=heads)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("mode", "pack_window"), [("native", False), ("triton", False), ("kernel", False),
                                                   ("triton", True), ("kernel", True)],
                         ids=["native", "triton", "kernel", "triton-packed-window", "kernel-packed-window"])
def test_graph_replay_is_the_eager_step_as_batches_change(mode, pack_window):
    # Two copies of the same sequences, one stepped through captured graphs, one eagerly:
    # batches of 3, 1, 5 and 2 rows (other buckets, padding rows) and growing contexts
    # (other page buckets) give the same logits and the same pools.
    keep = torch.arange(0, 448, 448 // 192)[:192]
    runs = []
    for cuda_graph in (True, False):
        model = Model(_args(), device="cuda", dtype="bfloat16", cuda_graph=cuda_graph, cuda_graph_max_bs=8)
        if mode != "native":
            model.set_c4_formats({i: C4Format(mode, keep, pack_window=pack_window) for i in model.csa_layers})
        pools = scratch_pools(model, 900, sequences=5)
        seqs = [new_sequence(pools, 900) for _ in range(5)]
        logits = []
        with torch.inference_mode():
            for i, s in enumerate(seqs):
                model.forward([s], [_ids(100 + 150 * i, i)], pools)
            for step, rows in enumerate((3, 1, 5, 2, 5, 3)):
                logits.append(model.forward(seqs[:rows], [[t] for t in _ids(rows, 50 + step)], pools))
        runs.append((logits, pools, model))
    (graphed, a, model), (eager, b, _) = runs
    assert model.graphs.stats["replays"] == 6 and len(model.graphs.stats["captured"]) >= 3
    # A graph pads rows and pages, so its matmuls round as other shapes do: logits agree to
    # bf16 rounding, ring records to one rounding step.
    for g, e in zip(graphed, eager):
        torch.testing.assert_close(g, e, atol=5e-2, rtol=0)
        assert (g.argmax(-1) == e.argmax(-1)).float().mean() >= 0.8
    for li in range(len(a.swa.bufs)):
        assert_same_ring(live_ring(a, li), live_ring(b, li), ring_keep(model, li))


@needs_gpu
@pytest.mark.gpu
def test_a_graph_step_never_synchronizes_with_the_host():
    model = Model(_args(), device="cuda", cuda_graph=False)
    pools = scratch_pools(model, 600, sequences=2)
    seqs = [new_sequence(pools, 600) for _ in range(2)]
    with torch.inference_mode():
        for s in seqs:
            model.forward([s], [_ids(300, 1)], pools)
        batch = DecodeBatch.of(seqs, [1, 2], pools, model.device)
        decode_step(model, pools, batch, model.attention)  # compiles the kernels first
        torch.cuda.set_sync_debug_mode("error")
        try:
            decode_step(model, pools, batch, model.attention)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("mode", "packed"), [("native", None), ("kernel", "sm90")])
def test_the_kernel_per_mode_at_64_heads(mode, packed):
    from remnant.kernels.decode.flashmla import unavailable_reason

    model = Model(_args(heads=64), device="cuda")
    if mode == "kernel":
        model.set_c4_formats({i: C4Format("kernel", torch.arange(192)) for i in model.csa_layers})
    assert model.dtype == torch.bfloat16 and model.graphs is not None and model.attention == "kernels"
    assert model.packed_decode == packed, model.packed_decode_reason
    flashmla = unavailable_reason(model.device, 64) is None
    assert model.native_decode == ("flashmla" if flashmla else "triton")


@needs_gpu
@pytest.mark.gpu
def test_capacity_is_unchanged_by_graphs_and_padding():
    from remnant.engine.capacity import size_pools
    from remnant.engine.pools import KVPools, geometry_of

    tokens = []
    for cuda_graph in (True, False):
        model = Model(_args(), device="cuda", cuda_graph=cuda_graph)
        geometry = geometry_of(model)
        pools = KVPools(geometry, size_pools(geometry, 64 << 20), model.device)
        tokens.append((pools.num_pages, pools.swa_blocks.n, pools.slots.n))
    assert tokens[0] == tokens[1]
