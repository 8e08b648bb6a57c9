"""SGLang general plugin: Remnant's packed C4 records inside SGLang's DeepSeek-V4 runtime.

SGLang (0.5.18) calls `register` through the entry point group `sglang.srt.plugins`
(pyproject.toml) in every process it starts, then applies the hooks registered with its
HookRegistry. With REMNANT_MODE=native (the default) `register` registers nothing, so
SGLang runs untouched; native with REMNANT_CAPTURE registers the capture hooks
(remnant.sglang.capture, which records calibration captures and changes nothing the server
computes), native with REMNANT_INDEX_KEY_FORMAT=mxfp4 the two sizing hooks
(SIZING_TARGETS). In triton and kernel mode it registers (TARGETS):

- DeepSeekV4TokenToKVPool._make_kv_pool (AROUND): the C4 pool becomes a PackedC4Pool;
  with REMNANT_WINDOW_RECORDS=packed_csa the window pool a PackedWindowPool (each CSA
  layer's window records packed with its C4 keep list, R + 72 bytes; the others native).
- DeepSeekV4TokenToKVPool.__init__ (AFTER): refuses a KV pool without the packed pools.
- DSV4PoolConfigurator._get_bytes_per_full_token (AROUND): the C4 term counts R + 72
  bytes per record instead of 584 (and with packed_csa the CSA layers' window term too),
  and with SGLang's --enable-deepseek-v4-fp4-indexer the
  indexer term the pool's 68 bytes a key instead of 132 (remnant.sglang.sizing), so the
  freed bytes become tokens. Native mode with REMNANT_INDEX_KEY_FORMAT=mxfp4 registers
  this hook and the server-args check only (SIZING_TARGETS).
- CompressorBackendMixin._forward_compress_all_in_one (AROUND): the C4 compressor's fused
  kernel writes its bf16 latents to a scratch (its own bf16_store path) and
  remnant.kernels.dispatch.store quantizes and packs them into the pool.
- DeepseekV4AttnBackend.forward (AROUND), CSA layers on the FlashMLA decode path:
  triton mode reconstructs each query's selected records (C4, and with packed_csa the
  window's) into native pages and runs the stock forward on them; kernel mode attends the
  packed records directly (remnant.kernels.decode.decode; a packed window with
  window_columns="packed"). Window-only and C128 layers run unchanged.
- dequantize_k_cache_paged (AROUND), the sparse-prefill path (both modes): the packed
  records a prefill chunk reads (C4, and packed CSA windows) are reconstructed into native
  pages first. In kernel mode the dequantized columns are put in the order of the layer's
  q: kept-first where its weights were folded (reconstructed records permuted, kept-first
  window records as they are), natural where not (kept-first window records permuted back).
- The window writers (remnant.sglang.window):
  DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused_norm_rope (AROUND), the CUDA
  path's fused norm + RoPE + native store: on a CSA layer with packed or kept-first window
  records, SGLang's Triton norm + RoPE and then that layer's store;
  set_swa_key_buffer_radix_fused (AROUND): bf16 latents stored kept-first (a packed
  window's pool packs them itself); set_swa_key_buffer, set_swa_key_buffer_radix
  (already-quantized natural records: packed by a packed window's pool, refused on
  kept-first layers) and get_swa_raw_buffer (HIP's fused store: refused on packed and
  kept-first layers), since they would write native records. Kept-first window records
  are kernel mode's with native windows (REMNANT_WINDOW_RECORDS=native).
- Kernel mode only: DeepseekV4ForCausalLM.load_weights (AROUND): the checkpoint's
  CSA-layer wq_b and wo_a folded with the kept-first column order (remnant.sglang.fold),
  so q and the attention output come out kept-first and decode makes the folded call (the
  SM90 kernel's, with kept-first or packed windows, where it runs; else the Triton kernel's).
- ServerArgs.check_server_args (AFTER): HiCache, HiSparse, context parallelism and
  sparse prefill against the mode and retention; REMNANT_INDEX_KEY_FORMAT=mxfp4 against
  --enable-deepseek-v4-fp4-indexer.
"""

from __future__ import annotations

import logging
import math

