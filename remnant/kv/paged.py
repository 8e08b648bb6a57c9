"""Records in paged pools (remnant.kv.layout's PageLayout), in plain torch: the references
every kernel of remnant.kernels is tested against.

`store_reference`, `store_kept_first_reference`, `reconstruct_reference`,
`decode_native_reference` and `decode_packed_reference` run on any device and never
dispatch: remnant.kernels.dispatch's `store`, `store_kept_first`, `reconstruct`,
`decode_native` and `decode_packed` take the kernels on CUDA tensors and these elsewhere.
`write` and `gather` move record bytes to and from their locations; the decodes attend
token by token through remnant.kv.attention. A keep list may be given as a tensor or as a
KeptColumns table built once.
"""

from __future__ import annotations

import torch

from remnant.kv.attention import SOFTMAX_SCALE, attend_native, attend_packed
from remnant.kv.codec import dequantize_ordered, quantize
from remnant.kv.formats import NATIVE_RECORD_BYTES
from remnant.kv.layout import KeptColumns, PageLayout, keep_tensor
from remnant.kv.packing import check_keep, pack, unpack


def quantize_kept_first(x: torch.Tensor, cols: KeptColumns) -> torch.Tensor:
    """Latents x float [n, 512] -> kept-first window records uint8 [n, 584]: the native
    record of x with its columns in kept-first order (cols.order: the kept columns in map
    order, the dropped ones, then RoPE), so each of the 7 FP8 scale tiles covers 64
    consecutive kept-first positions, not 64 natural columns. A code's scale then follows
    from its position, as a native code's from its column, and the packed decode kernel
    computes it in place where held per-column selectors spilled (NOTES.md, fifteenth
    round). The reference of remnant.kernels.store.store_kept_first, and the form of the
    engine's kernel-mode window rings (decode's window_columns="kept_first"). The values
    differ from a native record's only in how coordinates share a scale."""
    return quantize(x[:, cols.order.to(device=x.device, dtype=torch.long)])


def dequantize_kept_first(records: torch.Tensor, cols: KeptColumns) -> torch.Tensor:
    """Kept-first window records uint8 [n, 584] -> float32 [n, 512] in natural column order."""
    return dequantize_ordered(records, cols.order)


def _check_locs(locs: torch.Tensor, layout: PageLayout, pages: torch.Tensor, name: str) -> None:
    if locs.dtype not in (torch.int32, torch.int64) or locs.ndim != 1:
        raise ValueError(f"{name} must be an int tensor [k], got {locs.dtype} {tuple(locs.shape)}")
    if locs.numel() and (int(locs.min()) < 0 or int(locs.max()) >= layout.capacity(pages)):
        raise ValueError(f"{name} must lie in [0, {layout.capacity(pages)}), got [{int(locs.min())}, {int(locs.max())}]")


def write(pages: torch.Tensor, layout: PageLayout, locs: torch.Tensor, records: torch.Tensor) -> None:
    """Write records uint8 [k, record_bytes] to `locs` [k].

    Locations are range-checked on the CPU only: on CUDA the check would read them back to
    the host (a sync, and an error inside CUDA-graph capture)."""
    layout.check(pages)
    if not pages.is_cuda:
        _check_locs(locs, layout, pages, "locs")
    layout.write(pages, locs, records)


def gather(pages: torch.Tensor, layout: PageLayout, locs: torch.Tensor) -> torch.Tensor:
    """Records at `locs` [k] as uint8 [k, record_bytes]."""
    layout.check(pages)
    _check_locs(locs, layout, pages, "locs")
    return layout.read(pages, locs)


def store_reference(
    x: torch.Tensor,
    pages: torch.Tensor,
    layout: PageLayout,
    locs: torch.Tensor,
    keep: "torch.Tensor | KeptColumns | None" = None,
) -> None:
    """Quantize latents x float [n, 512] and write them at `locs` [n].

    keep None: native records (layout.record_bytes 584); keep int64 [N]: packed records of
    R = N + 64 coordinates (layout.record_bytes R + 72).
    """
    records = quantize(x)
    if keep is not None:
        records = pack(records, keep_tensor(keep))
    if records.shape[1] != layout.record_bytes:
        raise ValueError(f"records are {records.shape[1]} bytes but the layout holds {layout.record_bytes}-byte records")
    write(pages, layout, locs, records)


