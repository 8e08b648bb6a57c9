"""Where records sit and which columns a layer keeps: the page layout and the kept-columns
table every store, reconstruct and decode takes (references and kernels alike).

A pool buffer is uint8 [pages, page_stride] in SGLang's split page layout. A record lives
at a flat location `loc = page * per_page + slot`: its data part (NoPE codes + RoPE) at
byte `page * page_stride + slot * data_bytes`, its 8 scale+pad bytes at
`page * page_stride + per_page * data_bytes + slot * 8` (DeepSeekV4SingleKVPool's layout;
`loc` is SGLang's `out_cache_loc`). A plain [n, record_bytes] tensor is the layout with
per_page = 1 and page_stride = record_bytes.

A leaf: it imports torch and remnant.kv's formats and keep checks only, so the torch
references (remnant.kv.paged) and the Triton kernels (remnant.kernels) both build on it
without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from remnant.kv.formats import NATIVE_RECORD_BYTES, NOPE_DIM, SCALE_BYTES, page_bytes, packed_record_bytes
from remnant.kv.packing import check_keep


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

    def _views(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of pages [P, page_stride]: data parts [P, per_page, data_bytes] and tails
        [P, per_page, tail_bytes]."""
        at = self.per_page * self.data_bytes
        return (pages[:, :at].unflatten(1, (self.per_page, self.data_bytes)),
                pages[:, at : at + self.per_page * self.tail_bytes].unflatten(1, (self.per_page, self.tail_bytes)))

    def read(self, pages: torch.Tensor, locs: torch.Tensor) -> torch.Tensor:
        """Records at locations `locs` (any shape, each in range) as uint8 [*locs.shape,
        record_bytes]: indexed through views of the pages, with no index tensor per byte and
        no range check (a check would read the locations back to the host)."""
        data, tail = self._views(pages)
        locs = locs.to(pages.device)
        page, slot = locs // self.per_page, locs % self.per_page
        return torch.cat([data[page, slot], tail[page, slot]], dim=-1)

    def write(self, pages: torch.Tensor, locs: torch.Tensor, records: torch.Tensor) -> None:
        """records uint8 [k, record_bytes] to locations `locs` [k] (read's inverse; unchecked)."""
        data, tail = self._views(pages)
        locs = locs.to(pages.device)
        page, slot = locs // self.per_page, locs % self.per_page
        data[page, slot] = records[:, : self.data_bytes]
        tail[page, slot] = records[:, self.data_bytes :]


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


def keep_tensor(keep: "torch.Tensor | KeptColumns") -> torch.Tensor:
    """The kept NoPE indices int64 [N] of a keep tensor or a KeptColumns table."""
    return keep.kept[: keep.n_kept].long() if isinstance(keep, KeptColumns) else keep
