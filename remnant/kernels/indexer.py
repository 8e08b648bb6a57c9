"""indexer: the lightning indexer's decode scores over FP8 index keys in their pages, and
the top-k that picks a token's records from them.

For row b (one decode token) and each C4 record j the page table reaches,

    score[b, j] = sum_h w[b, h] * relu(q[b, h] . key_j)      (-inf where j is not visible)

key_j = codes_j * scale_j: 128 FP8 e4m3 codes and one float32 scale per 128 coordinates, in
the indexer pool's split pages (codes of a page's keys first, then their 4-byte scales;
remnant.engine.pools). This is DeepSeek-V4's indexer as SGLang runs it in decode
(DeepGEMM's fp8 paged MQA logits), and what the engine's torch path computes by gathering
the keys, dequantizing them to the compute dtype and multiplying.

The kernel (`index_scores`) reads each reachable key once, straight from its page: one
program per (row, block of BLOCK_N keys) loads the row's q [H, D] once, the block's codes
widened to q's dtype (exact: an e4m3 value is a bf16 value), multiplies on the tensor cores
with float32 accumulation, applies the scale per key to the float32 product (the scale is
constant along the summed axis, so this is the dequantized product), relu and the weighted
sum over heads, and writes float32 scores. The torch path instead moves the gathered keys
through memory four times (gather, widen, scale, cast) and rounds the product to bf16.

`index_scores_reference` is the same function in float64 from dequantized keys (the
ground truth the kernel is tested against). The selection from the scores is
remnant.engine.ops.index_top_k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from remnant.kernels.common import interpreted
from remnant.kv.layout import PageLayout

#: The kernel reads keys of one 128-coordinate scale block (V4's index_head_dim).
KEY_DIM = 128
SCALE_BYTES = 4


def _check(q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor, layout: PageLayout, locs: torch.Tensor,
           visible: torch.Tensor) -> None:
    if q.ndim != 3 or q.shape[2] != KEY_DIM or q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"q must be bfloat16 or float32 [B, heads, {KEY_DIM}], got {q.dtype} {tuple(q.shape)}")
    B, H, _ = q.shape
    if w.shape != (B, H):
        raise ValueError(f"w must be [B={B}, heads={H}], got {tuple(w.shape)}")
    if layout.data_bytes != KEY_DIM or layout.tail_bytes != SCALE_BYTES:
        raise ValueError(f"the indexer's pages hold {KEY_DIM} code bytes and a {SCALE_BYTES}-byte scale per key, "
                         f"got data_bytes={layout.data_bytes}, tail_bytes={layout.tail_bytes}")
    layout.check(pages, "index key pages")
    if layout.page_stride % 4 or (layout.per_page * KEY_DIM) % 4:
        raise ValueError(f"index key pages must keep their float32 scales 4-byte aligned, got page_stride="
                         f"{layout.page_stride}")
    if locs.ndim != 2 or locs.shape[0] != B or visible.shape != locs.shape or visible.dtype != torch.bool:
        raise ValueError(f"locs must be int [B={B}, n] with visible bool of the same shape, got "
                         f"{locs.dtype} {tuple(locs.shape)} and {visible.dtype} {tuple(visible.shape)}")
    devices = {t.device for t in (q, w, pages, locs, visible)}
    if len(devices) > 1:
        raise ValueError(f"the indexer's tensors must share one device, got {sorted(map(str, devices))}")


def keys_at(pages: torch.Tensor, layout: PageLayout, locs: torch.Tensor) -> torch.Tensor:
    """Dequantized keys float32 [*locs.shape, 128] at `locs` (each a valid location)."""
    stored = layout.read(pages, locs.clamp_min(0))
    codes = stored[..., :KEY_DIM].contiguous().view(torch.float8_e4m3fn).float()
    scale = stored[..., KEY_DIM:].contiguous().view(torch.float32)
    return codes * scale


def index_scores_reference(q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor, layout: PageLayout,
                           locs: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The ground truth of `index_scores`, in float64 (returned as float32)."""
    _check(q, w, pages, layout, locs, visible)
    keys = keys_at(pages, layout, locs).double()                      # [B, n, D]
    logits = torch.relu(torch.einsum("bhd,bnd->bhn", q.double(), keys))
    scores = torch.einsum("bh,bhn->bn", w.double(), logits).float()
    return scores.masked_fill(~visible, float("-inf"))


