"""Checks that need a real sglang process of their own: `python -m tests.sglang.probe CHECK`.

Each runs in a fresh interpreter because SGLang's plugin loader patches classes for the
life of the process; the test passes the REMNANT_* variables in the environment. Prints
one JSON line. The DeepSeek-V4 server arguments come from a config.json written to a
temporary directory (no weights: sglang reads only the config here).
"""

from __future__ import annotations

import dataclasses
import json
import pkgutil
import sys
import tempfile
from pathlib import Path

#: V4-Flash attention geometry (conf/model/dsv4_flash_attn.yaml).
FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4]
TINY_RATIOS = [0, 0, 4, 128, 4, 128, 4]


def write_config(ratios: list[int]) -> str:
    d = tempfile.mkdtemp(prefix="dsv4cfg")
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 256,
        "num_hidden_layers": len(ratios), "num_attention_heads": 64, "vocab_size": 258,
        "compress_ratios": ratios, "window_size": 128, "sliding_window": 128, "index_head_dim": 128,
        "index_n_heads": 4, "index_topk": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 448,
        "head_dim": 512, "v_head_dim": 512, "q_lora_rank": 128, "kv_lora_rank": 512,
        "intermediate_size": 512, "moe_intermediate_size": 256, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "num_key_value_heads": 1, "hc_mult": 4, "max_position_embeddings": 65536, "torch_dtype": "bfloat16",
    }
    Path(d, "config.json").write_text(json.dumps(cfg))
    return d


def write_map(path: str, retention: int = 256, seed: int = 0, ratios: list[int] = TINY_RATIOS) -> str:
    """A retention map file at `path` keeping `retention` coordinates of each CSA layer of
    `ratios`, scattered (seeded): a prefix keep would leave every column order the identity."""
    import torch

    from remnant.calibration.retention import LayerKeep, RetentionMap

    g = torch.Generator().manual_seed(seed)
    layers = [LayerKeep(i, retention, torch.randperm(448, generator=g)[: retention - 64].sort().values.tolist())
              for i, r in enumerate(ratios) if r == 4]
    calibration = {"fingerprint": "0" * 64, "source": "tests/sglang", "queries": 1, "records": 1}
    RetentionMap("tiny-dsv4", "random", {"seed": seed}, calibration, layers).save(path)
    return path


def server_args(ratios: list[int], fp4_indexer: str = "off", **extra):
    """SGLang's ServerArgs for a config of `ratios`, published as a scheduler's. fp4_indexer
    "on": --enable-deepseek-v4-fp4-indexer, set after construction because ServerArgs
    refuses it off SM100/SM120 GPUs (what it changes here, the indexer pool's key size and
    the plugin's count of it, needs no GPU). Resolved ServerArgs are read-only; the write
    goes around that guard as SGLang's own test-only `override` writes its flag bags, and
    before publish, so the config bags SGLang's pools read carry it."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=write_config(ratios), device="cpu", skip_tokenizer_init=True, **extra)
    if fp4_indexer == "on":
        object.__setattr__(sa, "enable_deepseek_v4_fp4_indexer", True)
    publish(sa, role="scheduler")
    return sa


def patched() -> dict:
    """Load plugins with SGLang's own loader; report which targets carry a wrapper."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from remnant.sglang.plugin import TARGETS

    out = {}
    for target, _, _ in TARGETS:
        obj = pkgutil.resolve_name(target)
        out[target] = hasattr(obj, "__wrapped__")
    from sglang.srt.layers.attention import deepseek_v4_backend as backend

    out["backend.dequantize_k_cache_paged"] = hasattr(backend.dequantize_k_cache_paged, "__wrapped__")
    return out


def token_pool(ratios=TINY_RATIOS, c4_size=1024):
    import torch
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    return DeepSeekV4TokenToKVPool(
        max_num_reqs=4, swa_size=1024, c4_size=c4_size, c128_size=c4_size // 32, c4_state_pool_size=64,
        c128_state_pool_size=0, page_size=256, swa_page_size=128, dtype=torch.float8_e4m3fn,
        c4_state_dtype=torch.float32, c128_state_dtype=torch.float32, qk_nope_head_dim=448,
        qk_rope_head_dim=64, indexer_head_dim=128, layer_num=len(ratios), device="cpu",
        enable_memory_saver=False, compression_ratios=ratios)


