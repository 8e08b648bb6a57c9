"""Pieces the engine's two decode paths share: the model's model-free operations (RMS norm,
RoPE, the indexer keys' FP8 codec) and the decode kernels' launch settings for its head
count (the layers' ratios are remnant.kv.formats' CSA_RATIO and HCA_RATIO). A leaf of
remnant.engine: remnant.engine.model (the per-sequence path) and remnant.engine.decode_step
(the batched step) both build on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from remnant.kv import HEAD_DIM, NOPE_DIM, ROPE_DIM
from remnant.kv.index_keys import quantize_index_keys

if TYPE_CHECKING:
    from remnant.kernels.decode import DecodeConfig

SCRATCH_PER_PAGE = 64  # triton mode's reconstructed records: SGLang's C4 pages at page size 256


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm computed in float32 (bf16 sums of squares lose the mean), result in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2 * S] (gate columns first): SwiGLU's activation,
    rounded to gate_up's dtype after the silu as after the product."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
              theta: float) -> torch.Tensor:
    """rope(rms_norm(x, weight, eps), positions, theta): the queries' and window latents'
    chain, one call so that a compiled step fuses it into one kernel (remnant.engine.step_ops)."""
    return rope(rms_norm(x, weight, eps), positions, theta)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate the last ROPE_DIM coordinates of x [T, 512] or [T, H, 512] by positions [T]."""
    half = ROPE_DIM // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    ang = positions.float()[:, None] * inv[None, :]  # [T, half]
    cos, sin = ang.cos(), ang.sin()
    if x.ndim == 3:  # [T, H, D]
        cos, sin = cos[:, None, :], sin[:, None, :]
    nope, r = x[..., :NOPE_DIM], x[..., NOPE_DIM:].float()
    r1, r2 = r[..., :half], r[..., half:]
    # Rotated in float32 (as SGLang's rope kernels), then back to x's dtype.
    return torch.cat([nope, (r1 * cos - r2 * sin).to(x.dtype), (r1 * sin + r2 * cos).to(x.dtype)], dim=-1)


def compress_latents(c: torch.Tensor, g: torch.Tensor, gate_bias: torch.Tensor, norm: torch.Tensor,
                     block_index: torch.Tensor, ratio: int, eps: float, theta: float) -> torch.Tensor:
    """Blocks of `ratio` tokens -> record latents float32 [n, 512] with RoPE at each block's
    first position: c, g [n, ratio, 512] the blocks' content and gate logits, a softmax
    gate over the block's tokens per coordinate (plus gate_bias [ratio, 512]), then the
    RMS norm (weight `norm`). block_index: int64 [n], each block's index in its sequence."""
    weights = torch.softmax(g + gate_bias, dim=1)
    latent = rms_norm((weights * c).sum(1), norm, eps)
    return rope(latent, block_index * ratio, theta).float()


def compress_decode(c: torch.Tensor, g: torch.Tensor, state: torch.Tensor, state_row: torch.Tensor,
                    block_rows: torch.Tensor, gate_bias: torch.Tensor, norm: torch.Tensor,
                    block_index: torch.Tensor, ratio: int, eps: float, theta: float,
                    compress=compress_latents, *, complete: torch.Tensor) -> torch.Tensor:
    """A decode token per row joins its compressor's open block: c, g [B, 512] into state
    [rows, 2, >= 512] at state_row [B] (content, then gate, in the state's dtype), then the
    block's rows block_rows [B, ratio] (its own among them), read back in float32, through
    `compress` (compress_latents: latents float32 [B, 512]); zeros where `complete` (bool
    [B]: the token completes its block) is False. The plain reference of
    remnant.kernels.compress.compress_decode."""
    state[state_row, :, :HEAD_DIM] = torch.stack([c, g], dim=1).to(state.dtype)
    block = state[block_rows, :, :HEAD_DIM].float()  # [B, ratio, 2, 512]: one gather for both
    latents = compress(block[:, :, 0], block[:, :, 1], gate_bias, norm, block_index, ratio, eps, theta)
    return torch.where(complete[:, None], latents, 0.0)


def index_key_decode(ik: torch.Tensor, state: torch.Tensor, state_row: torch.Tensor, block_rows: torch.Tensor,
                     pages: torch.Tensor, layout, locs: torch.Tensor, quantize=quantize_index_keys) -> None:
    """The indexer keys' decode update: ik [B, d] into state [rows, 2, >= d] at [state_row, 0]
    (state's dtype); the mean of its block's rows block_rows [B, ratio], through `quantize`
    (FP8 by default, or the MXFP4 codec), written at locs [B] into the indexer pages
    (`layout`, a remnant.kv.layout.PageLayout). The plain reference of
    remnant.kernels.compress.index_key_decode (FP8 keys)."""
    d = ik.shape[1]
    state[state_row, 0, :d] = ik.to(state.dtype)
    keys = state[block_rows, 0, :d].float().mean(1)
    layout.write(pages, locs, quantize(keys))


