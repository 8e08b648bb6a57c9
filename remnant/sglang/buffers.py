"""The packed C4 pool's buffers and the steps that move records in and out of them.

Everything here is torch, remnant.kv and remnant.kernels only (no sglang import), so CPU
tests and the GPU check of the store / reconstruct / decode kernels use the buffers
exactly as the plugin lays them out. The kernels run on CUDA tensors and the torch
references elsewhere (remnant.kernels.dispatch for store and reconstruct; decode_c4_packed
for decode).

Layout, per CSA layer: uint8 [num_pages, page_stride] in SGLang's split page layout
(PageLayout.sglang(per_page, R)): per page, per_page packed data parts (R + 64 bytes each),
then per_page 8-byte scale+pad parts. per_page is the C4 pool's page size (SGLang's
page_size / 4 = 64 records at the default page of 256 tokens); a record's location is
SGLang's C4 location (`c4_out_loc`, the FlashMLA C4 indices).
"""

from __future__ import annotations

import torch

from remnant.kv.formats import HEAD_DIM, NATIVE_RECORD_BYTES, NOPE_DIM, ROPE_BYTES
from remnant.kv.packing import pack
from remnant.kernels.dispatch import reconstruct
from remnant.kv.layout import KeptColumns, PageLayout
from remnant.kv.paged import write

NATIVE = HEAD_DIM  # retention 512: the native record


def num_pages(size: int, per_page: int) -> int:
    """Pages of a pool of `size` records, as DeepSeekV4SingleKVPool allocates them
    (one spare page: SGLang's locations run 1..size, location 0 being the null slot)."""
    return (size + per_page + 1) // per_page


def packed_layouts(per_page: int, retentions: list[int]) -> list[PageLayout]:
    """One PageLayout per CSA layer of the pool: R + 72-byte records, SGLang's split pages."""
    return [PageLayout.sglang(per_page, r) for r in retentions]


def native_layout(per_page: int) -> PageLayout:
    """SGLang's native C4 page layout (584-byte records; what FlashMLA reads)."""
    return PageLayout.sglang(per_page, NATIVE)


def window_layout(per_page: int, keep: "torch.Tensor | KeptColumns | None" = None) -> PageLayout:
    """A window pool layer's pages of `per_page` records: native, or packed with `keep`
    (R = N + 64, the CSA layer's C4 keep list: retention.window_records=packed_csa)."""
    if keep is None:
        return native_layout(per_page)
    return PageLayout.sglang(per_page, KeptColumns.of(keep, torch.device("cpu")).n_kept + 64)


def make_packed_buffers(
    size: int, per_page: int, retentions: list[int], device: str | torch.device = "cpu"
) -> tuple[list[torch.Tensor], list[PageLayout]]:
    """The packed C4 pool's buffers: one zeroed uint8 [num_pages(size, per_page),
    page_stride] per CSA layer, with its layout. size: records per layer (SGLang's C4 pool
    size); retentions: R per CSA layer of the pool."""
    layouts = packed_layouts(per_page, retentions)
    pages = num_pages(size, per_page)
    buffers = [torch.zeros(pages, layout.page_stride, dtype=torch.uint8, device=device) for layout in layouts]
    return buffers, layouts


def native_records(k_nope_fp8: torch.Tensor, k_rope_bf16: torch.Tensor, scale_ue8m0: torch.Tensor) -> torch.Tensor:
    """SGLang's NopeFp8RopeBf16Pack fields -> native records uint8 [n, 584] (no dequantize).

    k_nope_fp8: float8_e4m3fn [n, 448]; k_rope_bf16: bf16 [n, 64]; scale_ue8m0: [n, 7]
    UE8M0 exponents (uint8 or float8_e8m0fnu bytes).
    """
    n = k_nope_fp8.shape[0]
    out = torch.zeros(n, NATIVE_RECORD_BYTES, dtype=torch.uint8, device=k_nope_fp8.device)
    out[:, :NOPE_DIM] = k_nope_fp8.reshape(n, NOPE_DIM).view(torch.uint8)
    out[:, NOPE_DIM : NOPE_DIM + ROPE_BYTES] = k_rope_bf16.reshape(n, -1).contiguous().view(torch.uint8)
    out[:, NOPE_DIM + ROPE_BYTES : NATIVE_RECORD_BYTES - 1] = scale_ue8m0.reshape(n, -1).view(torch.uint8)
    return out


