"""The Triton decode kernel: sparse decode attention over native or packed records (one CSA
layer's C4 records; the engine also passes HCA layers' C128 records, or none, in the same
slot). It reads every record form on every GPU and in Triton's interpreter: the CPU-tested
reference of the SM90 kernel and the fallback wherever another cannot take a call.

For each decode token b and each block of H_BLOCK query heads, one program (or `splits`
programs, each over a share of the records, their partial outputs written in float32 or
row-scaled float16 and joined by their log-sum-exp: by _combine_kernel, or, for two splits
launched as one cluster of two CTAs, by the splits themselves) runs one online
softmax over the attention sink, W window tokens and K selected C4 records, V = K (the same
512-vector), as DeepSeek-V4's sparse MLA decode does. C4 records are native (the stock
baseline) or packed (kernel mode); window tokens are native records or, with packed C4
records, records packed with the same keep list (window_columns="packed").

Both variants share this code and its care: native and packed C4 records are read once
per program as vector loads of 4-byte words (16-byte vectors on SGLang's pages, 8-byte on
plain rows), bf16 RoPE and one int64 of scales, on addresses the compiler is told are
aligned; each column's scale is the float32 2^(s-127) built from its tile's UE8M0 byte,
picked by one byte permute per value (exact; _selected_scales; the packed kernel's
transposed loops compare positions with tile starts instead), keys are dequantized to bf16 (exact: FP8 e4m3 times a power of two), and both
matrix products run on the tensor cores in bf16 with float32 accumulation.

Packed C4 records hold only the kept NoPE coordinates, so the packed variant works in
kept-first column order (KeptColumns.order): q is read and out written as the N kept
columns in map order, the 448 - N dropped ones, then RoPE, each set contiguous. Scores of
C4 records use the kept columns and RoPE only and add to acc_kept; window records add to
acc_kept and acc_drop: native ones with their codes read by column index into both sets,
or kept-first window records (window_columns="kept_first": remnant.kv.paged.
quantize_kept_first, codes in kept-first order and scale tiles of 64 kept-first
positions) as runs of words, each code's scale found from its position. Packed window
records (window_columns="packed": the C4 format, stored with the layer's keep list) are
read by the C4 loop itself over the window's range and add to acc_kept only: no record
then holds a dropped column, and those output columns are 0. (A kept set whose size is
not a power of two is a block and a tail, each with its own accumulator:
kept_column_blocks.) Every output column has exactly one accumulator (with a packed
window the dropped ones none: they are written as 0) and is rounded to bf16 once. The
wrapper permutes q and out to and from that order (permute_columns) unless the caller
passes them in it (columns="kept_first": the permutation folded into the model's
projections).

Where q, out and the window are all in natural order (as SGLang calls the kernel) and the
batch fills the GPU, the window gets a program of its own instead (window_apart): split 0
runs the native program over the window, the other splits the packed program over the C4
records with q read through the kept columns, and the join (_combine_kernel) reads each
partial in its own order. That avoids the fused program's window loop, whose codes are
read by column index.

Which of these runs, with which launch settings, is remnant.kernels.decode.plan's
DecodePlan (plan_decode); `run` launches a plan on inputs remnant.kernels.decode.decode
has checked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from remnant.kernels.common import alignment, byte_permute, interpreted, launch_in_pairs, record_addresses
from remnant.kernels.decode.plan import DecodePlan, window_step_cost
from remnant.kv.formats import HEAD_DIM
from remnant.kv.layout import KeptColumns, PageLayout

LOG2E = 1.4426950408889634
LOG2E_IN_KERNEL: tl.constexpr = tl.constexpr(LOG2E)
EMPTY_MAX: tl.constexpr = tl.constexpr(-1e30)  # the running max of a split before its first record
PARTIAL_DTYPES = {"float32": torch.float32, "float16": torch.float16}
# Heads per program and warps of the join (_combine_kernel) and of the permute pass
# (permute_columns). Reading a row by index is one 2-byte load per value; 2 heads per
# program spread those loads over four times the programs of 8 (NOTES.md, thirteenth round).
JOIN_LAUNCH = (2, 4)
PERMUTE_LAUNCH = (2, 2)


@triton.jit
def _locations(locs_ptr, n, count):
    """The locations listed at locs_ptr[n], -1 (invalid) for n >= count.

    Each loop loads the next step's locations at the top of the current step, so a step
    waits for one memory round trip (its records), not two (locations, then records)."""
    return tl.load(locs_ptr + n, mask=n < count, other=-1)


@triton.jit
def _load_records(base_ptr, loc, PER_PAGE: tl.constexpr, stride,
                  DATA: tl.constexpr, ALIGN: tl.constexpr, ROPE_AT: tl.constexpr):
    """Records at locations loc [BN] (-1: invalid): (valid [BN], data pointers [BN], RoPE
    bf16 [BN, 64] at byte ROPE_AT, the 7 scale bytes and a zero byte as one int64 [BN])."""
    valid = loc >= 0
    data, tail = record_addresses(base_ptr, tl.maximum(loc, 0), PER_PAGE, stride, DATA, ALIGN)
    r = tl.arange(0, 64)
    rope = tl.load((data + ROPE_AT).to(tl.pointer_type(tl.bfloat16))[:, None] + r[None, :],
                   mask=valid[:, None], other=0.0)
    # The pad byte is cleared: selectors (_selected_scales) read it as a zero byte, and
    # SGLang's quantizer need not write it.
    scales = tl.load(tail.to(tl.pointer_type(tl.int64)), mask=valid, other=0) & 0x00FFFFFFFFFFFFFF
    return valid, data, rope, scales


@triton.jit
def _load_words(data, valid, WORDS: tl.constexpr, NW: tl.constexpr):
    """The first WORDS 4-byte words of each record's codes, int32 [BN, NW] (zero beyond):
    16-byte vector loads where the layout is 16-byte aligned."""
    w = tl.arange(0, NW)
    return tl.load(data.to(tl.pointer_type(tl.int32))[:, None] + w[None, :],
                   mask=valid[:, None] & (w[None, :] < WORDS), other=0)


@triton.jit
def _load_columns(data, valid, cols, cols_ok):
    """FP8 codes of the native columns `cols` [C] of each record, uint8 [BN, C] (byte loads
    by index; the record's lines are shared by the whole block, L1-served)."""
    return tl.load(data[:, None] + cols[None, :], mask=valid[:, None] & cols_ok[None, :], other=0)


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
def _selectors(cols):
    """The byte selector of each native column (int32 [C]) for _selected_scales: byte 3
    of the result from tail byte (its scale tile) col // 64, bytes 0-2 from the zero pad
    byte 7."""
    return ((cols >> 6) << 12) | 0x777


@triton.jit
def _selected_scales(scales, sel, INTERPRETED: tl.constexpr):
    """float32 [BN, C]: each record's scale 2^(s - 127) of each column's tile (exact), picked
    by the column's selector (_selectors) with one byte permute (prmt) of the 8 tail bytes:
    it yields s << 24, shifted to the float's exponent field. Three instructions per value
    where comparing positions with the 7 tile starts took twelve (a third of the packed
    kernel's instructions; benchmarks/kernels/NOTES.md, fifth round)."""
    shape: tl.constexpr = (scales.shape[0], sel.shape[0])
    byte3 = byte_permute(tl.broadcast_to(scales.to(tl.int32)[:, None], shape),
                         tl.broadcast_to((scales >> 32).to(tl.int32)[:, None], shape),
                         tl.broadcast_to(sel[None, :], shape), INTERPRETED)
    return (byte3.to(tl.uint32, bitcast=True) >> 1).to(tl.float32, bitcast=True)


@triton.jit
def _tile_start_scales(scales, col, starts_ptr):
    """float32 [BN, C]: each record's scale of each position `col` [C] of a sorted column set
    whose tile t starts at position starts_ptr[t] (KeptColumns): position j is in tile t or
    later when j >= start t, so a select chain over the 7 tile scales compares positions
    with 7 scalars. Used where a selector per column would be held in the transposed
    product's operand layout, in which each thread holds many columns and the selectors
    spilled (NOTES.md, fifth round)."""
    scale = tl.broadcast_to(_tile_scale(scales, 0)[:, None], (scales.shape[0], col.shape[0]))
    for t in tl.static_range(1, 7):
        scale = tl.where(col[None, :] >= tl.load(starts_ptr + t), _tile_scale(scales, t)[:, None], scale)
    return scale


@triton.jit
def _dequant(codes, scale):
    """FP8 e4m3 codes [BN, C] (uint8) times their scales [BN, C] -> bf16 (exact: the scale is
    a power of two)."""
    return (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale).to(tl.bfloat16)


@triton.jit
def _set_scales(scales, col, sel, starts_ptr, BY_SELECTOR: tl.constexpr, INTERPRETED: tl.constexpr):
    """A packed column set's scales [BN, C]: by its selectors `sel` (BY_SELECTOR: the q K^T
    form, and kept-first window records in either form, whose selectors follow from
    positions) or by its positions `col` and tile starts (natural tiles, transposed form)."""
    if BY_SELECTOR:
        return _selected_scales(scales, sel, INTERPRETED)
    return _tile_start_scales(scales, col, starts_ptr)


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
def _qk(q, q_t, k, SCORES_T: tl.constexpr, INTERPRETED: tl.constexpr):
    """q k^T [H, BN] for H query heads and BN keys.

    SCORES_T computes (k q^T)^T instead, so the records are the product's M side and the
    heads its N side (q^T loaded once): with 16-32 records per step, q k^T is a product of
    N = 16-32, which ran the tensor cores at a fraction of their rate on the H200.
    """
    if SCORES_T:
        return tl.trans(_mma(k, q_t, INTERPRETED))
    return _mma(q, tl.trans(k), INTERPRETED)


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
def _inverse_sum(l, SPLIT: tl.constexpr):
    """1 / l; 0 for a split that saw no record (l = 0, its accumulators are 0)."""
    if SPLIT:
        return tl.where(l > 0, 1.0 / l, 0.0)
    return 1.0 / l


@triton.jit
def _load_q(q_row, h_ok, cols, cols_ok):
    q = tl.load(q_row[:, None] + cols[None, :], mask=h_ok[:, None] & cols_ok[None, :], other=0.0).to(tl.bfloat16)
    return q, tl.trans(q)


@triton.jit
def _native_step(valid, data, rope, scales, q_full, q_full_t, q_rope, q_rope_t, qk_scale, m, l,
                 acc_full, acc_rope, SCORES_T: tl.constexpr, INTERPRETED: tl.constexpr):
    """One block of native records (window or C4) into the all-columns accumulators."""
    k_rope = rope.to(tl.bfloat16)
    # Native selectors come from the column index (no table held), in either form.
    k_full = _dequant(_code_bytes(_load_words(data, valid, 112, 128)),
                      _selected_scales(scales, _selectors(tl.arange(0, 512)), INTERPRETED))
    s = _qk(q_full, q_full_t, k_full, SCORES_T, INTERPRETED) + _qk(q_rope, q_rope_t, k_rope, SCORES_T, INTERPRETED)
    m_new, alpha, pb, l = _softmax_step(s, valid, qk_scale, m, l)
    acc_rope = acc_rope * alpha[:, None] + _mma(pb, k_rope, INTERPRETED)
    acc_full = acc_full * alpha[:, None] + _mma(pb, k_full, INTERPRETED)
    return m_new, l, acc_full, acc_rope


@triton.jit
def _native_loop(ptr, locs, lo, hi, STEP: tl.constexpr, PER_PAGE: tl.constexpr, ALIGN: tl.constexpr, stride,
                 q_full, q_full_t, q_rope, q_rope_t, qk_scale, m, l, acc_full, acc_rope,
                 SCORES_T: tl.constexpr, INTERPRETED: tl.constexpr):
    """Native records at locs[lo:hi], STEP per step, into the all-columns accumulators."""
    off = tl.arange(0, STEP)
    loc = _locations(locs, lo + off, hi)
    for start in range(lo, hi, STEP):
        loc_next = _locations(locs, start + STEP + off, hi)
        valid, data, rope, scales = _load_records(ptr, loc, PER_PAGE, stride, 576, ALIGN, 448)
        loc = loc_next
        m, l, acc_full, acc_rope = _native_step(valid, data, rope, scales, q_full, q_full_t, q_rope, q_rope_t,
                                                qk_scale, m, l, acc_full, acc_rope, SCORES_T, INTERPRETED)
    return m, l, acc_full, acc_rope


@triton.jit
def _native_program(q_row, h_ok, o_row, m, l, qk_scale,
                    win_ptr, win_locs, win_lo, win_hi, win_stride, c4_ptr, c4_locs, c4_lo, c4_hi, c4_stride,
                    WIN_PER_PAGE: tl.constexpr, WIN_ALIGN: tl.constexpr, C4_PER_PAGE: tl.constexpr,
                    C4_ALIGN: tl.constexpr, H_BLOCK: tl.constexpr, BN: tl.constexpr, WIN_BN: tl.constexpr,
                    SCORES_T: tl.constexpr, WIN_SCORES_T: tl.constexpr, SPLIT: tl.constexpr,
                    SCALED: tl.constexpr, INTERPRETED: tl.constexpr):
    """Native records (window tokens, then C4 records) in natural column order: q read and
    out written as the model holds them. Returns the running max and sum, and the scale
    of the partial it wrote (SCALED: float16 partials, _row_scale; else 1)."""
    r = tl.arange(0, 64)
    d = tl.arange(0, 512)
    d_ok = d < 448
    q_full, q_full_t = _load_q(q_row, h_ok, d, d_ok)
    q_rope, q_rope_t = _load_q(q_row + 448, h_ok, r, r < 64)
    acc_full = tl.zeros((H_BLOCK, 512), dtype=tl.float32)
    acc_rope = tl.zeros((H_BLOCK, 64), dtype=tl.float32)
    m, l, acc_full, acc_rope = _native_loop(
        ptr=win_ptr, locs=win_locs, lo=win_lo, hi=win_hi, STEP=WIN_BN, PER_PAGE=WIN_PER_PAGE, ALIGN=WIN_ALIGN,
        stride=win_stride, q_full=q_full, q_full_t=q_full_t, q_rope=q_rope, q_rope_t=q_rope_t, qk_scale=qk_scale,
        m=m, l=l, acc_full=acc_full, acc_rope=acc_rope, SCORES_T=WIN_SCORES_T, INTERPRETED=INTERPRETED)
    # When the window loop and the C4 loop take scores in different forms (q in registers,
    # or q^T in shared memory), the second loop loads q again (from L2) rather than hold
    # both forms through both loops.
    if WIN_SCORES_T != SCORES_T:
        q_full, q_full_t = _load_q(q_row, h_ok, d, d_ok)
        q_rope, q_rope_t = _load_q(q_row + 448, h_ok, r, r < 64)
    m, l, acc_full, acc_rope = _native_loop(
        ptr=c4_ptr, locs=c4_locs, lo=c4_lo, hi=c4_hi, STEP=BN, PER_PAGE=C4_PER_PAGE, ALIGN=C4_ALIGN,
        stride=c4_stride, q_full=q_full, q_full_t=q_full_t, q_rope=q_rope, q_rope_t=q_rope_t, qk_scale=qk_scale,
        m=m, l=l, acc_full=acc_full, acc_rope=acc_rope, SCORES_T=SCORES_T, INTERPRETED=INTERPRETED)
    inv_l = _inverse_sum(l, SPLIT)
    row_scale = tl.full((H_BLOCK,), 1.0, tl.float32)
    if SCALED:
        row_scale = _row_scale(tl.maximum(_row_max(acc_full), _row_max(acc_rope)) * inv_l)
        inv_l = inv_l / row_scale
    out_ty = o_row.dtype.element_ty
    tl.store(o_row[:, None] + d[None, :], (acc_full * inv_l[:, None]).to(out_ty), mask=h_ok[:, None] & d_ok[None, :])
    tl.store(o_row[:, None] + 448 + r[None, :], (acc_rope * inv_l[:, None]).to(out_ty), mask=h_ok[:, None])
    return m, l, row_scale


@triton.jit
def _row_max(acc):
    """Each row's largest magnitude of an accumulator [H, C]."""
    return tl.max(tl.abs(acc), axis=1)


@triton.jit
def _row_scale(top):
    """The scale of each row of a float16 partial: 2^-14 times the power of two at or below
    the row's largest magnitude `top` (at least 2^-126, the least normal float32). The row
    is written divided by it (exact: a power of two), so its largest value lies in [2^14,
    2^15), under float16's 65504 (less in a row below 2^-112), and every value down to
    2^-28 of the largest is a normal float16, rounded to 2^-11 of itself as float32 would
    be to 2^-24 (the bf16 output rounds to 2^-8); infinities and NaN stay so. Unscaled
    bf16 partials doubled the error where partials nearly cancel (NOTES.md, eighth round)."""
    bits = (top.to(tl.int32, bitcast=True) & 0x7F800000) - (14 << 23)
    return tl.maximum(bits, 1 << 23).to(tl.float32, bitcast=True)


@triton.jit
def _cluster_barrier():
    """Both CTAs of the cluster arrive (releasing their writes) and wait (acquiring the
    other's); every thread of each runs it once."""
    tl.inline_asm_elementwise("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; "
                              "mov.b32 $0, 0;", "=r,r", [tl.full([], 0, tl.int32)], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def _q_columns(idx, cols_ptr, Q_GATHER: tl.constexpr):
    """The q columns of a kept-first column set at positions idx: idx itself (q given in
    kept-first order) or, Q_GATHER, the natural columns listed at cols_ptr[idx]."""
    if Q_GATHER:
        return tl.load(cols_ptr + idx)
    return idx


@triton.jit
def _packed_loop(ptr, locs, lo, hi, STEP: tl.constexpr, PER_PAGE: tl.constexpr, ALIGN: tl.constexpr, stride,
                 kept_starts_ptr, q_kept, q_kept_t, q_tail, q_tail_t, q_rope, q_rope_t, sel_kept, sel_tail,
                 qk_scale, m, l, acc_kept, acc_tail, acc_rope, N: tl.constexpr, KA: tl.constexpr,
                 KA_N: tl.constexpr, KT: tl.constexpr, SCORES_T: tl.constexpr, INTERPRETED: tl.constexpr):
    """Packed records at locs[lo:hi], STEP per step, into the kept columns' accumulators
    (acc_kept; acc_tail where KT, else a placeholder, and q_tail, q_tail_t and sel_tail None): the C4
    records, and a packed window (window_columns="packed"), which is read as they are.
    Their kept codes are runs of words; each code's scale is its kept column's (natural
    tiles: the selectors sel_kept and sel_tail, or the kept list's tile starts)."""
    j = tl.arange(0, KA)
    n_off = tl.arange(0, STEP)
    loc = _locations(locs, lo + n_off, hi)
    for start in range(lo, hi, STEP):
        loc_next = _locations(locs, start + STEP + n_off, hi)
        valid, data, rope, scales = _load_records(ptr, loc, PER_PAGE, stride, N + 128, ALIGN, N)
        loc = loc_next
        k_rope = rope.to(tl.bfloat16)
        k_kept = _dequant(_code_bytes(_load_words(data, valid, KA_N // 4, KA // 4)),
                          _set_scales(scales, j, sel_kept, kept_starts_ptr, not SCORES_T, INTERPRETED))
        s = _qk(q_kept, q_kept_t, k_kept, SCORES_T, INTERPRETED) + _qk(q_rope, q_rope_t, k_rope, SCORES_T, INTERPRETED)
        if KT:
            t = tl.arange(0, KT)
            k_tail = _dequant(_code_bytes(_load_words(data + KA, valid, (N - KA) // 4, KT // 4)),
                              _set_scales(scales, KA + t, sel_tail, kept_starts_ptr, not SCORES_T, INTERPRETED))
            s += _qk(q_tail, q_tail_t, k_tail, SCORES_T, INTERPRETED)
        m_new, alpha, pb, l = _softmax_step(s, valid, qk_scale, m, l)
        acc_rope = acc_rope * alpha[:, None] + _mma(pb, k_rope, INTERPRETED)
        acc_kept = acc_kept * alpha[:, None] + _mma(pb, k_kept, INTERPRETED)
        if KT:
            acc_tail = acc_tail * alpha[:, None] + _mma(pb, k_tail, INTERPRETED)
        m = m_new
    return m, l, acc_kept, acc_tail, acc_rope


@triton.jit
def _packed_program(q_row, h_ok, o_row, m, l, qk_scale,
                    win_ptr, win_locs, win_lo, win_hi, win_stride, c4_ptr, c4_locs, c4_lo, c4_hi, c4_stride,
                    kept_ptr, dropped_ptr, kept_starts_ptr, dropped_starts_ptr,
                    WIN_PER_PAGE: tl.constexpr, WIN_ALIGN: tl.constexpr, C4_PER_PAGE: tl.constexpr,
                    C4_ALIGN: tl.constexpr, N: tl.constexpr, KA: tl.constexpr, KA_N: tl.constexpr, KT: tl.constexpr,
                    DP: tl.constexpr, H_BLOCK: tl.constexpr, BN: tl.constexpr, WIN_BN: tl.constexpr,
                    WIN_KEPT_FIRST: tl.constexpr, WIN_PACKED: tl.constexpr, WITH_WINDOW: tl.constexpr,
                    Q_GATHER: tl.constexpr, SCORES_T: tl.constexpr, WIN_SCORES_T: tl.constexpr, SPLIT: tl.constexpr,
                    SCALED: tl.constexpr, INTERPRETED: tl.constexpr):
    """Packed C4 records, then (WITH_WINDOW) window tokens, in kept-first column order.
    Returns the running max and sum, and the scale of the partial it wrote (SCALED: float16
    partials, _row_scale; else 1).

    out is written in kept-first column order (KeptColumns.order): the N kept columns in
    map order, then the 448 - N dropped ones, then RoPE at 448, so both column sets store
    contiguously (scattered bf16 stores of the output by column index cost a large part of
    the call); q is read in that order too or, Q_GATHER, from the model's
    order through the column tables. Each set has its accumulators: acc_kept (C4 records
    and window tokens add to it) and acc_drop (window tokens only). C4 records come first,
    so acc_drop is live only in the window loop (the softmax does not depend on the order).
    The kept set is one block of KA columns (a power of two, KA_N of them kept) or, when N
    is not a power of two, a block of KA = KA_N columns and a tail of KT (N = 192: 128 and
    64, not 256 with 64 of padding in every product and accumulator). Without the window
    (WITH_WINDOW False: it has a program of its own) no dropped column is written: the
    join reads none of this program's. A packed window (WIN_PACKED: records packed with
    the C4 records' keep list) runs the C4 loop over its own range (_packed_loop): no
    record adds to the dropped columns then, and they are written as 0, no acc_drop held.
    """
    r = tl.arange(0, 64)
    j = tl.arange(0, KA)
    kept_ok = j < N
    q_kept, q_kept_t = _load_q(q_row, h_ok, _q_columns(j, kept_ptr, Q_GATHER), kept_ok)
    q_rope, q_rope_t = _load_q(q_row + 448, h_ok, r, r < 64)
    acc_kept = tl.zeros((H_BLOCK, KA), dtype=tl.float32)
    acc_rope = tl.zeros((H_BLOCK, 64), dtype=tl.float32)
    # Each set's scale selectors are loaded before each loop that reads them (a transposed
    # loop over natural tiles leaves them unused, and they are dropped): _set_scales.
    sel_kept = _selectors(tl.load(kept_ptr + j))
    if KT:
        t = tl.arange(0, KT)
        tail_ok = t < N - KA
        q_tail, q_tail_t = _load_q(q_row, h_ok, _q_columns(KA + t, kept_ptr, Q_GATHER), tail_ok)
        acc_tail = tl.zeros((H_BLOCK, KT), dtype=tl.float32)
        sel_tail = _selectors(tl.load(kept_ptr + KA + t))
    else:  # no tail: _packed_loop takes None for its operands, and a placeholder
        # accumulator it hands back untouched (compiled Triton 3.6 returns no None)
        q_tail, q_tail_t, sel_tail = None, None, None
        acc_tail = tl.zeros((1, 1), dtype=tl.float32)
    m, l, acc_kept, acc_tail, acc_rope = _packed_loop(
        ptr=c4_ptr, locs=c4_locs, lo=c4_lo, hi=c4_hi, STEP=BN, PER_PAGE=C4_PER_PAGE, ALIGN=C4_ALIGN,
        stride=c4_stride, kept_starts_ptr=kept_starts_ptr, q_kept=q_kept, q_kept_t=q_kept_t, q_tail=q_tail,
        q_tail_t=q_tail_t, q_rope=q_rope, q_rope_t=q_rope_t, sel_kept=sel_kept, sel_tail=sel_tail,
        qk_scale=qk_scale, m=m, l=l, acc_kept=acc_kept, acc_tail=acc_tail, acc_rope=acc_rope, N=N, KA=KA, KA_N=KA_N,
        KT=KT, SCORES_T=SCORES_T, INTERPRETED=INTERPRETED)
    if WITH_WINDOW:
        i = tl.arange(0, DP)
        dropped_ok = i < 448 - N
    if WITH_WINDOW and WIN_PACKED:
        # Window records packed as the C4 records are: the same loop over the window's
        # range, q loaded again where the two loops take scores in different forms.
        if WIN_SCORES_T != SCORES_T:
            q_kept, q_kept_t = _load_q(q_row, h_ok, _q_columns(j, kept_ptr, Q_GATHER), kept_ok)
            q_rope, q_rope_t = _load_q(q_row + 448, h_ok, r, r < 64)
            if KT:
                q_tail, q_tail_t = _load_q(q_row, h_ok, _q_columns(KA + t, kept_ptr, Q_GATHER), tail_ok)
        m, l, acc_kept, acc_tail, acc_rope = _packed_loop(
            ptr=win_ptr, locs=win_locs, lo=win_lo, hi=win_hi, STEP=WIN_BN, PER_PAGE=WIN_PER_PAGE, ALIGN=WIN_ALIGN,
            stride=win_stride, kept_starts_ptr=kept_starts_ptr, q_kept=q_kept, q_kept_t=q_kept_t, q_tail=q_tail,
            q_tail_t=q_tail_t, q_rope=q_rope, q_rope_t=q_rope_t, sel_kept=sel_kept, sel_tail=sel_tail,
            qk_scale=qk_scale, m=m, l=l, acc_kept=acc_kept, acc_tail=acc_tail, acc_rope=acc_rope, N=N, KA=KA,
            KA_N=KA_N, KT=KT, SCORES_T=WIN_SCORES_T, INTERPRETED=INTERPRETED)
    elif WITH_WINDOW:
        # Window tokens: native records. In natural order their codes are read by native
        # column index into both sets; the index loads hold a pointer per byte, so this
        # loop runs best at 16 records per step (its registers bound the whole kernel's),
        # and it cost the packed kernel several times the native kernel's window loop
        # (hence window_apart). WIN_KEPT_FIRST:
        # kept-first window records (store_kept_first), read as runs of words.
        tl.static_assert(not Q_GATHER, "q through the kept columns is for programs without the window")
        acc_drop = tl.zeros((H_BLOCK, DP), dtype=tl.float32)
        if WIN_KEPT_FIRST:
            # Their scale tiles are of 64 kept-first positions, so a column's selector
            # follows from its position, as a native column's from its index: computed in
            # place, not held. Held (natural tiles: the kept and dropped lists' selectors)
            # they spilled, 60 values against 22 (NOTES.md, fifteenth round).
            # (Padding positions past 448, as at N = 64 with 384 dropped in 512, take the
            # zero pad byte's selector: their codes are masked to 0, and a tile-8 selector
            # would have prmt replicate a sign instead.)
            sel_kept = _selectors(j)
            sel_drop = _selectors(tl.minimum(N + i, 448))
            if KT:
                sel_tail = _selectors(KA + t)
        else:  # natural order: the column lists give each code's address and its tile
            kept = tl.load(kept_ptr + j)
            dropped = tl.load(dropped_ptr + i)
            sel_kept = _selectors(kept)
            sel_drop = _selectors(dropped)
            if KT:
                kept_tail = tl.load(kept_ptr + KA + t)
                sel_tail = _selectors(kept_tail)
        if WIN_SCORES_T != SCORES_T:
            q_kept, q_kept_t = _load_q(q_row, h_ok, j, kept_ok)
            q_rope, q_rope_t = _load_q(q_row + 448, h_ok, r, r < 64)
            if KT:
                q_tail, q_tail_t = _load_q(q_row + KA, h_ok, t, tail_ok)
        q_drop, q_drop_t = _load_q(q_row + N, h_ok, i, dropped_ok)
        w_off = tl.arange(0, WIN_BN)
        loc = _locations(win_locs, win_lo + w_off, win_hi)
        for start in range(win_lo, win_hi, WIN_BN):
            loc_next = _locations(win_locs, start + WIN_BN + w_off, win_hi)
            valid, data, rope, scales = _load_records(win_ptr, loc, WIN_PER_PAGE, win_stride, 576, WIN_ALIGN, 448)
            loc = loc_next
            k_rope = rope.to(tl.bfloat16)
            if WIN_KEPT_FIRST:
                # Window records written in kept-first order: every set is word loads.
                kept_codes = _code_bytes(_load_words(data, valid, KA_N // 4, KA // 4))
                drop_codes = _code_bytes(_load_words(data + N, valid, (448 - N) // 4, DP // 4))
                if KT:
                    tail_codes = _code_bytes(_load_words(data + KA, valid, (N - KA) // 4, KT // 4))
            else:
                kept_codes = _load_columns(data, valid, kept, kept_ok)
                drop_codes = _load_columns(data, valid, dropped, dropped_ok)
                if KT:
                    tail_codes = _load_columns(data, valid, kept_tail, tail_ok)
            k_kept = _dequant(kept_codes, _set_scales(scales, j, sel_kept, kept_starts_ptr,
                                                      WIN_KEPT_FIRST or not WIN_SCORES_T, INTERPRETED))
            k_drop = _dequant(drop_codes, _set_scales(scales, i, sel_drop, dropped_starts_ptr,
                                                      WIN_KEPT_FIRST or not WIN_SCORES_T, INTERPRETED))
            if KT:
                k_tail = _dequant(tail_codes, _set_scales(scales, KA + t, sel_tail, kept_starts_ptr,
                                                          WIN_KEPT_FIRST or not WIN_SCORES_T, INTERPRETED))
            s = (_qk(q_kept, q_kept_t, k_kept, WIN_SCORES_T, INTERPRETED)
                 + _qk(q_drop, q_drop_t, k_drop, WIN_SCORES_T, INTERPRETED)
                 + _qk(q_rope, q_rope_t, k_rope, WIN_SCORES_T, INTERPRETED))
            if KT:
                s += _qk(q_tail, q_tail_t, k_tail, WIN_SCORES_T, INTERPRETED)
            m_new, alpha, pb, l = _softmax_step(s, valid, qk_scale, m, l)
            acc_rope = acc_rope * alpha[:, None] + _mma(pb, k_rope, INTERPRETED)
            acc_kept = acc_kept * alpha[:, None] + _mma(pb, k_kept, INTERPRETED)
            acc_drop = acc_drop * alpha[:, None] + _mma(pb, k_drop, INTERPRETED)
            if KT:
                acc_tail = acc_tail * alpha[:, None] + _mma(pb, k_tail, INTERPRETED)
            m = m_new
    inv_l = _inverse_sum(l, SPLIT)
    row_scale = tl.full((H_BLOCK,), 1.0, tl.float32)
    if SCALED:
        top = tl.maximum(_row_max(acc_kept), _row_max(acc_rope))
        if KT:
            top = tl.maximum(top, _row_max(acc_tail))
        if WITH_WINDOW and not WIN_PACKED:
            top = tl.maximum(top, _row_max(acc_drop))
        row_scale = _row_scale(top * inv_l)
        inv_l = inv_l / row_scale
    out_ty = o_row.dtype.element_ty
    tl.store(o_row[:, None] + j[None, :], (acc_kept * inv_l[:, None]).to(out_ty), mask=h_ok[:, None] & kept_ok[None, :])
    if KT:
        tl.store(o_row[:, None] + KA + t[None, :], (acc_tail * inv_l[:, None]).to(out_ty),
                 mask=h_ok[:, None] & tail_ok[None, :])
    if WITH_WINDOW and WIN_PACKED:  # no record holds a dropped column
        tl.store(o_row[:, None] + N + i[None, :], tl.zeros((H_BLOCK, DP), dtype=out_ty),
                 mask=h_ok[:, None] & dropped_ok[None, :])
    elif WITH_WINDOW:
        tl.store(o_row[:, None] + N + i[None, :], (acc_drop * inv_l[:, None]).to(out_ty),
                 mask=h_ok[:, None] & dropped_ok[None, :])
    tl.store(o_row[:, None] + 448 + r[None, :], (acc_rope * inv_l[:, None]).to(out_ty), mask=h_ok[:, None])
    return m, l, row_scale


@triton.jit
def _split_step(s, S, win_steps, c4_steps, WINDOW_STEP_COST: tl.constexpr):
    """The first step of split s of S (s = S: the end) when splits are cut by cost: one
    sequence, the window's steps then the C4 records', cut into S parts of equal cost (a
    window step costs WINDOW_STEP_COST C4 steps: window_step_cost) at the nearest step
    boundary (a half rounds up). So a split whose share is all window or all C4 records runs
    one loop, not two with a pipeline fill each. Split s's end and split s + 1's start are
    one computation: every step is read once."""
    window_cost = win_steps * WINDOW_STEP_COST
    cut = (window_cost + c4_steps) * s // S
    return tl.where(cut <= window_cost, (cut + WINDOW_STEP_COST // 2) // WINDOW_STEP_COST,
                    win_steps + cut - window_cost)


@triton.jit
def _decode_kernel(
    q_ptr, q_sb, q_sh,
    out_ptr, o_ss, o_sb, o_sh, lse_ptr, fin_ptr, f_sb, f_sh,
    sink_ptr, H,
    win_ptr, win_locs_ptr, win_sb, W, win_stride, win_chunk,
    c4_ptr, c4_locs_ptr, c4_sb, K, c4_stride, c4_chunk,
    kept_ptr, dropped_ptr, kept_starts_ptr, dropped_starts_ptr, qk_scale,
    WIN_PER_PAGE: tl.constexpr, WIN_ALIGN: tl.constexpr, C4_PER_PAGE: tl.constexpr, C4_ALIGN: tl.constexpr,
    N: tl.constexpr, KA: tl.constexpr, KA_N: tl.constexpr, KT: tl.constexpr, DP: tl.constexpr,
    PACKED: tl.constexpr, H_BLOCK: tl.constexpr, BN: tl.constexpr, WIN_BN: tl.constexpr, WIN_KEPT_FIRST: tl.constexpr,
    WIN_PACKED: tl.constexpr, SCORES_T: tl.constexpr, WIN_SCORES_T: tl.constexpr, SPLIT: tl.constexpr,
    SCALED: tl.constexpr, WINDOW_APART: tl.constexpr, BY_COST: tl.constexpr, WIN_STEP_COST: tl.constexpr,
    EXCHANGE: tl.constexpr, INTERPRETED: tl.constexpr,
):
    # Head blocks of one token are adjacent in launch order, so they run together and the
    # second and later blocks read the token's records from L2, not memory. EXCHANGE: the
    # launch pairs CTAs 2x and 2x + 1 along axis 0 into a cluster (launch_in_pairs), the
    # token's two splits, which join their partials into fin_ptr themselves (below).
    b = tl.program_id(1).to(tl.int64)
    if EXCHANGE:
        split = tl.program_id(0) % 2
        head_block = tl.program_id(0) // 2
        n_splits = 2
    else:
        split = tl.program_id(2)
        head_block = tl.program_id(0)
        n_splits = tl.num_programs(2)
    heads = head_block * H_BLOCK + tl.arange(0, H_BLOCK)
    h_ok = heads < H
    q_row = q_ptr + b * q_sb + heads * q_sh
    o_row = out_ptr + split.to(tl.int64) * o_ss + b * o_sb + heads * o_sh
    win_locs = win_locs_ptr + b * win_sb
    c4_locs = c4_locs_ptr + b * c4_sb

    # The sink takes softmax mass and gives no value: it starts the running max and sum
    # (of split 0; the other splits start empty, at a finite floor so that a step of only
    # padding rescales by exp2(0), not by exp2(-inf + inf)).
    m = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * LOG2E_IN_KERNEL
    l = tl.full((H_BLOCK,), 1.0, dtype=tl.float32)
    if SPLIT:
        m = tl.where(split == 0, m, EMPTY_MAX)
        l = tl.where(split == 0, l, 0.0)

    if WINDOW_APART:
        # Packed C4 records with a window in natural order, q and out in natural order:
        # split 0 reads the whole window as the native kernel does (word loads into
        # natural columns) and the others share the C4 records in kept-first order, q
        # read through the kept columns; _combine_kernel joins the two orders. Reading
        # natural window records by column index into kept-first sets cost the fused
        # program as much as its C4 records (benchmarks/kernels/NOTES.md).
        if split == 0:  # an empty C4 range: only the window's steps run
            m, l, row_scale = _native_program(
                q_row=q_row, h_ok=h_ok, o_row=o_row, m=m, l=l, qk_scale=qk_scale,
                win_ptr=win_ptr, win_locs=win_locs, win_lo=0, win_hi=W, win_stride=win_stride,
                c4_ptr=c4_ptr, c4_locs=c4_locs, c4_lo=0, c4_hi=0, c4_stride=c4_stride,
                WIN_PER_PAGE=WIN_PER_PAGE, WIN_ALIGN=WIN_ALIGN, C4_PER_PAGE=C4_PER_PAGE, C4_ALIGN=C4_ALIGN,
                H_BLOCK=H_BLOCK, BN=BN, WIN_BN=WIN_BN, SCORES_T=SCORES_T, WIN_SCORES_T=WIN_SCORES_T, SPLIT=SPLIT,
                SCALED=SCALED, INTERPRETED=INTERPRETED)
        else:
            c4_lo = (split - 1) * c4_chunk
            m, l, row_scale = _packed_program(
                q_row=q_row, h_ok=h_ok, o_row=o_row, m=m, l=l, qk_scale=qk_scale,
                win_ptr=win_ptr, win_locs=win_locs, win_lo=0, win_hi=0, win_stride=win_stride,
                c4_ptr=c4_ptr, c4_locs=c4_locs, c4_lo=c4_lo, c4_hi=tl.minimum(K, c4_lo + c4_chunk),
                c4_stride=c4_stride, kept_ptr=kept_ptr, dropped_ptr=dropped_ptr, kept_starts_ptr=kept_starts_ptr,
                dropped_starts_ptr=dropped_starts_ptr,
                WIN_PER_PAGE=WIN_PER_PAGE, WIN_ALIGN=WIN_ALIGN, C4_PER_PAGE=C4_PER_PAGE, C4_ALIGN=C4_ALIGN,
                N=N, KA=KA, KA_N=KA_N, KT=KT, DP=DP, H_BLOCK=H_BLOCK, BN=BN, WIN_BN=WIN_BN,
                WIN_KEPT_FIRST=WIN_KEPT_FIRST, WIN_PACKED=WIN_PACKED, WITH_WINDOW=False, Q_GATHER=True,
                SCORES_T=SCORES_T, WIN_SCORES_T=WIN_SCORES_T, SPLIT=SPLIT, SCALED=SCALED, INTERPRETED=INTERPRETED)
    else:
        # This program's share of the window and of the C4 records (all of them unless
        # SPLIT): a share of each (split_plan "even"), or BY_COST steps p0..p1 of the
        # window's steps followed by the C4 records' (_split_step). Two branches, not one
        # formula: the same ranges computed another way compiled to slower code (NOTES.md,
        # tenth round).
        if BY_COST:
            win_steps = tl.cdiv(W, WIN_BN)
            p0 = _split_step(split, n_splits, win_steps, tl.cdiv(K, BN), WIN_STEP_COST)
            p1 = _split_step(split + 1, n_splits, win_steps, tl.cdiv(K, BN), WIN_STEP_COST)
            win_lo = tl.minimum(p0, win_steps) * WIN_BN
            win_hi = tl.minimum(tl.minimum(p1, win_steps) * WIN_BN, W)
            c4_lo = tl.maximum(p0 - win_steps, 0) * BN
            c4_hi = tl.minimum(tl.maximum(p1 - win_steps, 0) * BN, K)
        else:
            win_lo = split * win_chunk
            win_hi = tl.minimum(W, win_lo + win_chunk)
            c4_lo = split * c4_chunk
            c4_hi = tl.minimum(K, c4_lo + c4_chunk)
        if PACKED:
            m, l, row_scale = _packed_program(
                q_row=q_row, h_ok=h_ok, o_row=o_row, m=m, l=l, qk_scale=qk_scale,
                win_ptr=win_ptr, win_locs=win_locs, win_lo=win_lo, win_hi=win_hi, win_stride=win_stride,
                c4_ptr=c4_ptr, c4_locs=c4_locs, c4_lo=c4_lo, c4_hi=c4_hi, c4_stride=c4_stride,
                kept_ptr=kept_ptr, dropped_ptr=dropped_ptr, kept_starts_ptr=kept_starts_ptr,
                dropped_starts_ptr=dropped_starts_ptr,
                WIN_PER_PAGE=WIN_PER_PAGE, WIN_ALIGN=WIN_ALIGN, C4_PER_PAGE=C4_PER_PAGE, C4_ALIGN=C4_ALIGN,
                N=N, KA=KA, KA_N=KA_N, KT=KT, DP=DP, H_BLOCK=H_BLOCK, BN=BN, WIN_BN=WIN_BN,
                WIN_KEPT_FIRST=WIN_KEPT_FIRST, WIN_PACKED=WIN_PACKED, WITH_WINDOW=True, Q_GATHER=False,
                SCORES_T=SCORES_T, WIN_SCORES_T=WIN_SCORES_T, SPLIT=SPLIT, SCALED=SCALED, INTERPRETED=INTERPRETED)
        else:
            m, l, row_scale = _native_program(
                q_row=q_row, h_ok=h_ok, o_row=o_row, m=m, l=l, qk_scale=qk_scale,
                win_ptr=win_ptr, win_locs=win_locs, win_lo=win_lo, win_hi=win_hi, win_stride=win_stride,
                c4_ptr=c4_ptr, c4_locs=c4_locs, c4_lo=c4_lo, c4_hi=c4_hi, c4_stride=c4_stride,
                WIN_PER_PAGE=WIN_PER_PAGE, WIN_ALIGN=WIN_ALIGN, C4_PER_PAGE=C4_PER_PAGE, C4_ALIGN=C4_ALIGN,
                H_BLOCK=H_BLOCK, BN=BN, WIN_BN=WIN_BN, SCORES_T=SCORES_T, WIN_SCORES_T=WIN_SCORES_T, SPLIT=SPLIT,
                SCALED=SCALED, INTERPRETED=INTERPRETED)
    if SPLIT:  # the split's log-sum-exp (base 2; -inf when it saw nothing) and row scale, for the join
        batch_heads = tl.num_programs(1).to(tl.int64) * H
        row = split * batch_heads + b * H + heads
        tl.store(lse_ptr + row, m + tl.log2(l), mask=h_ok)
        if SCALED:  # lse_ptr's second [S, B, H] block
            tl.store(lse_ptr + n_splits * batch_heads + row, row_scale, mask=h_ok)
    if EXCHANGE:
        # Both splits' partials and statistics are written: once both CTAs pass the cluster
        # barrier (release, then acquire), each joins half of the columns, rank 0 columns
        # 0-255 and rank 1 256-511, reading both partials from L2 (.cg: never this SM's L1).
        _cluster_barrier()
        c = split * 256 + tl.arange(0, 256)
        _join(part_ptr=out_ptr, lse_ptr=lse_ptr, out_rows=fin_ptr + b * f_sb + heads * f_sh, b=b, heads=heads,
              h_ok=h_ok, H=H, split_stride=batch_heads, c=c, cols=c, held=c >= 0,  # (held: read with FIRST_IN_PLACE only)
              S=2, FIRST_IN_PLACE=False, SCALED=SCALED, CACHE=".cg")


@triton.jit
def _join(part_ptr, lse_ptr, out_rows, b, heads, h_ok, H, split_stride, c, cols, held, S: tl.constexpr,
          FIRST_IN_PLACE: tl.constexpr, SCALED: tl.constexpr, CACHE: tl.constexpr):
    """out_rows[h, c] = sum_s w_s part[s, b, h, cols] / sum_s w_s, w_s = 2^(lse_s - max lse),
    for heads [Hb] (h_ok) and output columns c [C] read from partial columns cols [C]
    (held: columns the packed splits of FIRST_IN_PLACE hold): the splits' normalized
    partial outputs ([S, B, H, 512]: float32, or SCALED float16 each row divided by its
    scale, lse_ptr's second [S, B, H] block) joined by their log-sum-exp (_combine_kernel).
    CACHE: the loads' cache modifier. Split 0 holds the sink, so the max is finite."""
    lse_row = lse_ptr + b * H + heads
    top = tl.load(lse_row, mask=h_ok, other=0.0, cache_modifier=CACHE)
    for s in tl.static_range(1, S):
        top = tl.maximum(top, tl.load(lse_row + s * split_stride, mask=h_ok, other=0.0, cache_modifier=CACHE))
    acc = tl.zeros((heads.shape[0], c.shape[0]), dtype=tl.float32)
    norm = tl.zeros((heads.shape[0],), dtype=tl.float32)
    for s in tl.static_range(S):
        w = tl.exp2(tl.load(lse_row + s * split_stride, mask=h_ok, other=0.0, cache_modifier=CACHE) - top)
        rows = part_ptr + (s * split_stride + b * H + heads) * 512
        if FIRST_IN_PLACE and s == 0:
            part = tl.load(rows[:, None] + c[None, :], mask=h_ok[:, None], other=0.0, cache_modifier=CACHE)
        elif FIRST_IN_PLACE:
            part = tl.load(rows[:, None] + cols[None, :], mask=h_ok[:, None] & held[None, :], other=0.0,
                           cache_modifier=CACHE)
        else:
            part = tl.load(rows[:, None] + cols[None, :], mask=h_ok[:, None], other=0.0, cache_modifier=CACHE)
        if SCALED:
            w_part = w * tl.load(lse_row + (S + s) * split_stride, mask=h_ok, other=0.0, cache_modifier=CACHE)
        else:
            w_part = w
        acc += w_part[:, None] * part.to(tl.float32)
        norm += w
    out = acc / norm[:, None]
    tl.store(out_rows[:, None] + c[None, :], out.to(out_rows.dtype.element_ty), mask=h_ok[:, None])


@triton.jit
def _combine_kernel(part_ptr, lse_ptr, out_ptr, o_sb, o_sh, index_ptr, H, n_kept,
                    S: tl.constexpr, H_BLOCK: tl.constexpr, GATHER: tl.constexpr, FIRST_IN_PLACE: tl.constexpr,
                    SCALED: tl.constexpr):
    """The join of a token's S splits (_join) for a block of H_BLOCK heads, all 512 columns:
    GATHER reads each row through `index` (kept-first -> natural order), else in place.
    FIRST_IN_PLACE (the window apart): split 0 is the window program's natural-order
    partial, read in place, and the others, packed C4 records only, hold no dropped column
    (kept-first positions n_kept..447): those read as 0."""
    b = tl.program_id(1).to(tl.int64)
    heads = tl.program_id(0) * H_BLOCK + tl.arange(0, H_BLOCK)
    c = tl.arange(0, 512)
    cols = tl.load(index_ptr + c) if GATHER else c
    # The batch from the grid: an integer argument equal to 1 is specialised to a constant.
    _join(part_ptr=part_ptr, lse_ptr=lse_ptr, out_rows=out_ptr + b * o_sb + heads * o_sh, b=b, heads=heads,
          h_ok=heads < H, H=H, split_stride=tl.num_programs(1).to(tl.int64) * H, c=c, cols=cols,
          held=(cols < n_kept) | (cols >= 448), S=S, FIRST_IN_PLACE=FIRST_IN_PLACE, SCALED=SCALED, CACHE="")


@triton.jit
def _permute_columns_kernel(x_ptr, x_sb, x_sh, y_ptr, y_sb, y_sh, index_ptr, H,
                            C: tl.constexpr, H_BLOCK: tl.constexpr):
    """y[b, h, c] = x[b, h, index[c]]: each row read by index (L1 serves a row's 1 KB after
    its first touch) and written whole with vector stores."""
    b = tl.program_id(1).to(tl.int64)
    heads = tl.program_id(0) * H_BLOCK + tl.arange(0, H_BLOCK)
    h_ok = heads < H
    c = tl.arange(0, C)
    index = tl.load(index_ptr + c)
    values = tl.load(x_ptr + b * x_sb + heads[:, None] * x_sh + index[None, :], mask=h_ok[:, None])
    tl.store(y_ptr + b * y_sb + heads[:, None] * y_sh + c[None, :], values, mask=h_ok[:, None])


def permute_columns(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, H, 512] (last dim contiguous) -> out[..., c] = x[..., index[c]] (index int32
    [512], a permutation): the packed decode's q and out between the model's column order
    and kept-first order. One Triton pass, faster than torch.index_select on the last dim
    (benchmarks/kernels/NOTES.md)."""
    if out is None:
        out = torch.empty_like(x)
    batch, heads, width = x.shape
    if x.stride(2) != 1 or out.stride(2) != 1 or index.shape != (width,):
        raise ValueError(f"permute_columns needs contiguous rows and an index of {width}, got strides {x.stride()}, "
                         f"{out.stride()} and index {tuple(index.shape)}")
    if batch and heads:
        h_block, warps = PERMUTE_LAUNCH
        _permute_columns_kernel[(triton.cdiv(heads, h_block), batch)](
            x_ptr=x, x_sb=x.stride(0), x_sh=x.stride(1), y_ptr=out, y_sb=out.stride(0), y_sh=out.stride(1),
            index_ptr=index, H=heads, C=width, H_BLOCK=h_block, num_warps=warps)
    return out


def kept_column_blocks(n_kept: int, padded: int) -> tuple[int, int]:
    """The packed kernel's kept set as (KA, KT): KA columns in one power-of-two block and a
    tail of KT (0: none). N = 192 is 128 + 64 rather than 256 with 64 columns of zeros in
    every product and accumulator; a tail pays only where it is smaller than the padding."""
    if n_kept <= 16 or n_kept & (n_kept - 1) == 0:
        return padded, 0
    head = 1 << (n_kept.bit_length() - 1)
    tail = max(16, 1 << (n_kept - head - 1).bit_length())
    return (head, tail) if head + tail < padded else (padded, 0)


def run(plan: DecodePlan, q: torch.Tensor, c4: torch.Tensor, c4_layout: PageLayout, c4_locs: torch.Tensor,
        window: torch.Tensor, window_layout: PageLayout, window_locs: torch.Tensor, sink: torch.Tensor,
        cols: KeptColumns, scale: float, out: torch.Tensor | None, compiled: list | None) -> torch.Tensor:
    """decode's launches of _decode_kernel (and of the join or the permute pass) for a plan
    whose kernel is "triton", on inputs remnant.kernels.decode.decode has checked (q [B, H,
    512] with contiguous rows, int32 locations, sink [H], `out` [B, H, 512] or None)."""
    out = torch.empty_like(q) if out is None else out
    sink = sink.float().contiguous()
    batch, heads, _ = q.shape
    splits = plan.splits
    # The window's program reads q as given; the C4 programs read it through the kept
    # columns, and the join takes their partials back to natural order.
    q_in = permute_columns(q, cols.order) if plan.permute and not plan.window_apart else q
    c4_programs = splits - 1 if plan.window_apart else splits
    exchange = plan.join == "exchange"
    scaled = plan.partials == "float16"
    if splits > 1:  # normalized partial outputs, their log-sum-exp (and row scales: float16), joined below
        out_k = torch.empty(splits, batch, heads, HEAD_DIM, dtype=PARTIAL_DTYPES[plan.partials], device=q.device)
        lse = torch.empty(2 if scaled else 1, splits, batch, heads, dtype=torch.float32, device=q.device)
        out_strides = out_k.stride()[:3]
    else:
        out_k = torch.empty_like(q_in, dtype=out.dtype) if plan.permute else out
        lse = sink  # not read
        out_strides = (0, *out_k.stride()[:2])
    win_steps = triton.cdiv(window_locs.shape[1], plan.window_block_n)
    c4_steps = triton.cdiv(c4_locs.shape[1], plan.block_n)
    kept_blocks = kept_column_blocks(cols.n_kept, cols.kept.numel())
    # The exchange join's splits write `out` themselves (fin_ptr), and its launch doubles
    # axis 0 into clusters of two (launch_in_pairs).
    grid = (triton.cdiv(heads, plan.h_block), batch, 1 if exchange else splits)
    args = dict(
        q_ptr=q_in, q_sb=q_in.stride(0), q_sh=q_in.stride(1),
        out_ptr=out_k, o_ss=out_strides[0], o_sb=out_strides[1], o_sh=out_strides[2], lse_ptr=lse,
        fin_ptr=out, f_sb=out.stride(0), f_sh=out.stride(1),
        sink_ptr=sink, H=heads,
        win_ptr=window, win_locs_ptr=window_locs, win_sb=window_locs.stride(0), W=window_locs.shape[1],
        win_stride=window_layout.page_stride, win_chunk=triton.cdiv(win_steps, splits) * plan.window_block_n,
        c4_ptr=c4, c4_locs_ptr=c4_locs, c4_sb=c4_locs.stride(0), K=c4_locs.shape[1],
        c4_stride=c4_layout.page_stride, c4_chunk=triton.cdiv(c4_steps, c4_programs) * plan.block_n,
        kept_ptr=cols.kept, dropped_ptr=cols.dropped, kept_starts_ptr=cols.kept_tile_starts,
        dropped_starts_ptr=cols.dropped_tile_starts, qk_scale=scale * LOG2E,
        WIN_PER_PAGE=window_layout.per_page, WIN_ALIGN=alignment(window_layout, "window"),
        C4_PER_PAGE=c4_layout.per_page, C4_ALIGN=alignment(c4_layout, "c4"),
        N=cols.n_kept, KA=kept_blocks[0], KA_N=min(cols.n_kept, kept_blocks[0]), KT=kept_blocks[1],
        DP=cols.dropped.numel(), PACKED=cols.packed, H_BLOCK=plan.h_block, BN=plan.block_n,
        WIN_BN=plan.window_block_n, WIN_KEPT_FIRST=plan.window_kept_first, WIN_PACKED=plan.window_packed,
        SCORES_T=plan.scores_transposed, WIN_SCORES_T=plan.window_scores_transposed,
        SPLIT=splits > 1, SCALED=scaled, WINDOW_APART=plan.window_apart, BY_COST=plan.split_plan == "by_cost",
        WIN_STEP_COST=window_step_cost(cols.packed, plan.window_columns), EXCHANGE=exchange, INTERPRETED=interpreted(),
        num_warps=plan.num_warps, num_stages=plan.num_stages)
    try:
        if exchange:  # compiled first, so that its first launch is already in pairs
            launch_in_pairs(_decode_kernel.warmup(grid=grid, **args))
        kernel = _decode_kernel[grid](**args)
    except OutOfResources as exc:  # name the settings, not only the kernel's shared memory
        settings = dict(h_block=plan.h_block, num_warps=plan.num_warps, **plan.loops())
        raise ValueError(f"decode launch settings {settings} need {exc.required} bytes of {exc.name}, the GPU has "
                         f"{exc.limit}: lower num_stages or block_n") from exc
    if plan.join == "kernel":  # the join also takes the output back to the model's order (permute)
        join_heads, join_warps = JOIN_LAUNCH
        _combine_kernel[(triton.cdiv(heads, join_heads), batch)](
            part_ptr=out_k, lse_ptr=lse, out_ptr=out, o_sb=out.stride(0), o_sh=out.stride(1), index_ptr=cols.inverse,
            H=heads, n_kept=cols.n_kept, S=splits, H_BLOCK=join_heads, GATHER=plan.permute,
            FIRST_IN_PLACE=plan.window_apart, SCALED=scaled, num_warps=join_warps)
    elif plan.permute:
        permute_columns(out_k, cols.inverse, out=out)
    if compiled is not None:
        compiled.append(kernel)
    return out
