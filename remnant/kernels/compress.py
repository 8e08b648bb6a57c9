"""The compressors' decode update in two launches a layer: compress_decode (state write,
gated sum, RMS norm, RoPE) and index_key_decode (the indexer keys' state write, mean, FP8
quantization and store).

A decode token joins its sequence's open block: its content and gate rows go into the
compressor state, the block's rows are read back, and a softmax gate over the block's
tokens (per coordinate) weighs the content into one latent, RMS-normed and rotated at the
block's first position. In torch that is some ten launches a layer (stack, cast,
index_put, gather, then Inductor's four kernels and a cast), and the indexer keys' update
another thirteen (cast, index_put, gather, mean, quantize, cat, the page write's
index arithmetic and two index_puts): at batch 1 each launch reads almost nothing and
costs 1.5-2 us, some 1.1 ms of an H100's 12.9 ms step at V4-Flash's 41 compressed
layers (benchmarks/engine-h200-per-pair/). Here one program per sequence does each chain.

The token's own row is written and also used from registers (its block's other rows are
read from the state), so no program reads a row another one writes: sequences own their
state slots (padding rows share the padding slot, and what they compute goes to the
padding page).

Plain references of the same operations: remnant.engine.ops.compress_decode and
index_key_decode (the CPU's decode step runs them), which tests/kernels/test_compress.py
compares against. RoPE as remnant.kernels.rope rotates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from remnant.kernels.common import cast_nearest, interpreted
from remnant.kernels.rope import ROPE_HALF, ROWS, rope_inverse_frequencies, rotate
from remnant.kv.formats import HEAD_DIM
from remnant.kv.index_keys import BLOCK
from remnant.kv.layout import PageLayout



@triton.jit
def _compress_kernel(c_ptr, c_stride, g_ptr, g_stride, state_ptr, state_stride0, state_stride1,
                     state_row_ptr, block_rows_ptr, bias_ptr, norm_ptr, index_ptr, inv_ptr, out_ptr, eps,
                     RATIO: tl.constexpr, ROWS: tl.constexpr, HALF: tl.constexpr, INTERPRETED: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, ROWS)[:, None]
    col = tl.arange(0, HALF)[None, :]
    d = r * HALF + col                                            # [ROWS, HALF]: coordinate
    own = tl.load(state_row_ptr + b)
    c_new = cast_nearest(tl.load(c_ptr + b * c_stride + d), state_ptr.dtype.element_ty, INTERPRETED)
    g_new = cast_nearest(tl.load(g_ptr + b * g_stride + d), state_ptr.dtype.element_ty, INTERPRETED)
    tl.store(state_ptr + own * state_stride0 + d, c_new)
    tl.store(state_ptr + own * state_stride0 + state_stride1 + d, g_new)
    # Online softmax over the block's rows, per coordinate: running max, sum and weighted content.
    m = tl.full([ROWS, HALF], float("-inf"), tl.float32)
    s = tl.zeros([ROWS, HALF], tl.float32)
    acc = tl.zeros([ROWS, HALF], tl.float32)
    for j in range(RATIO):
        row = tl.load(block_rows_ptr + b * RATIO + j)
        base = state_ptr + row * state_stride0 + d
        mine = row == own
        cj = tl.where(mine, c_new, tl.load(base)).to(tl.float32)
        gj = tl.where(mine, g_new, tl.load(base + state_stride1)).to(tl.float32)
        logit = gj + tl.load(bias_ptr + j * (ROWS * HALF) + d).to(tl.float32)
        m_new = tl.maximum(m, logit)
        decay = tl.exp(m - m_new)
        e = tl.exp(logit - m_new)
        s = s * decay + e
        acc = acc * decay + e * cj
        m = m_new
    latent = acc / s
    ms = tl.sum(tl.sum(latent * latent, axis=1), axis=0) / (ROWS * HALF)
    latent = latent * (1.0 / tl.sqrt(ms + eps)) * tl.load(norm_ptr + d).to(tl.float32)
    # RoPE at the block's first position.
    latent = rotate(latent, tl.load(index_ptr + b) * RATIO, inv_ptr, ROWS, HALF)
    tl.store(out_ptr + b * (ROWS * HALF) + d, cast_nearest(latent, out_ptr.dtype.element_ty, INTERPRETED))


def compress_decode(c: torch.Tensor, g: torch.Tensor, state: torch.Tensor, state_row: torch.Tensor,
                    block_rows: torch.Tensor, gate_bias: torch.Tensor, norm: torch.Tensor,
                    block_index: torch.Tensor, ratio: int, eps: float, theta: float,
                    out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One decode token per row joins its open block: c, g [B, 512] (row-strided views are
    fine) go to state [rows, 2, >= 512] at state_row [B] (content at [:, 0], gate at [:, 1],
    in the state's dtype); the block's rows block_rows [B, ratio] (the token's own among
    them) give the latent as remnant.engine.ops.compress_latents does (softmax gate plus
    gate_bias [ratio, 512], RMS norm with weight `norm` [512], RoPE at block_index * ratio).
    Returns [B, 512] in out_dtype (bf16: what the record store rounds to). Graph-safe."""
    B = c.shape[0]
    if c.shape[-1] != HEAD_DIM or g.shape != c.shape or c.stride(-1) != 1 or g.stride(-1) != 1:
        raise ValueError(f"c and g must be [B, {HEAD_DIM}] with unit column stride, got {tuple(c.shape)}, "
                         f"{tuple(g.shape)}")
    if state.ndim != 3 or state.shape[1] != 2 or state.shape[2] < HEAD_DIM or state.stride(2) != 1:
        raise ValueError(f"state must be [rows, 2, >= {HEAD_DIM}] with unit column stride, got {tuple(state.shape)}")
    if tuple(block_rows.shape) != (B, ratio) or tuple(gate_bias.shape) != (ratio, HEAD_DIM):
        raise ValueError(f"block_rows must be [{B}, {ratio}] and gate_bias [{ratio}, {HEAD_DIM}], got "
                         f"{tuple(block_rows.shape)} and {tuple(gate_bias.shape)}")
    out = torch.empty(B, HEAD_DIM, dtype=out_dtype, device=c.device)
    if B:
        _compress_kernel[(B,)](c, c.stride(0), g, g.stride(0), state, state.stride(0), state.stride(1),
                               state_row.contiguous(), block_rows.contiguous(), gate_bias.contiguous(),
                               norm.contiguous(), block_index.contiguous(),
                               rope_inverse_frequencies(float(theta), c.device), out, eps,
                               RATIO=ratio, ROWS=ROWS, HALF=ROPE_HALF, INTERPRETED=interpreted(), num_warps=4)
    return out


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

