"""indexer: the lightning indexer's decode scores over index keys in their pages (FP8 or
MXFP4), and the top-k that picks a token's records from them.

For row b (one decode token) and each C4 record j the page table reaches,

    score[b, j] = sum_h w[b, h] * relu(q[b, h] . key_j)      (-inf where j is not visible)

key_j = codes_j * scale_j: 128 FP8 e4m3 codes and one float32 scale per 128 coordinates, in
the indexer pool's split pages (codes of a page's keys first, then their 4-byte scales;
remnant.engine.pools). This is DeepSeek-V4's indexer as SGLang runs it in decode
(DeepGEMM's fp8 paged MQA logits), and what the engine's torch path computes by gathering
the keys, dequantizing them to the compute dtype and multiplying.

The kernel reads each key straight from its page: one program per (block of BLOCK_T rows,
block of BLOCK_N keys) loads the block's codes widened to q's dtype (exact: an e4m3 value
is a bf16 value) and, for each of its rows, the row's q [H, D], multiplies on the tensor
cores with float32 accumulation, applies the scale per key to the float32 product (the
scale is constant along the summed axis, so this is the dequantized product), relu and the
weighted sum over heads, and writes float32 scores. Two forms: `index_scores`, a decode
step's, where each row (sequence) has its own keys (BLOCK_T = 1); `index_scores_shared`,
a prefill's, where a sequence's tokens score the same keys, so a program reuses its key
block for BLOCK_T tokens. The torch path instead moves the gathered keys through memory
four times (gather, widen, scale, cast) and rounds the product to the compute dtype.

MXFP4 keys (key_format="mxfp4": 64 bytes of e2m1 codes, two a byte, and 4 UE8M0
exponents, one per 32 coordinates; remnant.kv.index_keys) are read in place the same way:
the program loads each code byte for both of its coordinates and each exponent for its 32,
takes the nibble, widens it to its e2m1 value and multiplies by 2^(s - 127) before the
product (the scale varies along the summed axis, so it cannot wait). Both factors are
powers of two times at most 3 bits, so the dequantized key is exact in q's dtype and the
product is again the dequantized one with float32 accumulation. The queries stay in q's
dtype: SGLang's FP4 path also quantizes them to MXFP4 (DeepGEMM's fp8_fp4_paged_mqa_logits
on SM100), which Remnant does not.

`index_scores_reference` is the same function in float64 from dequantized keys (the
ground truth the kernel is tested against). The selection from the scores is
remnant.engine.ops.index_top_k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from remnant.kernels.common import cast_nearest, interpreted
from remnant.kv.formats import FP8_MAX
from remnant.kv.index_keys import BLOCK, MX_BLOCK, IndexKeyFormat, index_key_format
from remnant.kv.layout import PageLayout

#: The kernel reads keys of one FP8 scale block (V4's index_head_dim: 128 coordinates).
KEY_DIM = BLOCK


def _check(q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor, layout: PageLayout, locs: torch.Tensor,
           counts: torch.Tensor, shared: bool, fmt: IndexKeyFormat) -> None:
    if q.ndim != 3 or q.shape[2] != KEY_DIM or q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"q must be bfloat16 or float32 [B, heads, {KEY_DIM}], got {q.dtype} {tuple(q.shape)}")
    B, H, _ = q.shape
    if w.shape != (B, H):
        raise ValueError(f"w must be [B={B}, heads={H}], got {tuple(w.shape)}")
    if layout.data_bytes != fmt.data_bytes or layout.tail_bytes != fmt.tail_bytes:
        raise ValueError(f"the indexer's pages of {fmt.name} keys hold {fmt.data_bytes} code bytes and "
                         f"{fmt.tail_bytes} scale bytes per key, got data_bytes={layout.data_bytes}, "
                         f"tail_bytes={layout.tail_bytes}")
    layout.check(pages, "index key pages")
    if fmt.name == "fp8" and (layout.page_stride % 4 or (layout.per_page * KEY_DIM) % 4):
        raise ValueError(f"index key pages must keep their float32 scales 4-byte aligned, got page_stride="
                         f"{layout.page_stride}")
    want = "[n]" if shared else f"[B={B}, n]"
    if locs.ndim != (1 if shared else 2) or (not shared and locs.shape[0] != B) or locs.is_floating_point():
        raise ValueError(f"locs must be int {want}, got {locs.dtype} {tuple(locs.shape)}")
    if counts.shape != (B,) or counts.is_floating_point():
        raise ValueError(f"counts must be int [B={B}], got {counts.dtype} {tuple(counts.shape)}")
    devices = {t.device for t in (q, w, pages, locs, counts)}
    if len(devices) > 1:
        raise ValueError(f"the indexer's tensors must share one device, got {sorted(map(str, devices))}")


def keys_at(pages: torch.Tensor, layout: PageLayout, locs: torch.Tensor,
            key_format: "str | IndexKeyFormat" = "fp8") -> torch.Tensor:
    """Dequantized keys float32 [*locs.shape, 128] at `locs` (-1 reads location 0)."""
    return index_key_format(key_format, KEY_DIM).dequantize(layout.read(pages, locs.clamp_min(0)))


def fp8_query_heads(q: torch.Tensor) -> torch.Tensor:
    """q [B, H, D] as ScoresConfig.fp8_q multiplies it, in float64: each head's FP8 e4m3
    codes times its float32 scale. scale = amax times float32(1 / 448) (the least normal
    float32 for a head of zeros); codes = q times 1 / scale rounded to nearest even by
    torch's cast, as the kernel forms them. Only multiplies and a tensor's reciprocal:
    torch divides a CUDA tensor by a number as a multiply by its reciprocal and a CPU one
    exactly, so `amax / 448` would differ between the two in the last bit."""
    qf = q.float()
    scale = (qf.abs().amax(-1) * (1.0 / FP8_MAX)).clamp_min(torch.finfo(torch.float32).tiny)
    codes = (qf * (1.0 / scale)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.double() * scale.double()[..., None]


def index_scores_reference(q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor, layout: PageLayout,
                           locs: torch.Tensor, counts: torch.Tensor,
                           key_format: "str | IndexKeyFormat" = "fp8", fp8_q: bool = False) -> torch.Tensor:
    """The ground truth of `index_scores` (locs [B, n]) and `index_scores_shared` (locs
    [n]), in float64, returned as float32. fp8_q: of index_scores with ScoresConfig.fp8_q,
    whose queries are first rounded to FP8 per head (fp8_query_heads)."""
    shared = locs.ndim == 1
    fmt = index_key_format(key_format, KEY_DIM)
    _check(q, w, pages, layout, locs, counts, shared, fmt)
    q = fp8_query_heads(q) if fp8_q else q
    keys = keys_at(pages, layout, locs, fmt).double()
    spec = "bhd,nd->bhn" if shared else "bhd,bnd->bhn"
    logits = torch.relu(torch.einsum(spec, q.double(), keys))
    scores = torch.einsum("bh,bhn->bn", w.double(), logits).float()
    j = torch.arange(locs.shape[-1], device=locs.device)
    hidden = (j[None, :] >= counts[:, None]) | (locs < 0)
    return scores.masked_fill(hidden, float("-inf"))


@triton.jit
def _key_slots(locs_ptr, j, n, PER_PAGE: tl.constexpr):
    """(page int64, slot, usable bool) [BLOCK_N] of the keys at locations locs_ptr[j]; -1 or
    j >= n is unusable, and reads page 0, slot 0 (masked by the caller)."""
    loc = tl.load(locs_ptr + j, mask=j < n, other=-1)
    usable = (j < n) & (loc >= 0)
    safe = tl.where(usable, loc, 0)
    return (safe // PER_PAGE).to(tl.int64), safe % PER_PAGE, usable


@triton.jit
def _load_keys(locs_ptr, pages_ptr, scales_ptr, j, n, page_stride, PER_PAGE: tl.constexpr, D: tl.constexpr):
    """Codes uint8 [BLOCK_N, D], scales float32 [BLOCK_N] and usable bool [BLOCK_N] of the
    keys at locations locs_ptr[j] (-1 or j >= n: unusable, zeros)."""
    page, slot, usable = _key_slots(locs_ptr, j, n, PER_PAGE)
    d = tl.arange(0, D)
    codes = tl.load(pages_ptr + page[:, None] * page_stride + slot[:, None] * D + d[None, :],
                    mask=usable[:, None], other=0)
    # The scales sit after the page's codes; scales_ptr is the pages as float32 words.
    scale = tl.load(scales_ptr + page * (page_stride // 4) + (PER_PAGE * D) // 4 + slot, mask=usable, other=0.0)
    return codes, scale, usable


@triton.jit
def _load_mxfp4_keys(locs_ptr, pages_ptr, j, n, page_stride, PER_PAGE: tl.constexpr, D: tl.constexpr,
                     MX: tl.constexpr):
    """Dequantized MXFP4 keys float32 [BLOCK_N, D] (exact) and usable bool [BLOCK_N] at
    locations locs_ptr[j] (-1 or j >= n: unusable, zeros). A key's D / 2 code bytes sit at
    slot * D / 2 in its page, its D / MX exponent bytes after the page's codes."""
    page, slot, usable = _key_slots(locs_ptr, j, n, PER_PAGE)
    d = tl.arange(0, D)
    base = pages_ptr + page[:, None] * page_stride
    # Each byte is loaded for both of its coordinates, each exponent for its MX (cached).
    byte = tl.load(base + slot[:, None] * (D // 2) + d[None, :] // 2, mask=usable[:, None], other=0).to(tl.int32)
    nibble = (byte >> ((d[None, :] % 2) * 4)) & 0xF
    exponent = tl.load(base + PER_PAGE * (D // 2) + slot[:, None] * (D // MX) + d[None, :] // MX,
                       mask=usable[:, None], other=0).to(tl.int32)
    # e2m1 magnitude index m -> 4 x value: 0, 2 (m < 2: subnormal 0, 0.5) and
    # (2 + mantissa) << exponent field (1, 1.5, 2, 3, 4, 6 for m = 2..7).
    m = nibble & 7
    quarters = tl.where(m < 2, 2 * m, (2 + (m & 1)) << (m >> 1))
    signed = tl.where(nibble >= 8, -quarters, quarters).to(tl.float32)
    scale = (exponent << 23).to(tl.float32, bitcast=True)        # 2^(s - 127): s is the exponent field
    return signed * 0.25 * scale, usable


@triton.jit
def _block_keys(locs_ptr, pages_ptr, scales_ptr, j, limit, page_stride, PER_PAGE: tl.constexpr, D: tl.constexpr,
                MXFP4: tl.constexpr, MX: tl.constexpr, OP: tl.constexpr):
    """The keys at locs_ptr[j] widened to OP [BLOCK_N, D] (exact), their float32 scales
    [BLOCK_N] (1 for MXFP4, whose scales are in the values) and usable bool [BLOCK_N] (a
    location, not -1, below limit: the keys at j >= limit are not read)."""
    # One return at the end: a jit function with an early return cannot be inlined under a
    # runtime branch (the MXFP4 form did not compile inside _row_scores_kernel's count test).
    if MXFP4:
        values, usable = _load_mxfp4_keys(locs_ptr, pages_ptr, j, limit, page_stride, PER_PAGE, D, MX)
        keys = values.to(OP)                                           # e2m1 x 2^k is exact in bf16
        scale = tl.where(usable, 1.0, 0.0)
    else:
        codes, scale, usable = _load_keys(locs_ptr, pages_ptr, scales_ptr, j, limit, page_stride, PER_PAGE, D)
        keys = codes.to(tl.float8e4nv, bitcast=True).to(OP)           # exact in bf16 and in float16
    return keys, scale, usable


@triton.jit
def _block_scores(q, wh, keys, scale, INTERPRETED: tl.constexpr, KEYS_ON_M: tl.constexpr = False):
    """Scores float32 [BLOCK_N] of one row's q [BLOCK_H, D] and scaled head weights wh
    [BLOCK_H] against keys [BLOCK_N, D] (in the MMA operands' dtype) with their scales.
    KEYS_ON_M: the product as keys times q's transpose, [BLOCK_N, BLOCK_H], so that the sum
    over heads runs along a row of the accumulator (within a thread and its quad) instead
    of down its columns, which the warps of a warpgroup split (ScoresConfig.keys_on_m)."""
    if KEYS_ON_M:
        if INTERPRETED:
            dots = tl.dot(keys.to(tl.float32), tl.trans(q.to(keys.dtype).to(tl.float32)), input_precision="ieee")
        elif keys.dtype == tl.float32:
            dots = tl.dot(keys, tl.trans(q), input_precision="ieee")
        else:
            dots = tl.dot(keys, tl.trans(q.to(keys.dtype)))                # [BLOCK_N, BLOCK_H] float32
        return tl.sum(tl.maximum(dots * scale[:, None], 0.0) * wh[None, :], axis=1)
    if INTERPRETED:
        # Triton's interpreter returns garbage for tl.dot on bf16 operands (remnant.kernels.moe).
        dots = tl.dot(q.to(keys.dtype).to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
    elif keys.dtype == tl.float32:
        dots = tl.dot(q, tl.trans(keys), input_precision="ieee")
    else:
        dots = tl.dot(q.to(keys.dtype), tl.trans(keys))               # [BLOCK_H, BLOCK_N] float32
    # The scale is constant along the summed axis: the product of the dequantized key.
    return tl.sum(tl.maximum(dots * scale[None, :], 0.0) * wh[:, None], axis=0)


@triton.jit
def _fp8_heads(q, INTERPRETED: tl.constexpr):
    """q [BLOCK_H, D] as FP8 e4m3 codes with one float32 scale per head (row), as
    fp8_query_heads forms them, bit for bit: scale = amax times float32(1 / 448) (the least
    normal float32 for a head of zeros) and its reciprocal by IEEE division, once a head;
    codes = q times the reciprocal (one multiply an element, not a division) rounded to
    nearest even."""
    qf = q.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(qf), axis=1) * (1.0 / 448.0), 1.1754943508222875e-38)
    inverse = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    codes = cast_nearest(tl.clamp(qf * inverse[:, None], -448.0, 448.0), tl.float8e4nv, INTERPRETED)
    return codes, scale


@triton.jit
def _row_scores_kernel(q_ptr, w_ptr, w_stride, w_scale, pages_ptr, scales_ptr, locs_ptr, counts_ptr, out_ptr, n, H,
                       page_stride, PER_PAGE: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, STAGES: tl.constexpr,
                       INTERPRETED: tl.constexpr, MXFP4: tl.constexpr, MX: tl.constexpr, F16: tl.constexpr,
                       FP8_Q: tl.constexpr = False, KEYS_ON_M: tl.constexpr = False):
    """A decode step's scores: row pid0 (its own locations locs [b, :n]) against its key
    blocks [pid1 * BLOCKS, +BLOCKS) of BLOCK_N keys. The row's queries and head weights are
    loaded once for the BLOCKS blocks, whose key loads the loop pipelines (STAGES); keys at
    or past the row's count are invisible and not read. FP8_Q: the queries as FP8 codes
    with a scale per head (_fp8_heads), multiplied with the keys' FP8 codes as they are
    stored (the MMAs at FP8's rate, nothing widened); each head's scale, positive, goes
    into its weight: w relu(s q'.k) = (w s) relu(q'.k)."""
    b = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    h = tl.arange(0, BLOCK_H)
    q = tl.load(q_ptr + (b * H + h[:, None]) * D + d[None, :], mask=h[:, None] < H, other=0.0)
    wh = tl.load(w_ptr + b * w_stride + h, mask=h < H, other=0.0).to(tl.float32) * w_scale
    if FP8_Q:
        q, q_scale = _fp8_heads(q, INTERPRETED)
        wh = wh * q_scale
    count = tl.load(counts_ptr + b)
    limit = tl.minimum(count, n)
    row_locs = locs_ptr + b * n
    first = tl.program_id(1) * (BLOCKS * BLOCK_N)
    op = tl.float8e4nv if FP8_Q else (tl.float16 if F16 else q_ptr.dtype.element_ty)  # the MMA operands' dtype
    # A program wholly at or past the row's count only stores -inf: n is the page-table
    # bucket's (up to twice a row's records, and the batch's longest row's for the rest),
    # so skipping the products keeps a row's cost to its count.
    if first < limit:
        for i in tl.range(0, BLOCKS, num_stages=STAGES):
            j = first + i * BLOCK_N + tl.arange(0, BLOCK_N)
            keys, scale, usable = _block_keys(row_locs, pages_ptr, scales_ptr, j, limit, page_stride, PER_PAGE, D,
                                              MXFP4, MX, op)
            s = _block_scores(q, wh, keys, scale, INTERPRETED, KEYS_ON_M)
            tl.store(out_ptr + b * n + j, tl.where(usable, s, float("-inf")), mask=j < n)
    else:
        for i in range(BLOCKS):
            j = first + i * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(out_ptr + b * n + j, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=j < n)


@triton.jit
def _shared_scores_kernel(q_ptr, w_ptr, w_stride, w_scale, pages_ptr, scales_ptr, locs_ptr, counts_ptr, out_ptr, B, n,
                          H, page_stride, PER_PAGE: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, INTERPRETED: tl.constexpr,
                          MXFP4: tl.constexpr, MX: tl.constexpr, FP8_Q: tl.constexpr = False,
                          KEYS_ON_M: tl.constexpr = False):
    """A prefill's scores: rows [pid0 * BLOCK_T, +BLOCK_T), which all read the same
    locations locs [n], against keys [pid1 * BLOCK_N, +BLOCK_N), loaded once for them.
    FP8_Q: each row's queries as FP8 codes with a scale per head, as _row_scores_kernel's."""
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    h = tl.arange(0, BLOCK_H)
    op = tl.float8e4nv if FP8_Q else q_ptr.dtype.element_ty  # the MMA operands' dtype
    keys, scale, usable = _block_keys(locs_ptr, pages_ptr, scales_ptr, j, n, page_stride, PER_PAGE, D, MXFP4, MX, op)
    for r in range(BLOCK_T):
        b = tl.program_id(0) * BLOCK_T + r
        if b < B:
            q = tl.load(q_ptr + (b.to(tl.int64) * H + h[:, None]) * D + d[None, :], mask=h[:, None] < H, other=0.0)
            wh = tl.load(w_ptr + b.to(tl.int64) * w_stride + h, mask=h < H, other=0.0).to(tl.float32) * w_scale
            if FP8_Q:
                q, q_scale = _fp8_heads(q, INTERPRETED)
                wh = wh * q_scale
            s = _block_scores(q, wh, keys, scale, INTERPRETED, KEYS_ON_M)
            seen = usable & (j < tl.load(counts_ptr + b))
            tl.store(out_ptr + b.to(tl.int64) * n + j, tl.where(seen, s, float("-inf")), mask=j < n)


@dataclass(frozen=True)
class ScoresConfig:
    """Launch settings of a decode step's scores: keys per block (block_n, >= 16 for
    tl.dot), key blocks per program (blocks: the row's queries are loaded once for them,
    and their loads pipelined over num_stages), warps, and f16_operands: the keys widened
    to float16 rather than bf16 and q rounded to it (one conversion instruction widens two
    FP8 codes to float16, more to bf16; FP8 and MXFP4 keys are exact in both, q's bf16
    elements in float16's normal range, 2^-14 to 65504: a smaller element loses bits, a
    larger one overflows). fp8_q (FP8 keys only): the queries rounded to FP8 e4m3 with a
    scale per head, in the kernel, and multiplied with the keys' codes as stored, as
    DeepSeek's indexer runs in FP8 (DeepGEMM's fp8_mqa_logits): no key widened, the
    keys' shared-memory tile half the bf16 one's, the MMAs at FP8's rate. Costs q's FP8
    rounding (index_scores_reference(fp8_q=True) is its ground truth). Off by default: it
    moves the choice a little (tests/kernels/test_indexer.py), and with the head sums down
    the accumulator's columns it took nothing off the decode step (H100, 33da047,
    benchmarks/engine-h100-prefill-tiles/). keys_on_m: _block_scores' KEYS_ON_M, the
    product as keys times q's transpose, so that the sum over heads runs along the
    accumulator's rows; the same scores up to float32 summation order.

    The defaults come from the H100 sweeps (runners/device/moe_topk_timings.py indexer;
    one row alone, blocks of 64 keys in 8 warps took 3.5-3.8 us against 4.3-4.7, left):
    blocks of 128 keys took half the time of blocks of 64 at 32 and 128 rows of
    1,024 and 8,192 keys (29.7 against 57.3 us at 32 x 8,192; 2026-12-06), and more blocks a
    program changed nothing (99.1 to 100.3 us at 128 x 8,192). keys_on_m took 95.0 against
    103.2 us at 128 x 8,192, 27.4 against 30.7 at 32 x 8,192 and 4.3 against 4.7 at 1 x
    8,192; with fp8_q 78.0, 23.8 and 3.8 (2026-12-07, 44d9823, the same page's NOTES)."""

    block_n: int = 128
    blocks: int = 1
    num_warps: int = 4
    num_stages: int = 1
    f16_operands: bool = False
    fp8_q: bool = False
    keys_on_m: bool = True


def default_scores_config(key_format: "str | IndexKeyFormat" = "fp8") -> ScoresConfig:
    """ScoresConfig's defaults for FP8 keys; MXFP4 keys in 8 warps: their dequantized block
    is a float32 [128, 128] tile, which at 4 warps ptxas fitted only by spilling 1,112 bytes
    a thread (255 registers; sm_90 compile of 2026-12-07, tests/kernels/
    test_launches_compile.py), at 8 in 217 registers, and with the head sums down the
    accumulator's columns (keys_on_m off: that form of their tile is the one compiled and
    tested at V4-Flash's shapes on a GPU). Not timed on a GPU."""
    if index_key_format(key_format, KEY_DIM).name == "mxfp4":
        return ScoresConfig(num_warps=8, keys_on_m=False)
    return ScoresConfig()


def _check_fp8_q(fp8_q: bool, fmt: IndexKeyFormat, f16_operands: bool) -> None:
    if fp8_q and (fmt.name == "mxfp4" or f16_operands):
        raise ValueError(f"ScoresConfig.fp8_q takes FP8 keys without f16_operands, got key_format={fmt.name!r}, "
                         f"f16_operands={f16_operands}")


def _launch(q, w, pages, layout, locs, counts, fmt: IndexKeyFormat, w_scale: float = 1.0,
            config: ScoresConfig | None = None, block_t: int = 1, block_n: int | None = None,
            fp8_q: bool = False, keys_on_m: bool | None = None) -> torch.Tensor:
    """The decode form (locs [B, n], config) or the shared one (locs [n], block_t, block_n,
    fp8_q, keys_on_m: index_scores_shared resolves them)."""
    B, H, D = q.shape
    n = locs.shape[-1]
    shared = locs.ndim == 1
    if shared:
        _check_fp8_q(fp8_q, fmt, False)
    else:
        config = config or default_scores_config(fmt)
        _check_fp8_q(config.fp8_q, fmt, config.f16_operands)
    out = torch.empty(B, n, dtype=torch.float32, device=q.device)
    if B == 0 or n == 0:
        return out
    locs = locs.to(torch.int32).contiguous()
    mxfp4 = fmt.name == "mxfp4"
    # FP8 pages are also read as float32 words (their scales); MXFP4 pages need no such view.
    scales = pages if mxfp4 else pages.view(torch.float32)
    w = w if w.stride(1) == 1 else w.contiguous()
    counts = counts.to(torch.int32).contiguous()
    common = dict(PER_PAGE=layout.per_page, D=D, BLOCK_H=max(16, triton.next_power_of_2(H)),
                  INTERPRETED=interpreted(), MXFP4=mxfp4, MX=MX_BLOCK)
    if shared:
        grid = (triton.cdiv(B, block_t), triton.cdiv(n, block_n))
        _shared_scores_kernel[grid](q.contiguous(), w, w.stride(0), float(w_scale), pages, scales, locs, counts, out,
                                    B, n, H, layout.page_stride, BLOCK_N=block_n, BLOCK_T=block_t, FP8_Q=fp8_q,
                                    KEYS_ON_M=keys_on_m, **common)
        return out
    grid = (B, triton.cdiv(n, config.block_n * config.blocks))
    _row_scores_kernel[grid](q.contiguous(), w, w.stride(0), float(w_scale), pages, scales, locs, counts, out, n, H,
                             layout.page_stride, BLOCK_N=config.block_n, BLOCKS=config.blocks,
                             STAGES=config.num_stages, F16=config.f16_operands and q.dtype == torch.bfloat16,
                             FP8_Q=config.fp8_q, KEYS_ON_M=config.keys_on_m,
                             num_warps=config.num_warps, **common)
    return out


def index_scores(q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor, layout: PageLayout, locs: torch.Tensor,
                 counts: torch.Tensor, key_format: "str | IndexKeyFormat" = "fp8", w_scale: float = 1.0,
                 config: ScoresConfig | None = None) -> torch.Tensor:
    """A decode step's scores float32 [B, n]: row b's queries q [B, H, 128] (bfloat16 or
    float32) with head weights w [B, H] (any float dtype, a row-strided view is fine; in
    float32 times w_scale: the engine's 1/sqrt(heads) without a launch of its own)
    against the keys at its own locations locs
    int [B, n]; -inf at column j >= counts[b] (int [B]: the records visible to the row) and
    at location -1. pages: the indexer pool's uint8 [pages, page_stride] (`layout`: per key
    128 code bytes and a 4-byte scale for key_format "fp8", 64 code bytes and 4 exponent
    bytes for "mxfp4"). config: ScoresConfig (None: default_scores_config's). Nothing is read back to the host: a CUDA graph can capture it."""
    fmt = index_key_format(key_format, KEY_DIM)
    _check(q, w, pages, layout, locs, counts, False, fmt)
    return _launch(q, w, pages, layout, locs, counts, fmt, w_scale, config)


# index_scores_shared's key block and keys_on_m by key format (its docstring says why).
SHARED_TILE = {"fp8": dict(block_n=128, keys_on_m=True), "mxfp4": dict(block_n=64, keys_on_m=False)}


def index_scores_shared(q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor, layout: PageLayout,
                        locs: torch.Tensor, counts: torch.Tensor, block_t: int = 16,
                        block_n: int | None = None, key_format: "str | IndexKeyFormat" = "fp8",
                        fp8_q: bool = False, keys_on_m: bool | None = None) -> torch.Tensor:
    """A prefill's scores float32 [T, n]: T tokens of one sequence against the same keys at
    locs int [n]; otherwise as index_scores. A program scores block_t tokens against one
    key block, so keys are read T / block_t times, not T. block_n and keys_on_m (as
    ScoresConfig.keys_on_m; None: SHARED_TILE's for the key format), from the H100's
    timings at 2,048 tokens (2026-12-07, benchmarks/engine-h100-prefill-tiles/; block_t 8-32
    within 4% at block_n 128): with FP8 keys, blocks of 128 took 1,092 us against 1,789 with 64 at 8,192
    keys, 4,218 against 6,939 at 32,768; keys_on_m then 976 and 3,820. MXFP4 keys' 128 spill
    registers for sm_90, so they keep 64, and keys_on_m off (not timed). fp8_q: the queries
    rounded to FP8 per head and multiplied on FP8 MMAs, as ScoresConfig.fp8_q (FP8 keys
    only): 888 and 3,404 us with keys_on_m; off by default, as in decode."""
    fmt = index_key_format(key_format, KEY_DIM)
    _check(q, w, pages, layout, locs, counts, True, fmt)
    tile = SHARED_TILE[fmt.name]
    block_n = tile["block_n"] if block_n is None else block_n
    keys_on_m = tile["keys_on_m"] if keys_on_m is None else keys_on_m
    return _launch(q, w, pages, layout, locs, counts, fmt, block_t=block_t, block_n=block_n, fp8_q=fp8_q,
                   keys_on_m=keys_on_m)