def pool(fp4_indexer: str = "off") -> dict:
    """The token pool SGLang builds, with the plugin loaded: what the C4 pool is and holds."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    server_args(TINY_RATIOS, fp4_indexer)
    p = token_pool()
    c4 = p.c4_kv_pool
    return {
        "c4_class": type(c4).__name__,
        "c4_buffers": [list(b.shape) for b in c4.kv_buffer],
        "c4_record_bytes": [layout.record_bytes for layout in getattr(c4, "layouts", [])],
        "c4_page_size": c4.page_size,
        "c128_class": type(p.c128_kv_pool).__name__,
        "swa_class": type(p.swa_kv_pool).__name__,
        "c128_buffers": [list(b.shape) for b in p.c128_kv_pool.kv_buffer],
        "swa_buffers": [list(b.shape) for b in p.swa_kv_pool.kv_buffer],
        "indexer_page_size": p.c4_indexer_kv_pool.page_size,
        "indexer_buffers": [list(b.shape) for b in p.c4_indexer_kv_pool.index_k_with_scale_buffer],
        "mapping": [[m.compress_ratio, m.compress_layer_id] for m in p.layer_mapping],
    }


def configurator(budget: int, fp4_indexer: str = "off") -> dict:
    """Token capacity SGLang's DSV4PoolConfigurator computes for `budget` bytes at V4-Flash geometry."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    sa = server_args(FLASH_RATIOS, fp4_indexer)
    mc = ModelConfig.from_server_args(sa)
    ps = ParallelState(**{f.name: (1 if f.name.endswith("_size") else 0) for f in dataclasses.fields(ParallelState)})
    n = len(FLASH_RATIOS)
    kvc = KVCacheConfigurator(
        device="cpu", gpu_id=0, ps=ps, pp_group=None, model=None, model_config=mc, server_args=sa,
        kv_cache_dtype=torch.float8_e4m3fn, model_dtype=torch.bfloat16, page_size=sa.page_size,
        sliding_window_size=128, spec_algorithm=SpeculativeAlgorithm.NONE, is_draft_worker=False,
        post_capture_kv_active=False, spec_aux_config=None, is_hybrid_swa=True, is_hybrid_swa_compress=True,
        use_mla_backend=False, layer_info=ModelLayerInfo(start_layer=0, end_layer=n, num_effective_layers=n),
        forward_stream=None, req_to_token_pool=None, token_to_kv_pool_allocator=None, memory_pool_config=None,
        kv_cache_dtype_str="fp8_e4m3")
    conf = create_memory_pool_configurator(kvc)
    sizes = conf.calculate_pool_sizes(budget, sa.page_size)
    return {"class": type(conf).__name__, "bytes_per_full_token": conf.bytes_per_full_token,
            "max_total_num_tokens": sizes.max_total_num_tokens, "c4_tokens": sizes.c4_max_total_num_tokens,
            "max_running_requests": sa.max_running_requests, "page_size": sa.page_size,
            "swa_ratio": sa.swa_full_tokens_ratio}


def server_check(hicache: str, fp4_indexer: str = "off") -> dict:
    """check_server_args with --enable-hierarchical-cache (and the FP4 indexer) on or off:
    the error, if any."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    try:
        sa = server_args(TINY_RATIOS, fp4_indexer, enable_hierarchical_cache=hicache == "on")
        sa.check_server_args()
    except ValueError as e:
        return {"error": str(e)}
    except Exception as e:  # SGLang's own checks unrelated to Remnant
        return {"other": f"{type(e).__name__}: {e}"}
    return {"error": None}


def capture_patched() -> dict:
    """Load plugins; which of the packed-mode and capture-mode targets carry a wrapper."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from remnant.sglang import capture
    from remnant.sglang.plugin import TARGETS

    out = {"packed": {}, "capture": {}}
    for key, targets in (("packed", TARGETS), ("capture", capture.TARGETS)):
        for target, _, _ in targets:
            out[key][target] = hasattr(pkgutil.resolve_name(target), "__wrapped__")
    from sglang.srt.plugins.hook_registry import HookRegistry

    out["registered"] = sorted(f"{target} {hook.__module__}.{hook.__name__} {kind.value}"
                               for target, hooks in HookRegistry._hooks.items() for kind, hook, _ in hooks)
    return out


