"""Kernel mode inside SGLang: the folded call the SM90 packed decode takes.

The packed decode's fast kernel takes q, its output and a CSA layer's window records in
kept-first column order (remnant.kv.layout.KeptColumns.order). Kernel mode therefore folds
that order into each CSA layer's wq_b (output rows) and wo_a (input columns) as the
checkpoint streams in (fold_weights, remnant.sglang.fold), stores the CSA layers' window
records kept-first (window_store_*), refuses SGLang's paths that would write natural window
records on them, and tells the plugin's readers which layers are folded (folded) and which
buffer is a kept-first window (window_of), so that decode makes the folded call and sparse
prefill gets columns in the order of each layer's q (remnant.sglang.plugin).
"""

from __future__ import annotations

import logging

from remnant.kv.formats import CSA_RATIO
from remnant.kv.modes import mode_of
from remnant.sglang.retention_plan import retention_plan
from remnant.sglang.settings import active

logger = logging.getLogger("remnant.sglang.plugin")  # the plugin's log, as before the split

#: Model layers of this process whose wq_b and wo_a kernel mode folded (fold_weights):
#: their q and attention output are kept-first. A loader that bypasses load_weights (dummy
#: weights) leaves a layer natural, and the hooks then keep natural q/out order for it.
_FOLDED: set[int] = set()


def kernel_mode() -> bool:
    return mode_of(active().mode).direct_decode


def folded(layer_id: int) -> bool:
    """Whether model layer `layer_id`'s wq_b and wo_a were folded (q and out kept-first)."""
    return layer_id in _FOLDED


def fold_weights(original, model, weights, *args, is_nextn=False, **kwargs):
    """DeepseekV4ForCausalLM.load_weights: in kernel mode, each CSA layer's wq_b (output rows)
    and wo_a (input columns) folded per head with its kept-first order as the checkpoint
    streams in (remnant.sglang.fold.CheckpointFold), before SGLang shards, quantizes or
    re-lays them out. The MTP draft (is_nextn) has no CSA layer and is left alone."""
    if args:
        is_nextn = args[0]
    if is_nextn or not kernel_mode():
        return original(model, weights, is_nextn=is_nextn, **kwargs)
    import torch

    from remnant.kv.layout import KeptColumns
    from remnant.sglang.fold import CheckpointFold

    _, keeps = retention_plan(active(), list(model.config.compress_ratios))
    fold = CheckpointFold({i: KeptColumns.of(keep, torch.device("cpu")).order for i, keep in keeps.items()})
    result = original(model, fold(weights), is_nextn=is_nextn, **kwargs)
    _FOLDED.update(fold.layers())
    logger.info("remnant: kernel mode folded the kept-first column order into wq_b and wo_a of CSA layers %s",
                fold.layers())
    return result


#: DeepSeek-V4 token pools of this process (check_token_pool adds them): the window buffer
#: a prefill dequantize reads is found among theirs.
_TOKEN_POOLS = None


def token_pools():
    global _TOKEN_POOLS
    if _TOKEN_POOLS is None:
        import weakref

        _TOKEN_POOLS = weakref.WeakSet()
    return _TOKEN_POOLS


def window_columns_of(pool, layer_id: int):
    """The KeptColumns of model layer `layer_id`'s window records where kernel mode stores
    them kept-first (a CSA layer of a packed kernel-mode pool), else None."""
    from remnant.sglang.pool import PackedC4Pool

    c4 = getattr(pool, "c4_kv_pool", None)
    if not isinstance(c4, PackedC4Pool) or not mode_of(c4.mode).direct_decode:
        return None
    item = pool.layer_mapping[layer_id]
    if item is None or item.compress_ratio != CSA_RATIO:
        return None
    return c4.keeps[item.compress_layer_id]


def _window_pages(pool, layer_id: int):
    """(uint8 pages, tokens per page) of model layer `layer_id`'s window records."""
    return pool.swa_kv_pool.kv_buffer[pool._swa_local_layer_id(layer_id)], pool.swa_kv_pool.page_size