def ratio_slots(pos: torch.Tensor, page_table: torch.Tensor, slot: torch.Tensor, page_size: int, ratio: int,
                ring: int, pad_page: int) -> tuple[torch.Tensor, ...]:
    """Where a decode batch's tokens (positions pos int64 [B], full pages page_table int64
    [B, P], compressor state slots slot int64 [B]) sit in one ratio's records and
    compressor state: (locs int32 [B, N], visible bool [B, N], visible_locs int32 [B, N],
    counts int32 [B], state_row int64 [B], block_rows int64 [B, ratio], index int64 [B],
    write_locs int32 [B], complete bool [B]) with N = P * page_size // ratio
    (remnant.engine.decode_step.RatioSlots names them). Record j is visible once its block
    is complete: j * ratio + ratio - 1 <= pos. The reference of
    remnant.kernels.slots.ratio_slots (one launch for these thirty-odd)."""
    per = page_size // ratio
    j = torch.arange(page_table.shape[1] * per, device=pos.device)
    locs = page_table[:, j // per] * per + j % per
    counts = torch.clamp((pos + 1) // ratio, max=locs.shape[1])
    index = pos // ratio
    complete = pos % ratio == ratio - 1
    page = page_table.gather(1, (index // per)[:, None])[:, 0]
    visible = j[None, :] < counts[:, None]
    i32 = torch.int32
    return (locs.to(i32), visible, torch.where(visible, locs, -1).to(i32), counts.to(i32), slot * ring + pos % ratio,
            slot[:, None] * ring + torch.arange(ratio, device=pos.device), index,
            torch.where(complete, page * per + index % per, pad_page * per).to(i32), complete)


def decode_config(heads: int) -> "DecodeConfig | None":
    """Launch settings of remnant.kernels.decode: its plan's own (None), tuned for V4's 64
    heads; for 16 heads or fewer (the tiny model has 8), blocks of 16 heads (tl.dot's
    minimum) on 4 warps, as tests/kernels/test_decode.py also runs it compiled."""
    from remnant.kernels.decode import DecodeConfig

    return DecodeConfig(h_block=16, num_warps=4) if heads <= 16 else None



def index_top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest scores of each row [..., n] (float32) and their indices, in descending
    order, ties to the lower index: exactly a stable descending sort's first k
    (remnant.kernels.top_k.top_k_reference), through one torch.topk (the CPU's; the
    GPU's is remnant.kernels.top_k).

    The indexer's scores tie often (relu gives records whose every head scores below zero
    exactly 0), and torch.topk alone breaks ties by its own blocking, which depends on n:
    the per-sequence path (n visible records) and the batched step (n padded to the page
    table, and to a CUDA graph's bucket) would then read other records for the same token.
    A full sort does not, but sorts all n where k are needed. Here each score becomes one
    int64 ordered by (score, then lower index): the float's bits as a signed integer of the
    same order (negative floats' magnitude bits flipped) in the high half, n - 1 - index in
    the low half. The values are distinct, so topk's choice is the sort's."""
    if scores.dtype != torch.float32:
        raise ValueError(f"index_top_k takes float32 scores, got {scores.dtype}")
    n = scores.shape[-1]
    bits = (scores + 0.0).view(torch.int32).to(torch.int64)   # + 0.0: -0.0 becomes 0.0, its tie
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    packed = (ordered << 32) | (n - 1 - torch.arange(n, device=scores.device))
    indices = n - 1 - (torch.topk(packed, k, dim=-1).values & 0xFFFFFFFF)
    return scores.gather(-1, indices), indices


def index_top_locations(scores: torch.Tensor, k: int, locs: torch.Tensor,
                        counts: torch.Tensor | None = None) -> torch.Tensor:
    """Where index_top_k's choice of each row of scores [B, n] lies: locs [B, n] at the
    chosen indices as int32 [B, k] (the attention kernels' index type), -1 where the chosen
    score is -inf (a record not visible). The plain form of
    remnant.kernels.top_k.top_k_locations; counts (each row's visible records, past which
    its scores are -inf) is the kernel's to skip reading, and changes nothing here."""
    values, indices = index_top_k(scores, k)
    return torch.where(values > float("-inf"), locs.gather(1, indices), -1).to(torch.int32)
