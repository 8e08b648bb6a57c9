"""The plugin's capture mode (remnant.sglang.capture) against the real sglang 0.5.18 on CPU.

The hooks run around SGLang's own CompressorBackendMixin._forward_compress_all_in_one and
write into SGLang's own DeepSeekV4TokenToKVPool. Two of SGLang's kernels there are CUDA
JIT kernels that cannot run on a CPU, so they are stood for by plain torch:
`compress_forward` (the softmax pooling, whose state writes a second call would change:
the stand-in's do) and the FlashMLA variant of `compress_norm_rope_store`
(fused_norm_rope_v2.cuh: RMS norm, RoPE on the last 64 coordinates, then either its
bf16_store of the rows or its UE8M0 FP8 quantization, written by SGLang's own page writer
SetKAndS). SGLang's Triton quantizer (quant_to_nope_fp8_rope_bf16_pack_triton) is not used
for that: under Triton's CPU interpreter its FP8 cast rounds 31.0 to 16 (a carry into the
exponent is lost), which the GPU does not do. Everything else is SGLang's code. The attention hook's original is FlashMLA (CUDA), stood
for by a function that returns a tensor of its own.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from remnant.calibration.capture_recorder import CaptureSettings
from remnant.config_errors import ConfigError
from remnant.sglang.settings import Settings, capture_from_env
from tests.sglang.env import needs_sglang, probe, run_loader

N_HEADS = 64
CSA = [2, 4, 6]  # probe.TINY_RATIOS' CSA layers
PER_PAGE = 64  # C4 records per page at SGLang's page size 256


# Settings (plain Python) ---------------------------------------------------------------


def test_capture_settings_round_trip_through_the_environment(tmp_path):
    s = CaptureSettings(path=str(tmp_path / "cap.safetensors"), tokens=7, records=9, source="sharegpt",
                        model_id="deepseek-ai/DeepSeek-V4-Flash")
    assert capture_from_env(Settings(), s.to_env()) == s
    assert capture_from_env(Settings(), {}) is None
    assert capture_from_env(Settings(), {"REMNANT_MODE": "kernel"}) is None


def test_capture_is_refused_in_a_packed_mode(tmp_path):
    path = tmp_path / "cap.safetensors"
    with pytest.raises(ConfigError, match=f"REMNANT_CAPTURE={path} is not allowed with REMNANT_MODE=kernel; "
                                          f"capture runs only with REMNANT_MODE=native"):
        capture_from_env(Settings("kernel"), {"REMNANT_CAPTURE": str(path)})
    with pytest.raises(ConfigError, match="REMNANT_CAPTURE_TOKENS='x' is not an integer"):
        capture_from_env(Settings(), {"REMNANT_CAPTURE": str(path), "REMNANT_CAPTURE_TOKENS": "x"})


# SGLang's loader and server arguments (fresh processes) --------------------------------


@needs_sglang
def test_loader_registers_exactly_the_capture_hooks(tmp_path):
    from remnant.sglang import capture

    got = probe("capture_patched", REMNANT_CAPTURE=str(tmp_path / "cap.safetensors"))
    assert all(got["capture"].values()), got["capture"]
    assert got["registered"] == sorted(f"{t} {h.__module__}.{h.__name__} {k}" for t, h, k in capture.TARGETS)
    # Targets only the packed modes patch stay untouched.
    untouched = set(got["packed"]) - set(got["capture"])
    assert untouched and not any(got["packed"][t] for t in untouched)
    # Native without capture still registers nothing.
    assert probe("capture_patched")["registered"] == []


@needs_sglang
def test_loader_refuses_a_packed_mode_with_capture(tmp_path):
    proc = run_loader(REMNANT_MODE="kernel", REMNANT_CAPTURE=str(tmp_path / "cap.safetensors"))
    assert proc.returncode != 0 and "LOADED" not in proc.stdout
    assert (f"remnant: REMNANT_CAPTURE={tmp_path / 'cap.safetensors'} is not allowed with REMNANT_MODE=kernel; "
            f"capture runs only with REMNANT_MODE=native") in proc.stderr


@needs_sglang
def test_server_args_need_cuda_graphs_off(tmp_path):
    env = {"REMNANT_CAPTURE": str(tmp_path / "cap.safetensors")}
    got = probe("capture_server_check", **env)
    assert "needs CUDA graphs off (decode=full); add SGLang's --disable-cuda-graph" in (got.get("error") or ""), got
    assert probe("capture_server_check", "--disable-cuda-graph", **env) == {"error": None}
    got = probe("capture_server_check", "--disable-cuda-graph", "--cuda-graph-backend-decode", "full", **env)
    assert "needs CUDA graphs off (decode=full)" in (got.get("error") or ""), got
    got = probe("capture_server_check", "--disable-cuda-graph", "--enable-torch-compile", **env)
    assert "does not allow --enable-torch-compile" in (got.get("error") or ""), got
    assert probe("capture_server_check") == {"error": None}  # without capture: SGLang's own defaults


# The hooks, in this process -----------------------------------------------------------


@pytest.fixture
def settings(tmp_path):
    return CaptureSettings(path=str(tmp_path / "cap.safetensors"), tokens=1000, records=1000, source="test",
                           model_id="tiny-dsv4")


@pytest.fixture
def capture_mode(settings):
    from remnant.sglang import capture

    capture.configure(settings)
    yield capture
    capture.configure(None)


def token_pool():
    from tests.sglang.probe import TINY_RATIOS, server_args, token_pool

    server_args(TINY_RATIOS)
    return token_pool()


class Kernels:
    """Torch stand-ins for SGLang's two CUDA-only compressor kernels (see the module doc)."""

    def __init__(self):
        self.compress_calls = 0

    def compress_forward(self, kv_score_buffer, kv_score_input, ape, plan, *, head_dim, compress_ratio, out=None,
                         is_online=False):
        self.compress_calls += 1
        state = kv_score_buffer.view(-1, kv_score_buffer.shape[-1])
        state[: plan[1].shape[0]] += 1  # writes the state, then reads it: a second call would differ
        plan_raw = plan[1].view(torch.int32)
        rows = torch.arange(plan_raw.shape[0]) if plan.is_decode else (plan_raw[:, 1] & 0xFFFF).long()
        out = kv_score_input[rows, :head_dim] + ape.view(-1, head_dim)[0] + 0.1 * state[0, :head_dim]
        return out.to(kv_score_input.dtype)

    @staticmethod
    def norm_rope_store(kv, plan, *, norm_weight, norm_eps, freq_cis, out_loc, kvcache, page_size, use_fp4=False,
                        bf16_store=False):
        from sglang.kernels.ops.attention.dsv4.index_buf_accessor import NopeFp8RopeBf16Pack, SetKAndS

        plan_raw = plan[1].view(torch.int32)
        seq = plan_raw[:, 0].long()
        if plan.is_decode:  # tokens that close no record are not written
            rows = (seq % plan.compress_ratio == 0).nonzero().flatten()
            locs = out_loc[rows]
        else:
            rows = torch.arange(plan_raw.shape[0])
            locs = out_loc[(plan_raw[:, 1] & 0xFFFF).long()]
        x = kv[rows].float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm_eps) * norm_weight.float()
        rot = torch.view_as_complex(x[:, 448:].reshape(-1, 32, 2).contiguous()) * freq_cis[seq[rows] - plan.compress_ratio]
        y = torch.cat([x[:, :448], torch.view_as_real(rot).flatten(-2)], -1).to(torch.bfloat16)
        if bf16_store:
            assert page_size == 1
            kvcache.view(torch.bfloat16).view(-1, 512)[locs] = y
        else:  # the kernel's FP8 path: per 64-coordinate tile, scale 2^ceil(log2(max(1e-4, amax) / 448))
            tiles = y[:, :448].float().view(-1, 7, 64)
            exponent = torch.ceil(torch.log2(tiles.abs().amax(-1).clamp_min(1e-4) / 448))
            codes = (tiles * torch.exp2(-exponent).unsqueeze(-1)).to(torch.float8_e4m3fn).view(-1, 448)
            pack = NopeFp8RopeBf16Pack(k_nope_fp8=codes, k_rope_bf16=y[:, 448:].contiguous(),
                                       scale_k_nope_ue8m0=(exponent + 127).to(torch.uint8))
            SetKAndS.torch(SimpleNamespace(page_size=page_size), kvcache, locs, pack)