@triton.jit
def _scores_kernel(q_ptr, w_ptr, pages_ptr, scales_ptr, locs_ptr, visible_ptr, out_ptr, n, H,
                   page_stride, PER_PAGE: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = j < n
    loc = tl.load(locs_ptr + b.to(tl.int64) * n + j, mask=in_row, other=0)
    seen = tl.load(visible_ptr + b.to(tl.int64) * n + j, mask=in_row, other=0) != 0
    ok = in_row & seen & (loc >= 0)
    loc = tl.where(ok, loc, 0)
    page = (loc // PER_PAGE).to(tl.int64)
    slot = loc % PER_PAGE
    d = tl.arange(0, D)
    codes = tl.load(pages_ptr + page[:, None] * page_stride + slot[:, None] * D + d[None, :],
                    mask=ok[:, None], other=0)
    # The scales sit after the page's codes; scales_ptr is the pages as float32 words.
    scale = tl.load(scales_ptr + page * (page_stride // 4) + (PER_PAGE * D) // 4 + slot, mask=ok, other=0.0)
    h = tl.arange(0, BLOCK_H)
    q = tl.load(q_ptr + (b.to(tl.int64) * H + h[:, None]) * D + d[None, :], mask=h[:, None] < H, other=0.0)
    keys = codes.to(tl.float8e4nv, bitcast=True).to(q.dtype)
    if INTERPRETED:
        # Triton's interpreter returns garbage for tl.dot on bf16 operands (remnant.kernels.moe).
        dots = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
    elif q.dtype == tl.float32:
        dots = tl.dot(q, tl.trans(keys), input_precision="ieee")
    else:
        dots = tl.dot(q, tl.trans(keys))                              # [BLOCK_H, BLOCK_N] float32
    wh = tl.load(w_ptr + b.to(tl.int64) * H + h, mask=h < H, other=0.0)
    s = tl.sum(tl.maximum(dots * scale[None, :], 0.0) * wh[:, None], axis=0)
    tl.store(out_ptr + b.to(tl.int64) * n + j, tl.where(ok, s, float("-inf")), mask=in_row)


def index_scores(q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor, layout: PageLayout, locs: torch.Tensor,
                 visible: torch.Tensor, block_n: int = 64) -> torch.Tensor:
    """Scores float32 [B, n] of the keys at `locs` int [B, n] for queries q [B, H, 128]
    (bfloat16 or float32) with head weights w float32 [B, H]; -inf where `visible` (bool [B,
    n]) is false or a location is -1. pages: the indexer pool's uint8 [pages, page_stride]
    (`layout`: 128 code bytes and a 4-byte scale per key). Nothing is read back to the
    host: a CUDA graph can capture it."""
    _check(q, w, pages, layout, locs, visible)
    B, H, D = q.shape
    n = locs.shape[1]
    out = torch.empty(B, n, dtype=torch.float32, device=q.device)
    if B == 0 or n == 0:
        return out
    block_h = max(16, triton.next_power_of_2(H))
    grid = (B, triton.cdiv(n, block_n))
    _scores_kernel[grid](q.contiguous(), w.float().contiguous(), pages, pages.view(torch.float32),
                         locs.to(torch.int32).contiguous(), visible.contiguous().view(torch.uint8), out, n, H,
                         layout.page_stride, PER_PAGE=layout.per_page, D=D, BLOCK_H=block_h, BLOCK_N=block_n,
                         INTERPRETED=interpreted())
    return out
