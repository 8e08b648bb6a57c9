"""reconstruct: packed C4 records -> native records for selected pool locations.

The triton mode's gather: each selected packed record (R + 72 bytes) becomes a native
record (584 bytes) whose kept NoPE codes sit at their coordinates, dropped codes are FP8
zero, and RoPE, scales and pad are copied. The result goes to a plain [k, 584] tensor or
into native pages at given locations (so stock attention reads it unchanged).

Two ways to permute the kept codes into native order, measured against each other by
remnant-kernels: "registers", the plain one (the kept codes loaded, then tl.gather along
each row, which Triton lowers to warp shuffles), and "shared", the default: the record's
words loaded once with vector loads and each native code word built by one byte permute
(prmt) of the two packed words that hold its kept codes (KeptColumns.word_plan), those
words gathered on chip through shared memory, the faster on an H200 at every R
(benchmarks/kernels/NOTES.md, seventh and twelfth rounds).
Bytes: read R + 72, write 584 per record.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from remnant.kernels.common import alignment, byte_permute, check_locs, interpreted, record_addresses
from remnant.kv.formats import NATIVE_RECORD_BYTES
from remnant.kv.layout import KeptColumns, PageLayout


PERMUTES = ("registers", "shared")
# The most kept NoPE codes at which "shared" stores native code words one 4-byte word per
# thread (VECTOR_CODES off), in the layout its gather gives them, not as 16-byte vectors:
# those need the words moved to another layout first (4 rounds through shared memory, 8
# barriers per program), which at few kept codes cost a reconstruct more than its gather
# (NOTES.md, twelfth round). R = 64 (no kept code, so no gather) takes them too.
WORD_STORES_UP_TO_KEPT = 128
# The fastest launch per permutation on the H200 (records per program, warps): "shared"
# needs several warps (its gather goes through shared memory only when it spans warps).
LAUNCH = {"registers": (4, 1), "shared": (16, 4)}


def data_words(n_kept: int) -> int:
    """The "shared" permutation's words per record: the packed record's whole data part
    (n_kept codes, then 128 bytes of RoPE) as 4-byte words, padded to a power of two."""
    return triton.next_power_of_2(n_kept // 4 + 32)


def vector_code_stores(n_kept: int) -> bool:
    """Whether "shared" stores native code words as 16-byte vectors (VECTOR_CODES) for
    n_kept kept codes: above WORD_STORES_UP_TO_KEPT."""
    return n_kept > WORD_STORES_UP_TO_KEPT


@triton.jit(do_not_specialize=["zero"])
def _reconstruct_kernel(
    src_ptr, src_locs_ptr, src_stride,
    dst_ptr, dst_locs_ptr, dst_stride,
    slot_of_ptr, plan_ptr, n_rows, zero,
    SRC_PER_PAGE: tl.constexpr, SRC_ALIGN: tl.constexpr, DST_PER_PAGE: tl.constexpr, DST_ALIGN: tl.constexpr,
    N: tl.constexpr, NP: tl.constexpr, NPW: tl.constexpr, PERMUTE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    VECTOR_CODES: tl.constexpr, INTERPRETED: tl.constexpr,
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

    if PERMUTE == "shared":
        # Native code word w holds kept codes that are one run of packed bytes within
        # packed words plan[0, w] and the next (kept slots are sorted); one byte permute
        # of that pair puts them in place and the mask clears the dropped bytes.
        # The pairs are gathered from the block's words flattened to one axis: Triton
        # lowers a gather whose axis spans warps through shared memory (a store, then a
        # load per value), where a gather along a row gets a warp-local layout and several
        # shuffles per value (NOTES.md, sixth and seventh rounds).
        w = tl.arange(0, 128)
        w_ok = w < 112
        shape: tl.constexpr = (BLOCK_ROWS, 128)
        if N == 0:  # no NoPE code kept: the codes are FP8 zeros
            native = tl.zeros(shape, dtype=tl.int32)
        else:
            # The record's whole data part (codes, then RoPE) in one vector load: masked at
            # the last code word they were single words, and stopping short of the RoPE
            # sent its load to memory a second time (R = 128: 0.73 of copy, 0.80 whole).
            v = tl.arange(0, NPW)
            words = tl.load(src_data.to(tl.pointer_type(tl.int32))[:, None] + v[None, :],
                            mask=row_ok[:, None] & (v[None, :] < N // 4 + 32), other=0)
            first = tl.load(plan_ptr + w, mask=w_ok, other=0)
            selector = tl.load(plan_ptr + 112 + w, mask=w_ok, other=0)
            kept_bytes = tl.load(plan_ptr + 224 + w, mask=w_ok, other=0)
            at = tl.arange(0, BLOCK_ROWS)[:, None] * NPW + first[None, :]
            # Both words of every pair in one gather (one store of the words, not two).
            pairs = tl.gather(tl.reshape(words, (BLOCK_ROWS * NPW,)),
                              tl.reshape(tl.join(at, at + 1), (BLOCK_ROWS * 256,)), axis=0)
            lo, hi = tl.split(tl.reshape(pairs, (BLOCK_ROWS, 128, 2)))
            native = byte_permute(lo, hi, tl.broadcast_to(selector[None, :], shape), INTERPRETED) & kept_bytes[None, :]
        dst_words = dst_data.to(tl.pointer_type(tl.int32))
        if not VECTOR_CODES:
            # zero is 0, passed unspecialized: the compiler cannot prove these stores 16-byte
            # aligned, so it stores each word where the gather put it (WORD_STORES_UP_TO_KEPT).
            dst_words += zero
        tl.store(dst_words[:, None] + w[None, :], native, mask=row_ok[:, None] & w_ok[None, :])
    else:
        # Kept codes, contiguous; native coordinate c takes kept slot slot_of[c] (or zero).
        c = tl.arange(0, 512)
        slot_of = tl.load(slot_of_ptr + c)
        j = tl.arange(0, NP)
        kept = tl.load(src_data[:, None] + j[None, :], mask=row_ok[:, None] & (j[None, :] < N), other=0)
        native = tl.gather(kept, tl.broadcast_to(tl.maximum(slot_of, 0)[None, :], (BLOCK_ROWS, 512)), axis=1)
        native = tl.where(slot_of[None, :] >= 0, native, 0)
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
    block_rows: int | None = None,
    num_warps: int | None = None,
    permute: str | None = None,
) -> torch.Tensor:
    """Packed records at `locs` [k] of `pages` -> native records.

    Without `out`: returns uint8 [k, 584]. With `out` (native pages), `out_layout` and
    `out_locs` [k]: writes record i at out_locs[i] there and returns `out`. permute: how
    codes reach native order, "shared" (the default: vector loads, a byte permute of two
    packed words per native word, the words gathered through shared memory) or
    "registers" (the plain one: the kept codes loaded, then tl.gather along the row); both
    give the same bytes. Launch: block_rows records per program on num_warps warps, None
    taking LAUNCH's (the fastest on the H200; on 1 warp the gather falls back to shuffles:
    benchmarks/kernels/NOTES.md, seventh round).
    """
    cols = KeptColumns.of(keep, pages.device)
    permute = permute or "shared"
    if permute not in PERMUTES:
        raise ValueError(f"permute={permute!r} is not allowed; allowed: {', '.join(map(repr, PERMUTES))}")
    block_rows = block_rows or LAUNCH[permute][0]
    num_warps = num_warps or LAUNCH[permute][1]
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
        src_ptr=pages, src_locs_ptr=src_locs, src_stride=layout.page_stride,
        dst_ptr=out, dst_locs_ptr=dst_locs, dst_stride=out_layout.page_stride,
        slot_of_ptr=cols.slot_of, plan_ptr=cols.word_plan, n_rows=k, zero=0,
        SRC_PER_PAGE=layout.per_page, SRC_ALIGN=alignment(layout, "pages"),
        DST_PER_PAGE=out_layout.per_page, DST_ALIGN=alignment(out_layout, "out"),
        N=cols.n_kept, NP=cols.kept.numel(), NPW=data_words(cols.n_kept),
        PERMUTE=permute, BLOCK_ROWS=block_rows, VECTOR_CODES=vector_code_stores(cols.n_kept),
        INTERPRETED=interpreted(), num_warps=num_warps,
    )
    return out
