"""Records in paged pools, SGLang's split page layout: the reference for remnant.kernels.

A pool buffer is uint8 [pages, page_stride]. A record lives at a flat location
`loc = page * per_page + slot`: its data part (NoPE codes + RoPE) at byte
`page * page_stride + slot * data_bytes`, its 8 scale+pad bytes at
`page * page_stride + per_page * data_bytes + slot * 8` (DeepSeekV4SingleKVPool's layout;
`loc` is SGLang's `out_cache_loc`). A plain [n, record_bytes] tensor is the layout with
per_page = 1 and page_stride = record_bytes.

Every function here is the plain torch version; on CUDA tensors `store`, `reconstruct`
and the two decodes dispatch to the kernels of remnant.kernels (imported only then: the
Triton kernels, and FlashMLA's V4 decode for native records where it runs), which tests
check against these references (`reference=True` forces the torch path
on any device). A keep list may be given as a tensor or as a KeptColumns table built once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from remnant.kv.attention import SOFTMAX_SCALE, decode_native as _decode_native_records
from remnant.kv.attention import decode_packed as _decode_packed_records
from remnant.kv.codec import dequantize_ordered, quantize
from remnant.kv.formats import NATIVE_RECORD_BYTES, NOPE_DIM, SCALE_BYTES, page_bytes
from remnant.kv.packing import check_keep, pack, unpack


@dataclass(frozen=True)
class PageLayout:
    """Where records sit in a pool buffer (bytes; see the module docstring)."""

    per_page: int
    record_bytes: int
    page_stride: int
    #: Bytes of the per-record tail after all data parts: C4 records' 7 scales + pad (8);
    #: the engine's indexer keys keep a 4-byte fp32 scale there. The kernels read tail 8.
    tail_bytes: int = SCALE_BYTES

    def __post_init__(self):
        if self.per_page < 1 or self.record_bytes <= self.tail_bytes:
            raise ValueError(f"bad page layout: per_page={self.per_page}, record_bytes={self.record_bytes}")
        if self.page_stride < self.per_page * self.record_bytes:
            raise ValueError(
                f"page_stride={self.page_stride} is smaller than per_page x record_bytes = "
                f"{self.per_page * self.record_bytes}"
            )

    @property
    def data_bytes(self) -> int:
        return self.record_bytes - self.tail_bytes

    @classmethod
    def sglang(cls, per_page: int, retention: int = 512) -> "PageLayout":
        """SGLang's pages of `per_page` records, padded to a multiple of the data row."""
        from remnant.kv.formats import packed_record_bytes

        width = NATIVE_RECORD_BYTES if retention == 512 else packed_record_bytes(retention)
        return cls(per_page, width, page_bytes(per_page, retention))

    @classmethod
    def rows(cls, record_bytes: int) -> "PageLayout":
        """A plain [n, record_bytes] tensor of records."""
        return cls(1, record_bytes, record_bytes)

    def check(self, pages: torch.Tensor, name: str = "pages") -> None:
        if pages.dtype != torch.uint8 or pages.ndim != 2 or pages.shape[1] != self.page_stride:
            raise ValueError(
                f"{name} must be uint8 [pages, {self.page_stride}] for this layout, got {pages.dtype} {tuple(pages.shape)}"
            )
        if not pages.is_contiguous():
            raise ValueError(f"{name} must be contiguous")

    def capacity(self, pages: torch.Tensor) -> int:
        return pages.shape[0] * self.per_page

    def byte_offsets(self, locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Byte offsets [k, data_bytes] and [k, 8] of records at `locs` [k] in the flat buffer."""
        locs = locs.long()
        page, slot = locs // self.per_page, locs % self.per_page
        base = page * self.page_stride
        data = (base + slot * self.data_bytes)[:, None] + torch.arange(self.data_bytes, device=locs.device)
        tail = (base + self.per_page * self.data_bytes + slot * self.tail_bytes)[:, None] + torch.arange(
            self.tail_bytes, device=locs.device
        )
        return data, tail


def _padded(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """int32 values padded with zeros to a power of two of at least 16 (tl.dot's minimum)."""
    size = max(16, 1 << max(values.numel() - 1, 0).bit_length())
    out = torch.zeros(size, dtype=torch.int32, device=device)
    out[: values.numel()] = values.to(device=device, dtype=torch.int32)
    return out


@dataclass(frozen=True)
class KeptColumns:
    """One layer's kept NoPE columns in the forms the kernels read, built once per layer.

    Serving code builds it when the pool is made and passes it wherever a keep tensor is
    taken: validating a keep tensor reads it back to the host, which a CUDA graph being
    captured (SGLang's decode) does not allow.

    kept: int32 [NP] kept indices in map order, zero-padded; n_kept: N.
    dropped: int32 [DP] the other NoPE indices, zero-padded; n_dropped: 448 - N.
    slot_of: int32 [512] for native coordinate c < 448 its position in kept, else -1.
    kept_tile_starts, dropped_tile_starts: int32 [8], entry t the position in kept (in
    dropped) of the first column of scale tile t or later (entry 7: N, 448 - N). Both lists
    are sorted, so column j of a set lies in tile t or later exactly when j >= entry t: the
    decode kernel's transposed loops pick each column's scale by comparing positions with
    these, where a value per column held in registers spilled (the other loops derive a
    byte selector per column from kept and dropped; kept-first window records, tiled by
    position, need neither).
    order: int32 [512] kept-first column order (kept in map order, dropped, RoPE 448..511),
    in which the packed decode kernel reads q and writes out (and store_kept_first
    quantizes window records: quantize_kept_first); inverse: int32 [512], its inverse.
    word_plan: int32 [3, 112], for each 4-byte word w of a native record's codes: the
    packed code word where its kept codes start (they are one run, within that word and the
    next), the byte-permute selector that moves them into place, and the mask of its kept
    bytes (the reconstruct kernel's "shared" permutation: _word_plan).
    packed: False when every NoPE coordinate is kept (native records).
    """

    kept: torch.Tensor
    n_kept: int
    dropped: torch.Tensor
    n_dropped: int
    slot_of: torch.Tensor
    kept_tile_starts: torch.Tensor
    dropped_tile_starts: torch.Tensor
    order: torch.Tensor
    inverse: torch.Tensor
    word_plan: torch.Tensor

    @property
    def packed(self) -> bool:
        return self.n_kept < NOPE_DIM

    @property
    def record_bytes(self) -> int:
        return self.n_kept + 136

    @classmethod
    def of(cls, keep: "torch.Tensor | KeptColumns | None", device: torch.device) -> "KeptColumns":
        """From a keep tensor (int64 [N], sorted NoPE indices), or None for native records."""
        if isinstance(keep, KeptColumns):
            return keep
        if keep is None:
            keep = torch.arange(NOPE_DIM)
        else:
            check_keep(keep)
        keep = keep.cpu().long()
        mask = torch.ones(NOPE_DIM, dtype=torch.bool)
        mask[keep] = False
        dropped = mask.nonzero().flatten()
        slot_of = torch.full((512,), -1, dtype=torch.int32)
        slot_of[keep] = torch.arange(keep.numel(), dtype=torch.int32)
        tile_firsts = torch.arange(8) * 64
        kept_starts = torch.searchsorted(keep, tile_firsts).to(torch.int32)
        dropped_starts = torch.searchsorted(dropped, tile_firsts).to(torch.int32)
        order = torch.cat([keep, dropped, torch.arange(NOPE_DIM, 512)])
        return cls(_padded(keep, device), keep.numel(), _padded(dropped, device), dropped.numel(),
                   slot_of.to(device), kept_starts.to(device), dropped_starts.to(device),
                   order.to(device=device, dtype=torch.int32), torch.argsort(order).to(device=device, dtype=torch.int32),
                   _word_plan(slot_of).to(device))


def _word_plan(slot_of: torch.Tensor) -> torch.Tensor:
    """KeptColumns.word_plan from slot_of (native coordinate -> kept slot or -1).

    Kept slots are sorted, so the kept codes of native word w (coordinates 4w..4w+3) are
    consecutive packed bytes starting at slot s: all within packed words s // 4 and
    s // 4 + 1. A byte permute of that pair (prmt: selector nibble k picks byte k of the
    result from the pair's 8 bytes) puts kept code k at its offset (s % 4 + its rank in
    the word); the mask clears the dropped bytes."""
    slots_of = slot_of.tolist()
    plan = [[0] * (NOPE_DIM // 4) for _ in range(3)]
    for w in range(NOPE_DIM // 4):
        slots = slots_of[4 * w : 4 * w + 4]
        kept = [k for k, slot in enumerate(slots) if slot >= 0]
        if not kept:
            continue
        first = slots[kept[0]]
        plan[0][w] = first // 4
        plan[1][w] = sum((first % 4 + rank) << (4 * k) for rank, k in enumerate(kept))  # nibbles <= 6
        plan[2][w] = sum(0xFF << (8 * k) for k in kept)
    plan = torch.tensor(plan, dtype=torch.int64)
    return (plan - (plan >= 2**31) * 2**32).to(torch.int32)  # the masks as signed int32 bit patterns


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


def keep_tensor(keep: "torch.Tensor | KeptColumns") -> torch.Tensor:
    """The kept NoPE indices int64 [N] of a keep tensor or a KeptColumns table."""
    return keep.kept[: keep.n_kept].long() if isinstance(keep, KeptColumns) else keep


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
    data, tail = layout.byte_offsets(locs.to(pages.device))
    flat = pages.view(-1)
    flat[data] = records[:, : layout.data_bytes]
    flat[tail] = records[:, layout.data_bytes :]


def gather(pages: torch.Tensor, layout: PageLayout, locs: torch.Tensor) -> torch.Tensor:
    """Records at `locs` [k] as uint8 [k, record_bytes]."""
    layout.check(pages)
    _check_locs(locs, layout, pages, "locs")
    data, tail = layout.byte_offsets(locs.to(pages.device))
    flat = pages.view(-1)
    return torch.cat([flat[data], flat[tail]], dim=1)


def _use_kernels(*tensors: torch.Tensor, reference: bool) -> bool:
    return not reference and all(t.is_cuda for t in tensors)


def store(
    x: torch.Tensor,
    pages: torch.Tensor,
    layout: PageLayout,
    locs: torch.Tensor,
    keep: "torch.Tensor | KeptColumns | None" = None,
    reference: bool = False,
) -> None:
    """Quantize latents x float [n, 512] and write them at `locs` [n].

    keep None: native records (layout.record_bytes 584); keep int64 [N]: packed records of
    R = N + 64 coordinates (layout.record_bytes R + 72).
    """
    if _use_kernels(x, pages, reference=reference):
        from remnant.kernels.store import store as store_kernel

        return store_kernel(x, pages, layout, locs, keep)
    records = quantize(x)
    if keep is not None:
        records = pack(records, keep_tensor(keep))
    if records.shape[1] != layout.record_bytes:
        raise ValueError(f"records are {records.shape[1]} bytes but the layout holds {layout.record_bytes}-byte records")
    write(pages, layout, locs, records)


def store_kept_first(
    x: torch.Tensor,
    pages: torch.Tensor,
    layout: PageLayout,
    locs: torch.Tensor,
    keep: "torch.Tensor | KeptColumns",
    reference: bool = False,
) -> None:
    """Quantize latents x float [n, 512] into kept-first window records
    (quantize_kept_first) and write them at `locs` [n] (layout.record_bytes 584)."""
    if _use_kernels(x, pages, reference=reference):
        from remnant.kernels.store import store_kept_first as store_kernel

        return store_kernel(x, pages, layout, locs, keep)
    if layout.record_bytes != NATIVE_RECORD_BYTES:
        raise ValueError(f"kept-first records are {NATIVE_RECORD_BYTES} bytes but the layout holds "
                         f"{layout.record_bytes}-byte records")
    write(pages, layout, locs, quantize_kept_first(x, KeptColumns.of(keep, x.device)))


def reconstruct(
    pages: torch.Tensor,
    layout: PageLayout,
    locs: torch.Tensor,
    keep: "torch.Tensor | KeptColumns",
    out: torch.Tensor | None = None,
    out_layout: PageLayout | None = None,
    out_locs: torch.Tensor | None = None,
    reference: bool = False,
) -> torch.Tensor:
    """Packed records at `locs` [k] -> native records (dropped NoPE codes = FP8 zero).

    Without `out`: returns uint8 [k, 584]. With `out` (native pages), `out_layout` and
    `out_locs` [k]: writes record i to out_locs[i] there (the triton mode's gather into
    pages the stock attention reads) and returns `out`.
    """
    if (out is None) != (out_locs is None) or (out is None) != (out_layout is None):
        raise ValueError("reconstruct: give out, out_layout and out_locs together, or none of them")
    if _use_kernels(pages, reference=reference):
        from remnant.kernels.reconstruct import reconstruct as reconstruct_kernel

        return reconstruct_kernel(pages, layout, locs, keep, out, out_layout, out_locs)
    keep = keep_tensor(keep)
    check_keep(keep)
    native = unpack(gather(pages, layout, locs), keep)
    if out is None:
        return native
    write(out, out_layout, out_locs, native)
    return out


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


def decode_native(
    q: torch.Tensor,
    c4: torch.Tensor,
    c4_layout: PageLayout,
    c4_locs: torch.Tensor,
    window: torch.Tensor,
    window_layout: PageLayout,
    window_locs: torch.Tensor,
    sink: torch.Tensor,
    scale: float = SOFTMAX_SCALE,
    reference: bool = False,
    dtype: torch.dtype = torch.float64,
    kernel: str = "auto",
) -> torch.Tensor:
    """Sparse decode over native C4 records in pages, for a batch of B decode tokens.

    q: [B, H, 512] (RoPE applied); c4_locs: int [B, K] selected records' locations
    (-1 = padding); window_locs: int [B, W] window tokens' locations in the window pool
    (-1 = padding); sink: [H]. Returns [B, H, 512] (`dtype` on the reference path,
    q's dtype from the kernel).

    kernel (CUDA tensors): "flashmla" (FlashMLA's V4 decode, the stock attention SGLang
    runs), "triton" (remnant.kernels.decode) or "auto": FlashMLA where it runs
    (remnant.kernels.flashmla.choose_native: its package, an SM90/SM100 GPU, 64 or 128
    heads, SGLang's split pages), Triton elsewhere.
    """
    if _use_kernels(q, c4, window, reference=reference):
        from remnant.kernels.flashmla import choose_native

        if choose_native(kernel, q.device, q.shape[1], (c4_layout, window_layout))[0] == "flashmla":
            from remnant.kernels.flashmla import decode as flashmla_decode

            return flashmla_decode(q, c4, c4_layout, c4_locs, window, window_layout, window_locs, sink, scale)
        from remnant.kernels.decode import decode

        return decode(q, c4, c4_layout, c4_locs, window, window_layout, window_locs, sink, None, scale)
    return _per_token(q, c4, c4_layout, c4_locs, window, window_layout, window_locs,
                      lambda qb, win, rows: _decode_native_records(qb, win, rows, torch.arange(rows.shape[0]), sink,
                                                                   scale, dtype))


def decode_packed(
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
    reference: bool = False,
    dtype: torch.dtype = torch.float64,
    window_columns: str = "natural",
) -> torch.Tensor:
    """Sparse decode directly over packed C4 records in pages (the kernel mode).

    As decode_native, with c4 holding packed records (R + 72 bytes) and keep int64 [N] the
    layer's kept NoPE indices. window_columns: the window records' form, "natural" (native
    records) or "kept_first" (quantize_kept_first's, as kernel mode keeps its rings).
    """
    if window_columns not in ("natural", "kept_first"):
        raise ValueError(f"window_columns={window_columns!r} is not allowed; allowed: 'natural', 'kept_first'")
    if _use_kernels(q, c4, window, reference=reference):
        from remnant.kernels.decode import decode

        return decode(q, c4, c4_layout, c4_locs, window, window_layout, window_locs, sink, keep, scale,
                      window_columns=window_columns)
    kept = keep_tensor(keep)
    window_order = KeptColumns.of(keep, torch.device("cpu")).order if window_columns == "kept_first" else None
    return _per_token(q, c4, c4_layout, c4_locs, window, window_layout, window_locs,
                      lambda qb, win, rows: _decode_packed_records(qb, win, rows, kept, torch.arange(rows.shape[0]),
                                                                   sink, scale, dtype, window_order))