def decode_plan(seq_lens):
    from sglang.kernels.ops.attention.dsv4 import CompressorDecodePlan

    raw = torch.zeros(len(seq_lens), 4, dtype=torch.int32)
    raw[:, 0] = torch.tensor(seq_lens)
    return CompressorDecodePlan(4, raw.view(torch.uint8))


def prefill_plan(seq_lens, ragged_ids):
    from sglang.kernels.ops.attention.dsv4 import CompressorPrefillPlan

    raw = torch.zeros(len(seq_lens), 4, dtype=torch.int32)
    raw[:, 0], raw[:, 1] = torch.tensor(seq_lens), torch.tensor(ragged_ids)
    return CompressorPrefillPlan(4, raw.view(torch.uint8), torch.zeros(0, 8, dtype=torch.uint8))


def steps():
    """(plan, C4 out_loc per token): a prefill of two requests (8 and 4 tokens, so C4
    records at their 4th and 8th tokens), then decode steps of three requests, one closing
    a record at each step. Location 0 is SGLang's null slot: the token closes no record."""
    out_loc = torch.zeros(12, dtype=torch.int64)
    out_loc[[3, 7, 11]] = torch.tensor([65, 66, 129])
    yield prefill_plan([4, 8, 4], [3, 7, 11]), out_loc
    for i, seq_lens in enumerate(([9, 5, 12], [10, 6, 16], [12, 7, 17])):
        locs = [0 if s % 4 else 200 + 3 * i + j for j, s in enumerate(seq_lens)]
        yield decode_plan(seq_lens), torch.tensor(locs, dtype=torch.int64)


