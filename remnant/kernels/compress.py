"""The compressors' decode update in three launches a CSA layer, two an HCA one:
compress_decode (state write and gated sums, then remnant.kernels.rope.norm_rope's RMS
norm and RoPE) and, on CSA layers, index_key_decode (the indexer keys' state write, mean,
FP8 quantization and store).

A decode token joins its sequence's open block: its content and gate rows go into the
compressor state, the block's rows are read back, and a softmax gate over the block's
tokens (per coordinate) weighs the content into one latent, RMS-normed and rotated at the
block's first position. In torch that is some ten launches a layer (stack, cast,
index_put, gather, then Inductor's four kernels and a cast), and the indexer keys' update
another thirteen (cast, index_put, gather, mean, quantize, cat, the page write's
index arithmetic and two index_puts): at batch 1 each launch reads almost nothing and
costs 1.5-2 us, some 1.1 ms of an H100's 12.9 ms step at V4-Flash's 41 compressed
layers (benchmarks/engine-h200-per-pair/). Here the gated sums take 16 programs per
sequence (32 coordinates each: the gate is per coordinate), and the index key one.

The token's own row is written and also used from registers (its block's other rows are
read from the state), so no program reads what another one writes: sequences own their
state slots, programs their coordinates (padding rows share the padding slot, and what
they compute goes to the padding page).

Plain references of the same operations: remnant.engine.ops.compress_decode and
index_key_decode (the CPU's decode step runs them), which tests/kernels/test_compress.py
compares against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from remnant.kernels.common import cast_nearest, interpreted
from remnant.kernels.rope import norm_rope
from remnant.kv.formats import HEAD_DIM
from remnant.kv.index_keys import BLOCK
from remnant.kv.layout import PageLayout

#: Coordinates a gate program takes, and block rows it reads at once: a C128 block's
#: state (2 x 128 rows of 512 float32, 512 KB) read by one program took 77 us on an H100
#: (2026-12-06); spread over 16 programs a row, in tiles of 32 rows, it is read in parallel.
GATE_COLUMNS = 32
GATE_ROWS = 32


@triton.jit
def _gate_kernel(c_ptr, c_stride, g_ptr, g_stride, state_ptr, state_stride0, state_stride1,
                 state_row_ptr, block_rows_ptr, bias_ptr, complete_ptr, latent_ptr,
                 RATIO: tl.constexpr, J: tl.constexpr, CB: tl.constexpr, D: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * CB + tl.arange(0, CB)                  # [CB]: this program's coordinates
    own = tl.load(state_row_ptr + b)
    c_new = cast_nearest(tl.load(c_ptr + b * c_stride + d), state_ptr.dtype.element_ty, INTERPRETED)
    g_new = cast_nearest(tl.load(g_ptr + b * g_stride + d), state_ptr.dtype.element_ty, INTERPRETED)
    tl.store(state_ptr + own * state_stride0 + d, c_new)
    tl.store(state_ptr + own * state_stride0 + state_stride1 + d, g_new)
    # Online softmax over the block's rows, J at a time, per coordinate; none where the
    # token leaves its block open (its latent goes to the padding page: zeros).
    rows_read = tl.where(tl.load(complete_ptr + b) != 0, RATIO, 0)
    m = tl.full([CB], float("-inf"), tl.float32)
    s = tl.zeros([CB], tl.float32)
    acc = tl.zeros([CB], tl.float32)
    for j0 in range(0, rows_read, J):
        j = j0 + tl.arange(0, J)
        rows = tl.load(block_rows_ptr + b * RATIO + j)
        base = state_ptr + rows.to(tl.int64)[:, None] * state_stride0 + d[None, :]  # [J, CB]
        mine = (rows == own)[:, None]
        cj = tl.where(mine, c_new[None, :], tl.load(base)).to(tl.float32)
        gj = tl.where(mine, g_new[None, :], tl.load(base + state_stride1)).to(tl.float32)
        logit = gj + tl.load(bias_ptr + j[:, None] * D + d[None, :]).to(tl.float32)
        m_new = tl.maximum(m, tl.max(logit, axis=0))
        e = tl.exp(logit - m_new[None, :])
        decay = tl.exp(m - m_new)
        s = s * decay + tl.sum(e, axis=0)
        acc = acc * decay + tl.sum(e * cj, axis=0)
        m = m_new
    # s >= 1 where rows were read (the largest logit's term is 1); 0 / 1 where none were.
    tl.store(latent_ptr + b * D + d, acc / tl.maximum(s, 1.0))


def compress_decode(c: torch.Tensor, g: torch.Tensor, state: torch.Tensor, state_row: torch.Tensor,
                    block_rows: torch.Tensor, gate_bias: torch.Tensor, norm: torch.Tensor,
                    block_index: torch.Tensor, ratio: int, eps: float, theta: float,
                    out_dtype: torch.dtype = torch.bfloat16, *, complete: torch.Tensor) -> torch.Tensor:
    """One decode token per row joins its open block: c, g [B, 512] (row-strided views are
    fine) go to state [rows, 2, >= 512] at state_row [B] (content at [:, 0], gate at [:, 1],
    in the state's dtype); the block's rows block_rows [B, ratio] (the token's own among
    them) give the latent as remnant.engine.ops.compress_latents does (softmax gate plus
    gate_bias [ratio, 512], RMS norm with weight `norm` [512], RoPE at block_index * ratio).
    Returns [B, 512] in out_dtype (bf16: what the record store rounds to): zeros where
    `complete` (bool [B], whether the token completes its block) is False, for which the
    block is not read (a C128 block's state is 512 KB a sequence; 1 step in 128 completes
    it). Graph-safe."""
    B = c.shape[0]
    if c.shape[-1] != HEAD_DIM or g.shape != c.shape or c.stride(-1) != 1 or g.stride(-1) != 1:
        raise ValueError(f"c and g must be [B, {HEAD_DIM}] with unit column stride, got {tuple(c.shape)}, "
                         f"{tuple(g.shape)}")
    if state.ndim != 3 or state.shape[1] != 2 or state.shape[2] < HEAD_DIM or state.stride(2) != 1:
        raise ValueError(f"state must be [rows, 2, >= {HEAD_DIM}] with unit column stride, got {tuple(state.shape)}")
    if tuple(block_rows.shape) != (B, ratio) or tuple(gate_bias.shape) != (ratio, HEAD_DIM):
        raise ValueError(f"block_rows must be [{B}, {ratio}] and gate_bias [{ratio}, {HEAD_DIM}], got "
                         f"{tuple(block_rows.shape)} and {tuple(gate_bias.shape)}")
    if ratio & (ratio - 1):
        raise ValueError(f"ratio must be a power of two, got {ratio}")
    # The gated sums (float32), then their RMS norm and RoPE: the norm needs a whole row,
    # which one program no longer holds.
    latent = torch.empty(B, HEAD_DIM, dtype=torch.float32, device=c.device)
    if B:
        _gate_kernel[(B, HEAD_DIM // GATE_COLUMNS)](
            c, c.stride(0), g, g.stride(0), state, state.stride(0), state.stride(1), state_row.contiguous(),
            block_rows.contiguous(), gate_bias.contiguous(), complete.contiguous(), latent, RATIO=ratio,
            J=min(ratio, GATE_ROWS), CB=GATE_COLUMNS, D=HEAD_DIM, INTERPRETED=interpreted(), num_warps=4)
    return norm_rope(latent, norm, eps, block_index, theta, position_scale=ratio, out_dtype=out_dtype)


@triton.jit
def _index_key_kernel(ik_ptr, ik_stride, state_ptr, state_stride0, state_row_ptr, block_rows_ptr,
                      pages_ptr, scales_ptr, locs_ptr, page_stride,
                      RATIO: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, PER_PAGE: tl.constexpr,
                      INTERPRETED: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    blk = tl.arange(0, D // BLOCK)[:, None]
    d = blk * BLOCK + tl.arange(0, BLOCK)[None, :]                # [D / BLOCK, BLOCK]
    own = tl.load(state_row_ptr + b)
    k_new = cast_nearest(tl.load(ik_ptr + b * ik_stride + d), state_ptr.dtype.element_ty, INTERPRETED)
    tl.store(state_ptr + own * state_stride0 + d, k_new)
    total = tl.zeros([D // BLOCK, BLOCK], tl.float32)
    for j in range(RATIO):
        row = tl.load(block_rows_ptr + b * RATIO + j)
        total += tl.where(row == own, k_new, tl.load(state_ptr + row * state_stride0 + d)).to(tl.float32)
    key = total / RATIO
    # The scale as remnant.kv.index_keys forms it (times 1/448 in float32); the codes by an
    # IEEE division, as torch divides two tensors (Triton's own '/' may round otherwise).
    scale = tl.maximum(tl.max(tl.abs(key), axis=1) * (1.0 / 448.0), 1e-12)  # [D / BLOCK]
    codes = tl.math.div_rn(key, scale[:, None]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    loc = tl.load(locs_ptr + b)
    page = (loc // PER_PAGE).to(tl.int64)
    slot = loc % PER_PAGE
    tl.store(pages_ptr + page * page_stride + slot * D + d, codes)
    # The scales (float32) after the page's PER_PAGE code rows; page_stride is in bytes.
    tl.store(scales_ptr + (page * page_stride + PER_PAGE * D) // 4 + slot * (D // BLOCK) + tl.arange(0, D // BLOCK),
             scale)


def index_key_decode(ik: torch.Tensor, state: torch.Tensor, state_row: torch.Tensor, block_rows: torch.Tensor,
                     pages: torch.Tensor, layout: PageLayout, locs: torch.Tensor) -> None:
    """The indexer keys' decode update: ik [B, d] (a row-strided view is fine) goes to
    state [rows, 2, >= d] at [state_row, 0] (state's dtype); the mean of its block's rows
    block_rows [B, ratio] is quantized to FP8 (remnant.kv.index_keys.quantize_index_keys: d
    codes, a float32 scale per 128) and written at locs int32 [B] into the indexer pages
    (`layout`: d code bytes a key, then the page's scales). Graph-safe."""
    B, D = ik.shape
    ratio = block_rows.shape[1]
    if D % BLOCK or ik.stride(-1) != 1:
        raise ValueError(f"ik must be [B, d] with d a multiple of {BLOCK} and unit column stride, got "
                         f"{tuple(ik.shape)}")
    if state.ndim != 3 or state.shape[2] < D or state.stride(2) != 1:
        raise ValueError(f"state must be [rows, 2, >= {D}] with unit column stride, got {tuple(state.shape)}")
    scale_bytes = 4 * D // BLOCK
    if (layout.data_bytes, layout.tail_bytes) != (D, scale_bytes) or layout.page_stride % 4:
        raise ValueError(f"the indexer pages must hold {D} code bytes and {scale_bytes} scale bytes a key with a "
                         f"page stride a multiple of 4, got data_bytes={layout.data_bytes}, "
                         f"tail_bytes={layout.tail_bytes}, page_stride={layout.page_stride}")
    if B:
        _index_key_kernel[(B,)](ik, ik.stride(0), state, state.stride(0), state_row.contiguous(),
                                block_rows.contiguous(), pages, pages.view(torch.float32),
                                locs.to(torch.int32).contiguous(), layout.page_stride,
                                RATIO=ratio, D=D, BLOCK=BLOCK, PER_PAGE=layout.per_page,
                                INTERPRETED=interpreted(), num_warps=1)

