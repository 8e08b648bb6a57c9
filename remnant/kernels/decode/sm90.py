"""Direct packed decode for SM90 (H100/H200), written in Gluon.

The same operation as the Triton kernel's folded packed call (remnant.kernels.decode.triton:
q and out in kept-first column order, kept-first or packed window records, the attention
sink, -1 padding, V = K), for R = 256 (N = 192 kept NoPE columns); that Triton kernel stays as the
reference on the CPU (its interpreter) and the fallback everywhere else. Its plain
reference is remnant.kernels.decode.reference.decode_packed_reference.

What the Triton program could not express, and this one does:
- the records' bytes travel global -> shared memory as asynchronous copies (cp.async, 16
  bytes per thread and copy) STAGES steps ahead, so no register holds a record while its
  load is in flight;
- each step's FP8 codes are dequantized shared -> registers -> shared once, into bf16
  tiles that both warpgroup MMAs read from shared memory (q K^T takes them transposed,
  P V as they are); RoPE, bf16 already, is copied straight into its operand tile;
- the two warpgroups split the keys of q K^T and the output columns of P V, so neither
  product is computed twice.

Work: one program per (token, split) for 64 heads. A token's records are one sequence,
its C4 records' steps then its window's, and each split takes a contiguous range of it cut
at equal cost (a kept-first window step moves and multiplies about twice a C4 step's
columns). A window packed with the C4 records' keep list (window_columns="packed",
retention.window_records=packed_csa) is read by the C4 records' loop, a step of it
costing one C4 step, and the output's dropped columns stay 0. With
one split the program writes out; with several, float32 partials and their log-sum-exp
(base 2), joined by _join_kernel.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from remnant.kv.formats import HEAD_DIM
from remnant.kv.layout import KeptColumns, PageLayout

try:  # Gluon comes with Triton >= 3.5 builds for NVIDIA GPUs
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                                  warpgroup_mma_wait)
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

KEPT = 192  # N at R = 256, the retention this kernel is written for
HEADS = 64  # one warpgroup MMA's M; fewer heads are masked
STEP = 64  # records per step
STAGES = 2  # steps of copies in flight (shared memory holds two: 204 KB of the H200's 227)
LOG2E = 1.4426950408889634
MAX_SPLITS = 16
NUM_WARPS = 8


def unavailable_reason(device: torch.device, n_kept: int | None = None, heads: int | None = None) -> str | None:
    """Why this kernel cannot run on `device` for these records (None: it can)."""
    if gluon is None:
        return f"Triton {triton.__version__} has no Gluon (needs >= 3.5)"
    if device.type != "cuda" or not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.version.hip is not None:
        return "needs an NVIDIA GPU (ROCm has no warpgroup MMA)"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return f"needs sm_90 (H100/H200); this GPU is sm_{capability[0]}{capability[1]}"
    if n_kept is not None and n_kept != KEPT:
        return f"is written for R = 256 ({KEPT} kept NoPE columns), got {n_kept}"
    if heads is not None and heads > HEADS:
        return f"takes at most {HEADS} heads per call, got {heads}"
    return None


if gluon is not None:

    @gluon.jit
    def _split_point(s, n_splits, c4_steps, win_steps, WIN_COST: gl.constexpr):
        """The first step of split s: steps below c4_steps are C4 steps (cost 1), the rest
        window steps (cost WIN_COST: 2 for kept-first records, 1 for packed ones); split s
        starts where the cost reaches s * total / n_splits."""
        total = c4_steps + WIN_COST * win_steps
        u = (s * total + n_splits - 1) // n_splits
        return gl.where(u <= c4_steps, u, c4_steps + (u - c4_steps + WIN_COST - 1) // WIN_COST)

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
        """cp.async of the data part's bytes from col0 of the step's records into dst [BN, C]
        (uint8, or bf16 for RoPE); rows that are no record are zero-filled."""
        COLS: gl.constexpr = dst.shape[1]
        c = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        loc, ok = _step_locations(locs, idx0, count, gl.SliceLayout(1, layout))
        loc = gl.maximum(loc, 0)
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
    def _issue_step(stage, raw_a, raw_b, raw_d0, raw_d1, rope, scales, base_ptr, locs, idx0, count,
                    PER_PAGE: gl.constexpr, stride, DATA: gl.constexpr, WINDOW: gl.constexpr,
                    L128: gl.constexpr, L64: gl.constexpr, LROPE: gl.constexpr, LSC: gl.constexpr):
        """One step's copies into stage `stage`, committed as one group. C4 records: kept codes
        0-127 and 128-191, RoPE at byte 192. Kept-first window records: also the dropped
        positions 192-319 and 320-447, RoPE at byte 448."""
        _issue(raw_a.index(stage), base_ptr, locs, idx0, count, 0, PER_PAGE, stride, DATA, L128)
        _issue(raw_b.index(stage), base_ptr, locs, idx0, count, 128, PER_PAGE, stride, DATA, L64)
        if WINDOW:
            _issue(raw_d0.index(stage), base_ptr, locs, idx0, count, 192, PER_PAGE, stride, DATA, L128)
            _issue(raw_d1.index(stage), base_ptr, locs, idx0, count, 320, PER_PAGE, stride, DATA, L128)
            _issue(rope.index(stage), base_ptr, locs, idx0, count, 448, PER_PAGE, stride, DATA, LROPE)
        else:
            _issue(rope.index(stage), base_ptr, locs, idx0, count, 192, PER_PAGE, stride, DATA, LROPE)
        _issue_scales(scales.index(stage), base_ptr, locs, idx0, count, PER_PAGE, stride, DATA, LSC)
        async_copy.commit_group()

    @gluon.jit
    def _stage_locations(locs_row, count, dst, ROWS: gl.constexpr, layout: gl.constexpr):
        """A token's locations into shared dst [steps, BN], one row per step, as asynchronous
        copies (entries past `count` are left as they are: readers mask them): read there by
        every copy and mask of a step, never from global memory in the loop."""
        BN: gl.constexpr = dst.shape[1]
        for step in gl.static_range(ROWS):
            n = step * BN + gl.arange(0, BN, layout=layout)
            async_copy.async_copy_global_to_shared(dst.index(step), locs_row + n, mask=n < count)

    @gluon.jit
    def _dequant(raw, lo, hi, tiles, dst, layout: gl.constexpr):
        """FP8 codes raw [BN, C] times 2^(s - 127), s the UE8M0 byte tiles[c] of each record's
        scales (lo: bytes 0-3, hi: 4-7), into dst as bf16 (exact: a power of two)."""
        codes = raw.load(layout)
        t = tiles[None, :]
        word = gl.where(t < 4, lo[:, None], hi[:, None])
        byte = (word >> ((t & 3) * 8)) & 0xFF
        scale = (byte << 23).to(gl.float32, bitcast=True)
        dst.store((codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale).to(gl.bfloat16))

    @gluon.jit
    def _scale_words(scales, layout: gl.constexpr):
        s = scales.load(gl.SliceLayout(1, layout))
        return (s & 0xFFFFFFFF).to(gl.int32), (s >> 32).to(gl.int32)

    @gluon.jit
    def _kept_tiles(starts_ptr, j0: gl.constexpr, COLS: gl.constexpr, layout: gl.constexpr):
        j = j0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        tile = gl.zeros([COLS], gl.int32, gl.SliceLayout(0, layout))
        for t in gl.static_range(1, 7):
            tile += (j >= gl.load(starts_ptr + t)).to(gl.int32)
        return tile

    @gluon.jit
    def _softmax(s, valid, qk_scale, m, l):
        s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, axis=1))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[:, None])
        return m_new, alpha, p.to(gl.bfloat16), l * alpha + gl.sum(p, axis=1)

    @gluon.jit
    def _valid(locs, idx0, count, layout: gl.constexpr):
        return _step_locations(locs, idx0, count, gl.SliceLayout(0, layout))[1]

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
    def _q_tile(q_row, h_ok, col0: gl.constexpr, COLS: gl.constexpr, layout: gl.constexpr, smem_layout: gl.constexpr):
        """q's columns [col0, col0 + COLS) of the 64 heads (0 past H) into a new operand tile,
        as an asynchronous copy: every load of the preamble is in flight at once, where
        loads each waited on before the next cost a memory round trip apiece
        (benchmarks/kernels/NOTES.md, nineteenth round)."""
        c = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        rows = gl.convert_layout(q_row, gl.SliceLayout(1, layout))
        ok = gl.convert_layout(h_ok, gl.SliceLayout(1, layout))
        tile = gl.allocate_shared_memory(gl.bfloat16, [64, COLS], smem_layout)
        async_copy.async_copy_global_to_shared(tile, rows[:, None] + c[None, :], mask=ok[:, None])
        return tile

    @gluon.jit
    def _packed_steps(base_ptr, locs, lo, hi, count, PER_PAGE: gl.constexpr, stride, raw_a, raw_b, raw_d0, raw_d1,
                      rope, scales, ka, kb, p_smem, qa, qb, qr, ta, tb, m, l, oa, ob, orope, qk_scale,
                      BN: gl.constexpr, STAGES: gl.constexpr, SKIP: gl.constexpr, L128: gl.constexpr,
                      L64: gl.constexpr, LROPE: gl.constexpr, LSC: gl.constexpr, S_L: gl.constexpr):
        """Steps lo..hi of packed records (R + 72 bytes: kept codes, RoPE, scales) at base_ptr,
        locations in shared `locs` (a row per step, `count` in all), STAGES - 1 steps of
        copies ahead: the online softmax state (m, l) and the output columns (oa, ob, orope)
        carried on. The C4 records, and a window packed with their keep list."""
        gl.thread_barrier()  # every warp is done with the stages and tiles of the steps before
        for j in gl.static_range(STAGES - 1):
            if lo + j < hi:
                _issue_step(j, raw_a, raw_b, raw_d0, raw_d1, rope, scales, base_ptr, locs.index(lo + j), (lo + j) * BN, count,
                            PER_PAGE, stride, 320, False, L128, L64, LROPE, LSC)
            else:
                async_copy.commit_group()
        for i in range(lo, hi):
            k = i - lo
            gl.thread_barrier()  # every warp is done with the stage refilled below
            ahead = i + STAGES - 1
            if ahead < hi and (SKIP & 4) == 0:
                _issue_step((k + STAGES - 1) % STAGES, raw_a, raw_b, raw_d0, raw_d1, rope, scales, base_ptr,
                            locs.index(ahead), ahead * BN, count, PER_PAGE, stride, 320, False, L128, L64, LROPE, LSC)
            else:
                async_copy.commit_group()
            async_copy.wait_group(STAGES - 1)
            gl.thread_barrier()
            stage = k % STAGES
            if (SKIP & 1) == 0:
                lo_a, hi_a = _scale_words(scales.index(stage), L128)
                _dequant(raw_a.index(stage), lo_a, hi_a, ta, ka, L128)
                lo_b, hi_b = _scale_words(scales.index(stage), L64)
                _dequant(raw_b.index(stage), lo_b, hi_b, tb, kb, L64)
            fence_async_shared()
            gl.thread_barrier()
            kr = rope.index(stage)
            s = gl.zeros([64, BN], gl.float32, S_L)
            if (SKIP & 2) == 0:
                s = warpgroup_mma(qa, ka.permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(qb, kb.permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(qr, kr.permute((1, 0)), s, is_async=True)
                s = warpgroup_mma_wait(0, deps=[s])
            m, alpha, p, l = _softmax(s, _valid(locs.index(i), i * BN, count, S_L), qk_scale, m, l)
            p_smem.store(p)
            fence_async_shared()
            gl.thread_barrier()
            oa = _rescale(oa, alpha)
            ob = _rescale(ob, alpha)
            orope = _rescale(orope, alpha)
            if (SKIP & 2) == 0:
                oa = warpgroup_mma(p_smem, ka, oa, is_async=True)
                ob = warpgroup_mma(p_smem, kb, ob, is_async=True)
                orope = warpgroup_mma(p_smem, kr, orope, is_async=True)
                oa, ob, orope = warpgroup_mma_wait(0, deps=[oa, ob, orope])
        async_copy.wait_group(0)
        return m, l, oa, ob, orope

    @gluon.jit
    def _packed_sm90_kernel(
        q_ptr, q_sb, q_sh, out_ptr, o_ss, o_sb, o_sh, lse_ptr, sink_ptr, H,
        c4_ptr, c4_locs_ptr, c4_sb, K, c4_stride,
        win_ptr, win_locs_ptr, win_sb, W, win_stride,
        kept_starts_ptr, qk_scale,
        C4_PER_PAGE: gl.constexpr, WIN_PER_PAGE: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
        C4_ROWS: gl.constexpr, WIN_ROWS: gl.constexpr, SPLIT: gl.constexpr, SKIP: gl.constexpr,
        WIN_PACKED: gl.constexpr,
    ):
        b = gl.program_id(0).to(gl.int64)
        split = gl.program_id(1)
        n_splits = gl.num_programs(1)

        # Layouts: 8 warps. Copies and dequantization move 16 bytes per thread and row.
        L128: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0])  # uint8 [64, 128]
        L64: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [8, 1], [1, 0])  # uint8 [64, 64]
        LROPE: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # bf16 [64, 64]
        LSC: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])  # int64 [64]
        LQ: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
        # Warpgroup MMAs: 4 warps along the 64 heads, the two warpgroups along N.
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
        O128: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 64, 16])
        O64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
        T128: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, 128], gl.bfloat16)
        T64: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, 64], gl.bfloat16)
        RAW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        SC: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        LOCS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        LL: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])

        heads = gl.arange(0, 64, layout=gl.SliceLayout(1, S_L))
        h_ok = heads < H
        q_row = q_ptr + b * q_sb + heads * q_sh
        o_row = out_ptr + split.to(gl.int64) * o_ss + b * o_sb + heads * o_sh
        c4_row = c4_locs_ptr + b * c4_sb
        win_row = win_locs_ptr + b * win_sb

        c4_steps = gl.cdiv(K, BN)
        win_steps = gl.cdiv(W, BN)
        p0 = _split_point(split, n_splits, c4_steps, win_steps, 1 if WIN_PACKED else 2)
        p1 = _split_point(split + 1, n_splits, c4_steps, win_steps, 1 if WIN_PACKED else 2)
        c4_lo = gl.minimum(p0, c4_steps)
        c4_hi = gl.minimum(p1, c4_steps)
        win_lo = gl.maximum(p0 - c4_steps, 0)
        win_hi = gl.maximum(p1 - c4_steps, 0)

        # The sink takes softmax mass and gives no value: it starts split 0's running max
        # and sum; the other splits start empty at a finite floor.
        m = gl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(gl.float32) * 1.4426950408889634
        l = gl.full([64], 1.0, gl.float32, gl.SliceLayout(1, S_L))
        if SPLIT:
            m = gl.where(split == 0, m, -1e30)
            l = gl.where(split == 0, l, 0.0)

        # The preamble's copies (q, both location lists) all in flight at once, one wait.
        qa = _q_tile(q_row, h_ok, 0, 128, LQ, T128)
        qb = _q_tile(q_row, h_ok, 128, 64, LQ, T64)
        qr = _q_tile(q_row, h_ok, 448, 64, LQ, T64)
        qd0 = _q_tile(q_row, h_ok, 192, 128, LQ, T128)
        qd1 = _q_tile(q_row, h_ok, 320, 128, LQ, T128)
        c4_locs = gl.allocate_shared_memory(gl.int32, [C4_ROWS, BN], LOCS)
        _stage_locations(c4_row, K, c4_locs, C4_ROWS, LL)
        w_locs = gl.allocate_shared_memory(gl.int32, [WIN_ROWS, BN], LOCS)
        _stage_locations(win_row, W, w_locs, WIN_ROWS, LL)
        async_copy.commit_group()

        raw_a = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, 128], RAW)
        raw_b = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, 64], RAW)
        raw_d0 = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, 128], RAW)
        raw_d1 = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, 128], RAW)
        rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, 64], T64)
        scales = gl.allocate_shared_memory(gl.int64, [STAGES, BN], SC)
        ka = gl.allocate_shared_memory(gl.bfloat16, [BN, 128], T128)
        kb = gl.allocate_shared_memory(gl.bfloat16, [BN, 64], T64)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [64, BN], T64)

        oa = gl.zeros([64, 128], gl.float32, O128)
        ob = gl.zeros([64, 64], gl.float32, O64)
        orope = gl.zeros([64, 64], gl.float32, O64)

        # Kept position j's scale tile (that of its native column): the kept list is sorted,
        # so j lies in tile t or later exactly when j >= the tile's start (KeptColumns).
        ta = _kept_tiles(kept_starts_ptr, 0, 128, L128)
        tb = _kept_tiles(kept_starts_ptr, 128, 64, L64)

        async_copy.wait_group(0)
        gl.thread_barrier()

        # C4 records: steps c4_lo..c4_hi.
        m, l, oa, ob, orope = _packed_steps(
            c4_ptr, c4_locs, c4_lo, c4_hi, K, C4_PER_PAGE, c4_stride, raw_a, raw_b, raw_d0, raw_d1, rope, scales,
            ka, kb, p_smem, qa, qb, qr, ta, tb, m, l, oa, ob, orope, qk_scale, BN, STAGES, SKIP,
            L128, L64, LROPE, LSC, S_L)

        # A packed window: more packed records, with the C4 records' keep list (columns
        # 192..447 of the output stay 0, as the dropped coordinates give nothing).
        if WIN_PACKED:
            m, l, oa, ob, orope = _packed_steps(
                win_ptr, w_locs, win_lo, win_hi, W, WIN_PER_PAGE, win_stride, raw_a, raw_b, raw_d0, raw_d1, rope,
                scales, ka, kb, p_smem, qa, qb, qr, ta, tb, m, l, oa, ob, orope, qk_scale, BN, STAGES, SKIP,
                L128, L64, LROPE, LSC, S_L)

        # Window tokens (kept-first records): all 448 positions, so the dropped ones too.
        od0 = gl.zeros([64, 128], gl.float32, O128)
        od1 = gl.zeros([64, 128], gl.float32, O128)
        if not WIN_PACKED and win_lo < win_hi:
            kd0 = gl.allocate_shared_memory(gl.bfloat16, [BN, 128], T128)
            kd1 = gl.allocate_shared_memory(gl.bfloat16, [BN, 128], T128)
            # Kept-first window records are tiled by position: 64 positions per scale.
            wa = gl.arange(0, 128, layout=gl.SliceLayout(0, L128)) // 64
            wb = gl.full([64], 2, gl.int32, gl.SliceLayout(0, L64))
            gl.thread_barrier()
            for j in gl.static_range(STAGES - 1):
                if win_lo + j < win_hi:
                    _issue_step(j, raw_a, raw_b, raw_d0, raw_d1, rope, scales, win_ptr, w_locs.index(win_lo + j), (win_lo + j) * BN, W,
                                WIN_PER_PAGE, win_stride, 576, True, L128, L64, LROPE, LSC)
                else:
                    async_copy.commit_group()
            for i in range(win_lo, win_hi):
                k = i - win_lo
                gl.thread_barrier()
                ahead = i + STAGES - 1
                if ahead < win_hi and (SKIP & 4) == 0:
                    _issue_step((k + STAGES - 1) % STAGES, raw_a, raw_b, raw_d0, raw_d1, rope, scales, win_ptr,
                                w_locs.index(ahead), ahead * BN, W, WIN_PER_PAGE, win_stride, 576, True, L128, L64, LROPE, LSC)
                else:
                    async_copy.commit_group()
                async_copy.wait_group(STAGES - 1)
                gl.thread_barrier()
                stage = k % STAGES
                if (SKIP & 1) == 0:
                    lo_a, hi_a = _scale_words(scales.index(stage), L128)
                    _dequant(raw_a.index(stage), lo_a, hi_a, wa, ka, L128)
                    _dequant(raw_d0.index(stage), lo_a, hi_a, wa + 3, kd0, L128)
                    _dequant(raw_d1.index(stage), lo_a, hi_a, wa + 5, kd1, L128)
                    lo_b, hi_b = _scale_words(scales.index(stage), L64)
                    _dequant(raw_b.index(stage), lo_b, hi_b, wb, kb, L64)
                fence_async_shared()
                gl.thread_barrier()
                kr = rope.index(stage)
                s = gl.zeros([64, BN], gl.float32, S_L)
                if (SKIP & 2) == 0:
                    s = warpgroup_mma(qa, ka.permute((1, 0)), s, is_async=True)
                    s = warpgroup_mma(qb, kb.permute((1, 0)), s, is_async=True)
                    s = warpgroup_mma(qd0, kd0.permute((1, 0)), s, is_async=True)
                    s = warpgroup_mma(qd1, kd1.permute((1, 0)), s, is_async=True)
                    s = warpgroup_mma(qr, kr.permute((1, 0)), s, is_async=True)
                    s = warpgroup_mma_wait(0, deps=[s])
                m, alpha, p, l = _softmax(s, _valid(w_locs.index(i), i * BN, W, S_L), qk_scale, m, l)
                p_smem.store(p)
                fence_async_shared()
                gl.thread_barrier()
                oa = _rescale(oa, alpha)
                ob = _rescale(ob, alpha)
                od0 = _rescale(od0, alpha)
                od1 = _rescale(od1, alpha)
                orope = _rescale(orope, alpha)
                if (SKIP & 2) == 0:
                    oa = warpgroup_mma(p_smem, ka, oa, is_async=True)
                    ob = warpgroup_mma(p_smem, kb, ob, is_async=True)
                    od0 = warpgroup_mma(p_smem, kd0, od0, is_async=True)
                    od1 = warpgroup_mma(p_smem, kd1, od1, is_async=True)
                    orope = warpgroup_mma(p_smem, kr, orope, is_async=True)
                    oa, ob, od0, od1, orope = warpgroup_mma_wait(0, deps=[oa, ob, od0, od1, orope])
            async_copy.wait_group(0)

        if SPLIT:
            inv_l = gl.where(l > 0, 1.0 / l, 0.0)
            gl.store(lse_ptr + (split * gl.num_programs(0) + b) * H + heads, m + gl.log2(l), mask=h_ok)
        else:
            inv_l = 1.0 / l
        _store_cols(o_row, h_ok, oa, inv_l, 0)
        _store_cols(o_row, h_ok, ob, inv_l, 128)
        _store_cols(o_row, h_ok, od0, inv_l, 192)
        _store_cols(o_row, h_ok, od1, inv_l, 320)
        _store_cols(o_row, h_ok, orope, inv_l, 448)


@triton.jit
def _join_kernel(part_ptr, lse_ptr, out_ptr, o_sb, o_sh, B, H, S: tl.constexpr, SP: tl.constexpr):
    """out[b, h] = sum_s 2^(lse_s - lse_max) part_s / sum_s 2^(lse_s - lse_max): the splits'
    normalized partials (float32 [S, B, H, 512]) weighted by their share of the softmax."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    lse = tl.load(lse_ptr + (s * B + b) * H + h, mask=s < S, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))
    w = w / tl.sum(w, axis=0)
    c = tl.arange(0, 512)
    part = tl.load(part_ptr + ((s[:, None] * B + b) * H + h).to(tl.int64) * 512 + c[None, :], mask=s[:, None] < S,
                   other=0.0)
    out = tl.sum(part * w[:, None], axis=0)
    tl.store(out_ptr + b.to(tl.int64) * o_sb + h * o_sh + c, out.to(out_ptr.dtype.element_ty))


