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

from remnant.kernels.common import alignment, check_locs, record_addresses
from remnant.kv.formats import HEAD_DIM, NATIVE_RECORD_BYTES, NOPE_DIM
from remnant.kv.layout import KeptColumns, PageLayout


PERMUTES = ("registers", "loads", "shared")
# The fastest launch per permutation on the H200 (latents per program, warps): "shared"
# needs several warps (its gather goes through shared memory only when it spans warps).
LAUNCH = {"registers": (4, 1), "loads": (4, 1), "shared": (16, 4)}
LOADS_UP_TO_KEPT = 128  # the default permutation is "loads" up to R = 192, "shared" above
#: Native records' column table per device, built on first use: building one copies host
#: tensors to the device, which a CUDA graph being captured refuses (the engine's first,
#: eager step of a bucket builds it before the capture).
_NATIVE_COLUMNS: dict[torch.device, KeptColumns] = {}


def _columns(keep: "torch.Tensor | KeptColumns | None", device: torch.device) -> KeptColumns:
    if keep is not None:
        return KeptColumns.of(keep, device)
    if device not in _NATIVE_COLUMNS:
        _NATIVE_COLUMNS[device] = KeptColumns.of(None, device)
    return _NATIVE_COLUMNS[device]


@triton.jit
def _store_kernel(
    x_ptr, x_stride, n_rows,
    pages_ptr, locs_ptr, page_stride,
    kept_ptr,
    PER_PAGE: tl.constexpr, ALIGN: tl.constexpr,
    N: tl.constexpr, NP: tl.constexpr, PACKED: tl.constexpr, PERMUTE: tl.constexpr,
    X_ORDER: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    tiles = tl.arange(0, 8)
    lanes = tl.arange(0, 64)

    # One contiguous load of each latent as 8 tiles of 64 (tile 7 is RoPE, not quantized),
    # then the exact operations of SGLang's _quant_k_cache_fused_kernel per NoPE tile.
    # X_ORDER (kept-first window records, quantize_kept_first): the latent is read through
    # the column order at kept_ptr [512] instead, so the tiles are of its positions.
    x_rows = x_ptr + rows[:, None, None].to(tl.int64) * x_stride
    if X_ORDER:
        x_cols = tl.load(kept_ptr + tiles[:, None] * 64 + lanes[None, :])
    else:
        x_cols = tiles[:, None] * 64 + lanes[None, :]
    x = tl.load(x_rows + x_cols[None, :, :], mask=row_ok[:, None, None], other=0.0).to(tl.float32)  # [BR, 8, 64]
    amax = tl.maximum(tl.max(tl.abs(x), axis=2), 1e-8)                      # [BR, 8]
    ceil_log2 = tl.math.ceil(tl.log2(amax / 448.0))
    scale_inv = 1.0 / tl.exp2(ceil_log2)

    # Split-layout addresses: data part (codes then RoPE), then the 8-byte tail.
    DATA: tl.constexpr = N + 128
    data, tail = record_addresses(pages_ptr, tl.load(locs_ptr + rows, mask=row_ok, other=0),
                                  PER_PAGE, page_stride, DATA, ALIGN)
    if PACKED and PERMUTE == "loads":
        # The kept latents re-read by index (L1 hits: the rows were just loaded) and
        # quantized in map order with their tiles' scales: contiguous code stores, no
        # permutation of the quantized tile.
        # (The tile scales reach the columns by tl.gather: a select chain over 7 per-row
        # scalars compiled to a replicated layout of 255 registers, far slower.)
        j = tl.arange(0, NP)
        kept = tl.load(kept_ptr + j)
        kept_ok = row_ok[:, None] & (j[None, :] < N)
        scale_kept = tl.gather(scale_inv, tl.broadcast_to((kept // 64)[None, :], (BLOCK_ROWS, NP)), axis=1)
        x_kept = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + kept[None, :], mask=kept_ok, other=0.0)
        kept_codes = tl.clamp(x_kept.to(tl.float32) * scale_kept, -448.0, 448.0).to(tl.float8e4nv)
        tl.store(data[:, None] + j[None, :], kept_codes.to(tl.uint8, bitcast=True), mask=kept_ok)
    else:
        codes = tl.clamp(x * scale_inv[:, :, None], -448.0, 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        codes = tl.reshape(codes, (BLOCK_ROWS, 512))                        # native order
        j = tl.arange(0, NP)
        if PACKED:
            kept = tl.load(kept_ptr + j)
            if PERMUTE == "shared":
                # The kept codes gathered from the block's codes flattened to one axis:
                # Triton lowers a gather whose axis spans warps through shared memory (a
                # store, then a load per value), where a gather along a row ("registers")
                # gets a warp-local layout and several shuffles per value (NOTES.md,
                # seventh round).
                at = tl.reshape(tl.arange(0, BLOCK_ROWS)[:, None] * 512 + kept[None, :], (BLOCK_ROWS * NP,))
                codes = tl.reshape(tl.gather(tl.reshape(codes, (BLOCK_ROWS * 512,)), at, axis=0), (BLOCK_ROWS, NP))
            else:  # the kept codes in map order, permuted in registers: stores stay contiguous
                codes = tl.gather(codes, tl.broadcast_to(kept[None, :], (BLOCK_ROWS, NP)), axis=1)
        tl.store(data[:, None] + j[None, :], codes, mask=row_ok[:, None] & (j[None, :] < N))

    r = tl.arange(0, 64)
    rope = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + 448 + r[None, :], mask=row_ok[:, None], other=0.0)
    rope_ptr = (data + N).to(tl.pointer_type(tl.bfloat16))
    tl.store(rope_ptr[:, None] + r[None, :], rope.to(tl.bfloat16), mask=row_ok[:, None])

    # The 7 biased exponents and a zero pad byte, stored as one little-endian int64.
    # (& 0xFF: a non-finite latent's exponent stays in its own byte.)
    biased = tl.where(tiles[None, :] < 7, (ceil_log2.to(tl.int64) + 127) & 0xFF, 0)
    tail_word = tl.sum(biased << (8 * tiles[None, :].to(tl.int64)), axis=1)
    tl.store(tail.to(tl.pointer_type(tl.int64)), tail_word, mask=row_ok)


def _checked(x: torch.Tensor, pages: torch.Tensor, layout: PageLayout, locs: torch.Tensor, check_range: bool,
             name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The latents as contiguous bf16 (SGLang stores K in bf16) and the checked locations."""
    if x.ndim != 2 or x.shape[1] != HEAD_DIM or not x.is_floating_point():
        raise ValueError(f"{name} expects float [n, {HEAD_DIM}] latents, got {x.dtype} {tuple(x.shape)}")
    layout.check(pages)
    if locs.shape != (x.shape[0],):
        raise ValueError(f"locs must be [{x.shape[0]}], got {tuple(locs.shape)}")
    return x.to(torch.bfloat16).contiguous(), check_locs(locs, "locs", layout.capacity(pages), check_range)


def store(
    x: torch.Tensor,
    pages: torch.Tensor,
    layout: PageLayout,
    locs: torch.Tensor,
    keep: "torch.Tensor | KeptColumns | None" = None,
    check_range: bool = False,
    block_rows: int | None = None,
    num_warps: int | None = None,
    permute: str | None = None,
) -> None:
    """Quantize x [n, 512] (bf16 or float; rounded to bf16 as SGLang stores K) into `pages`.

    keep None: native records; keep int64 [N]: packed records of R = N + 64. Writes record
    i at locs[i] (flat pool location). Non-finite latents are not checked here (the
    reference refuses them; SGLang's kernel gives undefined scales). permute: how packed
    codes reach map order, "shared" (the quantized codes gathered through shared memory,
    then contiguous stores), "loads" (the kept latents re-read by index and quantized in map
    order) or "registers" (the plain one: tl.gather along each row, warp shuffles); all give
    the same bytes. Native records have nothing to permute ("registers"). None picks the
    fastest measured on the H200 (benchmarks/kernels/NOTES.md, seventh round): "loads" up to
    R = 192 (its index loads grow with the kept codes), "shared" above.
    Launch: block_rows latents per program on num_warps warps, None taking LAUNCH's.
    """
    if permute is not None and permute not in PERMUTES:
        raise ValueError(f"permute={permute!r} is not allowed; allowed: {', '.join(map(repr, PERMUTES))}")
    cols = _columns(keep, x.device)
    if permute is None:
        permute = "registers" if not cols.packed else "loads" if cols.n_kept <= LOADS_UP_TO_KEPT else "shared"
    if cols.record_bytes != layout.record_bytes:
        raise ValueError(f"{cols.n_kept} kept codes make {cols.record_bytes}-byte records, but the layout holds {layout.record_bytes}")
    xb, locs = _checked(x, pages, layout, locs, check_range, "store")
    if x.shape[0] == 0:
        return
    block_rows = block_rows or LAUNCH[permute][0]
    num_warps = num_warps or LAUNCH[permute][1]
    grid = (triton.cdiv(x.shape[0], block_rows),)
    _store_kernel[grid](
        x_ptr=xb, x_stride=xb.stride(0), n_rows=x.shape[0],
        pages_ptr=pages, locs_ptr=locs, page_stride=layout.page_stride,
        kept_ptr=cols.kept,
        PER_PAGE=layout.per_page, ALIGN=alignment(layout, "pages"),
        N=cols.n_kept, NP=cols.kept.numel(), PACKED=cols.packed, PERMUTE=permute, X_ORDER=False,
        BLOCK_ROWS=block_rows, num_warps=num_warps,
    )


def store_kept_first(
    x: torch.Tensor,
    pages: torch.Tensor,
    layout: PageLayout,
    locs: torch.Tensor,
    keep: "torch.Tensor | KeptColumns",
    check_range: bool = False,
    block_rows: int = 4,
    num_warps: int = 1,
) -> None:
    """Quantize x [n, 512] into kept-first window records (584 bytes): the native record of
    x read in kept-first column order (KeptColumns.order: the kept columns in map order, the
    dropped ones, RoPE), so its 7 scale tiles are of 64 kept-first positions
    (remnant.kv.paged.quantize_kept_first, bit for bit).

    Written for the packed decode kernel's window (decode(..., window_columns="kept_first")),
    which then reads both column sets with word loads and derives each code's scale from
    its position, instead of loading each code and a scale selector by its column index.
    """
    if layout.record_bytes != NATIVE_RECORD_BYTES:
        raise ValueError(f"store_kept_first writes native {NATIVE_RECORD_BYTES}-byte records, but the layout holds "
                         f"{layout.record_bytes}")
    cols = KeptColumns.of(keep, x.device)
    xb, locs = _checked(x, pages, layout, locs, check_range, "store_kept_first")
    if x.shape[0] == 0:
        return
    # A native record of the latent read through the kept-first order.
    _store_kernel[(triton.cdiv(x.shape[0], block_rows),)](
        x_ptr=xb, x_stride=xb.stride(0), n_rows=x.shape[0],
        pages_ptr=pages, locs_ptr=locs, page_stride=layout.page_stride,
        kept_ptr=cols.order,
        PER_PAGE=layout.per_page, ALIGN=alignment(layout, "pages"),
        N=NOPE_DIM, NP=512, PACKED=False, PERMUTE="registers", X_ORDER=True, BLOCK_ROWS=block_rows,
        num_warps=num_warps,
    )