from remnant.config_errors import ConfigError
from remnant.kv.formats import CSA_RATIO
from remnant.kv.modes import mode_of
from remnant.sglang.kernel_mode import fold_weights, folded, permute_columns, token_pools, window_columns_of, window_of
from remnant.sglang.layers import stage_csa_layers
from remnant.sglang.retention_plan import packed_c4_bytes, retention_plan
from remnant.sglang.settings import activate, active, capture_from_env, check_sglang_version, from_env
from remnant.sglang.sizing import freed_per_full_token
from remnant.sglang.window import window_raw_buffer, window_store_fused, window_store_norm_rope, window_store_quantized

logger = logging.getLogger(__name__)

_POOL = "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool"
_CONFIGURATOR = "sglang.srt.model_executor.pool_configurator.DSV4PoolConfigurator"
_COMPRESSOR = "sglang.srt.layers.attention.dsv4.compressor_v2.CompressorBackendMixin"
_BACKEND = "sglang.srt.layers.attention.deepseek_v4_backend.DeepseekV4AttnBackend"
_DEQUANT = "sglang.kernels.ops.attention.dsv4.dequant_k_cache.dequantize_k_cache_paged"
_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
_MODEL = "sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM"

def installed_sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def register() -> None:
    """SGLang's entry point: read the settings and register the hooks they need: in triton
    or kernel mode all of them (TARGETS); in native mode with MXFP4 index keys
    (REMNANT_INDEX_KEY_FORMAT=mxfp4) only the sizing hooks (SIZING_TARGETS); in native
    mode with REMNANT_CAPTURE the capture hooks (remnant.sglang.capture) too.

    A bad setting (a packed mode with REMNANT_CAPTURE too) or an unsupported sglang raises
    SystemExit with a one-line reason: SGLang's loader logs and swallows ordinary
    exceptions, which would serve native records while the user asked for packed ones.
    """
    try:
        s = from_env()
        capture = capture_from_env(s)
        if s.resizes or capture is not None:
            check_sglang_version(installed_sglang_version())
    except (ConfigError, RuntimeError) as e:
        raise SystemExit(f"remnant: {e}") from None
    activate(s)
    if capture is None and not s.resizes:
        logger.info("remnant: REMNANT_MODE=native; no hooks registered, SGLang runs unchanged")
        return
    from sglang.srt.plugins.hook_registry import HookRegistry

    if capture is not None:
        from remnant.sglang import capture as capture_mode

        capture_mode.configure(capture)
        for target, hook, hook_type in capture_mode.targets():
            HookRegistry.register(target, hook, hook_type)
        logger.info("remnant: REMNANT_MODE=native with capture into %s: %d capture hooks registered",
                    capture.path, len(capture_mode.TARGETS))
    if not s.resizes:
        return
    chosen = targets() if s.packed else targets(SIZING_TARGETS)
    for target, hook, hook_type in chosen:
        HookRegistry.register(target, hook, hook_type)
    logger.info("remnant: mode=%s retention=%s map=%s index_keys=%s: %d hooks registered", s.mode,
                ",".join(map(str, s.retention)), s.map_path, s.index_key_format, len(chosen))


def targets(chosen: list | None = None) -> list[tuple[str, object, object]]:
    """(dotted target, hook, HookType) of every hook of `chosen` (default: TARGETS), as
    HookRegistry.register takes them."""
    from sglang.srt.plugins.hook_registry import HookType

    kinds = {"around": HookType.AROUND, "after": HookType.AFTER}
    return [(target, hook, kinds[kind]) for target, hook, kind in (TARGETS if chosen is None else chosen)]


# ---------------------------------------------------------------------------------------
# Hooks


def make_kv_pool(original, pool, **kwargs):
    """DeepSeekV4TokenToKVPool._make_kv_pool: the C4 call (the only one passing `cls`) builds
    a PackedC4Pool; with window_records=packed_csa the window call (the only one whose page
    is its model-wide page: global_page_size == page_size) a PackedWindowPool."""
    if "cls" in kwargs:
        return _c4_pool(pool, **kwargs)
    if active().packed_windows and kwargs.get("global_page_size") == kwargs["page_size"] and stage_csa_layers(pool):
        return _window_pool(pool, **kwargs)  # a stage without CSA layers (MTP's draft) keeps SGLang's
    return original(pool, **kwargs)