def capture_server_check(*flags: str) -> dict:
    """check_server_args of SGLang's own CLI parse of `flags` (after --model-path), with the
    plugin loaded: the error, if any."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    try:
        sa = prepare_server_args(["--model-path", write_config(TINY_RATIOS), "--device", "cpu",
                                  "--skip-tokenizer-init", *flags])
        publish(sa, role="scheduler")
        sa.check_server_args()
    except ValueError as e:
        return {"error": str(e)}
    except Exception as e:  # SGLang's own checks unrelated to Remnant
        return {"other": f"{type(e).__name__}: {e}"}
    return {"error": None}


def window() -> dict:
    """Kernel mode's window hooks on SGLang's own token pool (CPU; SGLang's Triton norm + RoPE
    under the interpreter): a CSA layer's window records kept-first, a window-only layer
    left to SGLang, natural-record writers refused, sparse-prefill dequantize in the order
    of the layer's q (folded or not)."""
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    server_args(TINY_RATIOS)
    import torch
    from sglang.kernels.ops.attention.dsv4.dequant_k_cache import dequantize_k_cache_paged

    from remnant.kv.paged import dequantize_kept_first, gather
    from remnant.sglang import fold, kernel_mode
    from remnant.sglang.buffers import native_layout

    from remnant.kv.layout import KeptColumns

    p = token_pool()
    g = torch.Generator().manual_seed(0)
    csa, window_only = 2, 0  # TINY_RATIOS: layer 2 is CSA, layer 0 window-only
    # A scattered keep (without a map the plugin keeps the prefix, whose order is the identity).
    keep = torch.randperm(448, generator=g)[:192].sort().values
    p.c4_kv_pool.keeps[p.layer_mapping[csa].compress_layer_id] = KeptColumns.of(keep, torch.device("cpu"))
    n, pos, locs = 20, torch.arange(5, 25), torch.arange(3, 23, dtype=torch.int32)
    kv = torch.randn(n, 512, generator=g).to(torch.bfloat16)
    weight = (torch.rand(512, generator=g) + 0.5).to(torch.bfloat16)
    table = torch.polar(torch.ones(64, 32), torch.rand(64, 32, generator=g) * 6)
    p.set_swa_key_buffer_radix_fused_norm_rope(csa, locs, kv, weight, 1e-6, table, pos)
    cols = kernel_mode.window_columns_of(p, csa)
    pages = p.swa_kv_pool.kv_buffer[csa]
    got = dequantize_kept_first(gather(pages, native_layout(p.swa_kv_pool.page_size), locs.long()), cols)
    want = fold.rms_norm_rope_reference(kv, weight, 1e-6, table, pos)
    err = ((got - want).abs() / want.abs().clamp_min(1.0)).max().item()
    untouched = kernel_mode.window_columns_of(p, window_only) is None
    refused = []
    for name, call in (("set_swa_key_buffer_radix", lambda: p.set_swa_key_buffer_radix(csa, locs, None)),
                       ("get_swa_raw_buffer", lambda: p.get_swa_raw_buffer(csa))):
        try:
            call()
        except RuntimeError as e:
            if "REMNANT_MODE=kernel" in str(e):
                refused.append(name)
    # Sparse prefill reads the window through SGLang's dequantize: kept-first records give
    # kept-first columns, which a folded layer's q matches; an unfolded layer's are put back.
    ids = locs.long()
    read = lambda: dequantize_k_cache_paged(p.get_swa_key_buffer_radix(csa), ids, p.swa_kv_pool.page_size)
    kernel_mode._FOLDED.add(csa)
    folded_read = read().float().reshape(n, 512)
    kernel_mode._FOLDED.discard(csa)
    natural_read = read().float().reshape(n, 512)
    order = cols.order.long()
    assert not torch.equal(order, torch.arange(512))
    return {
        "csa_kept_first_max_err": err,
        "native_window_layer_untouched": untouched,
        "refused": refused,
        "prefill_folded_equal": bool(torch.allclose(folded_read, got[:, order], rtol=1e-2, atol=1e-2)),
        "prefill_natural_equal": bool(torch.allclose(natural_read, got, rtol=1e-2, atol=1e-2)),
    }


