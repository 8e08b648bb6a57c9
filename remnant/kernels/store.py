"""store: quantize latents to native or packed C4 records at pool locations.

One program quantizes BLOCK_ROWS latents with SGLang's arithmetic (per 64-coordinate NoPE
tile: scale = 2^ceil(log2(max(amax, 1e-8) / 448)), codes = clamp(x / scale) as FP8 e4m3),
so its records are bit-identical to SGLang's quantizer (and to remnant.kv.quantize), then
writes either all 448 codes (native) or the kept ones in map order (packed), the 128 RoPE
bytes and the 7 scales + pad, in the split page layout.

Bytes: read 1024 per latent (bf16), write R + 72 (packed) or 584 (native).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from remnant.kernels.common import check_locs
from remnant.kv.formats import HEAD_DIM
from remnant.kv.paged import KeptColumns, PageLayout


@triton.jit
def _store_kernel(
    x_ptr, x_stride, n_rows,
    pages_ptr, locs_ptr, per_page, page_stride,
    cols_ptr,
    N: tl.constexpr, NP: tl.constexpr, PACKED: tl.constexpr, GATHER: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    tiles = tl.arange(0, 8)
    lanes = tl.arange(0, 64)

    # One contiguous load of each latent as 8 tiles of 64 (tile 7 is RoPE, not quantized),
    # then the exact operations of SGLang's _quant_k_cache_fused_kernel per NoPE tile.
    x_rows = x_ptr + rows[:, None, None].to(tl.int64) * x_stride
    x = tl.load(x_rows + tiles[None, :, None] * 64 + lanes[None, None, :],
                mask=row_ok[:, None, None], other=0.0).to(tl.float32)      # [BR, 8, 64]
    amax = tl.maximum(tl.max(tl.abs(x), axis=2), 1e-8)                      # [BR, 8]
    ceil_log2 = tl.math.ceil(tl.log2(amax / 448.0))
    scale_inv = 1.0 / tl.exp2(ceil_log2)
    scaled = x * scale_inv[:, :, None]
    j = tl.arange(0, NP)
    if PACKED and not GATHER:
        # The kept columns read again by index (L1-served), each scaled by its tile's
        # exponent chosen by a select chain (kept columns are sorted, tiles rise).
        kept = tl.load(cols_ptr + j)
        kept_tile = kept // 64
        x_kept = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + kept[None, :],
                         mask=row_ok[:, None] & (j[None, :] < N), other=0.0).to(tl.float32)
        inv = tl.broadcast_to(tl.sum(tl.where(tiles[None, :] == 0, scale_inv, 0.0), axis=1)[:, None], (BLOCK_ROWS, NP))
        for t in tl.static_range(1, 7):
            inv_t = tl.sum(tl.where(tiles[None, :] == t, scale_inv, 0.0), axis=1)
            inv = tl.where(kept_tile[None, :] >= t, inv_t[:, None], inv)
        codes = tl.clamp(x_kept * inv, -448.0, 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        codes = tl.clamp(scaled, -448.0, 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        codes = tl.reshape(codes, (BLOCK_ROWS, 512))                        # native order
        if PACKED:
            # The kept codes in map order, permuted in registers: stores stay contiguous.
            kept = tl.load(cols_ptr + j)
            codes = tl.gather(codes, tl.broadcast_to(kept[None, :], (BLOCK_ROWS, NP)), axis=1)

    # Split-layout addresses: data part (codes then RoPE), then the 8-byte tail.
    DATA: tl.constexpr = N + 128
    locs = tl.load(locs_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    page = locs // per_page
    slot = locs % per_page
    data = pages_ptr + page * page_stride + slot * DATA
    tail = pages_ptr + page * page_stride + per_page * DATA + slot * 8
    tl.store(data[:, None] + j[None, :], codes, mask=row_ok[:, None] & (j[None, :] < N))

    r = tl.arange(0, 64)
    rope = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + 448 + r[None, :], mask=row_ok[:, None], other=0.0)
    rope_ptr = (data + N).to(tl.pointer_type(tl.bfloat16))
    tl.store(rope_ptr[:, None] + r[None, :], rope.to(tl.bfloat16), mask=row_ok[:, None])

    scale_bytes = tl.where(tiles[None, :] < 7, (ceil_log2.to(tl.int32) + 127), 0).to(tl.uint8)
    tl.store(tail[:, None] + tiles[None, :], scale_bytes, mask=row_ok[:, None])


def store(
    x: torch.Tensor,
    pages: torch.Tensor,
    layout: PageLayout,
    locs: torch.Tensor,
    keep: "torch.Tensor | KeptColumns | None" = None,
    check_range: bool = False,
    block_rows: int = 16,
    permute: str = "registers",
) -> None:
    """Quantize x [n, 512] (bf16 or float; rounded to bf16 as SGLang stores K) into `pages`.

    keep None: native records; keep int64 [N]: packed records of R = N + 64. Writes record
    i at locs[i] (flat pool location). Non-finite latents are not checked here (the
    reference refuses them; SGLang's kernel gives undefined scales). permute: how packed
    codes reach map order, "registers" (tl.gather of the quantized tile) or "loads" (the
    kept latents re-read by index); both give the same bytes.
    """
    if permute not in ("registers", "loads"):
        raise ValueError(f"permute={permute!r} is not allowed; allowed: 'registers', 'loads'")
    if x.ndim != 2 or x.shape[1] != HEAD_DIM or not x.is_floating_point():
        raise ValueError(f"store expects float [n, {HEAD_DIM}] latents, got {x.dtype} {tuple(x.shape)}")
    layout.check(pages)
    cols = KeptColumns.of(keep, x.device)
    if cols.record_bytes != layout.record_bytes:
        raise ValueError(f"{cols.n_kept} kept codes make {cols.record_bytes}-byte records, but the layout holds {layout.record_bytes}")
    if locs.shape != (x.shape[0],):
        raise ValueError(f"locs must be [{x.shape[0]}], got {tuple(locs.shape)}")
    locs = check_locs(locs, "locs", layout.capacity(pages), check_range)
    if x.shape[0] == 0:
        return
    xb = x.to(torch.bfloat16).contiguous()
    grid = (triton.cdiv(x.shape[0], block_rows),)
    _store_kernel[grid](
        xb, xb.stride(0), x.shape[0],
        pages, locs, layout.per_page, layout.page_stride,
        cols.kept,
        N=cols.n_kept, NP=cols.kept.numel(), PACKED=cols.packed, GATHER=permute == "registers", BLOCK_ROWS=block_rows,
    )
