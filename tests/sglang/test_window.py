"""retention.window_records=packed_csa in the SGLang plugin, against the real sglang 0.5.18
on CPU: each CSA layer's window records packed with its C4 keep list (PackedWindowPool),
SGLang's pool sizing counting them, SGLang's window writers storing them packed, and the
attention reading them: decode through the plugin's hook around SGLang's own
DeepseekV4AttnBackend.forward, in both modes, against the torch reference.

The decode's stock kernel, FlashMLA, is CUDA-only; it is stood for by `flash_mla`
below, which reads SGLang's page views as FlashMLA does (records of the split page layout
at the given indices, masked by their lengths, one softmax with the sink) through
remnant.kernels.decode.reference. Everything else is SGLang's code or the plugin's.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from remnant.kv.attention import SOFTMAX_SCALE
from remnant.kv.codec import quantize
from remnant.kv.formats import page_bytes
from remnant.kv.layout import keep_tensor
from remnant.kv.packing import pack, unpack
from remnant.kv.paged import gather, write
from remnant.sglang.settings import Settings
from tests.sglang.env import needs_sglang, probe

pytestmark = needs_sglang

BUDGET = 30 * 2**30
HEADS = 8
CSA = [2, 4, 6]  # probe.TINY_RATIOS' CSA layers; 0, 1 window-only, 3, 5 HCA
SWA_PAGE = 128  # SGLang's window pool page (the model's window)


# SGLang's own loader and pool sizing (fresh processes) -----------------------------------


def test_sglang_builds_the_packed_window_pool_with_the_plugin():
    got = probe("pool", REMNANT_MODE="kernel", REMNANT_WINDOW_RECORDS="packed_csa")
    native = probe("pool", REMNANT_MODE="kernel")
    assert native["swa_class"] == "DeepSeekV4SingleKVPool" and got["swa_class"] == "PackedWindowPool"
    pages = native["swa_buffers"][0][0]
    packed_page, native_page = page_bytes(SWA_PAGE, 256), -(-SWA_PAGE * 584 // 576) * 576
    assert [b[1] for b in native["swa_buffers"]] == [native_page] * 7
    # CSA layers' windows at R + 72 = 328 bytes a record; the others as SGLang lays them out.
    assert got["swa_buffers"] == [[pages, packed_page if i in CSA else native_page] for i in range(7)]
    assert got["c4_buffers"] == native["c4_buffers"] and got["c128_buffers"] == native["c128_buffers"]


@pytest.mark.parametrize("mode", ["triton", "kernel"])
def test_packed_csa_windows_count_as_the_engines_formula(mode):
    from remnant.engine.capacity import C4_CSA_SWA
    from tests.sglang.test_plugin import assert_engine_capacity

    env = Settings(mode, window_records="packed_csa").to_env()
    assert env["REMNANT_WINDOW_RECORDS"] == "packed_csa"
    assert_engine_capacity(probe("configurator", BUDGET, **env), C4_CSA_SWA)


def test_per_layer_retention_packs_each_csa_window_at_its_r():
    from tests.sglang.probe import FLASH_RATIOS

    values = [64, 448] * 10 + [192]
    env = {"REMNANT_MODE": "triton", "REMNANT_RETENTION": ",".join(map(str, values))}
    got = probe("configurator", BUDGET, **env, REMNANT_WINDOW_RECORDS="packed_csa")
    c4_only = probe("configurator", BUDGET, **env)
    freed = got["swa_ratio"] * sum(584 - (r + 72) for r in values)
    assert got["bytes_per_full_token"] == pytest.approx(c4_only["bytes_per_full_token"] - freed, rel=1e-12)
    assert FLASH_RATIOS.count(4) == len(values)


def test_every_part_the_plugin_serves_gives_the_engines_ratio():
    """C4 and the CSA layers' windows packed, bf16 state, MXFP4 keys: docs/kv.md's 1.6000x."""
    from remnant.engine.capacity import C4_CSA_SWA_MXFP4_BF16
    from tests.sglang.test_plugin import assert_engine_capacity

    env = Settings("kernel", compressor_state_dtype="bfloat16", index_key_format="mxfp4",
                   window_records="packed_csa").to_env()
    got = probe("configurator", BUDGET, "on", **env)
    native = probe("configurator", BUDGET, REMNANT_MODE="native")
    assert_engine_capacity(got, C4_CSA_SWA_MXFP4_BF16)
    assert native["bytes_per_full_token"] / got["bytes_per_full_token"] == pytest.approx(1.6000, abs=1e-4)


@pytest.mark.parametrize("mode", ["triton", "kernel"])
def test_window_hooks_store_and_read_packed_records(tmp_path, mode):
    from tests.sglang.probe import write_map

    got = probe("packed_window", REMNANT_MODE=mode, REMNANT_WINDOW_RECORDS="packed_csa",
                REMNANT_RETENTION_MAP=write_map(str(tmp_path / "map.json")))
    assert got["swa_class"] == "PackedWindowPool" and got["window_keep_is_c4_keep"]
    assert not got["window_only_packed"] and not got["kept_first_columns"]
    # SGLang's Triton norm + RoPE, then the packed store: the kept coordinates within FP8
    # rounding (e4m3: 3 mantissa bits, at most 1/16 relative).
    assert got["norm_rope_max_err"] < 1 / 16
    assert got["quantized_packed"] and got["refused"] == ["get_swa_raw_buffer"]
    assert got["prefill_natural_equal"] and got["prefill_folded_equal"]


def test_server_args_refuse_hicache_with_packed_windows():
    env = {"REMNANT_MODE": "kernel", "REMNANT_WINDOW_RECORDS": "packed_csa"}
    on = probe("server_check", "on", **env)
    assert "REMNANT_WINDOW_RECORDS=packed_csa is not allowed with --enable-hierarchical-cache" in (on.get("error")
                                                                                                   or ""), on
    assert probe("server_check", "off", **env) == {"error": None}


# The pools and the attention hook, in this process ---------------------------------------


@pytest.fixture(params=["triton", "kernel"])
def kv(request, monkeypatch, tmp_path):
    """SGLang's DeepSeekV4TokenToKVPool of the tiny model built with the plugin's pool hook
    (called as HookRegistry's AROUND wrapper calls it) and window_records=packed_csa, with
    a scattered retention map at R = 256."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    from remnant.sglang import plugin, settings
    from tests.sglang.probe import TINY_RATIOS, server_args, token_pool, write_map

    monkeypatch.setattr(settings, "_active", Settings(request.param, map_path=write_map(str(tmp_path / "map.json")),
                                                      window_records="packed_csa"))
    stock = DeepSeekV4TokenToKVPool._make_kv_pool
    monkeypatch.setattr(DeepSeekV4TokenToKVPool, "_make_kv_pool",
                        lambda self, **kw: plugin.make_kv_pool(stock, self, **kw))
    server_args(TINY_RATIOS)
    pool = token_pool()
    plugin.check_token_pool(None, pool)
    return pool


def latents(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 512, generator=torch.Generator().manual_seed(seed)) * 3


def test_window_pool_packs_the_csa_layers_with_their_c4_keeps(kv):
    from remnant.sglang.pool import PackedWindowPool, packed_window_of

    window = kv.swa_kv_pool
    assert isinstance(window, PackedWindowPool) and window.model_layers == list(range(7))
    for layer in range(7):
        found = packed_window_of(kv, layer)
        assert (found is not None) == (layer in CSA)
        if found is None:
            assert window.layouts[layer].record_bytes == 584
            continue
        c4 = kv.c4_kv_pool.keeps[kv.layer_mapping[layer].compress_layer_id]
        assert torch.equal(keep_tensor(window.keeps[layer]), keep_tensor(c4))
        assert window.layouts[layer].record_bytes == 328
    assert window.kv_cache_total_dim == 584 and window.bytes_per_page_padded is None  # two page sizes


def test_sglangs_window_writes_reach_the_pool_packed(kv):
    from sglang.kernels.ops.attention.dsv4.index_buf_accessor import NopeFp8RopeBf16Pack

    from remnant.sglang.window import window_raw_buffer, window_store_fused, window_store_quantized

    stock = type(kv)
    window = kv.swa_kv_pool
    locs = torch.arange(7, 37)
    x = latents(30, 1)
    keep = keep_tensor(window.keeps[2])
    # The backend's store_cache path: SGLang's set_swa_key_buffer_radix_fused through the hook.
    window_store_fused(stock.set_swa_key_buffer_radix_fused, kv, 2, locs, x.to(torch.bfloat16))
    assert torch.equal(gather(window.kv_buffer[2], window.layouts[2], locs),
                       pack(quantize(x.to(torch.bfloat16).float()), keep))
    # Already-quantized records (SGLang's NopeFp8RopeBf16Pack): packed as copies of codes.
    rec = quantize(latents(30, 2))
    sg_pack = NopeFp8RopeBf16Pack(k_nope_fp8=rec[:, :448].view(torch.float8_e4m3fn),
                                  k_rope_bf16=rec[:, 448:576].view(torch.bfloat16), scale_k_nope_ue8m0=rec[:, 576:583])
    window_store_quantized(stock.set_swa_key_buffer_radix, kv, 4, locs, sg_pack)
    assert torch.equal(gather(window.kv_buffer[4], window.layouts[4], locs), pack(rec, keep_tensor(window.keeps[4])))
    # SGLang's native raw writer: refused on a packed layer, SGLang's own elsewhere.
    with pytest.raises(RuntimeError, match="CSA layer 6's window records are stored packed"):
        window_raw_buffer(stock.get_swa_raw_buffer, kv, 6)
    assert window_raw_buffer(stock.get_swa_raw_buffer, kv, 0) is window.kv_buffer[0]


def flash_mla(q, k_cache, head_dim_v, block_table, cache_seqlens, tile_scheduler_metadata, softmax_scale,
              is_fp8_kvcache, indices, topk_length, attn_sink, extra_k_cache, extra_indices_in_kvcache,
              extra_topk_length):
    """Stands for sgl_kernel.flash_mla.flash_mla_with_kvcache (CUDA only): SGLang passes
    views [pages, P, 1, 584] of its split-layout pages; the records each token's indices
    select, up to its length, attended in one softmax with the sink, in float64."""
    from remnant.kernels.decode.reference import decode_native_reference
    from remnant.sglang.buffers import mask_by_length, native_layout

    def pages(view):
        return torch.as_strided(view, (view.shape[0], view.stride(0)), (view.stride(0), 1)).view(torch.uint8)

    out = decode_native_reference(
        q[:, 0], pages(extra_k_cache), native_layout(extra_k_cache.shape[1]),
        mask_by_length(extra_indices_in_kvcache[:, 0], extra_topk_length), pages(k_cache),
        native_layout(k_cache.shape[1]), mask_by_length(indices[:, 0], topk_length), attn_sink, softmax_scale)
    return out.to(q.dtype).unsqueeze(1), None


def decode_step(kv, layer: int, seed: int = 3):
    """One decode step of 3 tokens on CSA `layer`: SGLang's backend (its attributes as its
    __init__ would set them for this pool), metadata and batch, the step's window latents,
    and what the torch reference reads: every C4 and window record native, its dropped
    coordinates zero (pack then unpack), written as SGLang writes native pages."""
    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend, DSV4AttnMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from remnant.sglang.buffers import native_layout, num_pages

    g = torch.Generator().manual_seed(seed)
    t = 3
    c4_layer = kv.layer_mapping[layer].compress_layer_id
    c4, window = kv.c4_kv_pool, kv.swa_kv_pool
    c4_keep, win_keep = keep_tensor(c4.keeps[c4_layer]), keep_tensor(window.keeps[layer])
    c4_x, win_x = latents(200, seed), latents(300, seed + 1)
    c4_locs, win_locs = torch.arange(1, 201), torch.arange(1, 301)
    c4.set_key_buffer_fused(c4_layer, c4_locs, c4_x)
    window.set_key_buffer_fused(layer, win_locs, win_x)
    step_locs = torch.tensor([301, 302, 303], dtype=torch.int32)  # this step's window records
    step_k = latents(t, seed + 2).to(torch.bfloat16)
    # The reference's native pages: the same latents, quantized, packed, rebuilt.
    ref_c4 = torch.zeros(num_pages(c4.size, c4.page_size), native_layout(c4.page_size).page_stride, dtype=torch.uint8)
    write(ref_c4, native_layout(c4.page_size), c4_locs, unpack(pack(quantize(c4_x), c4_keep), c4_keep))
    ref_win = torch.zeros(num_pages(window.size, SWA_PAGE), native_layout(SWA_PAGE).page_stride, dtype=torch.uint8)
    all_win = torch.cat([win_x, step_k.float()])
    write(ref_win, native_layout(SWA_PAGE), torch.cat([win_locs, step_locs.long()]),
          unpack(pack(quantize(all_win), win_keep), win_keep))

    c4_idx = torch.full((t, 64), -1, dtype=torch.int32)
    c4_idx[0, :10] = torch.arange(1, 11)
    c4_idx[1, :64] = torch.randperm(200, generator=g)[:64] + 1
    c4_idx[2, :5] = torch.tensor([200, 3, 3, 150, 77])
    swa_idx = torch.randint(1, 301, (t, 128), generator=g, dtype=torch.int32)
    swa_idx[:, 0] = step_locs  # each token sees its own new record
    meta = object.__new__(DSV4AttnMetadata)
    meta.c4_sparse_page_indices, meta.c4_sparse_topk_lengths = c4_idx, torch.tensor([10, 64, 5], dtype=torch.int32)
    meta.swa_page_indices, meta.swa_topk_lengths = swa_idx, torch.tensor([1, 128, 40], dtype=torch.int32)
    meta.swa_out_cache_loc, meta.c4_flashmla_metadata = step_locs, None
    backend = object.__new__(DeepseekV4AttnBackend)
    backend.mtp_enabled, backend.token_to_kv_pool, backend.head_dim_v = False, kv, 512
    backend.softmax_scale = SOFTMAX_SCALE
    backend.forward_metadata = SimpleNamespace(core_attn_metadata=meta)
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, out_cache_loc=step_locs.long())
    q = torch.randn(t, HEADS, 512, generator=g).to(torch.bfloat16)
    sink = torch.randn(HEADS, generator=g)
    reference = (ref_c4, c4_idx, meta.c4_sparse_topk_lengths, ref_win, swa_idx.clone(), meta.swa_topk_lengths)
    return backend, batch, q, step_k, sink, reference