def splits_per_token(batch: int, multiprocessors: int) -> int:
    """Programs per token (the plan's choice for this kernel). Below a full GPU's batch a
    token's records are shared by several programs so that every multiprocessor gets one;
    from 8 tokens on at most 6, as a split of fewer than two steps' work spends more on its
    start and its partial than it saves (benchmarks/kernels/NOTES.md, nineteenth round)."""
    splits = max(1, min(MAX_SPLITS, multiprocessors // max(batch, 1)))
    return splits if batch < 8 else min(splits, 6)


def layout_problem(c4_layout: PageLayout, window_layout: PageLayout, window_packed: bool = False) -> str | None:
    """Why the kernel cannot read these pages (None: it can): its 16-byte copies need split
    pages (data rows, then the 8-byte tails) with 16-byte aligned data parts of R = 256
    packed records and of native window records (packed ones where window_packed)."""
    window_width = KEPT + 128 if window_packed else 576
    for name, layout, width in (("c4", c4_layout, KEPT + 128), ("window", window_layout, window_width)):
        if layout.data_bytes != width or layout.tail_bytes != 8 or layout.page_stride % 16:
            return (f"reads {name} records with {width}-byte data parts on 16-byte aligned split pages, got "
                    f"{layout.per_page} per page of stride {layout.page_stride} with {layout.data_bytes}-byte data")
    return None


def _rows(count: int) -> int:
    """Rows of STEP locations that hold `count` of them, a power of two (a Gluon shape)."""
    return triton.next_power_of_2(max(1, triton.cdiv(count, STEP)))


def decode(q: torch.Tensor, c4: torch.Tensor, c4_layout: PageLayout, c4_locs: torch.Tensor, window: torch.Tensor,
           window_layout: PageLayout, window_locs: torch.Tensor, sink: torch.Tensor, keep: KeptColumns,
           splits: int, scale: float = 1.0 / math.sqrt(HEAD_DIM), out: torch.Tensor | None = None,
           profile_skip: int = 0, compiled: list | None = None, window_packed: bool = False) -> torch.Tensor:
    """Packed decode at R = 256 with q, out and the window records in kept-first order, as
    remnant.kernels.decode.decode(..., columns="kept_first", window_columns="kept_first"),
    or with the window packed (window_packed: window_columns="packed", records packed with
    `keep` as the C4 records are, read by the same loop; out's dropped columns are 0).

    q bf16 [B, H <= 64, 512]; c4: packed pages of `c4_layout` (SGLang's split layout,
    16-byte aligned), c4_locs int [B, K]; window: kept-first window records (native
    width) or packed ones, window_locs int [B, W] (-1 = padding in both); sink float [H]; keep: the
    layer's KeptColumns (192 kept). Returns out [B, H, 512] in q's dtype (or writes the
    given `out`, contiguous rows). splits: programs per token, 1 to MAX_SPLITS (the plan's
    choice: splits_per_token).

    profile_skip (measurement only; the output is then wrong): leave out the dequantizing
    (1), the matrix products (2) or the copies of every step after the first (4), or a
    sum of them, so that the benchmark can say where the time goes. compiled: a list the
    compiled kernel is appended to (the benchmark records its registers and spills).
    """
    reason = unavailable_reason(q.device, keep.n_kept, q.shape[1] if q.ndim == 3 else None)
    if reason is not None:
        raise ValueError(f"the SM90 packed decode {reason}")
    batch, heads, width = q.shape
    if width != HEAD_DIM or q.dtype != torch.bfloat16 or q.stride(2) != 1:
        raise ValueError(f"q must be bf16 [B, H, {HEAD_DIM}] with contiguous rows, got {q.dtype} {tuple(q.shape)}")
    problem = layout_problem(c4_layout, window_layout, window_packed)
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
    kernel = _packed_sm90_kernel[(batch, splits)](
        q_ptr=q, q_sb=q.stride(0), q_sh=q.stride(1), out_ptr=target, o_ss=strides[0], o_sb=strides[1],
        o_sh=strides[2], lse_ptr=lse, sink_ptr=sink, H=heads,
        c4_ptr=c4, c4_locs_ptr=c4_locs, c4_sb=c4_locs.stride(0), K=c4_locs.shape[1], c4_stride=c4_layout.page_stride,
        win_ptr=window, win_locs_ptr=window_locs, win_sb=window_locs.stride(0), W=window_locs.shape[1],
        win_stride=window_layout.page_stride, kept_starts_ptr=keep.kept_tile_starts, qk_scale=scale * LOG2E,
        C4_PER_PAGE=c4_layout.per_page, WIN_PER_PAGE=window_layout.per_page, BN=STEP, STAGES=STAGES,
        C4_ROWS=_rows(c4_locs.shape[1]), WIN_ROWS=_rows(window_locs.shape[1]), SPLIT=splits > 1, SKIP=profile_skip,
        WIN_PACKED=window_packed, num_warps=NUM_WARPS)
    if splits > 1:
        _join_kernel[(batch, heads)](part_ptr=part, lse_ptr=lse, out_ptr=out, o_sb=out.stride(0), o_sh=out.stride(1),
                                     B=batch, H=heads, S=splits, SP=triton.next_power_of_2(splits))
    if compiled is not None:
        compiled.append(kernel)
    return out


def run(plan, q: torch.Tensor, c4: torch.Tensor, c4_layout: PageLayout, c4_locs: torch.Tensor, window: torch.Tensor,
        window_layout: PageLayout, window_locs: torch.Tensor, sink: torch.Tensor, keep: KeptColumns, scale: float,
        out: torch.Tensor | None, compiled: list | None) -> torch.Tensor:
    """remnant.kernels.decode.decode's call of this kernel: `decode` at the plan's splits
    (a DecodePlan whose kernel is "sm90"), on inputs decode has checked."""
    return decode(q, c4, c4_layout, c4_locs, window, window_layout, window_locs, sink, keep, splits=plan.splits,
                  scale=scale, out=out, compiled=compiled, window_packed=plan.window_packed)
