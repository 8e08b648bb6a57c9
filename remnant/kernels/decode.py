"""decode: sparse decode attention of one CSA layer over native or packed C4 records.

For each decode token b and each block of H_BLOCK query heads, one program runs one online
softmax over [attention sink | W window tokens | K selected C4 records], V = K (the same
512-vector), as DeepSeek-V4's sparse MLA decode does. Window tokens are native records;
C4 records are native (the stock baseline) or packed (kernel mode).

Both variants share this code and its care: records are read once per program as 16-byte
vector loads of 4-byte words (codes), bf16 RoPE and one int64 of scales, on addresses the
compiler is told are aligned; scales are applied by building the float32 2^(s-127) from
the UE8M0 byte (exact), keys are dequantized to bf16 (exact: FP8 e4m3 times a power of
two), and both matrix products run on the tensor cores in bf16 with float32 accumulation.

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

from remnant.kernels.common import alignment, check_locs, record_addresses
from remnant.kv.formats import HEAD_DIM, NATIVE_RECORD_BYTES
from remnant.kv.paged import KeptColumns, PageLayout

LOG2E = 1.4426950408889634
LOG2E_IN_KERNEL: tl.constexpr = tl.constexpr(LOG2E)


@triton.jit
def _load_records(base_ptr, locs_ptr, n, count, PER_PAGE: tl.constexpr, stride,
                  DATA: tl.constexpr, ALIGN: tl.constexpr, WORDS: tl.constexpr, NW: tl.constexpr):
    """The raw bytes of the records listed at locs_ptr[n] (n >= count or loc -1: invalid).

    Returns (valid [BN], data pointers [BN], codes as int32 words [BN, NW] (4 codes each;
    words >= WORDS are zero), RoPE bf16 [BN, 64], the 8 tail bytes as one int64 [BN]).
    Fetching block i + 1 while computing block i (registers carried across the loop) was
    slower on the H200: it raised register spills (benchmarks/kernels/NOTES.md).
    """
    loc = tl.load(locs_ptr + n, mask=n < count, other=-1)
    valid = loc >= 0
    data, tail = record_addresses(base_ptr, tl.maximum(loc, 0), PER_PAGE, stride, DATA, ALIGN)
    w = tl.arange(0, NW)
    words = tl.load(data.to(tl.pointer_type(tl.int32))[:, None] + w[None, :],
                    mask=valid[:, None] & (w[None, :] < WORDS), other=0)
    r = tl.arange(0, 64)
    rope = tl.load((data + 4 * WORDS).to(tl.pointer_type(tl.bfloat16))[:, None] + r[None, :],
                   mask=valid[:, None], other=0.0)
    scales = tl.load(tail.to(tl.pointer_type(tl.int64)), mask=valid, other=0)
    return valid, data, words, rope, scales


@triton.jit
def _code_bytes(words):
    """int32 words [BN, NW] -> their bytes [BN, 4 NW] in memory order (little-endian)."""
    b0 = (words & 0xFF).to(tl.uint8)
    b1 = ((words >> 8) & 0xFF).to(tl.uint8)
    b2 = ((words >> 16) & 0xFF).to(tl.uint8)
    b3 = ((words >> 24) & 0xFF).to(tl.uint8)
    # join(join(b0, b2), join(b1, b3))[..., j, i] is byte 2j + i of the word.
    quads = tl.join(tl.join(b0, b2), tl.join(b1, b3))
    return tl.reshape(quads, (words.shape[0], 4 * words.shape[1]))


@triton.jit
def _tile_scale(scales, t: tl.constexpr):
    """float32 [BN]: tile t's UE8M0 scale 2^(s - 127) from the 8 tail bytes (exact)."""
    s = ((scales >> (8 * t)) & 0xFF).to(tl.int32)
    return (s << 23).to(tl.float32, bitcast=True)