class Compressor:
    """What CompressorBackendMixin._forward_compress_all_in_one is called with, per layer."""

    def __init__(self, pool):
        g = torch.Generator().manual_seed(0)
        self.pool = pool
        self.state = {i: torch.randn(16, 4, 2048, generator=g) for i in CSA}
        self.inputs = [torch.randn(out_loc.shape[0], 2048, generator=g) * 3 for _, out_loc in steps()]
        self.ape = torch.randn(8, 512, generator=g)
        self.norm = SimpleNamespace(weight=torch.rand(512, generator=g) + 0.5, variance_epsilon=1e-6)
        self.freqs = torch.polar(torch.ones(64, 32), torch.rand(64, 32, generator=g) * 6)

    def run(self, call):
        """Every step on every CSA layer (and the C128 layer 3, which is not captured)."""
        from sglang.srt.layers.attention.dsv4.compressor_v2 import CompressorBackendMixin

        for (plan, out_loc), x in zip(steps(), self.inputs):
            backend = SimpleNamespace(token_to_kv_pool=self.pool, forward_metadata=SimpleNamespace(
                c4_compress_metadata=plan))
            backend._get_paged_compress_metadata = CompressorBackendMixin._get_paged_compress_metadata.__get__(backend)
            for layer in CSA:
                call(backend, kv_score_buffer=self.state[layer], kv_score_input=x, ape=self.ape, head_dim=512,
                     norm=self.norm, freqs_cis_cache=self.freqs,
                     kv_cache=self.pool.get_extra_key_buffer(layer).view(torch.uint8), is_indexer=False,
                     rotate=False, compress_ratio=4, page_size=self.pool.get_extra_key_page_size(layer),
                     out_loc=out_loc)


