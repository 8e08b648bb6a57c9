"""LAB FILE, not used by the plan and not part of the package: a warp-specialized Gluon
packed decode for SM90.

Measured slower than remnant.kernels.decode.sm90 (the kernel the plan runs) at every
batch: 169-172 us against 159-161 at batch 512 with the window, 32.4 against 30.3 at 64
(H200, benchmarks/kernels/NOTES.md, twentieth round, which also gives the two other
warp-specialized layouts tried and why none overlapped its phases). Kept so that the
next attempt starts from a working producer/consumer ring: it passes
tests/kernels/decode/test_sm90.py when put in sm90's place, and
tests/kernels/decode/test_packed_sm90_ws.py checks it as it is; runners/device/
packed_sm90_h200.py times it.

The same call and contract as remnant.kernels.decode.sm90 (the folded packed call at
R = 256: q, out and the window in kept-first column order, kept-first window records, the
attention sink, -1 padding, V = K), laid out as producer and consumers:

- a producer warpgroup (4 warps, few registers) gathers each step's records with
  cp.async (16 bytes per thread and copy) into a two-stage staging buffer, one step
  ahead, dequantizes the FP8 codes shared -> registers -> shared into bf16 operand tiles
  in a ring of SLOTS slots guarded by mbarriers (ready: the producer filled it; empty:
  the consumers are done with it), and copies RoPE (bf16 already) straight into the slot;
- the consumers, two warpgroups (the kernel's 8 warps, most registers), run q K^T and
  P V as warpgroup MMAs from shared memory and the online softmax, the warpgroups
  splitting the keys of q K^T and the output columns of P V,

so that the gather and the dequantizing of step i + 1 run while step i's products and
softmax do. A slot is 32 KB: a C4 step of 64 records (256 columns: 192 kept, 64 RoPE) or
a window step of 32 records (512 columns), as 64-column bf16 tiles; q stays in shared
memory (64 KB) beside three slots.

Work: one program per (token, split) for 64 heads; a token's steps (its C4 steps, then its
window's) cut at equal cost into contiguous ranges, one per split (a window step of 32
records moves and multiplies about what a C4 step of 64 does). With one split the program
writes out; with several, float32 partials and their log-sum-exp (base 2), joined by
_join_kernel.
"""

from __future__ import annotations

import math

import torch
import triton

# What the two kernels share (their contract, the plan's split choice, the join of splits)
# has one home, remnant.kernels.decode.sm90; this file differs in the kernel only.
from remnant.kernels.decode.sm90 import (  # noqa: F401 - HEADS, KEPT, splits_per_token: its contract
    HEADS, KEPT, MAX_SPLITS, _join_kernel, layout_problem, splits_per_token, unavailable_reason)
from remnant.kv.formats import HEAD_DIM
from remnant.kv.layout import KeptColumns, PageLayout

try:  # Gluon comes with Triton >= 3.5 builds for NVIDIA GPUs
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier,
                                                                  warpgroup_mma, warpgroup_mma_wait)
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

STEP = 64  # C4 records per step
WINDOW_STEP = 32  # window records per step (512 columns: a slot holds as many bytes as a C4 step)
STAGES = 2  # steps of copies in flight in the producer (its staging buffer)
SLOTS = 3  # bf16 operand slots between producer and consumers
LOG2E = 1.4426950408889634
NUM_WARPS = 8  # the consumers; the producer's warps come on top
PRODUCER_WARPS = 4
PRODUCER_REGS = 88
MAX_REGS = 168  # 12 warps share the 64K registers: 168 each at launch, then redistributed


