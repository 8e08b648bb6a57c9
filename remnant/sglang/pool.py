"""The packed record pools inside SGLang's DeepSeek-V4 KV pool (imports sglang).

PackedC4Pool takes the place of the DeepSeekV4SingleKVPool that
DeepSeekV4TokenToKVPool builds for its CSA layers: same constructor, same page size, same
C4 locations, but R + 72-byte records (remnant.sglang.buffers lays them out).
PackedWindowPool takes the place of its window (SWA) pool with
retention.window_records=packed_csa: the CSA layers' window records packed with their C4
keep lists, the other layers' native. Both are PackedRecordPools and answer the calls
SGLang makes on the pool they replace (on a native layer, SGLang's own code does):

- set_key_buffer(layer, loc, NopeFp8RopeBf16Pack): SGLang's quantized records, packed.
- set_key_buffer_fused(layer, loc, cache_k bf16 [n, 512]): quantized and packed in one step.
- get_key_buffer(layer): the packed buffer, or, while the triton mode has staged the
  records a decode step selected, the native pages it reconstructed them into (what
  FlashMLA reads).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4SingleKVPool

from remnant.kernels.dispatch import store
from remnant.kv.formats import NATIVE_RECORD_BYTES
from remnant.kv.layout import KeptColumns
from remnant.kv.packing import check_keep
from remnant.sglang.buffers import NATIVE, make_packed_buffers, native_records, store_native

#: Live packed pools, so a hook that sees only a buffer can find the pool it belongs to.
_POOLS: "weakref.WeakSet[PackedRecordPool]" = weakref.WeakSet()


class PackedRecordPool(DeepSeekV4SingleKVPool):
    """Records of one of DeepSeekV4TokenToKVPool's single-KV pools, each layer packed (R + 72
    bytes with its keep list) or native (keep None: SGLang's own 584-byte pages, which
    SGLang's own code writes).

    retentions: R per layer of this pool (in the pool's layer order; 512 for a native
    layer); keeps: the kept NoPE indices per layer, int64 [R - 64], or None for a native
    layer; mode: triton | kernel.
    """

    #: What the pool holds, for messages (a subclass's records).
    noun = "record"

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, layer_num: int, device: str, enable_memory_saver: bool,
                 start_layer: int | None = None, end_layer: int | None = None, *,
                 retentions: list[int], keeps: list[torch.Tensor | None], mode: str):
        if len(retentions) != layer_num or len(keeps) != layer_num:
            raise ValueError(f"{type(self).__name__} has {layer_num} {self.noun} layers but {len(retentions)} "
                             f"retentions and {len(keeps)} keeps")
        for i, (r, keep) in enumerate(zip(retentions, keeps)):
            if keep is None:
                if r != NATIVE:
                    raise ValueError(f"keeps[{i}] is None (a native layer) but retention {r} is not {NATIVE}")
                continue
            check_keep(keep, name=f"keeps[{i}]")
            if keep.numel() != r - 64:
                raise ValueError(f"keeps[{i}] has {keep.numel()} indices; retention {r} keeps R - 64 = {r - 64}")
        self.retentions = list(retentions)
        self.mode = mode
        self._keeps_cpu = keeps
        self._staged: dict[int, torch.Tensor] = {}
        super().__init__(size, page_size, dtype, qk_nope_head_dim, qk_rope_head_dim, layer_num, device,
                         enable_memory_saver, start_layer, end_layer)
        _POOLS.add(self)

    def _create_buffers(self):
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            with (torch.cuda.use_mem_pool(self.custom_mem_pool) if self.custom_mem_pool else nullcontext()):
                self.kv_buffer, self.layouts = make_packed_buffers(
                    self.size, self.page_size, self.retentions, self.device)
        # Column tables built once: the hooks pass them to the kernels, which then never read
        # a keep list back to the host (SGLang captures decode in CUDA graphs).
        self.keeps = [None if k is None else KeptColumns.of(k, torch.device(self.device)) for k in self._keeps_cpu]
        # The record SGLang's code believes in; FlashMLA reads native (or staged native) pages only.
        self.kv_cache_total_dim = NATIVE_RECORD_BYTES
        strides = {layout.page_stride for layout in self.layouts}
        # HiCache and PD transfer copy whole pages of one size; a per-layer profile has several
        # (it needs HiCache off, which the plugin's server-args check enforces).
        self.bytes_per_page_padded = strides.pop() if len(strides) == 1 else None
        self._layer_by_ptr = {buf.data_ptr(): i for i, buf in enumerate(self.kv_buffer)}

    def get_bytes_per_token(self) -> int:
        """Stored bytes per record, averaged over the pool's layers (R + 72 when uniform)."""
        return round(sum(layout.record_bytes for layout in self.layouts) / len(self.layouts))

    def record_bytes(self) -> int:
        """Bytes every layer's records take together per location: sum of R + 72 (584 native)."""
        return sum(layout.record_bytes for layout in self.layouts)

    def packed_layer(self, layer_id: int) -> bool:
        return self.keeps[layer_id] is not None

    def layer_of(self, tensor: torch.Tensor) -> int | None:
        """This pool's layer whose buffer `tensor` views (same first byte), else None."""
        return self._layer_by_ptr.get(tensor.data_ptr())

    def set_key_buffer(self, layer_id: int, loc: torch.Tensor, cache_nope_fp8_rope_bf16_pack) -> None:
        if not self.packed_layer(layer_id):
            return super().set_key_buffer(layer_id, loc, cache_nope_fp8_rope_bf16_pack)
        p = cache_nope_fp8_rope_bf16_pack
        records = native_records(p.k_nope_fp8, p.k_rope_bf16, p.scale_k_nope_ue8m0)
        store_native(records, self.kv_buffer[layer_id], self.layouts[layer_id], loc, self.keeps[layer_id])

    def set_key_buffer_fused(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor) -> None:
        if not self.packed_layer(layer_id):
            return super().set_key_buffer_fused(layer_id, loc, cache_k)
        store(cache_k, self.kv_buffer[layer_id], self.layouts[layer_id], loc, self.keeps[layer_id])

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The layer's buffer (or the staged native pages), viewed as the stock pool views its
        uint8 buffer: as `self.dtype` (FP8), so FlashMLA sees the dtype it sees natively."""
        staged = self._staged.get(layer_id)
        buf = staged if staged is not None else self.kv_buffer[layer_id]
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    @contextmanager
    def staged(self, layer_id: int, native_pages: torch.Tensor):
        """While open, get_key_buffer(layer_id) answers `native_pages` (triton mode's decode)."""
        self._staged[layer_id] = native_pages
        try:
            yield native_pages
        finally:
            self._staged.pop(layer_id, None)


class PackedC4Pool(PackedRecordPool):
    """C4 records of the CSA layers of one pipeline stage, packed: every layer has a keep."""

    noun = "CSA"

    def __init__(self, *args, retentions: list[int], keeps: list[torch.Tensor], mode: str, **kwargs):
        for i, keep in enumerate(keeps):
            if keep is None:
                raise ValueError(f"keeps[{i}] is None; every layer of a PackedC4Pool is packed")
        super().__init__(*args, retentions=retentions, keeps=keeps, mode=mode, **kwargs)


class PackedWindowPool(PackedRecordPool):
    """The window (SWA) records of one pipeline stage, every layer's, with the CSA layers'
    packed with their C4 keep lists (retention.window_records=packed_csa) and the other
    layers' native. Layer i is the stage's i-th model layer (SGLang's SWA-local id)."""

    noun = "window"


def pool_of(tensor: torch.Tensor) -> tuple[PackedRecordPool, int] | None:
    """(pool, layer of that pool) whose buffer `tensor` views, or None."""
    for pool in list(_POOLS):
        layer = pool.layer_of(tensor)
        if layer is not None:
            return pool, layer
    return None


def packed_window_of(token_pool, layer_id: int) -> tuple[PackedWindowPool, int] | None:
    """(window pool, its layer) where model layer `layer_id`'s window records are packed in
    `token_pool` (a DeepSeekV4TokenToKVPool), else None."""
    window = getattr(token_pool, "swa_kv_pool", None)
    if not isinstance(window, PackedWindowPool):
        return None
    local = token_pool._swa_local_layer_id(layer_id)
    return (window, local) if window.packed_layer(local) else None