def _plan(pool):
    """retention_plan of the token pool's model, made once per token pool (both packed
    pools ask, and without a map it warns)."""
    plan = getattr(pool, "_remnant_retention_plan", None)
    if plan is None:
        plan = retention_plan(active(), list(pool.compression_ratios))
        pool._remnant_retention_plan = plan
    return plan


def _c4_pool(pool, **kwargs):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4SingleKVPool

    from remnant.sglang.pool import PackedC4Pool

    if kwargs["cls"] is not DeepSeekV4SingleKVPool:
        raise ConfigError(f"remnant: the C4 pool class {kwargs['cls'].__name__} (HiSparse) is not supported with "
                          f"REMNANT_MODE={active().mode}; allowed: SGLang's DeepSeekV4SingleKVPool")
    values, keeps = _plan(pool)
    stage = stage_csa_layers(pool)
    if len(stage) != kwargs["layer_num"]:
        raise RuntimeError(f"remnant: C4 pool of {kwargs['layer_num']} layers, but the stage has CSA layers {stage}")
    packed = PackedC4Pool(
        kwargs["size"], kwargs["page_size"], kwargs["dtype"], pool.qk_nope_head_dim, pool.qk_rope_head_dim,
        kwargs["layer_num"], kwargs["device"], kwargs["enable_memory_saver"],
        retentions=[values[i] for i in stage], keeps=[keeps[i] for i in stage], mode=active().mode,
    )
    packed.model_layers = list(stage)  # C4 layer -> model layer (dequantize_paged asks whether it is folded)
    return packed


def _window_pool(pool, **kwargs):
    """The stage's window pool: each CSA layer's records packed with its C4 keep list, the
    other layers' native (NATIVE retention, no keep)."""
    from remnant.sglang.buffers import NATIVE
    from remnant.sglang.pool import PackedWindowPool

    values, keeps = _plan(pool)
    stage = list(range(pool._stage_start, pool._stage_end))
    if len(stage) != kwargs["layer_num"]:
        raise RuntimeError(f"remnant: window pool of {kwargs['layer_num']} layers, but the stage has layers {stage}")
    window = PackedWindowPool(
        kwargs["size"], kwargs["page_size"], kwargs["dtype"], pool.qk_nope_head_dim, pool.qk_rope_head_dim,
        kwargs["layer_num"], kwargs["device"], kwargs["enable_memory_saver"],
        retentions=[values.get(i, NATIVE) for i in stage], keeps=[keeps.get(i) for i in stage], mode=active().mode,
    )
    window.model_layers = stage  # SWA-local layer -> model layer
    return window


def check_token_pool(result, pool, *args, **kwargs):
    """DeepSeekV4TokenToKVPool.__init__: a stage with CSA layers must hold the packed pools."""
    from remnant.sglang.pool import PackedC4Pool, PackedWindowPool

    has_csa = any(r == CSA_RATIO for r in pool.compression_ratios[pool._stage_start:pool._stage_end])
    token_pools().add(pool)
    if has_csa and not isinstance(pool.c4_kv_pool, PackedC4Pool):
        raise RuntimeError(f"remnant: REMNANT_MODE={active().mode} needs SGLang's paged C4 pool, but this KV pool "
                           f"has c4_kv_pool={type(pool.c4_kv_pool).__name__} (unified KV layout?)")
    if has_csa and active().packed_windows and not isinstance(pool.swa_kv_pool, PackedWindowPool):
        raise RuntimeError(f"remnant: REMNANT_WINDOW_RECORDS=packed_csa needs SGLang's paged window pool, but this "
                           f"KV pool has swa_kv_pool={type(pool.swa_kv_pool).__name__}")