if gluon is not None:

    @gluon.jit
    def _split_point(s, n_splits, c4_steps, win_steps):
        """The first step of split s: C4 steps then window steps, each of cost 1."""
        total = c4_steps + win_steps
        return (s * total + n_splits - 1) // n_splits

    @gluon.jit
    def _step_locations(locs, idx0, count, layout: gl.constexpr):
        """The step's locations (shared int32 [BN], records idx0..idx0 + BN) and which are
        records: not -1 (padding) and below `count` (past it the staged row holds anything)."""
        loc = locs.load(layout)
        n = idx0 + gl.arange(0, loc.shape[0], layout=layout)
        return gl.maximum(loc, 0), (loc >= 0) & (n < count)

    @gluon.jit
    def _issue(dst, base_ptr, locs, idx0, count, col0: gl.constexpr, PER_PAGE: gl.constexpr, stride,
               DATA: gl.constexpr, layout: gl.constexpr):
        """cp.async of the data part's bytes [col0, col0 + C) of the step's records into dst
        [BN, C] (uint8, or bf16 for RoPE); rows that are no record are zero-filled."""
        COLS: gl.constexpr = dst.shape[1]
        c = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        loc, ok = _step_locations(locs, idx0, count, gl.SliceLayout(1, layout))
        off = (loc // PER_PAGE).to(gl.int64) * stride + (loc % PER_PAGE) * DATA + col0
        row = (base_ptr + off).to(gl.pointer_type(dst.dtype))
        async_copy.async_copy_global_to_shared(dst, row[:, None] + c[None, :], mask=ok[:, None])

    @gluon.jit
    def _issue_scales(dst, base_ptr, locs, idx0, count, PER_PAGE: gl.constexpr, stride, DATA: gl.constexpr,
                      layout: gl.constexpr):
        """cp.async of the step's records' 8 tail bytes (7 UE8M0 scales, pad) as int64 [BN]."""
        loc, ok = _step_locations(locs, idx0, count, layout)
        off = (loc // PER_PAGE).to(gl.int64) * stride + PER_PAGE * DATA + (loc % PER_PAGE) * 8
        async_copy.async_copy_global_to_shared(dst, (base_ptr + off).to(gl.pointer_type(gl.int64)), mask=ok)

    @gluon.jit
    def _issue_c4(raw, scales, slot, base_ptr, locs, idx0, count, PER_PAGE: gl.constexpr, stride,
                  L64: gl.constexpr, LROPE: gl.constexpr, LSC: gl.constexpr):
        """A C4 step's copies (64 records): kept codes as three [64, 64] byte tiles, RoPE
        (byte 192) into the slot's fourth tile, the tails; one commit group."""
        for c in gl.static_range(3):
            _issue(raw.slice(c * 64, 64), base_ptr, locs, idx0, count, c * 64, PER_PAGE, stride, 320, L64)
        _issue(slot.slice(192, 64), base_ptr, locs, idx0, count, 192, PER_PAGE, stride, 320, LROPE)
        _issue_scales(scales, base_ptr, locs, idx0, count, PER_PAGE, stride, 320, LSC)
        async_copy.commit_group()

    @gluon.jit
    def _issue_window(raw, scales, slot, base_ptr, locs, idx0, count, PER_PAGE: gl.constexpr, stride,
                      L32: gl.constexpr, LROPE: gl.constexpr, LSC: gl.constexpr):
        """A window step's copies (32 kept-first records): positions 0-447 as seven [32, 64]
        byte tiles, RoPE (byte 448) into the slot's eighth tile, the tails; one group."""
        for c in gl.static_range(7):
            _issue(raw.slice(c * 32, 32), base_ptr, locs, idx0, count, c * 64, PER_PAGE, stride, 576, L32)
        _issue(slot.slice(224, 32), base_ptr, locs, idx0, count, 448, PER_PAGE, stride, 576, LROPE)
        _issue_scales(scales.slice(0, 32), base_ptr, locs, idx0, count, PER_PAGE, stride, 576, LSC)
        async_copy.commit_group()

    @gluon.jit
    def _dequant(raw, word, shift, dst, layout: gl.constexpr):
        """FP8 codes raw [BN, 64] times 2^(s - 127), s the byte of `word` (per record, or per
        record and column) at `shift` bits, into dst as bf16 (exact: a power of two)."""
        codes = raw.load(layout)
        scale = (((word >> shift) & 0xFF) << 23).to(gl.float32, bitcast=True)
        dst.store((codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale).to(gl.bfloat16))

    @gluon.jit
    def _kept_tiles(starts_ptr, layout: gl.constexpr):
        """The scale tile of kept positions 0..255 (the list is sorted: j is in tile t or later
        exactly when j >= the tile's start, KeptColumns.kept_tile_starts)."""
        j = gl.arange(0, 256, layout=layout)
        tile = gl.zeros([256], gl.int32, layout)
        for t in gl.static_range(1, 7):
            tile += (j >= gl.load(starts_ptr + t)).to(gl.int32)
        return tile

    @gluon.jit
    def _producer(ring, raw, scales, ready, empty, c4_locs, w_locs, c4_ptr, c4_stride, K, win_ptr, win_stride, W,
                  kept_starts_ptr, c4_lo, c4_hi, win_lo, win_hi,
                  C4_PER_PAGE: gl.constexpr, WIN_PER_PAGE: gl.constexpr, SKIP: gl.constexpr):
        """The producer warpgroup: copies one step ahead into the staging buffer, then
        dequantizes the step into its ring slot and marks it ready."""
        L64: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # uint8 [64, 64]
        L32: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # uint8 [32, 64]
        LROPE: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # bf16 [*, 64]
        LSC: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # int64 [64 or 32]
        NSLOT: gl.constexpr = ring.shape[0]
        n_c4 = c4_hi - c4_lo
        n = n_c4 + (win_hi - win_lo)
        # Kept position j's scale tile is that of its native column: kept in shared memory
        # (held in registers they cost the producer 48 of its registers).
        L192: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
        tiles = gl.allocate_shared_memory(gl.int32, [256], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        tiles.store(_kept_tiles(kept_starts_ptr, L192))
        if n > 0:
            if n_c4 > 0:
                _issue_c4(raw.index(0), scales.index(0), ring.index(0), c4_ptr, c4_locs.index(c4_lo), c4_lo * 64, K,
                          C4_PER_PAGE, c4_stride, L64, LROPE, LSC)
            else:
                _issue_window(raw.index(0), scales.index(0), ring.index(0), win_ptr, w_locs.index(win_lo),
                              win_lo * 32, W, WIN_PER_PAGE, win_stride, L32, LROPE, LSC)
        for k in range(n):
            gl.thread_barrier()  # every producer thread is done reading the stage refilled below
            a = k + 1
            if a < n:
                mbarrier.wait(empty.index(a % NSLOT), ((a // NSLOT) & 1) ^ 1)
            go = a < n
            if (SKIP & 4) != 0:
                go = go & (a < 2)
            if go:
                if a < n_c4:
                    i = c4_lo + a
                    _issue_c4(raw.index(a % 2), scales.index(a % 2), ring.index(a % NSLOT), c4_ptr, c4_locs.index(i),
                              i * 64, K, C4_PER_PAGE, c4_stride, L64, LROPE, LSC)
                else:
                    i = win_lo + a - n_c4
                    _issue_window(raw.index(a % 2), scales.index(a % 2), ring.index(a % NSLOT), win_ptr,
                                  w_locs.index(i), i * 32, W, WIN_PER_PAGE, win_stride, L32, LROPE, LSC)
            else:
                async_copy.commit_group()
            async_copy.wait_group(1)
            gl.thread_barrier()  # every thread's copies of step k have landed
            st = k % 2
            slot = ring.index(k % NSLOT)
            if (SKIP & 1) == 0:
                if k < n_c4:
                    for h in gl.static_range(2):  # 32 records at a time: fewer registers
                        sc = scales.index(st).slice(h * 32, 32).load(gl.SliceLayout(1, L32))
                        lo = (sc & 0xFFFFFFFF).to(gl.int32)[:, None]
                        hi = (sc >> 32).to(gl.int32)[:, None]
                        for c in gl.static_range(3):
                            t = tiles.slice(c * 64, 64).load(gl.SliceLayout(0, L32))[None, :]
                            _dequant(raw.index(st).slice(c * 64 + h * 32, 32), gl.where(t >= 4, hi, lo), (t & 3) * 8,
                                     slot.slice(c * 64 + h * 32, 32), L32)
                else:
                    # Kept-first window records are tiled by position: 64 positions per scale.
                    wsc = scales.index(st).slice(0, 32).load(gl.SliceLayout(1, L32))
                    wlo = (wsc & 0xFFFFFFFF).to(gl.int32)[:, None]
                    whi = (wsc >> 32).to(gl.int32)[:, None]
                    for c in gl.static_range(7):
                        if c < 4:
                            _dequant(raw.index(st).slice(c * 32, 32), wlo, c * 8, slot.slice(c * 32, 32), L32)
                        else:
                            _dequant(raw.index(st).slice(c * 32, 32), whi, (c - 4) * 8, slot.slice(c * 32, 32), L32)
            fence_async_shared()
            gl.thread_barrier()  # the whole slot is written
            mbarrier.arrive(ready.index(k % NSLOT))
        async_copy.wait_group(0)

    @gluon.jit
    def _softmax(s, valid, qk_scale, m, l):
        m = gl.convert_layout(m, gl.SliceLayout(1, s.type.layout))
        l = gl.convert_layout(l, gl.SliceLayout(1, s.type.layout))
        s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, axis=1))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[:, None])
        return m_new, alpha, p.to(gl.bfloat16), l * alpha + gl.sum(p, axis=1)

    @gluon.jit
    def _rescale(acc, alpha):
        return acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]

    @gluon.jit
    def _store_cols(o_row, h_ok, acc, inv_l, col0: gl.constexpr):
        layout: gl.constexpr = acc.type.layout
        c = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
        inv = gl.convert_layout(inv_l, gl.SliceLayout(1, layout))
        ok = gl.convert_layout(h_ok, gl.SliceLayout(1, layout))
        rows = gl.convert_layout(o_row, gl.SliceLayout(1, layout))
        gl.store(rows[:, None] + c[None, :], (acc * inv[:, None]).to(o_row.dtype.element_ty), mask=ok[:, None])

    @gluon.jit
    def _consumer(qt, ring, p64, p32, ready, empty, c4_locs, w_locs, K, W, c4_lo, c4_hi, win_lo, win_hi,
                  sink_ptr, lse_ptr, H, out_ptr, o_ss, o_sb, o_sh, qk_scale, SPLIT: gl.constexpr,
                  SKIP: gl.constexpr):
        """The consumers (8 warps): per step, wait for the slot, q K^T, the online softmax,
        P V, release the slot; then write the output (or the split's partial)."""
        S64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
        S32: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 16, 16])
        O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
        ROW: gl.constexpr = gl.SliceLayout(1, S64)
        NSLOT: gl.constexpr = ring.shape[0]
        b = gl.program_id(0).to(gl.int64)
        split = gl.program_id(1)
        heads = gl.arange(0, 64, layout=ROW)
        h_ok = heads < H
        # The sink takes softmax mass and gives no value: it starts split 0's running max
        # and sum; the other splits start empty at a finite floor.
        m = gl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(gl.float32) * 1.4426950408889634
        l = gl.full([64], 1.0, gl.float32, ROW)
        if SPLIT:
            m = gl.where(split == 0, m, -1e30)
            l = gl.where(split == 0, l, 0.0)
        o0 = gl.zeros([64, 64], gl.float32, O)
        o1 = gl.zeros([64, 64], gl.float32, O)
        o2 = gl.zeros([64, 64], gl.float32, O)
        o3 = gl.zeros([64, 64], gl.float32, O)
        o4 = gl.zeros([64, 64], gl.float32, O)
        o5 = gl.zeros([64, 64], gl.float32, O)
        o6 = gl.zeros([64, 64], gl.float32, O)
        o7 = gl.zeros([64, 64], gl.float32, O)
        k = 0
        for i in range(c4_lo, c4_hi):
            t = ring.index(k % NSLOT)
            mbarrier.wait(ready.index(k % NSLOT), (k // NSLOT) & 1)
            s = gl.zeros([64, 64], gl.float32, S64)
            if (SKIP & 2) == 0:
                s = warpgroup_mma(qt.index(0), t.slice(0, 64).permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(qt.index(1), t.slice(64, 64).permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(qt.index(2), t.slice(128, 64).permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(qt.index(7), t.slice(192, 64).permute((1, 0)), s, is_async=True)
                s = warpgroup_mma_wait(0, deps=[s])
            loc = c4_locs.index(i).load(gl.SliceLayout(0, S64))
            n = i * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, S64))
            m, alpha, p, l = _softmax(s, (loc >= 0) & (n < K), qk_scale, m, l)
            p64.store(p)
            fence_async_shared()
            gl.thread_barrier()
            o0 = _rescale(o0, alpha)
            o1 = _rescale(o1, alpha)
            o2 = _rescale(o2, alpha)
            o7 = _rescale(o7, alpha)
            if (SKIP & 2) == 0:
                o0 = warpgroup_mma(p64, t.slice(0, 64), o0, is_async=True)
                o1 = warpgroup_mma(p64, t.slice(64, 64), o1, is_async=True)
                o2 = warpgroup_mma(p64, t.slice(128, 64), o2, is_async=True)
                o7 = warpgroup_mma(p64, t.slice(192, 64), o7, is_async=True)
                o0, o1, o2, o7 = warpgroup_mma_wait(0, deps=[o0, o1, o2, o7])
            gl.thread_barrier()  # both warpgroups are done with the slot and with p
            mbarrier.arrive(empty.index(k % NSLOT))
            k += 1
        for i in range(win_lo, win_hi):
            t = ring.index(k % NSLOT)
            mbarrier.wait(ready.index(k % NSLOT), (k // NSLOT) & 1)
            s = gl.zeros([64, 32], gl.float32, S32)
            if (SKIP & 2) == 0:
                s = warpgroup_mma(qt.index(0), t.slice(0, 32).permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(qt.index(1), t.slice(32, 32).permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(qt.index(2), t.slice(64, 32).permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(qt.index(3), t.slice(96, 32).permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(qt.index(4), t.slice(128, 32).permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(qt.index(5), t.slice(160, 32).permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(qt.index(6), t.slice(192, 32).permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(qt.index(7), t.slice(224, 32).permute((1, 0)), s, is_async=True)
                s = warpgroup_mma_wait(0, deps=[s])
            loc = w_locs.index(i).load(gl.SliceLayout(0, S32))
            n = i * 32 + gl.arange(0, 32, layout=gl.SliceLayout(0, S32))
            m_new, alpha, p, l = _softmax(s, (loc >= 0) & (n < W), qk_scale, m, l)
            m = gl.convert_layout(m_new, ROW)
            l = gl.convert_layout(l, ROW)
            p32.store(p)
            fence_async_shared()
            gl.thread_barrier()
            o0 = _rescale(o0, alpha)
            o1 = _rescale(o1, alpha)
            o2 = _rescale(o2, alpha)
            o3 = _rescale(o3, alpha)
            o4 = _rescale(o4, alpha)
            o5 = _rescale(o5, alpha)
            o6 = _rescale(o6, alpha)
            o7 = _rescale(o7, alpha)
            if (SKIP & 2) == 0:
                o0 = warpgroup_mma(p32, t.slice(0, 32), o0, is_async=True)
                o1 = warpgroup_mma(p32, t.slice(32, 32), o1, is_async=True)
                o2 = warpgroup_mma(p32, t.slice(64, 32), o2, is_async=True)
                o3 = warpgroup_mma(p32, t.slice(96, 32), o3, is_async=True)
                o4 = warpgroup_mma(p32, t.slice(128, 32), o4, is_async=True)
                o5 = warpgroup_mma(p32, t.slice(160, 32), o5, is_async=True)
                o6 = warpgroup_mma(p32, t.slice(192, 32), o6, is_async=True)
                o7 = warpgroup_mma(p32, t.slice(224, 32), o7, is_async=True)
                o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(0, deps=[o0, o1, o2, o3, o4, o5, o6, o7])
            gl.thread_barrier()
            mbarrier.arrive(empty.index(k % NSLOT))
            k += 1

        o_row = out_ptr + split.to(gl.int64) * o_ss + b * o_sb + heads * o_sh
        if SPLIT:
            inv_l = gl.where(l > 0, 1.0 / l, 0.0)
            gl.store(lse_ptr + (split * gl.num_programs(0) + b) * H + heads, m + gl.log2(l), mask=h_ok)
        else:
            inv_l = 1.0 / l
        _store_cols(o_row, h_ok, o0, inv_l, 0)
        _store_cols(o_row, h_ok, o1, inv_l, 64)
        _store_cols(o_row, h_ok, o2, inv_l, 128)
        _store_cols(o_row, h_ok, o3, inv_l, 192)
        _store_cols(o_row, h_ok, o4, inv_l, 256)
        _store_cols(o_row, h_ok, o5, inv_l, 320)
        _store_cols(o_row, h_ok, o6, inv_l, 384)
        _store_cols(o_row, h_ok, o7, inv_l, 448)

    @gluon.jit
    def _stage_locations(locs_row, count, dst, layout: gl.constexpr):
        """A token's locations into shared dst [steps, BN], one row per step, as asynchronous
        copies (entries past `count` are left as they are: readers mask them)."""
        ROWS: gl.constexpr = dst.shape[0]
        BN: gl.constexpr = dst.shape[1]
        for step in gl.static_range(ROWS):
            n = step * BN + gl.arange(0, BN, layout=layout)
            async_copy.async_copy_global_to_shared(dst.index(step), locs_row + n, mask=n < count)

    @gluon.jit
    def _packed_sm90_ws_kernel(
        q_ptr, q_sb, q_sh, out_ptr, o_ss, o_sb, o_sh, lse_ptr, sink_ptr, H,
        c4_ptr, c4_locs_ptr, c4_sb, K, c4_stride,
        win_ptr, win_locs_ptr, win_sb, W, win_stride,
        kept_starts_ptr, qk_scale,
        C4_PER_PAGE: gl.constexpr, WIN_PER_PAGE: gl.constexpr, C4_ROWS: gl.constexpr, WIN_ROWS: gl.constexpr,
        SPLIT: gl.constexpr, SKIP: gl.constexpr, NSLOT: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
    ):
        b = gl.program_id(0).to(gl.int64)
        split = gl.program_id(1)
        n_splits = gl.num_programs(1)
        c4_steps = gl.cdiv(K, 64)
        win_steps = gl.cdiv(W, 32)
        p0 = _split_point(split, n_splits, c4_steps, win_steps)
        p1 = _split_point(split + 1, n_splits, c4_steps, win_steps)
        c4_lo = gl.minimum(p0, c4_steps)
        c4_hi = gl.minimum(p1, c4_steps)
        win_lo = gl.maximum(p0 - c4_steps, 0)
        win_hi = gl.maximum(p1 - c4_steps, 0)

        T64: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
        T32: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 32], gl.bfloat16)
        RAW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        LQ: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [8, 1], [1, 0])  # bf16 [64, 64], 8 warps
        LL: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])

        # The preamble (all 8 warps): q's eight 64-column tiles and the token's locations,
        # in flight at once, one wait.
        heads = gl.arange(0, 64, layout=gl.SliceLayout(1, LQ))
        h_ok = heads < H
        q_row = q_ptr + b * q_sb + heads * q_sh
        qt = gl.allocate_shared_memory(gl.bfloat16, [8, 64, 64], T64)
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, LQ))
        for c in gl.static_range(8):
            async_copy.async_copy_global_to_shared(qt.index(c), q_row[:, None] + (c * 64 + cols)[None, :],
                                                   mask=h_ok[:, None])
        c4_locs = gl.allocate_shared_memory(gl.int32, [C4_ROWS, 64], FLAT)
        _stage_locations(c4_locs_ptr + b * c4_sb, K, c4_locs, LL)
        w_locs = gl.allocate_shared_memory(gl.int32, [WIN_ROWS, 32], FLAT)
        _stage_locations(win_locs_ptr + b * win_sb, W, w_locs, LL)
        async_copy.commit_group()

        ring = gl.allocate_shared_memory(gl.bfloat16, [NSLOT, 256, 64], T64)
        raw = gl.allocate_shared_memory(gl.uint8, [2, 256, 64], RAW)
        scales = gl.allocate_shared_memory(gl.int64, [2, 64], FLAT)
        p64 = gl.allocate_shared_memory(gl.bfloat16, [64, 64], T64)
        p32 = gl.allocate_shared_memory(gl.bfloat16, [64, 32], T32)
        ready = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NSLOT):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        async_copy.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()

        gl.warp_specialize([
            (_consumer, (qt, ring, p64, p32, ready, empty, c4_locs, w_locs, K, W, c4_lo, c4_hi, win_lo, win_hi,
                         sink_ptr, lse_ptr, H, out_ptr, o_ss, o_sb, o_sh, qk_scale, SPLIT, SKIP)),
            (_producer, (ring, raw, scales, ready, empty, c4_locs, w_locs, c4_ptr, c4_stride, K, win_ptr, win_stride,
                         W, kept_starts_ptr, c4_lo, c4_hi, win_lo, win_hi, C4_PER_PAGE, WIN_PER_PAGE, SKIP)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


def _rows(count: int, step: int) -> int:
    """Rows of `step` locations that hold `count` of them, a power of two (a Gluon shape)."""
    return triton.next_power_of_2(max(1, triton.cdiv(count, step)))


def decode(q: torch.Tensor, c4: torch.Tensor, c4_layout: PageLayout, c4_locs: torch.Tensor, window: torch.Tensor,
           window_layout: PageLayout, window_locs: torch.Tensor, sink: torch.Tensor, keep: KeptColumns,
           splits: int, scale: float = 1.0 / math.sqrt(HEAD_DIM), out: torch.Tensor | None = None,
           profile_skip: int = 0, compiled: list | None = None, slots: int = SLOTS,
           producer_regs: int = PRODUCER_REGS) -> torch.Tensor:
    """Packed decode at R = 256 with q, out and the window records in kept-first order, as
    remnant.kernels.decode.decode(..., columns="kept_first", window_columns="kept_first").

    q bf16 [B, H <= 64, 512]; c4: packed pages of `c4_layout` (SGLang's split layout,
    16-byte aligned), c4_locs int [B, K]; window: kept-first window records (native
    width), window_locs int [B, W] (-1 = padding in both); sink float [H]; keep: the
    layer's KeptColumns (192 kept). Returns out [B, H, 512] in q's dtype (or writes the
    given `out`, contiguous rows). splits: programs per token, 1 to MAX_SPLITS (the plan's
    choice: splits_per_token).

    profile_skip (measurement only; the output is then wrong): leave out the dequantizing
    (1), the matrix products (2) or the copies of every step after the first (4), or a
    sum of them, so that the benchmark can say where the time goes. compiled: a list the
    compiled kernel is appended to (the benchmark records its registers and spills).
    slots, producer_regs: the ring's slots and the producer's registers (tuning only).
    """
    reason = unavailable_reason(q.device, keep.n_kept, q.shape[1] if q.ndim == 3 else None)
    if reason is not None:
        raise ValueError(f"the SM90 packed decode {reason}")
    batch, heads, width = q.shape
    if width != HEAD_DIM or q.dtype != torch.bfloat16 or q.stride(2) != 1:
        raise ValueError(f"q must be bf16 [B, H, {HEAD_DIM}] with contiguous rows, got {q.dtype} {tuple(q.shape)}")
    problem = layout_problem(c4_layout, window_layout)
    if problem is not None:
        raise ValueError(f"the SM90 packed decode {problem}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with contiguous rows, got {tuple(out.shape)}")
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {MAX_SPLITS}], got {splits}")
    c4_locs = c4_locs.to(torch.int32).contiguous()
    window_locs = window_locs.to(torch.int32).contiguous()
    sink = sink.float().contiguous()
    if splits > 1:
        part = torch.empty(splits, batch, heads, HEAD_DIM, dtype=torch.float32, device=q.device)
        lse = torch.empty(splits, batch, heads, dtype=torch.float32, device=q.device)
        target, strides = part, part.stride()[:3]
    else:
        lse = sink  # not read
        target, strides = out, (0, out.stride(0), out.stride(1))
    kernel = _packed_sm90_ws_kernel[(batch, splits)](
        q_ptr=q, q_sb=q.stride(0), q_sh=q.stride(1), out_ptr=target, o_ss=strides[0], o_sb=strides[1],
        o_sh=strides[2], lse_ptr=lse, sink_ptr=sink, H=heads,
        c4_ptr=c4, c4_locs_ptr=c4_locs, c4_sb=c4_locs.stride(0), K=c4_locs.shape[1], c4_stride=c4_layout.page_stride,
        win_ptr=window, win_locs_ptr=window_locs, win_sb=window_locs.stride(0), W=window_locs.shape[1],
        win_stride=window_layout.page_stride, kept_starts_ptr=keep.kept_tile_starts, qk_scale=scale * LOG2E,
        C4_PER_PAGE=c4_layout.per_page, WIN_PER_PAGE=window_layout.per_page,
        C4_ROWS=_rows(c4_locs.shape[1], STEP), WIN_ROWS=_rows(window_locs.shape[1], WINDOW_STEP),
        SPLIT=splits > 1, SKIP=profile_skip, NSLOT=slots, PRODUCER_WARPS=PRODUCER_WARPS,
        PRODUCER_REGS=producer_regs, num_warps=NUM_WARPS, maxnreg=MAX_REGS)
    if splits > 1:
        _join_kernel[(batch, heads)](part_ptr=part, lse_ptr=lse, out_ptr=out, o_sb=out.stride(0), o_sh=out.stride(1),
                                     B=batch, H=heads, S=splits, SP=triton.next_power_of_2(splits))
    if compiled is not None:
        compiled.append(kernel)
    return out
