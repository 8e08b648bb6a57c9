"""decode: sparse decode attention of one CSA layer over native or packed C4 records.

For each decode token b and each block of H_BLOCK query heads, one program runs one online
softmax over [attention sink | W window tokens | K selected C4 records], V = K (the same
512-vector), as DeepSeek-V4's sparse MLA decode does. Window tokens are native records;
C4 records are native (the stock baseline) or packed (kernel mode).

Both variants share this code and its care: records are read once per program with wide
loads (the codes of a record are one contiguous run), scales are applied by building the
float32 2^(s-127) from the UE8M0 byte (exact), keys are dequantized to bf16 (exact: FP8
e4m3 times a power of two), and both matrix products run on the tensor cores in bf16 with
float32 accumulation.

Packed C4 records hold only the kept NoPE coordinates, so the packed variant works in
"kept order": q is gathered to the kept columns once, scores of C4 records use those
columns and RoPE only, and their output accumulates in acc_kept. Window records (native)
use all 512 coordinates; their kept columns' output goes to acc_kept too (a second,
L1-served read of those codes), so every output column has exactly one accumulator and
is rounded to bf16 once.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from remnant.kernels.common import check_locs
from remnant.kv.formats import HEAD_DIM, NATIVE_RECORD_BYTES
from remnant.kv.paged import KeptColumns, PageLayout

LOG2E = 1.4426950408889634
LOG2E_IN_KERNEL: tl.constexpr = tl.constexpr(LOG2E)


@triton.jit
def _addresses(base_ptr, loc, per_page, stride, DATA: tl.constexpr):
    """Data and tail (scales) byte pointers of records at flat locations `loc`."""
    loc = loc.to(tl.int64)
    page_base = base_ptr + (loc // per_page) * stride
    slot = loc % per_page
    return page_base + slot * DATA, page_base + per_page * DATA + slot * 8


@triton.jit
def _column_scales(tail, valid, col_tile):
    """float32 [BN, C]: each column's UE8M0 scale 2^(s-127) (exact), col_tile [C] sorted.

    The 7 scale bytes are read as [BN] vectors and chosen per column by a select chain
    (kept columns are sorted, so their tiles rise). No [BN, C] gather or integer shift
    tile is formed: both spilled registers on the H200 (see benchmarks/kernels/NOTES.md).
    """
    s = tl.load(tail, mask=valid, other=127).to(tl.int32)
    scale = tl.broadcast_to(s[:, None], (s.shape[0], col_tile.shape[0]))
    for t in tl.static_range(1, 7):
        s_t = tl.load(tail + t, mask=valid, other=127).to(tl.int32)
        scale = tl.where(col_tile[None, :] >= t, s_t[:, None], scale)
    return (scale << 23).to(tl.float32, bitcast=True)


@triton.jit
def _dequant(codes, scales):
    """FP8 codes [BN, C] (uint8) times float32 scales [BN, C] -> bf16 (exact)."""
    return (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scales).to(tl.bfloat16)


@triton.jit
def _load_rope(data, valid, N: tl.constexpr):
    r = tl.arange(0, 64)
    return tl.load((data + N).to(tl.pointer_type(tl.bfloat16))[:, None] + r[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _mma(a, b, INTERPRETED: tl.constexpr):
    """a @ b with bf16 operands and float32 accumulation.

    Triton 3.9's CPU interpreter returns garbage for tl.dot on bf16 operands (measured here:
    error 2.6e10 on a 16 x 16 product of N(0,1) values), so interpreted runs multiply the
    same bf16-rounded values as float32; compiled runs use the tensor cores.
    """
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _softmax_step(s, valid, qk_scale, m, l):
    """One block of the online softmax (base 2): scores s [H, BN] of `valid` records
    against the running max m and sum l [H]. Returns the new max, the factor alpha that
    rescales earlier accumulators, the block's probabilities as bf16, and the new sum."""
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, alpha, p.to(tl.bfloat16), l * alpha + tl.sum(p, axis=1)