def bytes_per_full_token(original, configurator):
    """DSV4PoolConfigurator._get_bytes_per_full_token less what SGLang counts and the
    plugin's pools do not store (remnant.sglang.sizing): packed C4 records (and the CSA
    layers' packed window records), and MXFP4 index keys at their pool's size when SGLang's
    FP4 indexer is on."""
    from sglang.srt.runtime_context import get_exec

    s = active()
    # The flag as DeepSeekV4IndexerPool reads it, so the count follows what the pool stores.
    fp4 = bool(get_exec().kernel.enable_deepseek_v4_fp4_indexer)
    if s.index_key_format == "mxfp4" and not fp4:
        raise ConfigError("remnant: REMNANT_INDEX_KEY_FORMAT=mxfp4 needs SGLang's --enable-deepseek-v4-fp4-indexer "
                          "(its indexer pool stores FP8 keys without it)")
    has_c4 = s.packed and configurator.num_layers_ca4 > 0  # a pipeline stage may have no CSA layer
    packed = packed_c4_bytes(list(configurator.compression_ratios), s) if has_c4 else []
    return original(configurator) - sum(freed_per_full_token(configurator, s, packed, fp4).values())


def compress_store(original, backend, **kwargs):
    """CompressorBackendMixin._forward_compress_all_in_one: C4 records into the packed pool.

    SGLang's fused kernel (compress, norm, RoPE) writes the bf16 latents of this step's
    tokens to a scratch through its own bf16_store path, row i for token i; then
    remnant.kernels.dispatch.store quantizes (SGLang's UE8M0 FP8 quantizer) and packs them at
    the tokens' C4 locations. Tokens that close no C4 record carry location 0, SGLang's
    null slot, exactly as in the native write.
    """
    import torch

    from remnant.sglang.pool import pool_of

    found = None
    if not kwargs.get("is_indexer") and kwargs.get("compress_ratio") == CSA_RATIO:
        found = pool_of(kwargs["kv_cache"])
    if found is None:
        return original(backend, **kwargs)
    pool, layer = found
    out_loc = kwargs["out_loc"]
    n = out_loc.shape[0]
    latents = torch.zeros(n, 512, dtype=torch.bfloat16, device=out_loc.device)
    rows = torch.arange(n, dtype=out_loc.dtype, device=out_loc.device)
    original(backend, **{**kwargs, "kv_cache": latents.view(torch.uint8), "page_size": 1, "out_loc": rows,
                         "bf16_store": True})
    pool.set_key_buffer_fused(layer, out_loc, latents)


def _rows(x, n: int, fill: int):
    """x [m, ...] flattened to [m, w], cut or padded (with `fill`) to n rows, as the backend's
    match_num_queries does for its FlashMLA arguments."""
    import torch

    if x is None:
        return None
    x = x.reshape(x.shape[0], -1)
    if x.shape[0] >= n:
        return x[:n]
    pad = torch.full((n - x.shape[0], x.shape[1]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad])


def takes_sparse_prefill(q, forward_batch) -> bool:
    """Whether DeepseekV4AttnBackend.forward goes to _forward_prefill_sparse (its own test)."""
    from sglang.srt.environ import envs
    from sglang.srt.layers.attention import deepseek_v4_backend as b

    return bool(forward_batch.forward_mode.is_extend_without_speculative() and not b._is_sm120
                and (q.shape[0] > b._LARGE_INDEXER_QUERY_THRESHOLD or envs.SGLANG_OPT_FLASHMLA_SPARSE_PREFILL.get()))


def _staged_pages(pool, layer: int, indices):
    """Triton mode: the records `indices` [T, K] selects from `pool`'s packed `layer`,
    reconstructed into fresh native pages (remnant.sglang.buffers.stage_selected); returns
    (pages, the indices that read them there)."""
    import torch

    from remnant.sglang.buffers import native_layout, stage_selected

    layout = native_layout(pool.page_size)
    pages = math.ceil(indices.numel() / pool.page_size)
    scratch = torch.empty(max(pages, 1), layout.page_stride, dtype=torch.uint8, device=indices.device)
    remapped = stage_selected(pool.kv_buffer[layer], pool.layouts[layer], pool.keeps[layer], indices, scratch,
                              pool.page_size)
    return scratch, remapped