def packed_window() -> dict:
    """The window hooks with REMNANT_WINDOW_RECORDS=packed_csa on SGLang's own token pool
    (CPU; SGLang's Triton norm + RoPE and its dequantize under the interpreter): a CSA
    layer's window records packed with its C4 keep list, a window-only layer left to
    SGLang, SGLang's quantized writer packed, its native raw writer refused, and its
    sparse-prefill dequantize given the reconstructed records, in the order of the layer's
    q (folded or not)."""
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    server_args(TINY_RATIOS)
    import torch
    from sglang.kernels.ops.attention.dsv4.dequant_k_cache import dequantize_k_cache_paged
    from sglang.kernels.ops.attention.dsv4.index_buf_accessor import NopeFp8RopeBf16Pack

    from remnant.kv.attention import packed_keys
    from remnant.kv.codec import dequantize, quantize
    from remnant.kv.layout import keep_tensor
    from remnant.kv.packing import pack, unpack
    from remnant.kv.paged import gather
    from remnant.sglang import fold, kernel_mode
    from remnant.sglang.pool import PackedC4Pool, packed_window_of

    p = token_pool()
    g = torch.Generator().manual_seed(0)
    csa, other_csa, window_only = 2, 4, 0  # TINY_RATIOS: layers 2, 4 are CSA, 0 window-only
    window, local = packed_window_of(p, csa)
    keep = keep_tensor(window.keeps[local])
    c4_keep = keep_tensor(p.c4_kv_pool.keeps[p.layer_mapping[csa].compress_layer_id])
    n, pos, locs = 20, torch.arange(5, 25), torch.arange(3, 23, dtype=torch.int32)
    kv = torch.randn(n, 512, generator=g).to(torch.bfloat16)
    weight = (torch.rand(512, generator=g) + 0.5).to(torch.bfloat16)
    table = torch.polar(torch.ones(64, 32), torch.rand(64, 32, generator=g) * 6)
    p.set_swa_key_buffer_radix_fused_norm_rope(csa, locs, kv, weight, 1e-6, table, pos)
    stored = gather(window.kv_buffer[local], window.layouts[local], locs.long())
    want = fold.rms_norm_rope_reference(kv, weight, 1e-6, table, pos)
    kept = torch.cat([keep, torch.arange(448, 512)])
    got = packed_keys(stored, keep)  # the kept coordinates, then RoPE
    err = ((got - want[:, kept]).abs() / want[:, kept].abs().clamp_min(1.0)).max().item()
    # SGLang's quantized writer (already-quantized natural records): packing copies codes.
    rec = quantize(torch.randn(n, 512, generator=g) * 3)
    sg_pack = NopeFp8RopeBf16Pack(k_nope_fp8=rec[:, :448].view(torch.float8_e4m3fn),
                                  k_rope_bf16=rec[:, 448:576].view(torch.bfloat16), scale_k_nope_ue8m0=rec[:, 576:583])
    window2, local2 = packed_window_of(p, other_csa)
    p.set_swa_key_buffer_radix(other_csa, locs, sg_pack)
    keep2 = keep_tensor(window2.keeps[local2])
    quantized_packed = torch.equal(gather(window2.kv_buffer[local2], window2.layouts[local2], locs.long()),
                                   pack(rec, keep2))
    refused = []
    try:
        p.get_swa_raw_buffer(csa)
    except RuntimeError as e:
        if "REMNANT_WINDOW_RECORDS=packed_csa" in str(e):
            refused.append("get_swa_raw_buffer")
    # Sparse prefill: SGLang's dequantize of the packed window reads reconstructed records.
    ids = locs.long()
    rebuilt = dequantize(unpack(stored, keep)).reshape(n, 512)
    read = lambda: dequantize_k_cache_paged(p.get_swa_key_buffer_radix(csa), ids, p.swa_kv_pool.page_size)
    natural_read = read().float().reshape(n, 512)
    kernel_mode._FOLDED.add(csa)
    folded_read = read().float().reshape(n, 512)
    kernel_mode._FOLDED.discard(csa)
    order = window.keeps[local].order.long()
    kernel = isinstance(p.c4_kv_pool, PackedC4Pool) and p.c4_kv_pool.mode == "kernel"
    return {
        "swa_class": type(p.swa_kv_pool).__name__,
        "window_keep_is_c4_keep": bool(torch.equal(keep, c4_keep)),
        "window_only_packed": packed_window_of(p, window_only) is not None,
        "kept_first_columns": kernel_mode.window_columns_of(p, csa) is not None,
        "norm_rope_max_err": err,
        "quantized_packed": quantized_packed,
        "refused": refused,
        "prefill_natural_equal": bool(torch.allclose(natural_read, rebuilt, rtol=1e-2, atol=1e-2)),
        "prefill_folded_equal": bool(torch.allclose(folded_read, rebuilt[:, order] if kernel else rebuilt,
                                                    rtol=1e-2, atol=1e-2)),
    }


if __name__ == "__main__":
    check, *args = sys.argv[1:]
    fn = {"patched": patched, "pool": pool, "configurator": configurator, "server_check": server_check,
          "capture_patched": capture_patched, "capture_server_check": capture_server_check,
          "window": window, "packed_window": packed_window}[check]
    result = fn(*[int(a) if a.isdigit() else a for a in args])
    print("PROBE " + json.dumps(result))
