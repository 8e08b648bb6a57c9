"""remnant.engine.bench, through its command remnant.cli.engine_bench, and
remnant.engine.roofline on the CPU (the GPU run is the curated one)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from remnant.config import ModelConfig
from remnant.cli.engine_bench import main
from remnant.engine.bench import prefill_kernel_ms
from remnant.engine.capacity_report import load_model_preset
from remnant.engine.model import ModelArgs
from remnant.engine.prefill_reads import PrefillReads
from remnant.engine.roofline import step_cost
from remnant.records.schema import validate


def _args(name: str) -> ModelArgs:
    return ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig(**load_model_preset(name))))


def test_roofline_of_the_h200_model_by_hand():
    a = _args("dsv4_flash_h200")
    one = step_cost(a, 1, 32768, "native")
    # Batch 1 touches 6 routed + 1 shared expert per layer: ~7 x 25 MB x 43 in FP8/bf16, far
    # below the 34.6 GB of all 32 experts; batch 128 touches nearly all of them.
    assert 7e9 < one.parts["weights_ffn_bytes"] < 1.2e10
    assert step_cost(a, 128, 32768).parts["weights_ffn_bytes"] > 3.4e10
    # KV of one token at 32k: 43 windows of 128 native records, 21 layers of 8192 index keys
    # (132 B) and 512 C4 records, 20 layers of 256 C128 records.
    kv = 43 * 128 * 584 + 21 * (8192 * 132 + 512 * 584) + 20 * 256 * 584
    assert one.kv_bytes == pytest.approx(kv)
    packed = step_cost(a, 1, 32768, "kernel")
    assert one.kv_bytes - packed.kv_bytes == pytest.approx(21 * 512 * (584 - 328))
    assert step_cost(a, 1, 32768, "triton").kv_bytes > one.kv_bytes  # reconstruction written and read
    assert one.seconds(4.2e12, 7.9e14) == pytest.approx(one.bytes / 4.2e12)
    # MXFP4 keys (68 B) and, in kernel mode, the CSA layers' windows packed (328 B).
    mxfp4 = step_cost(a, 1, 32768, "native", index_key_format="mxfp4")
    assert one.kv_bytes - mxfp4.kv_bytes == pytest.approx(21 * 8192 * (132 - 68))
    windows = step_cost(a, 1, 32768, "kernel", window_records="packed_csa")
    assert packed.kv_bytes - windows.kv_bytes == pytest.approx(21 * 128 * (584 - 328))
    assert step_cost(a, 1, 32768, "native", window_records="packed_csa").kv_bytes == one.kv_bytes
    every = step_cost(a, 1, 32768, "kernel", window_records="packed", c128_records="packed")
    assert packed.kv_bytes - every.kv_bytes == pytest.approx((43 * 128 + 20 * 256) * (584 - 328))


@pytest.mark.slow
def test_bench_runs_each_mode_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--model", "tiny", "--device", "cpu", "--batches", "1,3", "--contexts", "260",
                 "--steps", "2", "--prefill-contexts", "300", "--chunk", "128", "--prefill-profile",
                 "--index-fp8-queries", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    validate(doc)
    assert doc["index_fp8_queries"] is True
    assert [(r["mode"], r["batch"]) for r in doc["rows"]] == [(m, b) for m in ("native", "triton", "kernel")
                                                              for b in (1, 3)]
    for row in doc["rows"]:
        assert row["step_ms"] > 0 and row["roofline_ms"] > 0 and row["gpu_idle_share"] is None and row["gpu_busy_ms"] is None
        assert row["gpu_gap_share"] is None and row["ahead_idle_share"] is None and row["ahead_step_ms"] > 0
    assert doc["peaks"]["copy_bytes_per_s"] > 0 and "roofline" in capsys.readouterr().out
    assert [(r["mode"], r["context"], r["chunk"]) for r in doc["prefill"]] == [
        (m, 300, 128) for m in ("native", "triton", "kernel")]
    assert all(r["tokens_per_s"] == pytest.approx(300 / r["prefill_s"]) for r in doc["prefill"])
    # What the attention read, by hand: tiny has 4 layers (ratios 0, 4, 128, 4), a window of
    # 128 and a top-64; 300 tokens in chunks [0, 128), [128, 256), [256, 300).
    chunks = [(0, 128), (128, 256), (256, 300)]
    tokens = range(300)
    reads = {r["mode"]: r["reads"] for r in doc["prefill"]}
    for mode, got in reads.items():
        # Every layer reads each token's window (its own record and the 127 before it); a
        # chunk's tokens share them: the chunk's records and the 127 before its first.
        assert got["window"] == {"pairs": 4 * sum(min(p + 1, 128) for p in tokens),
                                 "distinct": 4 * sum(e - max(0, a - 127) for a, e in chunks)}, mode
        # The HCA layer: every record whose block of 128 is complete at the token.
        assert got["c128"] == {"pairs": sum((p + 1) // 128 for p in tokens),
                               "distinct": sum(e // 128 for _, e in chunks)}, mode
        # Two CSA layers: the top-64 of the visible C4 records (all of them up to 64), so a
        # chunk reads at least its last token's 64 and at most every visible record.
        assert got["c4"]["pairs"] == 2 * sum(min((p + 1) // 4, 64) for p in tokens), mode
        assert 2 * sum(min(e // 4, 64) for _, e in chunks) <= got["c4"]["distinct"] <= 2 * sum(e // 4 for _, e in chunks)
    assert all(r["chunks"] == 3 and r["kernel_ms"] is None for r in doc["prefill"])  # no profiler on cpu


@pytest.mark.slow
def test_bench_packs_every_part_it_is_asked_to(tmp_path, capsys):
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit):  # FP8 queries take FP8 keys
        main(["--model", "tiny", "--index-key-format", "mxfp4", "--index-fp8-queries", "--out", str(out)])
    assert "--index-fp8-queries takes FP8 keys, got --index-key-format mxfp4" in capsys.readouterr().err
    assert main(["--model", "tiny", "--device", "cpu", "--modes", "triton,kernel", "--batches", "2", "--contexts",
                 "260", "--steps", "1", "--prefill-contexts", "", "--index-key-format", "mxfp4",
                 "--window-records", "packed", "--c128-records", "packed", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    validate(doc)
    assert doc["kv_parts"] == {"index_key_format": "mxfp4", "window_records": "packed", "c128_records": "packed"}
    assert doc["index_fp8_queries"] is False
    # Packed window and C128 records read fewer bytes than native ones in kernel mode.
    parts = {r["mode"]: r["parts"] for r in doc["rows"]}
    assert parts["kernel"]["window_bytes"] == 2 * 4 * 128 * 328 and parts["kernel"]["c128_records_bytes"] == 2 * 2 * 328


@pytest.mark.slow
def test_a_cells_rows_route_as_different_requests_do():
    # The roofline counts the distinct experts of uniform routing; a cell whose rows all
    # routed alike (one token for every row over copied records, as before 2026-12-07)
    # read 2 of 8 experts here, and 6 of 32 at V4-Flash's shapes, at any batch.
    from remnant.engine.bench import _timed_cell, decode_tokens
    from remnant.engine.model import Model
    from remnant.engine.moe import expected_distinct_experts, route_tokens

    a = dataclasses.replace(_args("tiny"), intermediate_size=0, n_routed_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=64, n_shared_experts=1, expert_dtype="float32")
    model = Model(a)
    hits = []

    def route(x, router, k, scaling):
        ids, weights = route_tokens(x, router, k, scaling)
        hits.append((x.shape[0], len(ids.unique())))
        return ids, weights

    model.ops = dataclasses.replace(model.ops, moe_route=route)
    batch = 8
    _timed_cell(model, batch, 260, steps=2)
    expected = expected_distinct_experts(batch, 8, 2)  # 7.2
    assert {t for t, _ in hits} == {batch} and len(hits) >= 4 * len(a.compress_ratios)
    assert min(h for _, h in hits) >= 5 and sum(h for _, h in hits) / len(hits) > 0.8 * expected
    assert len(set(decode_tokens(batch, a.vocab_size))) == batch
    assert len(decode_tokens(300, 258)) == 300 and max(decode_tokens(300, 258)) < 258


@pytest.mark.slow
def test_a_cell_out_of_memory_is_a_limit_and_the_others_run(tmp_path, monkeypatch):
    # CPU tensors never run out of memory: the pools of batch 3 raise the error CUDA raises
    # for a cell too big for the card (fault injection; the rest runs for real).
    import remnant.engine.pools

    real = remnant.engine.pools.scratch_pools

    def scratch_pools(model, tokens, sequences=1, **kw):
        assert kw == {"window_blocks": sequences}  # the cell's window pool holds its batch's blocks
        if sequences == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")
        return real(model, tokens, sequences=sequences, **kw)

    monkeypatch.setattr(remnant.engine.pools, "scratch_pools", scratch_pools)
    out = tmp_path / "bench.json"
    assert main(["--model", "tiny", "--device", "cpu", "--modes", "native", "--batches", "3,1", "--contexts", "260",
                 "--steps", "1", "--prefill-contexts", "", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    validate(doc)
    assert [(r["mode"], r["batch"]) for r in doc["rows"]] == [("native", 1)]
    assert [line for line in doc["limits"] if "not measured" in line] == [
        "native batch 3 context 260: not measured, its pools (3 x 261 tokens) did not fit in the GPU's memory "
        "beside the weights"]


def test_kernel_log_lists_events_in_order_with_gaps(tmp_path):
    # The profiler's CPU events stand where a GPU's kernels would (the same event type).
    from torch.profiler import ProfilerActivity, profile

    from remnant.engine.bench import write_kernel_log

    x = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (x @ x).relu()
    events = sorted((e for e in prof.events() if e.name in ("aten::mm", "aten::relu")),
                    key=lambda e: e.time_range.start)
    write_kernel_log(tmp_path / "log" / "native-b1-4096.tsv", events)
    lines = (tmp_path / "log" / "native-b1-4096.tsv").read_text().splitlines()
    assert lines[0] == "start_us\tgap_us\tduration_us\tname"
    rows = [line.split("\t") for line in lines[1:]]
    assert [r[3] for r in rows] == ["aten::mm", "aten::relu"]
    assert float(rows[0][0]) == 0.0 and float(rows[1][0]) >= float(rows[0][2]) and float(rows[1][1]) >= 0.0


def test_prefill_kernels_are_told_apart_by_name():
    # Names as the torch profiler gives them on an H100 (benchmarks/engine-h100-count-skip/).
    names = {
        "_reconstruct_kernel": "rebuild",
        "void legacy::sm90::decode::sparse::flash_fwd_splitkv_mla_fp8_sparse_kernel<legacy::sm90::decode>": "attention",
        "void legacy::smxx::decode::flash_fwd_mla_combine_kernel<cutlass::bfloat16_t, 512, 8, 160>": "attention",
        "_packed_sm90_kernel": "attention",
        "_decode_kernel": "attention",
        "_shared_scores_kernel": "indexer",
        "_radix_pass": "indexer",
        "_store_kernel": "store",
        "_gate_kernel": "other",  # the decode step's compressor: a prefill forms its records in torch
        "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>": "other",  # not the engine's top-k on CUDA
        "_gate_up_kernel": "moe",
        "_down_pair_kernel": "moe",
        "_select_kernel": "moe",  # the router's
        "nvjet_sm90_tst_64x8_64x16_2x1_v_bz_NNT": "dense",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "dense",
        "_norm_rope_kernel": "other",
    }
    for name, part in names.items():
        assert prefill_kernel_ms([(name, 1500.0)])[part] == 1.5, name
    totals = prefill_kernel_ms([(name, 1000.0) for name in names])
    assert totals == {"rebuild": 1.0, "attention": 4.0, "indexer": 2.0, "store": 1.0, "moe": 3.0, "dense": 2.0,
                      "other": 3.0}


def test_prefill_reads_count_locations_and_name_their_parts():
    reads = PrefillReads()
    reads.count("c4", torch.tensor([[3, 5, -1], [5, 7, -1]]))
    reads.count("c4", torch.tensor([[3, -1, -1]]))
    assert reads.as_record()["c4"] == {"pairs": 5, "distinct": 4}
    assert reads.as_record()["window"] == {"pairs": 0, "distinct": 0}
    with pytest.raises(ValueError, match="part 'c8' is not allowed; allowed: window, c4, c128"):
        reads.count("c8", torch.tensor([[1]]))


@pytest.mark.parametrize("key_format", ["fp8", "mxfp4"])
def test_filled_pools_give_every_index_key_its_own_value(key_format, monkeypatch):
    # With one page of keys copied to every page, a row's scores repeated every 64 records
    # and the top-k timed ties; now every key is its own (and the same in each CSA layer).
    from remnant.engine import bench
    from remnant.engine.model import Model
    from remnant.engine.pools import scratch_pools

    monkeypatch.setattr(bench, "KEY_PAGES_AT_ONCE", 3)  # several batches of pages, one partial
    model = Model(_args("tiny"), index_key_format=key_format)
    pools = scratch_pools(model, 2000, sequences=3, window_blocks=3)
    bench.fill_pools(model, pools)
    layers = list(pools.indexer.values())
    assert len(layers) == 2 and torch.equal(layers[0].buf, layers[1].buf)
    pages, layout = layers[0].buf, layers[0].layout
    assert pages.shape[0] > 2 * 3  # more pages than two batches
    keys = layout.read(pages, torch.arange(pages.shape[0] * layout.per_page))
    assert torch.unique(keys, dim=0).shape[0] == keys.shape[0]
    # Each a valid key of its format: finite, not all zero, as the indexer reads it.
    values = model.index_key_format.dequantize(keys)
    assert torch.isfinite(values).all() and (values.abs().amax(dim=1) > 0).all()