def store_kept_first_reference(
    x: torch.Tensor,
    pages: torch.Tensor,
    layout: PageLayout,
    locs: torch.Tensor,
    keep: "torch.Tensor | KeptColumns",
) -> None:
    """Quantize latents x float [n, 512] into kept-first window records
    (quantize_kept_first) and write them at `locs` [n] (layout.record_bytes 584)."""
    if layout.record_bytes != NATIVE_RECORD_BYTES:
        raise ValueError(f"kept-first records are {NATIVE_RECORD_BYTES} bytes but the layout holds "
                         f"{layout.record_bytes}-byte records")
    write(pages, layout, locs, quantize_kept_first(x, KeptColumns.of(keep, x.device)))


def reconstruct_reference(
    pages: torch.Tensor,
    layout: PageLayout,
    locs: torch.Tensor,
    keep: "torch.Tensor | KeptColumns",
    out: torch.Tensor | None = None,
    out_layout: PageLayout | None = None,
    out_locs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed records at `locs` [k] -> native records (dropped NoPE codes = FP8 zero).

    Without `out`: returns uint8 [k, 584]. With `out` (native pages), `out_layout` and
    `out_locs` [k]: writes record i to out_locs[i] there (the triton mode's gather into
    pages the stock attention reads) and returns `out`.
    """
    check_reconstruct_outputs(out, out_layout, out_locs)
    keep = keep_tensor(keep)
    check_keep(keep)
    native = unpack(gather(pages, layout, locs), keep)
    if out is None:
        return native
    write(out, out_layout, out_locs, native)
    return out


def check_reconstruct_outputs(out, out_layout, out_locs) -> None:
    """reconstruct's `out`, `out_layout` and `out_locs` come together or not at all."""
    if (out is None) != (out_locs is None) or (out is None) != (out_layout is None):
        raise ValueError("reconstruct: give out, out_layout and out_locs together, or none of them")


def _valid(row: torch.Tensor) -> torch.Tensor:
    return row[row >= 0]


def _per_token(q, c4, c4_layout, c4_locs, window, window_layout, window_locs, attend) -> torch.Tensor:
    """Reference decode token by token: gather each token's valid records, then `attend`."""
    out = []
    for b in range(q.shape[0]):
        c4_rows = gather(c4, c4_layout, _valid(c4_locs[b]))
        win_rows = gather(window, window_layout, _valid(window_locs[b]))
        out.append(attend(q[b], win_rows, c4_rows))
    return torch.stack(out)


def decode_native_reference(
    q: torch.Tensor,
    c4: torch.Tensor,
    c4_layout: PageLayout,
    c4_locs: torch.Tensor,
    window: torch.Tensor,
    window_layout: PageLayout,
    window_locs: torch.Tensor,
    sink: torch.Tensor,
    scale: float = SOFTMAX_SCALE,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Sparse decode over native C4 records in pages, for a batch of B decode tokens.

    q: [B, H, 512] (RoPE applied); c4_locs: int [B, K] selected records' locations
    (-1 = padding); window_locs: int [B, W] window tokens' locations in the window pool
    (-1 = padding); sink: [H]. Returns `dtype` [B, H, 512].
    """
    return _per_token(q, c4, c4_layout, c4_locs, window, window_layout, window_locs,
                      lambda qb, win, rows: attend_native(qb, win, rows, torch.arange(rows.shape[0]), sink, scale,
                                                          dtype))


def decode_packed_reference(
    q: torch.Tensor,
    c4: torch.Tensor,
    c4_layout: PageLayout,
    c4_locs: torch.Tensor,
    keep: "torch.Tensor | KeptColumns",
    window: torch.Tensor,
    window_layout: PageLayout,
    window_locs: torch.Tensor,
    sink: torch.Tensor,
    scale: float = SOFTMAX_SCALE,
    dtype: torch.dtype = torch.float64,
    window_columns: str = "natural",
) -> torch.Tensor:
    """Sparse decode directly over packed C4 records in pages (the kernel mode).

    As decode_native_reference, with c4 holding packed records (R + 72 bytes) and keep
    int64 [N] the layer's kept NoPE indices. window_columns: the window records' form,
    "natural" (native records) or "kept_first" (quantize_kept_first's, as kernel mode
    keeps its rings).
    """
    check_window_columns(window_columns)
    kept = keep_tensor(keep)
    window_order = KeptColumns.of(keep, torch.device("cpu")).order if window_columns == "kept_first" else None
    return _per_token(q, c4, c4_layout, c4_locs, window, window_layout, window_locs,
                      lambda qb, win, rows: attend_packed(qb, win, rows, kept, torch.arange(rows.shape[0]), sink,
                                                          scale, dtype, window_order))


def check_window_columns(window_columns: str) -> None:
    if window_columns not in ("natural", "kept_first"):
        raise ValueError(f"window_columns={window_columns!r} is not allowed; allowed: 'natural', 'kept_first'")
