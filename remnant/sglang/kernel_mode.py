"""Kernel mode inside SGLang: the folded call the SM90 packed decode takes.

The packed decode's fast kernel takes q, its output and a CSA layer's window records in
kept-first column order (remnant.kv.layout.KeptColumns.order). Kernel mode therefore folds
that order into each CSA layer's wq_b (output rows) and wo_a (input columns) as the
checkpoint streams in (fold_weights, remnant.sglang.fold), stores the CSA layers' native
window records kept-first (store_kept_first; the window hooks are remnant.sglang.window's),
and tells the plugin's readers which layers are folded (folded) and which buffer is a
kept-first window (window_of), so that decode makes the folded call and sparse prefill gets
columns in the order of each layer's q (remnant.sglang.plugin).
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
    them kept-first (a CSA layer of a packed kernel-mode pool whose windows are native
    records: window_records=native), else None."""
    from remnant.sglang.pool import PackedC4Pool, PackedWindowPool

    c4 = getattr(pool, "c4_kv_pool", None)
    if not isinstance(c4, PackedC4Pool) or not mode_of(c4.mode).direct_decode:
        return None
    if isinstance(getattr(pool, "swa_kv_pool", None), PackedWindowPool):
        return None  # packed windows (remnant.sglang.window) take the place of kept-first ones
    item = pool.layer_mapping[layer_id]
    if item is None or item.compress_ratio != CSA_RATIO:
        return None
    return c4.keeps[item.compress_layer_id]


def _window_pages(pool, layer_id: int):
    """(uint8 pages, tokens per page) of model layer `layer_id`'s window records."""
    return pool.swa_kv_pool.kv_buffer[pool._swa_local_layer_id(layer_id)], pool.swa_kv_pool.page_size


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


def store_kept_first(pool, layer_id: int, latents, swa_loc, cols) -> None:
    """Latents bf16/float [n, 512] of model layer `layer_id` stored kept-first with `cols`
    at window locations `swa_loc` (remnant.sglang.buffers.store_window_kept_first)."""
    from remnant.sglang.buffers import store_window_kept_first

    pages, per_page = _window_pages(pool, layer_id)
    store_window_kept_first(latents, pages, per_page, swa_loc, cols)


def permute_columns(x, index) -> None:
    """x [..., 512] with its last dim taken at `index` [512], in place."""
    import torch

    x.copy_(x.index_select(-1, index.to(device=x.device, dtype=torch.long)))