@triton.jit
def _dequant(codes, col_tile, scales):
    """FP8 codes [BN, C] (uint8) of columns in tiles col_tile [C] (sorted) -> bf16 (exact).

    Each column's scale is chosen by a select chain over the 7 tile scales (kept columns
    are sorted, so their tiles rise); no [BN, C] integer tile is formed.
    """
    scale = tl.broadcast_to(_tile_scale(scales, 0)[:, None], codes.shape)
    for t in tl.static_range(1, 7):
        scale = tl.where(col_tile[None, :] >= t, _tile_scale(scales, t)[:, None], scale)
    return (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale).to(tl.bfloat16)


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
    win_ptr, win_locs_ptr, win_sb, W, win_stride,
    c4_ptr, c4_locs_ptr, c4_sb, K, c4_stride,
    kept_ptr, slot_of_ptr, qk_scale,
    WIN_PER_PAGE: tl.constexpr, WIN_ALIGN: tl.constexpr, C4_PER_PAGE: tl.constexpr, C4_ALIGN: tl.constexpr,
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
    win_locs = win_locs_ptr + b * win_sb
    c4_locs = c4_locs_ptr + b * c4_sb

    q_full = tl.load(q_row[:, None] + d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(tl.bfloat16)
    q_rope = tl.load(q_row[:, None] + 448 + r[None, :], mask=h_ok[:, None], other=0.0).to(tl.bfloat16)
    acc_full = tl.zeros((H_BLOCK, 512), dtype=tl.float32)
    acc_rope = tl.zeros((H_BLOCK, 64), dtype=tl.float32)
    j = tl.arange(0, NP)
    kept = tl.load(kept_ptr + j)
    kept_ok = j < N
    kept_tile = kept // 64
    if PACKED:
        # Packed C4 records hold the kept columns only, in map order: their scores use q
        # at those columns, and their output accumulates in acc_kept (kept order).
        q_kept = tl.load(q_row[:, None] + kept[None, :], mask=h_ok[:, None] & kept_ok[None, :], other=0.0).to(tl.bfloat16)
        acc_kept = tl.zeros((H_BLOCK, NP), dtype=tl.float32)

    # The sink takes softmax mass and gives no value: it starts the running max and sum.
    m = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * LOG2E_IN_KERNEL
    l = tl.full((H_BLOCK,), 1.0, dtype=tl.float32)

    # Window tokens: native records, all 512 coordinates.
    for start in range(0, W, BN):
        valid, data, words, rope, scales = _load_records(win_ptr, win_locs, start + n_off, W, WIN_PER_PAGE,
                                                         win_stride, 576, WIN_ALIGN, 112, 128)
        k_rope = rope.to(tl.bfloat16)
        k_full = _dequant(_code_bytes(words), d_tile, scales)
        s = _mma(q_full, tl.trans(k_full), INTERPRETED) + _mma(q_rope, tl.trans(k_rope), INTERPRETED)
        m_new, alpha, pb, l = _softmax_step(s, valid, qk_scale, m, l)
        acc_rope = acc_rope * alpha[:, None] + _mma(pb, k_rope, INTERPRETED)
        if PACKED:
            # The kept columns' share goes to acc_kept (so each output column has one
            # accumulator), read again by index from the record the step just loaded (L1).
            kcodes = tl.load(data[:, None] + kept[None, :], mask=valid[:, None] & kept_ok[None, :], other=0)
            acc_kept = acc_kept * alpha[:, None] + _mma(pb, _dequant(kcodes, kept_tile, scales), INTERPRETED)
        acc_full = acc_full * alpha[:, None] + _mma(pb, k_full, INTERPRETED)
        m = m_new

    # Selected C4 records: native or packed. A packed record adds nothing to acc_full
    # (dropped columns), so acc_full is not rescaled per block: it is brought to the final
    # max once at the end (fewer live registers in the loop; it spilled otherwise).
    m_window = m
    C4_DATA: tl.constexpr = N + 128
    C4_WORDS: tl.constexpr = N // 4
    C4_NW: tl.constexpr = NP // 4 if PACKED else 128
    for start in range(0, K, BN):
        valid, data, words, rope, scales = _load_records(c4_ptr, c4_locs, start + n_off, K, C4_PER_PAGE, c4_stride,
                                                         C4_DATA, C4_ALIGN, C4_WORDS, C4_NW)
        k_rope = rope.to(tl.bfloat16)
        if PACKED:
            k_kept = _dequant(_code_bytes(words), kept_tile, scales)
            s = _mma(q_kept, tl.trans(k_kept), INTERPRETED) + _mma(q_rope, tl.trans(k_rope), INTERPRETED)
        else:
            k_full = _dequant(_code_bytes(words), d_tile, scales)
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
    block_n: int = 32,
    num_warps: int = 8,
    num_stages: int = 1,
    compiled: list | None = None,
) -> torch.Tensor:
    """Sparse decode of B tokens; see remnant.kv.paged.decode_native / decode_packed.

    q: bf16/float [B, H, 512]; c4_locs int [B, K], window_locs int [B, W] (-1 = padding);
    sink float [H]; keep None for native C4 records, int64 [N] for packed. The default
    config (64 heads per program, 32 records per step, 8 warps) was the fastest of the
    remnant-kernels tuning sweep on an H200 (benchmarks/kernels/). Returns out
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
        window, window_locs, window_locs.stride(0), window_locs.shape[1], window_layout.page_stride,
        c4, c4_locs, c4_locs.stride(0), c4_locs.shape[1], c4_layout.page_stride,
        cols.kept, cols.slot_of, scale * LOG2E,
        WIN_PER_PAGE=window_layout.per_page, WIN_ALIGN=alignment(window_layout, "window"),
        C4_PER_PAGE=c4_layout.per_page, C4_ALIGN=alignment(c4_layout, "c4"),
        N=cols.n_kept, NP=cols.kept.numel(),
        PACKED=cols.packed, H_BLOCK=h_block, BN=block_n, INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=num_warps, num_stages=num_stages,
    )
    if compiled is not None:  # the benchmark records registers and spills
        compiled.append(kernel)
    return out