def compressor_runs(monkeypatch, capture=None):
    """(pool, compressor, kernels) after the steps, through the capture hooks or stock."""
    from sglang.srt.layers.attention.dsv4 import compressor_v2
    from sglang.srt.layers.attention.dsv4.compressor_v2 import CompressorBackendMixin

    kernels = Kernels()
    monkeypatch.setattr(compressor_v2, "compress_forward", kernels.compress_forward)
    stock = CompressorBackendMixin._forward_compress_all_in_one
    if capture is None:
        monkeypatch.setattr(compressor_v2, "compress_norm_rope_store", kernels.norm_rope_store)
        call = stock
    else:  # as HookRegistry's AROUND wrappers call the hooks
        monkeypatch.setattr(compressor_v2, "compress_norm_rope_store",
                            lambda *a, **kw: capture.store_capture(kernels.norm_rope_store, *a, **kw))

        def call(backend, **kw):
            return capture.compress_capture(stock, backend, **kw)
    comp = Compressor(token_pool())
    comp.run(call)
    return comp.pool, comp, kernels


def decode_queries(capture, pool, layers, n=2, rows=3, seed=1):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    g = torch.Generator().manual_seed(seed)
    for layer in layers:
        q = torch.randn(rows, N_HEADS, 512, generator=g).to(torch.bfloat16)
        capture.attention_capture(lambda *a, **kw: None, SimpleNamespace(token_to_kv_pool=pool), q, None, None,
                                  SimpleNamespace(layer_id=layer), SimpleNamespace(
                                      forward_mode=ForwardMode.DECODE, batch_size=n), 4)


@needs_sglang
def test_attention_hook_records_decode_queries_of_csa_layers_and_returns_stock_output(capture_mode):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    capture = capture_mode
    pool = token_pool()
    backend = SimpleNamespace(token_to_kv_pool=pool)
    stock_out = torch.randn(5, N_HEADS, 512)
    calls = []

    def stock(*args, **kwargs):
        calls.append((args, kwargs))
        return stock_out

    g = torch.Generator().manual_seed(2)
    q = torch.randn(5, N_HEADS, 512, generator=g).to(torch.bfloat16)  # 3 requests, then 2 padding rows
    q_before = q.clone()
    k = torch.randn(5, 512, generator=g).to(torch.bfloat16)
    sink = torch.zeros(N_HEADS)
    decode = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=3)
    out = capture.attention_capture(stock, backend, q, k, k, SimpleNamespace(layer_id=2), decode, 4,
                                    save_kv_cache=False, attn_sink=sink)
    assert out is stock_out and torch.equal(q, q_before)
    (args, kwargs), = calls
    assert args[1] is q and args[2] is k and args[6] == 4 and kwargs == {"save_kv_cache": False, "attn_sink": sink}
    # Not recorded: window-only and C128 layers, extend batches.
    for layer, ratio, mode in ((0, 0, ForwardMode.DECODE), (3, 128, ForwardMode.DECODE), (4, 4, ForwardMode.EXTEND)):
        batch = SimpleNamespace(forward_mode=mode, batch_size=3)
        assert capture.attention_capture(stock, backend, q, k, k, SimpleNamespace(layer_id=layer), batch, ratio,
                                         attn_sink=sink) is stock_out
    assert len(calls) == 4
    rec = capture.recorder()
    assert rec.counts() == {2: (3, 0), 4: (0, 0), 6: (0, 0)}  # the pool's CSA layers are expected
    assert rec.params["query_heads"] == {"heads": N_HEADS, "first": 0, "of": N_HEADS,
                                         "note": "TP rank 0's head shard: model heads 0..heads-1"}
    decode_queries(capture, pool, [4, 6])
    assert capture.recorder().close() is None and not capture.recorder().done  # no latents: nothing written