def attention_forward(original, backend, q, k, v, layer, forward_batch, compress_ratio, save_kv_cache=True,
                      attn_sink=None, **kwargs):
    """DeepseekV4AttnBackend.forward for CSA layers over packed records (see the module doc)."""
    from contextlib import ExitStack

    from sglang.srt.layers.attention.deepseek_v4_backend import DSV4AttnMetadata

    from remnant.sglang.buffers import decode_c4_packed, mask_by_length
    from remnant.sglang.pool import PackedC4Pool, packed_window_of

    def stock(save=save_kv_cache):
        return original(backend, q, k, v, layer, forward_batch, compress_ratio, save_kv_cache=save,
                        attn_sink=attn_sink, **kwargs)

    kv = backend.token_to_kv_pool
    pool = getattr(kv, "c4_kv_pool", None)
    meta = getattr(backend.forward_metadata, "core_attn_metadata", None)
    if (compress_ratio != CSA_RATIO or not isinstance(pool, PackedC4Pool) or not isinstance(meta, DSV4AttnMetadata)
            or forward_batch.forward_mode.is_idle() or takes_sparse_prefill(q, forward_batch)):
        return stock()
    c4_layer = kv.layer_mapping[layer.layer_id].compress_layer_id
    window = packed_window_of(kv, layer.layer_id)  # (PackedWindowPool, its layer) with window_records=packed_csa
    queries = q.reshape(q.shape[0], q.shape[-2], q.shape[-1])
    n = queries.shape[0]
    indices = _rows(meta.c4_sparse_page_indices, n, -1)
    if save_kv_cache and (window is not None or mode_of(pool.mode).direct_decode):
        # This step's window records go in before they are read (or staged) below.
        backend.store_cache(layer.layer_id, k, forward_batch)
        save_kv_cache = False
    if mode_of(pool.mode).direct_decode:
        return decode_c4_packed(
            queries, pool.kv_buffer[c4_layer], pool.layouts[c4_layer], pool.keeps[c4_layer],
            indices, _rows(meta.c4_sparse_topk_lengths, n, 1),
            kv.get_swa_key_buffer_radix(layer.layer_id), kv.swa_kv_pool.page_size,
            _rows(meta.swa_page_indices, n, 0), _rows(meta.swa_topk_lengths, n, 1),
            attn_sink, backend.softmax_scale,
            # q and the output are kept-first where fold_weights folded the layer: the folded
            # call. Window records are packed with the layer's keep (packed_csa), else kept-first
            # (remnant.sglang.window).
            columns="kept_first" if folded(layer.layer_id) else "natural",
            window_columns="kept_first" if window is None else "packed",
        )
    saved = meta.c4_sparse_page_indices, meta.swa_page_indices
    try:
        with ExitStack() as staged:
            scratch, meta.c4_sparse_page_indices = _staged_pages(pool, c4_layer, indices)
            staged.enter_context(pool.staged(c4_layer, scratch))
            if window is not None:
                # Entries past a row's length may point anywhere: none is reconstructed.
                swa_indices = mask_by_length(_rows(meta.swa_page_indices, n, 0), _rows(meta.swa_topk_lengths, n, 1))
                window_pool, local = window
                swa_scratch, meta.swa_page_indices = _staged_pages(window_pool, local, swa_indices)
                staged.enter_context(window_pool.staged(local, swa_scratch))
            return stock(save_kv_cache)
    finally:
        meta.c4_sparse_page_indices, meta.swa_page_indices = saved


def dequantize_paged(original, quant_k_cache, page_table_1_flattened, page_size, out=None):
    """dequantize_k_cache_paged (sparse prefill): a packed C4 buffer, or a CSA layer's packed
    window buffer (window_records=packed_csa), is first reconstructed into native pages. In
    kernel mode the result is put in the order of the layer's q: reconstructed columns
    permuted to kept-first where the layer's weights were folded, and a CSA layer's
    kept-first window records (which dequantize to kept-first columns) permuted back to
    natural order where they were not."""
    from remnant.sglang.buffers import reconstruct_rows
    from remnant.sglang.pool import pool_of

    found = pool_of(quant_k_cache)
    if found is not None and found[0].packed_layer(found[1]):
        pool, layer = found
        pages, ids = reconstruct_rows(pool.kv_buffer[layer], pool.layouts[layer], pool.keeps[layer],
                                      page_table_1_flattened, page_size)
        result = original(pages, ids, page_size, out=out)
        model_layers = getattr(pool, "model_layers", None)
        if mode_of(pool.mode).direct_decode and model_layers is not None and folded(model_layers[layer]):
            permute_columns(result, pool.keeps[layer].order)
        return result
    window = window_of(quant_k_cache)
    result = original(quant_k_cache, page_table_1_flattened, page_size, out=out)
    if window is not None and not folded(window[1]):
        permute_columns(result, window_columns_of(*window).inverse)
    return result


