"""Records in paged pools (remnant.kv.layout's PageLayout), in plain torch: the references
the store and reconstruct kernels of remnant.kernels are tested against, and the byte moves
every reference builds on.

`store_reference`, `store_kept_first_reference` and `reconstruct_reference` run on any
device and never dispatch: remnant.kernels.dispatch's `store`, `store_kept_first` and
`reconstruct` take the kernels on CUDA tensors and these elsewhere. `write` and `gather`
move record bytes to and from their locations; `quantize_kept_first` is the kept-first
window record. The decode references, which attend through remnant.kv.attention, are
remnant.kernels.decode.reference. A keep list may be given as a tensor or as a
KeptColumns table built once.
"""

from __future__ import annotations

import torch

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