def window_store_norm_rope(original, pool, layer_id, swa_loc, kv, kv_weight, eps, freqs_cis, positions):
    """DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused_norm_rope (the CUDA path's
    window write, MQALayer._compute_kv_to_cache): on a kernel-mode CSA layer, SGLang's own
    norm + RoPE (fused_norm_rope_inplace_triton, in float32 as the fused kernel keeps its
    registers) and then a kept-first store, instead of its fused native store."""
    cols = window_columns_of(pool, layer_id)
    if cols is None:
        return original(pool, layer_id, swa_loc, kv, kv_weight, eps, freqs_cis, positions)
    import torch
    from sglang.kernels.ops.attention.deepseek_v4_rope import fused_norm_rope_inplace_triton

    from remnant.sglang.buffers import store_window_kept_first

    latents = kv.to(torch.float32).contiguous()  # a new tensor: the kernel writes in place
    if latents.data_ptr() == kv.data_ptr():
        latents = latents.clone()
    fused_norm_rope_inplace_triton(latents, kv_weight, eps, freqs_cis, positions)
    pages, per_page = _window_pages(pool, layer_id)
    store_window_kept_first(latents, pages, per_page, swa_loc, cols)


def window_store_fused(original, pool, layer_id, swa_loc, cache_k):
    """DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused (the backend's store_cache:
    SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE, the attention forward's save_kv_cache): bf16
    latents stored kept-first on a kernel-mode CSA layer."""
    cols = window_columns_of(pool, layer_id)
    if cols is None:
        return original(pool, layer_id, swa_loc, cache_k)
    from remnant.sglang.buffers import store_window_kept_first

    pages, per_page = _window_pages(pool, layer_id)
    store_window_kept_first(cache_k, pages, per_page, swa_loc, cols)


def window_store_quantized(original, pool, layer_id, loc, cache_nope_fp8_rope_bf16_pack):
    """DeepSeekV4TokenToKVPool.set_swa_key_buffer(_radix): already-quantized natural records
    (no CUDA serving path of sglang 0.5.18 calls them); refused on kernel-mode CSA layers,
    whose window records are kept-first: re-quantizing them would round twice."""
    if window_columns_of(pool, layer_id) is None:
        return original(pool, layer_id, loc, cache_nope_fp8_rope_bf16_pack)
    raise RuntimeError(f"remnant: REMNANT_MODE=kernel stores CSA layer {layer_id}'s window records kept-first from "
                       f"bf16 latents; this SGLang path writes quantized natural records "
                       f"(set_swa_key_buffer / set_swa_key_buffer_radix) and is not supported")


def window_raw_buffer(original, pool, layer_id):
    """DeepSeekV4TokenToKVPool.get_swa_raw_buffer: only the fused q/kv norm-rope-store of
    HIP (SGLANG_OPT_USE_FUSED_QK_NORM_ROPE) reads it, to write natural window records;
    refused on kernel-mode CSA layers."""
    if window_columns_of(pool, layer_id) is None:
        return original(pool, layer_id)
    raise RuntimeError(f"remnant: REMNANT_MODE=kernel stores CSA layer {layer_id}'s window records kept-first; "
                       f"SGLang's fused q/kv norm-rope-store (HIP, SGLANG_OPT_USE_FUSED_QK_NORM_ROPE) writes them "
                       f"natively and is not supported")


def window_of(tensor):
    """(token pool, model layer) whose kernel-mode kept-first window buffer `tensor` views."""
    for pool in list(token_pools()):
        if getattr(pool, "swa_kv_pool", None) is None:
            continue
        for layer_id in range(pool._stage_start, pool._stage_end):
            if window_columns_of(pool, layer_id) is not None and \
                    _window_pages(pool, layer_id)[0].data_ptr() == tensor.data_ptr():
                return pool, layer_id
    return None


def permute_columns(x, index) -> None:
    """x [..., 512] with its last dim taken at `index` [512], in place."""
    import torch

    x.copy_(x.index_select(-1, index.to(device=x.device, dtype=torch.long)))
