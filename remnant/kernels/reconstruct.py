"""reconstruct: packed C4 records -> native records for selected pool locations.

The triton mode's gather: each selected packed record (R + 72 bytes) becomes a native
record (584 bytes) whose kept NoPE codes sit at their coordinates, dropped codes are FP8
zero, and RoPE, scales and pad are copied. The result goes to a plain [k, 584] tensor or
into native pages at given locations (so stock attention reads it unchanged).

Three ways to permute the kept codes into native order, measured against each other by
remnant-kernels: one contiguous load per record then tl.gather in registers ("registers"),
one byte load per native coordinate from its kept slot, L1-served after the first touch
("loads"), or one byte permute per native code word of the two packed words that hold
its kept codes ("words": KeptColumns.word_plan; half the loads, each four bytes wide,
where the byte loads kept L1 at 91% of its peak on an H200, NOTES.md).
Bytes: read R + 72, write 584 per record.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from remnant.kernels.common import alignment, byte_permute, check_locs, interpreted, record_addresses
from remnant.kv.formats import NATIVE_RECORD_BYTES
from remnant.kv.paged import KeptColumns, PageLayout


PERMUTES = ("registers", "loads", "words")


@triton.jit
def _reconstruct_kernel(
    src_ptr, src_locs_ptr, src_stride,
    dst_ptr, dst_locs_ptr, dst_stride,
    slot_of_ptr, plan_ptr, n_rows,
    SRC_PER_PAGE: tl.constexpr, SRC_ALIGN: tl.constexpr, DST_PER_PAGE: tl.constexpr, DST_ALIGN: tl.constexpr,
    N: tl.constexpr, NP: tl.constexpr, PERMUTE: tl.constexpr, BLOCK_ROWS: tl.constexpr, INTERPRETED: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    SRC_DATA: tl.constexpr = N + 128
    DST_DATA: tl.constexpr = 576

    src_data, src_tail = record_addresses(src_ptr, tl.load(src_locs_ptr + rows, mask=row_ok, other=0),
                                          SRC_PER_PAGE, src_stride, SRC_DATA, SRC_ALIGN)
    dst_data, dst_tail = record_addresses(dst_ptr, tl.load(dst_locs_ptr + rows, mask=row_ok, other=0),
                                          DST_PER_PAGE, dst_stride, DST_DATA, DST_ALIGN)

    if PERMUTE == "words":
        # Native code word w: its kept codes are one run of packed bytes within packed
        # words plan[0, w] and the next (KeptColumns.word_plan); one byte permute puts
        # them in place and the mask clears the dropped bytes.
        w = tl.arange(0, 128)
        w_ok = w < 112
        first = tl.load(plan_ptr + w, mask=w_ok, other=0)
        selector = tl.load(plan_ptr + 112 + w, mask=w_ok, other=0)
        kept_bytes = tl.load(plan_ptr + 224 + w, mask=w_ok, other=0)
        src_words = src_data.to(tl.pointer_type(tl.int32))[:, None] + first[None, :]
        ok = row_ok[:, None] & w_ok[None, :]
        kept_ok = ok & (kept_bytes[None, :] != 0)  # a word of dropped codes only reads nothing
        lo = tl.load(src_words, mask=kept_ok, other=0)
        hi = tl.load(src_words + 1, mask=kept_ok, other=0)  # at most the RoPE's first word: within the record
        shape: tl.constexpr = (BLOCK_ROWS, 128)
        native = byte_permute(lo, hi, tl.broadcast_to(selector[None, :], shape), INTERPRETED) & kept_bytes[None, :]
        tl.store(dst_data.to(tl.pointer_type(tl.int32))[:, None] + w[None, :], native, mask=ok)
    else:
        # Kept codes, contiguous; native coordinate c takes kept slot slot_of[c] (or zero).
        c = tl.arange(0, 512)
        slot_of = tl.load(slot_of_ptr + c)
        if PERMUTE == "registers":
            j = tl.arange(0, NP)
            kept = tl.load(src_data[:, None] + j[None, :], mask=row_ok[:, None] & (j[None, :] < N), other=0)
            native = tl.gather(kept, tl.broadcast_to(tl.maximum(slot_of, 0)[None, :], (BLOCK_ROWS, 512)), axis=1)
            native = tl.where(slot_of[None, :] >= 0, native, 0)
        else:
            native = tl.load(src_data[:, None] + slot_of[None, :], mask=row_ok[:, None] & (slot_of[None, :] >= 0),
                             other=0)
        tl.store(dst_data[:, None] + c[None, :], native, mask=row_ok[:, None] & (c[None, :] < 448))

    r = tl.arange(0, 64)
    rope = tl.load((src_data + N).to(tl.pointer_type(tl.bfloat16))[:, None] + r[None, :], mask=row_ok[:, None])
    tl.store((dst_data + 448).to(tl.pointer_type(tl.bfloat16))[:, None] + r[None, :], rope, mask=row_ok[:, None])
    tail = tl.load(src_tail.to(tl.pointer_type(tl.int64)), mask=row_ok)  # 7 scales + pad
    tl.store(dst_tail.to(tl.pointer_type(tl.int64)), tail, mask=row_ok)


def reconstruct(
    pages: torch.Tensor,
    layout: PageLayout,
    locs: torch.Tensor,
    keep: "torch.Tensor | KeptColumns",
    out: torch.Tensor | None = None,
    out_layout: PageLayout | None = None,
    out_locs: torch.Tensor | None = None,
    check_range: bool = False,
    block_rows: int = 4,
    num_warps: int = 1,
    permute: str | None = None,
) -> torch.Tensor:
    """Packed records at `locs` [k] of `pages` -> native records.

    Without `out`: returns uint8 [k, 584]. With `out` (native pages), `out_layout` and
    `out_locs` [k]: writes record i at out_locs[i] there and returns `out`. permute: how
    codes reach native order, "registers" (one contiguous load, then tl.gather), "loads"
    (each native coordinate loaded from its kept slot) or "words" (a byte permute of two
    packed words per native word); all give the same bytes. None: "words", or "registers"
    when no NoPE code is kept (R = 64, nothing to permute). On an H200 "words" moved 64-74%
    of the copy bandwidth at R >= 256 against 55-61% by loads, and "registers" 72-74% at
    R = 64 (benchmarks/kernels/h200-2026-12-01-r7.json, NOTES.md).
    Launch: block_rows records per program on num_warps warps (4 on 1 measured best for
    "words": 8 on 1-2 and 2 on 1 were 10-15% slower).
    """
    cols = KeptColumns.of(keep, pages.device)
    if permute is None:
        permute = "registers" if cols.n_kept == 0 else "words"
    if permute not in PERMUTES:
        raise ValueError(f"permute={permute!r} is not allowed; allowed: {', '.join(map(repr, PERMUTES))}")
    layout.check(pages)
    if cols.record_bytes != layout.record_bytes:
        raise ValueError(f"keep holds {cols.n_kept} codes ({cols.record_bytes}-byte records), but the layout holds {layout.record_bytes}")
    if locs.ndim != 1:
        raise ValueError(f"locs must be [k], got {tuple(locs.shape)}")
    k = locs.shape[0]
    src_locs = check_locs(locs, "locs", layout.capacity(pages), check_range)
    if out is None:
        out_layout = PageLayout.rows(NATIVE_RECORD_BYTES)
        out = torch.empty(k, NATIVE_RECORD_BYTES, dtype=torch.uint8, device=pages.device)
        out_locs = torch.arange(k, dtype=torch.int32, device=pages.device)
    if out_layout.record_bytes != NATIVE_RECORD_BYTES:
        raise ValueError(f"out_layout must hold native {NATIVE_RECORD_BYTES}-byte records, got {out_layout.record_bytes}")
    out_layout.check(out, "out")
    if out_locs.shape != (k,):
        raise ValueError(f"out_locs must be [{k}] like locs, got {tuple(out_locs.shape)}")
    dst_locs = check_locs(out_locs, "out_locs", out_layout.capacity(out), check_range)
    if k == 0:
        return out
    grid = (triton.cdiv(k, block_rows),)
    _reconstruct_kernel[grid](
        pages, src_locs, layout.page_stride,
        out, dst_locs, out_layout.page_stride,
        cols.slot_of, cols.word_plan, k,
        SRC_PER_PAGE=layout.per_page, SRC_ALIGN=alignment(layout, "pages"),
        DST_PER_PAGE=out_layout.per_page, DST_ALIGN=alignment(out_layout, "out"),
        N=cols.n_kept, NP=cols.kept.numel(), PERMUTE=permute, BLOCK_ROWS=block_rows,
        INTERPRETED=interpreted(), num_warps=num_warps,
    )
    return out