@triton.jit
def _decode_kernel(
    q_ptr, q_sb, q_sh,
    out_ptr, o_sb, o_sh,
    sink_ptr, H,
    win_ptr, win_locs_ptr, win_sb, W, win_per_page, win_stride,
    c4_ptr, c4_locs_ptr, c4_sb, K, c4_per_page, c4_stride,
    kept_ptr, slot_of_ptr, qk_scale,
    N: tl.constexpr, NP: tl.constexpr,
    PACKED: tl.constexpr, H_BLOCK: tl.constexpr, BN: tl.constexpr, INTERPRETED: tl.constexpr,
):
    # Head blocks of one token are adjacent in launch order, so they run together and the
    # second and later blocks read the token's records from L2, not memory.
    b = tl.program_id(1).to(tl.int64)
    heads = tl.program_id(0) * H_BLOCK + tl.arange(0, H_BLOCK)
    h_ok = heads < H
    q_row = q_ptr + b * q_sb + heads * q_sh
    o_row = out_ptr + b * o_sb + heads * o_sh
    d = tl.arange(0, 512)
    d_ok = d < 448
    d_tile = d // 64
    r = tl.arange(0, 64)
    n_off = tl.arange(0, BN)

    q_full = tl.load(q_row[:, None] + d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(tl.bfloat16)
    q_rope = tl.load(q_row[:, None] + 448 + r[None, :], mask=h_ok[:, None], other=0.0).to(tl.bfloat16)
    acc_full = tl.zeros((H_BLOCK, 512), dtype=tl.float32)
    acc_rope = tl.zeros((H_BLOCK, 64), dtype=tl.float32)
    if PACKED:
        # Packed C4 records hold the kept columns only, in map order: their scores use q
        # at those columns, and their output accumulates in acc_kept (kept order).
        j = tl.arange(0, NP)
        kept = tl.load(kept_ptr + j)
        kept_ok = j < N
        kept_tile = kept // 64
        q_kept = tl.load(q_row[:, None] + kept[None, :], mask=h_ok[:, None] & kept_ok[None, :], other=0.0).to(tl.bfloat16)
        acc_kept = tl.zeros((H_BLOCK, NP), dtype=tl.float32)

    # The sink takes softmax mass and gives no value: it starts the running max and sum.
    m = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * LOG2E_IN_KERNEL
    l = tl.full((H_BLOCK,), 1.0, dtype=tl.float32)

    # Window tokens: native records, all 512 coordinates.
    for start in range(0, W, BN):
        n = start + n_off
        loc = tl.load(win_locs_ptr + b * win_sb + n, mask=n < W, other=-1)
        valid = loc >= 0
        data, tail = _addresses(win_ptr, tl.maximum(loc, 0), win_per_page, win_stride, 576)
        k_rope = _load_rope(data, valid, 448).to(tl.bfloat16)
        codes = tl.load(data[:, None] + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0)
        k_full = _dequant(codes, _column_scales(tail, valid, d_tile))
        s = _mma(q_full, tl.trans(k_full), INTERPRETED) + _mma(q_rope, tl.trans(k_rope), INTERPRETED)
        m_new, alpha, pb, l = _softmax_step(s, valid, qk_scale, m, l)
        acc_rope = acc_rope * alpha[:, None] + _mma(pb, k_rope, INTERPRETED)
        if PACKED:
            # The kept columns' share goes to acc_kept (so each output column has one
            # accumulator); the record is in L1 from the load above.
            kcodes = tl.load(data[:, None] + kept[None, :], mask=valid[:, None] & kept_ok[None, :], other=0)
            k_kept = _dequant(kcodes, _column_scales(tail, valid, kept_tile))
            acc_kept = acc_kept * alpha[:, None] + _mma(pb, k_kept, INTERPRETED)
        acc_full = acc_full * alpha[:, None] + _mma(pb, k_full, INTERPRETED)
        m = m_new

    # Selected C4 records: native or packed. A packed record adds nothing to acc_full
    # (dropped columns), so acc_full is not rescaled per block: it is brought to the final
    # max once at the end (fewer live registers in the loop; it spilled otherwise).
    m_window = m
    C4_DATA: tl.constexpr = N + 128
    for start in range(0, K, BN):
        n = start + n_off
        loc = tl.load(c4_locs_ptr + b * c4_sb + n, mask=n < K, other=-1)
        valid = loc >= 0
        data, tail = _addresses(c4_ptr, tl.maximum(loc, 0), c4_per_page, c4_stride, C4_DATA)
        k_rope = _load_rope(data, valid, N).to(tl.bfloat16)
        if PACKED:
            codes = tl.load(data[:, None] + j[None, :], mask=valid[:, None] & kept_ok[None, :], other=0)
            k_kept = _dequant(codes, _column_scales(tail, valid, kept_tile))
            s = _mma(q_kept, tl.trans(k_kept), INTERPRETED) + _mma(q_rope, tl.trans(k_rope), INTERPRETED)
        else:
            codes = tl.load(data[:, None] + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0)
            k_full = _dequant(codes, _column_scales(tail, valid, d_tile))
            s = _mma(q_full, tl.trans(k_full), INTERPRETED) + _mma(q_rope, tl.trans(k_rope), INTERPRETED)
        m_new, alpha, pb, l = _softmax_step(s, valid, qk_scale, m, l)
        acc_rope = acc_rope * alpha[:, None] + _mma(pb, k_rope, INTERPRETED)
        if PACKED:
            acc_kept = acc_kept * alpha[:, None] + _mma(pb, k_kept, INTERPRETED)
        else:
            acc_full = acc_full * alpha[:, None] + _mma(pb, k_full, INTERPRETED)
        m = m_new

    inv_l = 1.0 / l
    out_ty = out_ptr.dtype.element_ty
    full_cols = d_ok
    if PACKED:
        acc_full = acc_full * tl.exp2(m_window - m)[:, None]
        full_cols = d_ok & (tl.load(slot_of_ptr + d) < 0)  # dropped columns only
        tl.store(o_row[:, None] + kept[None, :], (acc_kept * inv_l[:, None]).to(out_ty),
                 mask=h_ok[:, None] & kept_ok[None, :])
    tl.store(o_row[:, None] + d[None, :], (acc_full * inv_l[:, None]).to(out_ty), mask=h_ok[:, None] & full_cols[None, :])
    tl.store(o_row[:, None] + 448 + r[None, :], (acc_rope * inv_l[:, None]).to(out_ty), mask=h_ok[:, None])


def _check_layout(layout: PageLayout, pages: torch.Tensor, width: int, name: str) -> None:
    layout.check(pages, name)
    if layout.record_bytes != width:
        raise ValueError(f"{name} layout holds {layout.record_bytes}-byte records, expected {width}")


def decode(
    q: torch.Tensor,
    c4: torch.Tensor,
    c4_layout: PageLayout,
    c4_locs: torch.Tensor,
    window: torch.Tensor,
    window_layout: PageLayout,
    window_locs: torch.Tensor,
    sink: torch.Tensor,
    keep: "torch.Tensor | KeptColumns | None" = None,
    scale: float = 1.0 / math.sqrt(HEAD_DIM),
    out: torch.Tensor | None = None,
    check_range: bool = False,
    h_block: int = 64,
    block_n: int = 16,
    num_warps: int = 8,
    num_stages: int = 1,
    compiled: list | None = None,
) -> torch.Tensor:
    """Sparse decode of B tokens; see remnant.kv.paged.decode_native / decode_packed.

    q: bf16/float [B, H, 512]; c4_locs int [B, K], window_locs int [B, W] (-1 = padding);
    sink float [H]; keep None for native C4 records, int64 [N] for packed. The default
    config (64 heads per program, 16 records per step, 8 warps) was the fastest of the
    remnant-kernels tuning sweep for both variants on an H200 (benchmarks/kernels/). Returns out
    [B, H, 512] in q's dtype (or writes the given `out`).
    """
    if q.ndim != 3 or q.shape[2] != HEAD_DIM:
        raise ValueError(f"q must be [B, H, {HEAD_DIM}], got {tuple(q.shape)}")
    batch, heads, _ = q.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    cols = KeptColumns.of(keep, q.device)
    _check_layout(c4_layout, c4, cols.record_bytes, "c4")
    _check_layout(window_layout, window, NATIVE_RECORD_BYTES, "window")
    if c4_locs.ndim != 2 or c4_locs.shape[0] != batch or window_locs.ndim != 2 or window_locs.shape[0] != batch:
        raise ValueError(f"c4_locs and window_locs must be [B={batch}, *], got {tuple(c4_locs.shape)} and {tuple(window_locs.shape)}")
    if sink.shape != (heads,):
        raise ValueError(f"sink must be [H] = [{heads}], got {tuple(sink.shape)}")
    c4_locs = check_locs(c4_locs, "c4_locs", c4_layout.capacity(c4), check_range)
    window_locs = check_locs(window_locs, "window_locs", window_layout.capacity(window), check_range)
    if out is None:
        out = torch.empty_like(q)
    sink = sink.float().contiguous()
    grid = (triton.cdiv(heads, h_block), batch)
    kernel = _decode_kernel[grid](
        q, q.stride(0), q.stride(1),
        out, out.stride(0), out.stride(1),
        sink, heads,
        window, window_locs, window_locs.stride(0), window_locs.shape[1], window_layout.per_page, window_layout.page_stride,
        c4, c4_locs, c4_locs.stride(0), c4_locs.shape[1], c4_layout.per_page, c4_layout.page_stride,
        cols.kept, cols.slot_of, scale * LOG2E,
        N=cols.n_kept, NP=cols.kept.numel(),
        PACKED=cols.packed, H_BLOCK=h_block, BN=block_n, INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=num_warps, num_stages=num_stages,
    )
    if compiled is not None:  # the benchmark records registers and spills
        compiled.append(kernel)
    return out
