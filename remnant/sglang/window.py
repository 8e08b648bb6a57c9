"""The hooks on SGLang's window (SWA) record writers: each CSA layer's window records go
to the form the settings give them.

- Packed (retention.window_records=packed_csa, triton and kernel mode): the layer's
  records in a PackedWindowPool layer, R + 72 bytes with its C4 keep list
  (remnant.sglang.pool). SGLang's fused store and its quantized writers reach the pool's
  own set_key_buffer_fused / set_key_buffer, which pack (packing SGLang's quantized codes
  is a copy: lossless); the CUDA path's fused norm + RoPE + store writes native pages
  itself, so its hook runs SGLang's norm + RoPE and then the packed store.
- Kept-first (kernel mode with native windows): remnant.sglang.kernel_mode.
- Otherwise (window-only and HCA layers, triton mode's native windows): SGLang's own.

Writers that would put native records on a packed or kept-first layer are refused with
an error naming the path.
"""

from __future__ import annotations

from remnant.sglang.kernel_mode import store_kept_first, window_columns_of


def _norm_rope(kv, kv_weight, eps, freqs_cis, positions):
    """SGLang's own norm + RoPE of window latents (fused_norm_rope_inplace_triton), in
    float32 as its fused kernel keeps its registers, on a copy (the kernel writes in place)."""
    import torch
    from sglang.kernels.ops.attention.deepseek_v4_rope import fused_norm_rope_inplace_triton

    latents = kv.to(torch.float32).contiguous()
    if latents.data_ptr() == kv.data_ptr():
        latents = latents.clone()
    fused_norm_rope_inplace_triton(latents, kv_weight, eps, freqs_cis, positions)
    return latents


def window_store_norm_rope(original, pool, layer_id, swa_loc, kv, kv_weight, eps, freqs_cis, positions):
    """DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused_norm_rope (the CUDA path's
    window write, MQALayer._compute_kv_to_cache): on a CSA layer with packed or kept-first
    window records, SGLang's own norm + RoPE and then that layer's store, instead of its
    fused native store."""
    from remnant.sglang.pool import packed_window_of

    packed = packed_window_of(pool, layer_id)
    cols = None if packed is not None else window_columns_of(pool, layer_id)
    if packed is None and cols is None:
        return original(pool, layer_id, swa_loc, kv, kv_weight, eps, freqs_cis, positions)
    latents = _norm_rope(kv, kv_weight, eps, freqs_cis, positions)
    if packed is not None:
        window, local = packed
        window.set_key_buffer_fused(local, swa_loc, latents)
    else:
        store_kept_first(pool, layer_id, latents, swa_loc, cols)


def window_store_fused(original, pool, layer_id, swa_loc, cache_k):
    """DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused (the backend's store_cache:
    SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE, the attention forward's save_kv_cache): bf16
    latents stored kept-first on a kernel-mode CSA layer; a packed window's pool packs
    them itself (SGLang's call reaches PackedWindowPool.set_key_buffer_fused)."""
    cols = window_columns_of(pool, layer_id)
    if cols is None:
        return original(pool, layer_id, swa_loc, cache_k)
    store_kept_first(pool, layer_id, cache_k, swa_loc, cols)


def window_store_quantized(original, pool, layer_id, loc, cache_nope_fp8_rope_bf16_pack):
    """DeepSeekV4TokenToKVPool.set_swa_key_buffer(_radix): already-quantized natural records
    (no CUDA serving path of sglang 0.5.18 calls them). A packed window's pool packs them
    (a copy of codes); refused on kernel-mode kept-first CSA layers: re-quantizing them in
    another column order would round twice."""
    if window_columns_of(pool, layer_id) is None:
        return original(pool, layer_id, loc, cache_nope_fp8_rope_bf16_pack)
    raise RuntimeError(f"remnant: REMNANT_MODE=kernel stores CSA layer {layer_id}'s window records kept-first from "
                       f"bf16 latents; this SGLang path writes quantized natural records "
                       f"(set_swa_key_buffer / set_swa_key_buffer_radix) and is not supported")


def window_raw_buffer(original, pool, layer_id):
    """DeepSeekV4TokenToKVPool.get_swa_raw_buffer: only the fused q/kv norm-rope-store of
    HIP (SGLANG_OPT_USE_FUSED_QK_NORM_ROPE) reads it, to write native window records;
    refused on CSA layers whose window records are packed or kept-first."""
    from remnant.sglang.pool import packed_window_of

    if packed_window_of(pool, layer_id) is not None:
        form = "packed (REMNANT_WINDOW_RECORDS=packed_csa)"
    elif window_columns_of(pool, layer_id) is not None:
        form = "kept-first (REMNANT_MODE=kernel)"
    else:
        return original(pool, layer_id)
    raise RuntimeError(f"remnant: CSA layer {layer_id}'s window records are stored {form}; SGLang's fused q/kv "
                       f"norm-rope-store (HIP, SGLANG_OPT_USE_FUSED_QK_NORM_ROPE) writes them natively and is not "
                       f"supported")