@needs_sglang
def test_data_parallel_replicas_outside_attention_dp_are_refused(capture_mode):
    """(SGLang's own CPU parse of --dp-size 2 fails before the plugin's check, so the hook
    is called with the resolved fields it reads.)"""
    from remnant.config_errors import ConfigError

    off = SimpleNamespace(decode=SimpleNamespace(backend="disabled"), prefill=SimpleNamespace(backend="disabled"))
    args = SimpleNamespace(cuda_graph_config=off, dp_size=2, enable_dp_attention=False, pp_size=1)
    with pytest.raises(ConfigError, match="does not allow --dp-size=2 without --enable-dp-attention"):
        capture_mode.check_server_args(None, args)
    args.enable_dp_attention = True
    capture_mode.check_server_args(None, args)


@needs_sglang
def test_flush_cache_writes_a_short_capture_only_when_the_run_asks(capture_mode):
    """SGLang stops its schedulers with SIGKILL: the run's marker file plus /flush_cache
    (Scheduler.flush_cache, AFTER) is where a capture short of its budget gets written."""
    from remnant.calibration.capture_recorder import write_request
    from remnant.calibration.captures import load_captures

    pool = token_pool()
    decode_queries(capture_mode, pool, CSA)
    rec = capture_mode.recorder()
    for layer in CSA:
        rec.add_latents(layer, torch.randn(3, 512))
    assert capture_mode.flush_write("flushed", None) == "flushed" and not rec.done  # an ordinary flush
    write_request(rec.settings.path).touch()
    assert capture_mode.flush_write("flushed", None) == "flushed" and rec.done
    caps = load_captures(rec.written)
    assert sorted(caps.layers) == CSA and caps.params["complete"] is False