def check_server_args(result, server_args, *args, **kwargs):
    """ServerArgs.check_server_args: what the plugin's settings need of the server."""
    from sglang.srt.environ import envs

    s = active()
    if s.index_key_format == "mxfp4" and not getattr(server_args, "enable_deepseek_v4_fp4_indexer", False):
        raise ConfigError("remnant: REMNANT_INDEX_KEY_FORMAT=mxfp4 needs SGLang's --enable-deepseek-v4-fp4-indexer "
                          "(the pool sizing counts the 68-byte keys that flag stores)")
    if not s.packed:
        return
    if s.packed_windows and server_args.enable_hierarchical_cache:
        # HiCache's host pools copy window pages of one size; packed CSA windows are another.
        raise ConfigError("remnant: REMNANT_WINDOW_RECORDS=packed_csa is not allowed with --enable-hierarchical-cache; "
                          "packed window records need HiCache off (allowed with HiCache: native)")
    try:
        s.check_hicache(bool(server_args.enable_hierarchical_cache))
    except ConfigError as e:
        raise ConfigError(f"remnant: {e} (SGLang's --enable-hierarchical-cache)") from None
    if getattr(server_args, "enable_hisparse", False):
        raise ConfigError(f"remnant: --enable-hisparse is not allowed with REMNANT_MODE={s.mode}; "
                          f"packed C4 records need hisparse off")
    if getattr(server_args, "enable_prefill_cp", False):
        raise ConfigError(f"remnant: --enable-prefill-cp is not allowed with REMNANT_MODE={s.mode}; "
                          f"prefill context parallelism turns off the sparse prefill the packed modes read through")
    if mode_of(s.mode).reconstructs and not envs.SGLANG_OPT_FLASHMLA_SPARSE_PREFILL.get():
        raise ConfigError(f"remnant: SGLANG_OPT_FLASHMLA_SPARSE_PREFILL=0 is not allowed with REMNANT_MODE={s.mode}; "
                          "allowed: 1 (SGLang's default on CUDA)")


#: (target, hook, kind): everything the plugin patches.
TARGETS = [
    (f"{_POOL}._make_kv_pool", make_kv_pool, "around"),
    (f"{_POOL}.__init__", check_token_pool, "after"),
    (f"{_CONFIGURATOR}._get_bytes_per_full_token", bytes_per_full_token, "around"),
    (f"{_COMPRESSOR}._forward_compress_all_in_one", compress_store, "around"),
    (f"{_BACKEND}.forward", attention_forward, "around"),
    (_DEQUANT, dequantize_paged, "around"),
    (f"{_SERVER_ARGS}.check_server_args", check_server_args, "after"),
    (f"{_MODEL}.load_weights", fold_weights, "around"),
    (f"{_POOL}.set_swa_key_buffer_radix_fused_norm_rope", window_store_norm_rope, "around"),
    (f"{_POOL}.set_swa_key_buffer_radix_fused", window_store_fused, "around"),
    (f"{_POOL}.set_swa_key_buffer_radix", window_store_quantized, "around"),
    (f"{_POOL}.set_swa_key_buffer", window_store_quantized, "around"),
    (f"{_POOL}.get_swa_raw_buffer", window_raw_buffer, "around"),
]

#: The hooks native mode registers for MXFP4 index keys: the pool sizing and its check.
SIZING_TARGETS = [t for t in TARGETS if t[1] in (bytes_per_full_token, check_server_args)]