def store_native(records: torch.Tensor, buffer: torch.Tensor, layout: PageLayout, locs: torch.Tensor,
                 keep: "torch.Tensor | KeptColumns") -> None:
    """Pack native records uint8 [n, 584] (already quantized by SGLang) and write them at `locs`.

    With a KeptColumns table nothing is read back to the host (CUDA-graph safe); a keep
    tensor is validated first."""
    if isinstance(keep, KeptColumns):
        kept = keep.kept[: keep.n_kept].long()
        packed = torch.cat([records.index_select(1, kept), records[:, NOPE_DIM:]], dim=1)
    else:
        packed = pack(records, keep)
    write(buffer, layout, locs, packed)


def _valid_or_null(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask of entries >= 0, the entries with -1 replaced by location 0, the null slot).

    Reading the null slot is harmless and keeps shapes static (no host sync: CUDA graphs)."""
    valid = indices >= 0
    return valid, torch.where(valid, indices, torch.zeros_like(indices))


def stage_selected(
    buffer: torch.Tensor, layout: PageLayout, keep: torch.Tensor, indices: torch.Tensor,
    scratch: torch.Tensor, per_page: int,
) -> torch.Tensor:
    """Triton mode's decode step: reconstruct the records each query selected into native pages.

    indices: int [T, K] C4 locations per query token (-1 = none), FlashMLA's
    `extra_indices_in_kvcache`. Entry (t, j) is reconstructed into `scratch` (native pages of
    `per_page` records, at least T * K records) at location t * K + j. Returns the indices
    FlashMLA must read instead: int [T, K], t * K + j where valid, -1 elsewhere.
    """
    t, k = indices.shape
    flat = indices.reshape(-1)
    valid, src = _valid_or_null(flat)
    dst = torch.arange(t * k, device=indices.device, dtype=torch.int64)
    out_layout = native_layout(per_page)
    if out_layout.capacity(scratch) < t * k:
        raise ValueError(f"scratch holds {out_layout.capacity(scratch)} records; {t} x {k} = {t * k} are needed")
    reconstruct(buffer, layout, src, keep, out=scratch, out_layout=out_layout, out_locs=dst)
    return torch.where(valid, dst, torch.full_like(dst, -1)).view(t, k).to(indices.dtype)


def reconstruct_rows(
    buffer: torch.Tensor, layout: PageLayout, keep: torch.Tensor, locs: torch.Tensor, per_page: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse-prefill step: the records at C4 locations `locs` [n] as native pages.

    Returns (native pages holding record i at location i, locations arange(n) in locs' dtype):
    what SGLang's dequantize_k_cache_paged reads in place of the packed pool.
    """
    n = locs.shape[0]
    out_layout = native_layout(per_page)
    pages = torch.zeros(max(1, -(-n // per_page)), out_layout.page_stride, dtype=torch.uint8, device=buffer.device)
    _, src = _valid_or_null(locs)
    dst = torch.arange(n, device=locs.device, dtype=torch.int64)
    reconstruct(buffer, layout, src, keep, out=pages, out_layout=out_layout, out_locs=dst)
    return pages, dst.to(locs.dtype)


def mask_by_length(indices: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """indices int [T, W] with entries at or past lengths[t] set to -1 (FlashMLA's topk_length)."""
    if lengths is None:
        return indices
    col = torch.arange(indices.shape[-1], device=indices.device)
    return torch.where(col[None, :] < lengths.reshape(-1, 1), indices, torch.full_like(indices, -1))


def decode_c4_packed(
    q: torch.Tensor, buffer: torch.Tensor, layout: PageLayout, keep: "torch.Tensor | KeptColumns",
    c4_indices: torch.Tensor, c4_lengths: torch.Tensor | None,
    swa: torch.Tensor, swa_per_page: int, swa_indices: torch.Tensor, swa_lengths: torch.Tensor | None,
    sink: torch.Tensor, scale: float, *, columns: str = "natural", window_columns: str = "natural",
) -> torch.Tensor:
    """Kernel mode: one CSA layer's attention straight over packed C4 records.

    q: [T, H, 512]; c4_indices int [T, K] and swa_indices int [T, W]: FlashMLA's C4 and
    window indices (-1 = none) with their valid lengths [T]; swa: SGLang's window pool
    pages (`swa_per_page` tokens per page); sink: [H]. Returns [T, H, 512] in q's dtype.

    columns: "natural", q and out in the model's column order; "kept_first", both in
    KeptColumns.order (the plugin's folded wq_b / wo_a: fold.py). window_columns: the
    window records' form, "natural" (SGLang's store), "kept_first" (store_window_kept_first)
    or "packed" (R + 72-byte records packed with `keep`, in PackedWindowPool's pages of
    `swa_per_page` records: retention.window_records=packed_csa). The SM90 kernel takes
    q and out kept-first with a kept-first or packed window (decode.plan.choose), where
    the window pool's pages suit its copies; every other call takes the Triton kernel.
    """
    c4_locs = mask_by_length(c4_indices, c4_lengths)
    win_locs = mask_by_length(swa_indices, swa_lengths)
    if swa.dtype != torch.uint8:
        swa = swa.view(torch.uint8)  # SGLang hands the window pool out as an FP8 view of its bytes
    swa_layout = window_layout(swa_per_page, keep if window_columns == "packed" else None)
    if q.is_cuda:
        from remnant.kernels.decode import decode

        return decode(q, buffer, layout, c4_locs, swa, swa_layout, win_locs, sink, keep, scale,
                      columns=columns, window_columns=window_columns)
    # Off the GPU (SGLang's CPU tests) the float64 reference, as for the store and reconstruct.
    # It takes q in natural order: a kept-first q is put back, and the output permuted again.
    from remnant.kernels.decode.reference import check_window_columns, decode_packed_reference

    check_window_columns(window_columns)
    if columns not in ("natural", "kept_first"):
        raise ValueError(f"columns={columns!r} is not allowed; allowed: 'natural', 'kept_first'")
    cols = KeptColumns.of(keep, q.device)
    if columns == "kept_first":
        q = q.index_select(-1, cols.inverse.long())
    out = decode_packed_reference(q, buffer, layout, c4_locs, cols, swa, swa_layout, win_locs, sink,
                                  scale, window_columns=window_columns)
    if columns == "kept_first":
        out = out.index_select(-1, cols.order.long())
    return out.to(q.dtype)


def store_window_kept_first(latents: torch.Tensor, swa: torch.Tensor, swa_per_page: int, locs: torch.Tensor,
                            keep: "torch.Tensor | KeptColumns") -> None:
    """Kernel mode's window store of a CSA layer: latents bf16 [n, 512] (after SGLang's kv
    norm and RoPE) quantized in kept-first order (remnant.kv.paged.quantize_kept_first) and
    written at window locations `locs` [n] of SGLang's window pool pages `swa` (native
    584-byte layout, `swa_per_page` tokens per page; uint8 or its FP8 view).
    remnant.kernels.dispatch.store_kept_first: the Triton store on CUDA, the reference
    elsewhere."""
    from remnant.kernels.dispatch import store_kept_first

    if swa.dtype != torch.uint8:
        swa = swa.view(torch.uint8)
    store_kept_first(latents, swa, native_layout(swa_per_page), locs, keep)


__all__ = [
    "decode_c4_packed",
    "make_packed_buffers",
    "mask_by_length",
    "native_layout",
    "native_records",
    "num_pages",
    "packed_layouts",
    "reconstruct_rows",
    "stage_selected",
    "store_native",
    "store_window_kept_first",
    "window_layout",
]