def test_decode_through_the_plugin_equals_the_reference(kv, monkeypatch):
    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend

    from remnant.kernels.decode.reference import decode_native_reference
    from remnant.sglang.buffers import mask_by_length, native_layout
    from remnant.sglang.plugin import attention_forward

    flash = types.ModuleType("sgl_kernel.flash_mla")
    flash.flash_mla_with_kvcache = flash_mla
    monkeypatch.setitem(sys.modules, "sgl_kernel", types.ModuleType("sgl_kernel"))
    monkeypatch.setitem(sys.modules, "sgl_kernel.flash_mla", flash)
    backend, batch, q, step_k, sink, (ref_c4, c4_idx, c4_len, ref_win, swa_idx, swa_len) = decode_step(kv, 4)
    layer = SimpleNamespace(layer_id=4, v_head_dim=512)
    out = torch.full_like(q, float("nan"))
    out[:] = attention_forward(DeepseekV4AttnBackend.forward, backend, q, step_k, step_k, layer, batch, 4,
                               save_kv_cache=True, attn_sink=sink)
    want = decode_native_reference(q, ref_c4, native_layout(kv.c4_kv_pool.page_size), mask_by_length(c4_idx, c4_len),
                                   ref_win, native_layout(SWA_PAGE), mask_by_length(swa_idx, swa_len), sink)
    # Both in float64 over the same records, then rounded once to bf16: equal within one
    # bf16 rounding step (kernel mode sums over the kept columns only, triton over zeros too).
    torch.testing.assert_close(out.double(), want.to(q.dtype).double(), rtol=2**-8, atol=1e-6)
    # The step's window records were stored (packed) before they were read.
    window = kv.swa_kv_pool
    assert torch.equal(gather(window.kv_buffer[4], window.layouts[4], swa_idx[:, 0].long()),
                       pack(quantize(step_k.float()), keep_tensor(window.keeps[4])))
    meta = backend.forward_metadata.core_attn_metadata
    assert meta.swa_page_indices is not None and torch.equal(meta.swa_page_indices, swa_idx)  # put back
    assert window.get_key_buffer(4).data_ptr() == window.kv_buffer[4].data_ptr()  # nothing left staged