@needs_sglang
def test_attention_hook_keeps_only_the_real_heads_of_a_padded_tp_shard(capture_mode):
    """Under attention TP DeepSeek-V4 pads a rank's 16 heads to 64 with unwritten memory;
    only the layer's tp_q_head_num heads are queries."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    pool = token_pool()
    q = torch.full((3, 64, 512), float("nan"), dtype=torch.bfloat16)
    q[:, :16] = torch.randn(3, 16, 512, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    layer = SimpleNamespace(layer_id=2, tp_q_head_num=16)
    capture_mode.attention_capture(lambda *a, **kw: None, SimpleNamespace(token_to_kv_pool=pool), q, None, None,
                                   layer, SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=3), 4)
    rec = capture_mode.recorder()
    assert rec.counts()[2] == (3, 0)
    assert rec.params["query_heads"]["heads"] == 16
    (kept,) = rec._layers[2].parts["queries"]
    assert kept.shape == (3, 16, 512) and torch.equal(kept, q[:, :16].float())


@needs_sglang
def test_compressor_hook_stores_stock_records_and_captures_what_was_quantized(monkeypatch, capture_mode):
    from remnant.calibration.captures import load_captures
    from remnant.kv.codec import dequantize, quantize
    from remnant.kv.paged import gather
    from remnant.sglang.buffers import native_layout

    stock_pool, stock, stock_kernels = compressor_runs(monkeypatch)
    pool, hooked, kernels = compressor_runs(monkeypatch, capture_mode)
    # What the server keeps is the stock call's, byte for byte: C4 records and compressor state.
    for layer in CSA:
        assert torch.equal(pool.get_extra_key_buffer(layer).view(torch.uint8),
                           stock_pool.get_extra_key_buffer(layer).view(torch.uint8))
        assert torch.equal(hooked.state[layer], stock.state[layer])
    assert kernels.compress_calls == stock_kernels.compress_calls == 4 * len(CSA)
    assert int(pool.get_extra_key_buffer(2).view(torch.uint8).count_nonzero()) > 0

    decode_queries(capture_mode, pool, CSA)
    path = capture_mode.recorder().close()
    caps = load_captures(path)
    assert sorted(caps.layers) == CSA
    locs = torch.tensor([65, 66, 129, 202, 205, 206])  # the steps' new records, in order
    layout = native_layout(PER_PAGE)
    for layer in CSA:
        k = caps.layers[layer].k
        assert k.shape == (len(locs), 512) and caps.layers[layer].q.shape == (2, N_HEADS, 512)
        records = gather(stock_pool.get_extra_key_buffer(layer).view(torch.uint8), layout, locs)
        assert torch.equal(k, k.to(torch.bfloat16).float())  # the bf16 values the quantizer read
        assert torch.equal(quantize(k), records)  # Remnant's quantizer gives SGLang's records exactly
        # ... and the records dequantize to the latents within FP8 e4m3 rounding per UE8M0 tile.
        scale = torch.pow(2.0, records[:, 576:583].float() - 127).repeat_interleave(64, 1)
        err = (dequantize(records)[:, :448] - k[:, :448]).abs()
        assert bool((err <= 2.0 ** -4 * k[:, :448].abs() + scale * 2.0 ** -9).all())
        assert torch.equal(dequantize(records)[:, 448:], k[:, 448:])  # RoPE is stored in bf16
    # Different layers saw different compressor states, so their latents differ.
    assert not torch.equal(caps.layers[2].k, caps.layers[4].k)


@needs_sglang
def test_budget_ends_recording_with_a_valid_file(monkeypatch, tmp_path):
    from remnant.calibration.captures import load_captures
    from remnant.records.provenance import sha256_file
    from remnant.sglang import capture

    s = CaptureSettings(path=str(tmp_path / "run" / "cap.safetensors"), tokens=3, records=5, source="sharegpt",
                        model_id="tiny-dsv4")
    capture.configure(s)
    try:
        (tmp_path / "run").mkdir()
        pool, _, _ = compressor_runs(monkeypatch, capture)  # 6 new records per layer, budget 5
        assert not capture.recorder().done
        decode_queries(capture, pool, CSA, n=2)
        assert not capture.recorder().done  # 2 of 3 query tokens
        decode_queries(capture, pool, CSA, n=2, seed=3)
        rec = capture.recorder()
        assert rec.done and rec.written == tmp_path / "run" / "cap.safetensors"
        digest = sha256_file(rec.written)
        decode_queries(capture, pool, CSA, n=2, seed=4)  # past the budget: ignored
        assert rec.close() == rec.written and sha256_file(rec.written) == digest
    finally:
        capture.configure(None)
    caps = load_captures(tmp_path / "run" / "cap.safetensors")
    assert caps.model_id == "tiny-dsv4" and caps.source == "sharegpt"
    assert {i: (c.q.shape[0], c.k.shape[0]) for i, c in caps.layers.items()} == {i: (3, 5) for i in CSA}
    p = caps.params
    assert p["server"] == "sglang" and p["sglang_version"] == "0.5.18" and p["complete"] is True
    assert p["settings"] == json.loads(json.dumps(dataclasses.asdict(s)))
    assert p["ranks"]["tp_rank"] == 0 and p["sources"]["remnant_version"]
    assert p["query_heads"]["heads"] == N_HEADS
    assert [f for f in tmp_path.joinpath("run").iterdir()] == [tmp_path / "run" / "cap.safetensors"]  # atomic


@needs_sglang
def test_only_tp_rank_0_records(settings):
    from remnant.sglang.capture import make_recorder

    pool = token_pool()
    assert make_recorder(settings, pool, {"tp_rank": 1, "tp_size": 4}) is None
    rec = make_recorder(settings, pool, {"tp_rank": 0, "tp_size": 4, "attn_tp_size": 4})
    assert rec is not None and rec.counts() == {i: (0, 0) for i in CSA}
    assert rec.params["ranks"] == {"tp_rank": 0, "tp_size": 4, "attn_tp_size": 4}
