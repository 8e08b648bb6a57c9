"""moe: the routed experts of a DeepSeek-style MoE block for decode-sized token counts.

Each of T tokens is routed to k of E experts with a weight. Expert e is a SwiGLU:
y = (silu(x @ G_e) * (x @ U_e)) @ D_e, with the gate and up projections side by side in
one matrix W_gate_up[e] = [G_e | U_e] of [hidden, 2 * I] and W_down[e] of [I, hidden]; a
token's output is the sum over its k experts of its routing weight times that expert's y.

The kernel reads only the experts the tokens were routed to (torch._grouped_mm reads every
expert's weights: on the H200, a V4-Flash-shaped step at batch 1 took the time of all 32
experts, 16.4 ms in a CUDA graph against a 6.2 ms roofline; docs/engine.md), the structure
of vLLM's and SGLang's fused_moe, written here from scratch:

1. Alignment (torch, `align`): the T * k (token, expert) pairs, pair p = t * k + j, are
   sorted by expert (a stable argsort) and laid out in blocks of BLOCK_M rows, each block
   holding pairs of one expert, the last block of an expert padded with the sentinel pair
   T * k. Every shape depends on T, k, E and BLOCK_M only, and nothing is read back to the
   host, so the whole step can be captured in a CUDA graph. The number of blocks is the
   worst case over all routings: with n = T * k pairs over m <= min(n, E) non-empty
   experts, sum_e ceil(c_e / BM) = m + sum_e floor((c_e - 1) / BM) <= m + (n - m) // BM,
   which grows with m, so `max_blocks` = min(n, E) + (n - min(n, E)) // BM (attained: all
   but one expert with one pair). Blocks past the routed ones are marked expert -1.
2. gate_up (Triton): one program per (block, tile of BLOCK_N of the I columns) that exits
   at once on a padding block; otherwise it loads its rows' tokens of x and, for each
   BLOCK_K slice of hidden, the expert's gate tile and up tile once, multiplies on the
   tensor cores (tl.dot: operands in x's dtype, float16 with MoEConfig.f16_operands, or
   FP8 codes on both sides with MoEConfig.fp8_x; float32 accumulation), scales
   by the per-column FP8 scale (and x's row scale), applies silu(gate) * up in float32
   and writes the pair's row of the intermediate h [n, I] (x's dtype).
3. down (Triton): one program per (block, tile of the hidden columns): h's rows times the
   expert's down tile, the FP8 scale and the pair's routing weight, written to the pair's
   own row of a float32 [T, k, hidden] buffer ([down_split_k, T, k, hidden] with splits).
   Each pair's row is written by exactly one program, so no atomics; the k rows of a token
   are summed in a fixed order (deterministic) by `_finish_kernel`, which also adds the
   callers' addends (the shared expert, the residual), and rounded to x's dtype once.
4. Split sums (MoEConfig.split_k, down_split_k): at batch 1 each routed expert is one
   block with one real row, and (block, tile) programs number too few to keep the memory
   system busy (the gate/up kernel took 86 us a call on an H100 for ~100 MB). With splits,
   a third grid axis splits the summed axis: gate/up programs write float32 partial sums
   [split_k, n, 2I], which the down kernel adds up (in split order) before silu(gate) *
   up; down programs write [down_split_k, n, hidden] partial rows, summed with the pairs.

Weight bytes read: the routed experts' gate_up and down tiles, each once per block (one
block per expert at decode sizes), plus their scales: for FP8 experts
3 * hidden * I + 4 * (2 * I + hidden) bytes per distinct expert. Activations are small
beside them (x's rows per block, h, the float32 pair buffer).

Expert weights: bfloat16, float32 or FP8 e4m3 (torch.float8_e4m3fn) with a float32 scale
per (expert, output column): W = codes * scale[e, column] (`quantize_experts`, with torch's
cast). FP8 codes are widened to x's dtype in the kernel (exact; float16 in the aligned
kernels with bf16 x, MoEConfig.f16_operands), or multiplied as they are against FP8
activations (MoEConfig.fp8_x and fp8_h: x's or h's rows quantized by one kernel before the
kernel that reads them, remnant.kernels.fp8_rows), and the scales, constant along the
summed axis, multiply the accumulator. The kernels address the experts through all three strides: [E, K, N] with N
contiguous, as the engine keeps them, or K contiguous (k_major, vLLM's and SGLang's layout).

Beside the kernel: `routed_experts_reference`, the float64 loop over tokens and their k
experts (the ground truth), `routed_experts_torch`, the same blocks as batched gather and
bmm (graph-safe; the path on CPU without Triton's interpreter), and `routed_experts`, which
picks the kernel for CUDA tensors and for CPU ones under the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from remnant.kernels.common import cast_nearest, interpreted
from remnant.kernels.fp8_rows import fp8_codes, quantize_rows, quantize_rows_triton

#: Expert weight dtypes the kernel reads, by name (the engine's expert_dtype values).
EXPERT_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn, "float32": torch.float32}
#: Activation (compute) dtypes: the dtype of x, of the matrix operands and of the output.
COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
IMPLS = ("auto", "triton", "torch")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most blocks of block_m rows that num_pairs (token, expert) pairs over num_experts
    experts can fill, each block holding one expert's pairs: min(n, E) + (n - min(n, E)) //
    block_m (see the module docstring), the static grid of the kernels."""
    m = min(num_pairs, num_experts)
    return m + (num_pairs - m) // block_m


@dataclass(frozen=True)
class Alignment:
    """The (token, expert) pairs sorted by expert in blocks of block_m rows.

    rows: int32 [max_blocks * block_m], the pair p = t * k + j at each row, n = T * k where
    a block's row is padding. block_expert: int32 [max_blocks], each block's expert, -1 for
    a padding block. All shapes are static given T, k, E and block_m.
    """

    rows: torch.Tensor
    block_expert: torch.Tensor
    block_m: int
    num_pairs: int


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort topk_ids int [T, k] (expert per token and slot) by expert into blocks of block_m
    rows, on topk_ids' device, without a host synchronisation (CUDA-graph safe)."""
    n = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    blocks_n = max_blocks(n, num_experts, block_m)
    order = torch.argsort(flat, stable=True)  # pair indices, by expert, in pair order within one
    # Per-expert counts by scatter_add (bincount's output size would depend on the values).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)                 # inclusive: expert e owns [end - blocks, end)
    first_pair = torch.cumsum(counts, 0) - counts       # sorted position of expert e's first pair
    sorted_expert = flat[order]
    rank = torch.arange(n, device=device) - first_pair[sorted_expert]
    slot = (block_end - blocks)[sorted_expert] * block_m + rank
    rows = torch.full((blocks_n * block_m,), n, dtype=torch.int64, device=device)
    rows.scatter_(0, slot, order)
    # Block b belongs to the first expert whose block range ends after b; none: padding.
    block_expert = torch.searchsorted(block_end, torch.arange(blocks_n, device=device), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return Alignment(rows.to(torch.int32), block_expert.to(torch.int32), block_m, n)


#: Most (token, expert) pairs and experts align_triton sorts in its launch (decode batches:
#: 128 tokens x 6 experts = 768 over V4's 256 experts at most); more go through `align` (a
#: prefill chunk's thousands). Each of its programs counts every pair for every expert.
ALIGN_KERNEL_MAX_PAIRS = 1024
ALIGN_KERNEL_MAX_EXPERTS = 256


#: Pairs x experts of the one-hot each align program counts at once: a one-hot of all 768
#: pairs of a batch of 128 (x 32 experts) spilled 12 KB a thread and took 138 us a layer
#: on an H100 (2026-12-06).
ALIGN_ONE_HOT = 4096


@triton.jit
def _align_kernel(ids_ptr, rows_ptr, block_expert_ptr, n, E: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCKS: tl.constexpr, PAIRS_P: tl.constexpr, EXPERTS_P: tl.constexpr, CHUNK: tl.constexpr,
                  PAD_P: tl.constexpr, BLOCKS_P: tl.constexpr, ROWS_P: tl.constexpr):
    """`align` with one program per expert: every expert's count (one-hot column sums, CHUNK
    pairs at a time) gives where each expert's blocks start; the program places its own
    expert's pairs (rank: earlier pairs of that expert, a stable sort), pads its last block
    and names its blocks' expert. Program 0 also pads the blocks after the last expert's.
    Each row and block is written by one program."""
    e = tl.program_id(0)
    x = tl.arange(0, EXPERTS_P)
    counts = tl.zeros([EXPERTS_P], tl.int32)
    for c0 in range(0, PAIRS_P, CHUNK):
        q = c0 + tl.arange(0, CHUNK)
        ids_q = tl.load(ids_ptr + q, mask=q < n, other=-1).to(tl.int32)
        counts += tl.sum((ids_q[:, None] == x[None, :]).to(tl.int32), 0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, 0)  # inclusive: expert e owns blocks [end - blocks, end)
    first = tl.sum(tl.where(x == e, block_end - blocks, 0), 0)
    own_blocks = tl.sum(tl.where(x == e, blocks, 0), 0)
    count = tl.sum(tl.where(x == e, counts, 0), 0)
    p = tl.arange(0, PAIRS_P)
    mine = (tl.load(ids_ptr + p, mask=p < n, other=-1).to(tl.int32) == e).to(tl.int32)
    rank = tl.cumsum(mine, 0) - mine
    tl.store(rows_ptr + first * BLOCK_M + rank, p, mask=mine != 0)
    j = tl.arange(0, PAD_P)
    tl.store(rows_ptr + first * BLOCK_M + count + j, tl.full([PAD_P], 0, tl.int32) + n,
             mask=j < own_blocks * BLOCK_M - count)
    b = tl.arange(0, BLOCKS_P)
    tl.store(block_expert_ptr + first + b, tl.full([BLOCKS_P], 0, tl.int32) + e, mask=b < own_blocks)
    if e == 0:
        used = tl.sum(blocks, 0)
        r = used * BLOCK_M + tl.arange(0, ROWS_P)
        tl.store(rows_ptr + r, tl.full([ROWS_P], 0, tl.int32) + n, mask=r < BLOCKS * BLOCK_M)
        t = used + b
        tl.store(block_expert_ptr + t, tl.full([BLOCKS_P], -1, tl.int32), mask=t < BLOCKS)


def align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int, fallback=align,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> Alignment:
    """`align`'s result in one launch (a dozen small kernels through `align` compiled, at
    batch 1), for up to ALIGN_KERNEL_MAX_PAIRS pairs over up to ALIGN_KERNEL_MAX_EXPERTS
    experts; others go to `fallback` (`align`, or the same compiled). `out`: int32 (rows,
    block_expert) of `align`'s sizes to write (tests pass poisoned ones: every element is
    written). On CUDA tensors, or CPU ones under Triton's interpreter."""
    n = topk_ids.numel()
    pow2 = triton.next_power_of_2
    if n == 0 or n > ALIGN_KERNEL_MAX_PAIRS or num_experts > ALIGN_KERNEL_MAX_EXPERTS:
        return fallback(topk_ids, num_experts, block_m)
    blocks = max_blocks(n, num_experts, block_m)
    if out is None:
        out = (torch.empty(blocks * block_m, dtype=torch.int32, device=topk_ids.device),
               torch.empty(blocks, dtype=torch.int32, device=topk_ids.device))
    rows, block_expert = out
    shapes = (tuple(rows.shape), tuple(block_expert.shape))
    if shapes != ((blocks * block_m,), (blocks,)) or rows.dtype != torch.int32 or block_expert.dtype != torch.int32:
        raise ValueError(f"out must be int32 [{blocks * block_m}] and [{blocks}], got {tuple(rows.shape)} and "
                         f"{tuple(block_expert.shape)}")
    _align_kernel[(num_experts,)](topk_ids.reshape(-1).contiguous(), rows, block_expert, n, E=num_experts,
                                  BLOCK_M=block_m, BLOCKS=blocks, PAIRS_P=pow2(n), EXPERTS_P=pow2(num_experts),
                                  CHUNK=max(1, ALIGN_ONE_HOT // pow2(num_experts)), PAD_P=pow2(block_m),
                                  BLOCKS_P=pow2(blocks), ROWS_P=pow2(blocks * block_m), num_warps=4)
    return Alignment(rows, block_expert, block_m, n)


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 codes and float32 scales of expert weights w float [E, K, N] (K: the summed
    input axis), one scale per (expert, output column). Returns (codes float8_e4m3fn
    [E, K, N], scale float32 [E, N]); codes * scale[:, None, :] approximates w."""
    if w.ndim != 3 or not w.is_floating_point():
        raise ValueError(f"quantize_experts expects float [E, K, N] weights, got {w.dtype} {tuple(w.shape)}")
    return fp8_codes(w)


def k_major(w: torch.Tensor) -> torch.Tensor:
    """Expert weights [E, K, N] laid out with K, the summed axis, contiguous: the same
    shape and values, strides (K * N, 1, K), as vLLM's and SGLang's fused MoE keep theirs
    ([E, N, K] tensors). An FP8 MMA (tl.dot on FP8 codes, MoEConfig.fp8_x) takes
    its operands K-major; the kernels read either layout. The engine keeps N-contiguous:
    K-contiguous took 25-35% longer on an H100 (2026-12-07, moe_topk_timings.py moe_fp8)."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Expert weights w [E, K, N] as `dtype`, times scale [E, N] where given (FP8 codes)."""
    out = w.to(dtype)
    return out if scale is None else out * scale.to(dtype)[:, None, :]


def check_routed(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor, gate_up_scale: torch.Tensor | None, down_scale: torch.Tensor | None,
                 check_ids: bool = False) -> tuple[int, int, int, int, int]:
    """Check the arguments of routed_experts*; returns (T, k, E, hidden, I).

    check_ids reads topk_ids back to the host (a device sync) to check their range: tests
    turn it on, serving paths (ids from torch.topk over E scores) leave it off.
    """
    if x.ndim != 2 or _name(x.dtype) not in COMPUTE_DTYPES:
        raise ValueError(f"x must be [T, hidden] of {', '.join(COMPUTE_DTYPES)}, got {x.dtype} {tuple(x.shape)}")
    T, hidden = x.shape
    if w_gate_up.ndim != 3 or w_gate_up.shape[1] != hidden or w_gate_up.shape[2] % 2:
        raise ValueError(f"w_gate_up must be [E, hidden={hidden}, 2 * I], got {tuple(w_gate_up.shape)}")
    E, _, two_i = w_gate_up.shape
    inter = two_i // 2
    if w_down.shape != (E, inter, hidden):
        raise ValueError(f"w_down must be [E={E}, I={inter}, hidden={hidden}], got {tuple(w_down.shape)}")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if _name(w.dtype) not in EXPERT_DTYPES:
            raise ValueError(f"{name} dtype={_name(w.dtype)} is not allowed; allowed: {', '.join(EXPERT_DTYPES)}")
    if w_down.dtype != w_gate_up.dtype:
        raise ValueError(f"w_down dtype={_name(w_down.dtype)} must equal w_gate_up's, {_name(w_gate_up.dtype)}")
    fp8 = w_gate_up.dtype == torch.float8_e4m3fn
    for name, scale, shape in (("gate_up_scale", gate_up_scale, (E, two_i)), ("down_scale", down_scale, (E, hidden))):
        if fp8 and (scale is None or scale.shape != shape or scale.dtype != torch.float32):
            got = "None" if scale is None else f"{scale.dtype} {tuple(scale.shape)}"
            raise ValueError(f"{name} must be float32 {shape} with float8_e4m3fn experts, got {got}")
        if not fp8 and scale is not None:
            raise ValueError(f"{name} must be None with {_name(w_gate_up.dtype)} experts (scales are for FP8 codes)")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != T or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64 [T={T}, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    if not 1 <= k <= E:
        raise ValueError(f"topk_ids has k={k} experts per token; allowed: 1..E={E}")
    if topk_weights.shape != (T, k) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be float [T={T}, k={k}], got {topk_weights.dtype} "
                         f"{tuple(topk_weights.shape)}")
    tensors = [x, topk_ids, topk_weights, w_gate_up, w_down] + [s for s in (gate_up_scale, down_scale) if s is not None]
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"routed experts' tensors must share one device, got {sorted(map(str, devices))}")
    if check_ids and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= E:
            raise ValueError(f"topk_ids must lie in [0, E={E}), got [{lo}, {hi}]")
    return T, k, E, hidden, inter


def _check_adds(adds: tuple[torch.Tensor, ...], x: torch.Tensor) -> None:
    if len(adds) > 2:
        raise ValueError(f"adds holds {len(adds)} tensors; allowed: at most 2 (the shared expert, the residual)")
    for i, a in enumerate(adds):
        if a.shape != x.shape or not a.is_floating_point() or a.device != x.device:
            raise ValueError(f"adds[{i}] must be float {tuple(x.shape)} on {x.device} as x, got {a.dtype} "
                             f"{tuple(a.shape)} on {a.device}")


def routed_experts_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                             w_gate_up: torch.Tensor, w_down: torch.Tensor,
                             gate_up_scale: torch.Tensor | None = None,
                             down_scale: torch.Tensor | None = None,
                             fp8_x: bool = False, fp8_h: bool = False) -> torch.Tensor:
    """The ground truth: float64 [T, hidden], sum over j of topk_weights[t, j] times expert
    topk_ids[t, j]'s SwiGLU of x[t], one token and expert at a time in float64 (weights
    dequantized exactly: codes * scale). Shapes as routed_experts. fp8_x, fp8_h: the same
    sums of MoEConfig.fp8_x's and fp8_h's operands: x's rows through quantize_rows; each
    pair's SwiGLU rounded to x's dtype (as the kernel writes h), then through it."""
    T, k, _, _, inter = check_routed(x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_scale, down_scale,
                                     check_ids=True)
    f64 = torch.float64

    def rows(t: torch.Tensor, fp8: bool) -> torch.Tensor:  # the values an operand holds
        if not fp8:
            return t.to(f64)
        codes, scale = quantize_rows(t)
        return codes.to(f64) * scale.to(f64)[:, None]

    xs = rows(x, fp8_x)
    out = torch.zeros(T, x.shape[1], dtype=f64, device=x.device)
    for t in range(T):
        for j in range(k):
            e = int(topk_ids[t, j])
            gu = w_gate_up[e].to(f64)
            dn = w_down[e].to(f64)
            if gate_up_scale is not None:
                gu = gu * gate_up_scale[e].to(f64)[None, :]
                dn = dn * down_scale[e].to(f64)[None, :]
            h = xs[t] @ gu
            a = F.silu(h[:inter]) * h[inter:]
            if fp8_h:
                a = rows(a.to(x.dtype)[None], True)[0]
            out[t] += float(topk_weights[t, j]) * (a @ dn)
    return out


def torch_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block of routed_experts_torch: at least 16, and at least the mean pairs per
    expert (a power of two), so its blocks number at most 2E and the weights it gathers at
    most twice all experts' (T of thousands in a CPU prefill would otherwise gather one
    expert copy per 16 pairs)."""
    mean = -(-num_pairs // num_experts)
    return max(16, 1 << (mean - 1).bit_length())


def routed_experts_torch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         w_gate_up: torch.Tensor, w_down: torch.Tensor,
                         gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
                         block_m: int | None = None, adds: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """The kernel's blocks as batched torch: each block's rows of x times its expert's
    weights (gathered, widened to x's dtype) with bmm, the scales per column, silu(gate) *
    up rounded to x's dtype, the down bmm, the routing weights, then the pairs summed per
    token in float32 with `adds` (as routed_experts_triton's). x's dtype [T, hidden];
    graph-safe (static shapes, no host sync). block_m: rows per block, None taking
    torch_block_m."""
    T, k, E, hidden, inter = check_routed(x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_scale, down_scale)
    _check_adds(adds, x)
    n = T * k
    al = align(topk_ids, E, block_m or torch_block_m(n, E))
    rows = al.rows.long().view(-1, al.block_m)                             # [B, BM], n = padding
    experts = al.block_expert.long().clamp_min(0)                          # padding blocks use expert 0
    x_pad = torch.cat([x, x.new_zeros(1, hidden)])                         # row T: the padding rows' token
    xb = x_pad[torch.where(rows < n, rows // k, T)]                        # [B, BM, hidden]
    h = torch.bmm(xb, w_gate_up[experts].to(x.dtype)).float()              # [B, BM, 2I]
    if gate_up_scale is not None:
        h = h * gate_up_scale[experts][:, None, :]
    a = (F.silu(h[..., :inter]) * h[..., inter:]).to(x.dtype)
    y = torch.bmm(a, w_down[experts].to(x.dtype)).float()                  # [B, BM, hidden]
    if down_scale is not None:
        y = y * down_scale[experts][:, None, :]
    weights = torch.cat([topk_weights.reshape(-1).float(), topk_weights.new_zeros(1, dtype=torch.float32)])
    y = y * weights[rows][..., None]
    # Each pair is one row; the padding rows all land on the extra row n, which is dropped.
    pairs = torch.zeros(n + 1, hidden, dtype=torch.float32, device=x.device)
    pairs.index_copy_(0, rows.reshape(-1), y.reshape(-1, hidden))
    out = pairs[:n].view(T, k, hidden).sum(1)
    for a in adds:
        out = out + a.float()
    return out.to(x.dtype)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, INTERPRETED: tl.constexpr, F8: tl.constexpr):
    """a @ b with float32 accumulation: the tensor cores on bf16, float16 or FP8 operands
    (IEEE float32 for float32 ones). Triton 3.9's interpreter returns garbage for tl.dot on
    bf16 operands (remnant.kernels.decode._mma), so interpreted runs multiply the same
    values as float32. FP8: Hopper's FP8 MMA sums in a narrower accumulator, and Triton by
    default keeps a whole loop's sums there (max_num_imprecise_acc 2**30 on sm90); here each
    call's K (one tile) is summed narrow and then added in float32, as DeepSeek's FP8 GEMMs
    promote every 128."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    if F8:
        return tl.dot(a, b, max_num_imprecise_acc=a.shape[1])
    return tl.dot(a, b)


@triton.jit
def _gate_up_kernel(
    x_ptr, stride_x, x_scale_ptr,
    w_ptr, stride_we, stride_wk, stride_wn,
    scale_ptr, stride_se,
    h_ptr, stride_h,
    partial_ptr, stride_ps, stride_pr,
    rows_ptr, block_expert_ptr, n_pairs,
    K_TOP: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    IEEE: tl.constexpr, INTERPRETED: tl.constexpr, F16: tl.constexpr, F8: tl.constexpr,
):
    """F8: x_ptr holds FP8 codes of x's rows and x_scale_ptr their scales (quantize_rows):
    FP8 operands on both sides, nothing widened, each row's scale on the accumulator."""
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b)
    if e < 0:  # a padding block: the grid is the worst case, most decode steps route fewer
        return
    # The MMA operands' dtype (MoEConfig.f16_operands, fp8_x).
    op = w_ptr.dtype.element_ty if F8 else (tl.float16 if F16 else x_ptr.dtype.element_ty)
    m = tl.arange(0, BLOCK_M)
    pair = tl.load(rows_ptr + b * BLOCK_M + m)
    row_ok = pair < n_pairs
    x_rows = x_ptr + (pair // K_TOP).to(tl.int64)[:, None] * stride_x
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    w_e = w_ptr + e.to(tl.int64) * stride_we
    split = tl.program_id(2)
    k_lo = split * (HIDDEN // SPLIT_K)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN // SPLIT_K, BLOCK_K):
        kk = k_lo + k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_lo + HIDDEN // SPLIT_K
        a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(op)
        w_tile = w_e + kk.to(tl.int64)[:, None] * stride_wk + n.to(tl.int64)[None, :] * stride_wn
        w_ok = k_ok[:, None] & n_ok[None, :]
        # FP8 codes widen exactly to the operand dtype (or stay FP8 with F8); the scales
        # wait for the accumulator.
        gate = tl.load(w_tile, mask=w_ok, other=0.0).to(op)
        up = tl.load(w_tile + INTER * stride_wn, mask=w_ok, other=0.0).to(op)
        acc_gate += _dot(a, gate, IEEE, INTERPRETED, F8)
        acc_up += _dot(a, up, IEEE, INTERPRETED, F8)
    if HAS_SCALE:
        s = scale_ptr + e.to(tl.int64) * stride_se + n
        acc_gate *= tl.load(s, mask=n_ok, other=0.0)[None, :]
        acc_up *= tl.load(s + INTER, mask=n_ok, other=0.0)[None, :]
    if F8:
        x_scale = tl.load(x_scale_ptr + pair // K_TOP, mask=row_ok, other=0.0)[:, None]
        acc_gate *= x_scale
        acc_up *= x_scale
    out_ok = row_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        h = acc_gate * tl.sigmoid(acc_gate) * acc_up
        h_rows = h_ptr + pair.to(tl.int64)[:, None] * stride_h
        # Rounded to nearest also under the interpreter: with F8, h's rows are quantized
        # next, where a one-step difference in h can move a whole FP8 step.
        tl.store(h_rows + n[None, :], cast_nearest(h, h_ptr.dtype.element_ty, INTERPRETED), mask=out_ok)
    else:  # this split's share of the sums; the down kernel adds the splits up
        p_rows = partial_ptr + split.to(tl.int64) * stride_ps + pair.to(tl.int64)[:, None] * stride_pr
        tl.store(p_rows + n[None, :], acc_gate, mask=out_ok)
        tl.store(p_rows + INTER + n[None, :], acc_up, mask=out_ok)


@triton.jit
def _summed_swiglu(p, mask, stride_ps, INTER: tl.constexpr, SPLITS: tl.constexpr):
    """silu(gate) * up in float32 from the gate/up kernel's split sums: gate at `p` (any
    shape of pointers into split 0's rows), up INTER columns on, each split stride_ps
    further (the pointer stepped, so no split * stride product overflows int32), summed in
    split order."""
    gate = tl.load(p, mask=mask, other=0.0)
    up = tl.load(p + INTER, mask=mask, other=0.0)
    for _ in tl.static_range(SPLITS - 1):
        p += stride_ps
        gate += tl.load(p, mask=mask, other=0.0)
        up += tl.load(p + INTER, mask=mask, other=0.0)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _down_kernel(
    h_ptr, stride_h, h_scale_ptr,
    partial_ptr, stride_ps, stride_pr,
    w_ptr, stride_we, stride_wk, stride_wn,
    scale_ptr, stride_se,
    weights_ptr, out_ptr, stride_os, stride_out,
    rows_ptr, block_expert_ptr, n_pairs,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATE_UP_SPLITS: tl.constexpr, SPLIT_K: tl.constexpr,
    IEEE: tl.constexpr, INTERPRETED: tl.constexpr, F16: tl.constexpr, F8: tl.constexpr,
):
    """F8: h_ptr holds FP8 codes of h's rows and h_scale_ptr their scales, as in
    _gate_up_kernel (unsplit gate/up only)."""
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b)
    if e < 0:
        return
    op = w_ptr.dtype.element_ty if F8 else (tl.float16 if F16 else h_ptr.dtype.element_ty)
    m = tl.arange(0, BLOCK_M)
    pair = tl.load(rows_ptr + b * BLOCK_M + m)
    row_ok = pair < n_pairs
    h_rows = h_ptr + pair.to(tl.int64)[:, None] * stride_h
    p_rows = partial_ptr + pair.to(tl.int64)[:, None] * stride_pr
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < HIDDEN
    w_e = w_ptr + e.to(tl.int64) * stride_we
    split = tl.program_id(2)
    k_lo = split * (INTER // SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER // SPLIT_K, BLOCK_K):
        kk = k_lo + k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_lo + INTER // SPLIT_K
        a_ok = row_ok[:, None] & k_ok[None, :]
        if GATE_UP_SPLITS == 1:
            a = tl.load(h_rows + kk[None, :], mask=a_ok, other=0.0)
        else:  # as the unsplit kernel writes h
            a = _summed_swiglu(p_rows + kk[None, :], a_ok, stride_ps, INTER, GATE_UP_SPLITS).to(h_ptr.dtype.element_ty)
        w = tl.load(w_e + kk.to(tl.int64)[:, None] * stride_wk + n.to(tl.int64)[None, :] * stride_wn,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(op)
        acc += _dot(a.to(op), w, IEEE, INTERPRETED, F8)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + e.to(tl.int64) * stride_se + n, mask=n_ok, other=0.0)[None, :]
    if F8:
        acc *= tl.load(h_scale_ptr + pair, mask=row_ok, other=0.0)[:, None]
    acc *= tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    out_rows = out_ptr + split.to(tl.int64) * stride_os + pair.to(tl.int64)[:, None] * stride_out
    tl.store(out_rows + n[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _gate_up_pair_kernel(
    x_ptr, stride_x, ids_ptr,
    w_ptr, stride_we, stride_wk, stride_wn,
    scale_ptr, stride_se,
    h_ptr, stride_h,
    partial_ptr, stride_ps, stride_pr,
    K_TOP: tl.constexpr, E: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """_gate_up_kernel for one pair per program, as a GEMV: no alignment (the pair's expert
    is read from ids) and no tl.dot, whose 16-row operand would be one real row and fifteen
    of padding at batch 1. Each thread keeps float32 products of its [BLOCK_K, BLOCK_N]
    elements and the K axis is summed once, after the loop."""
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    if (e < 0) | (e >= E):  # no such expert (a garbage row's id): read nothing, as the aligned kernels
        return
    x_row = x_ptr + (pair // K_TOP).to(tl.int64) * stride_x
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    w_e = w_ptr + e * stride_we
    split = tl.program_id(2)
    k_lo = split * (HIDDEN // SPLIT_K)
    acc_gate = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN // SPLIT_K, BLOCK_K):
        kk = k_lo + k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_lo + HIDDEN // SPLIT_K
        a = tl.load(x_row + kk, mask=k_ok, other=0.0).to(tl.float32)[:, None]
        w_tile = w_e + kk.to(tl.int64)[:, None] * stride_wk + n.to(tl.int64)[None, :] * stride_wn
        w_ok = k_ok[:, None] & n_ok[None, :]
        acc_gate += a * tl.load(w_tile, mask=w_ok, other=0.0).to(tl.float32)
        acc_up += a * tl.load(w_tile + INTER * stride_wn, mask=w_ok, other=0.0).to(tl.float32)
    gate = tl.sum(acc_gate, 0)
    up = tl.sum(acc_up, 0)
    if HAS_SCALE:
        s = scale_ptr + e * stride_se + n
        gate *= tl.load(s, mask=n_ok, other=0.0)
        up *= tl.load(s + INTER, mask=n_ok, other=0.0)
    if SPLIT_K == 1:
        h = gate * tl.sigmoid(gate) * up
        tl.store(h_ptr + pair.to(tl.int64) * stride_h + n, h.to(h_ptr.dtype.element_ty), mask=n_ok)
    else:
        p_row = partial_ptr + split.to(tl.int64) * stride_ps + pair.to(tl.int64) * stride_pr
        tl.store(p_row + n, gate, mask=n_ok)
        tl.store(p_row + INTER + n, up, mask=n_ok)


@triton.jit
def _down_pair_kernel(
    h_ptr, stride_h,
    partial_ptr, stride_ps, stride_pr,
    ids_ptr, w_ptr, stride_we, stride_wk, stride_wn,
    scale_ptr, stride_se,
    weights_ptr, out_ptr, stride_os, stride_out,
    E: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATE_UP_SPLITS: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """_down_kernel for one pair per program, as a GEMV (see _gate_up_pair_kernel)."""
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < HIDDEN
    split = tl.program_id(2)
    out_row = out_ptr + split.to(tl.int64) * stride_os + pair.to(tl.int64) * stride_out
    if (e < 0) | (e >= E):  # no such expert: the pair adds nothing (its gate/up rows were never written)
        tl.store(out_row + n, tl.zeros((BLOCK_N,), dtype=tl.float32), mask=n_ok)
        return
    h_row = h_ptr + pair.to(tl.int64) * stride_h
    p_row = partial_ptr + pair.to(tl.int64) * stride_pr
    w_e = w_ptr + e * stride_we
    k_lo = split * (INTER // SPLIT_K)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER // SPLIT_K, BLOCK_K):
        kk = k_lo + k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_lo + INTER // SPLIT_K
        if GATE_UP_SPLITS == 1:
            a = tl.load(h_row + kk, mask=k_ok, other=0.0)
        else:  # rounded as h would be
            a = _summed_swiglu(p_row + kk, k_ok, stride_ps, INTER, GATE_UP_SPLITS).to(h_ptr.dtype.element_ty)
        w = tl.load(w_e + kk.to(tl.int64)[:, None] * stride_wk + n.to(tl.int64)[None, :] * stride_wn,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += a.to(tl.float32)[:, None] * w.to(tl.float32)
    out = tl.sum(acc, 0)
    if HAS_SCALE:
        out *= tl.load(scale_ptr + e * stride_se + n, mask=n_ok, other=0.0)
    out *= tl.load(weights_ptr + pair)
    tl.store(out_row + n, out, mask=n_ok)


@triton.jit
def _finish_kernel(pairs_ptr, out_ptr, add_a_ptr, add_b_ptr, T,
                   HIDDEN: tl.constexpr, K_TOP: tl.constexpr, SPLITS: tl.constexpr, NUM_ADDS: tl.constexpr,
                   BLOCK: tl.constexpr):
    """out[t] = the float32 rows of token t's pairs, pairs[s, t, j] of [SPLITS, T, K_TOP,
    HIDDEN], summed over s then j in that order (the same sums every call), plus up to two
    addends [T, HIDDEN], rounded once to out's dtype."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < HIDDEN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # unrolled: the rows' loads all in flight at once
        for j in tl.static_range(K_TOP):
            acc += tl.load(pairs_ptr + ((s * T + t) * K_TOP + j) * HIDDEN + c, mask=ok, other=0.0)
    if NUM_ADDS >= 1:
        acc += tl.load(add_a_ptr + t * HIDDEN + c, mask=ok, other=0.0).to(tl.float32)
    if NUM_ADDS >= 2:
        acc += tl.load(add_b_ptr + t * HIDDEN + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * HIDDEN + c, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _finish(pairs: torch.Tensor, splits: int, T: int, k: int, hidden: int, dtype: torch.dtype,
            adds: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The tokens' outputs from their pairs' float32 rows (`_finish_kernel`) in one launch."""
    out = torch.empty(T, hidden, dtype=dtype, device=pairs.device)
    if T:
        args = [a.contiguous() for a in adds] + [out] * (2 - len(adds))  # unread where NUM_ADDS says so
        block = min(1024, triton.next_power_of_2(hidden))
        _finish_kernel[(T, triton.cdiv(hidden, block))](pairs, out, args[0], args[1], T, HIDDEN=hidden, K_TOP=k,
                                                        SPLITS=splits, NUM_ADDS=len(adds), BLOCK=block, num_warps=4)
    return out


@dataclass(frozen=True)
class MoEConfig:
    """Launch settings: rows per block (block_m, >= 16 for tl.dot), output columns (block_n)
    and summed inputs (block_k) per tile, warps and pipeline stages per program, and the
    splits of the summed axis (split_k of gate/up's hidden, down_split_k of down's I):
    split sums go to float32 buffers that the next kernel (the down kernel, or the final
    sum over a token's pairs) adds up, in a fixed order. per_pair: one program per (pair,
    tile, split) as a GEMV, without alignment or tl.dot (block_m unused); an expert that
    several pairs share is read once per pair, so it suits a token or so. down_block_n,
    down_block_k, down_num_warps, down_num_stages: the down kernel's own tile, warps and
    stages (None: the gate/up kernel's); the two kernels read different shapes (gate/up
    two [hidden, I] tiles a step of the summed axis, down one [I, hidden] tile), so their
    best tiles differ. f16_operands: with FP8 experts and bf16 x, the aligned kernels
    multiply in float16 (x and h rounded to it, FP8 codes exact in it): one conversion
    instruction widens two FP8 codes to float16, where bf16 takes more (through float16),
    and conversions run at a quarter of the SM's arithmetic rate. On the H200 at 32 tokens
    the gate/up kernel took as long as on the H100, so its conversions, not its bytes,
    bound it. A bf16 value is exact in float16 only in float16's normal range: an x or h
    element of 65520 or more overflows (inf), one below 2^-14 loses bits (2^-24 and below
    flush to zero).

    fp8_x, fp8_h: with FP8 experts, the gate/up kernel (fp8_x) or the down kernel (fp8_h)
    multiplies FP8 codes on both sides: x's or h's rows quantized per row just before it
    (quantize_rows_triton: one float32 scale a row, one launch), nothing widened in the
    kernel and the MMAs at FP8's rate, as DeepSeek's own serving runs its FP8 layers
    (activations quantized, there per 128 columns). Each such activation carries FP8's
    rounding (3 mantissa bits, as the weights already do), so the output moves from the
    bf16 path's by about the weights' own quantization error;
    routed_experts_reference(fp8_x=, fp8_h=) is the ground truth. Not with per_pair or
    gate/up splits. Off in default_config: on an H100 (2026-12-07,
    benchmarks/engine-h100-moe-tiles-fp8/) the kernels took the same time at 8 and 32
    tokens, and at 128 tokens FP8 x took 5% off gate/up (187 against 196 us), 1% off the
    call, moving its output by 3.8% (both on: 4.6%)."""

    per_pair: bool = False
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    down_split_k: int = 1
    down_block_n: int | None = None
    down_block_k: int | None = None
    down_num_warps: int | None = None
    down_num_stages: int | None = None
    f16_operands: bool = True
    fp8_x: bool = False
    fp8_h: bool = False

    def down_launch(self) -> dict:
        """The down kernel's BLOCK_N, BLOCK_K, num_warps and num_stages."""
        pick = lambda own, shared: shared if own is None else own  # noqa: E731
        return dict(BLOCK_N=pick(self.down_block_n, self.block_n), BLOCK_K=pick(self.down_block_k, self.block_k),
                    num_warps=pick(self.down_num_warps, self.num_warps),
                    num_stages=pick(self.down_num_stages, self.num_stages))


def _whole_splits(axis: int, block_k: int, most: int) -> int:
    """The largest split of `axis` up to `most` (a power of two) into whole block_k tiles."""
    split = most
    while split > 1 and axis % (split * block_k):
        split //= 2
    return split


def default_config(num_pairs: int, num_experts: int, on_gpu: bool, hidden: int, inter: int) -> MoEConfig:
    """Launch settings for num_pairs (token, expert) pairs over num_experts experts of
    `hidden` inputs and `inter` intermediate columns, from
    runners/device/moe_topk_timings.py at V4-Flash's expert shape (FP8, 32 experts of hidden
    4096 and I 2048, top-6; routing and the pairs' sums included):

    - up to one pair per expert (up to 5 tokens of V4-Flash): the per-pair GEMV, 128-column
      tiles of 64 rows, the summed axes split 4 and 2 (their partial sums added in the next
      kernel). One token: 64.3 us a call on an H200, 2.35 TB/s of the 6 experts' weights,
      against 150 us for the aligned kernels with the same splits (188-208 us in a later
      run, benchmarks/engine-h200-f16-moe/, the per-pair time unchanged; not explained)
      and 170 us for the former unsplit default; 2 and 4 tokens, timed with 32-row tiles
      pipelined (the default gives them the one-token tile, not timed there): 133 and 213
      us against 234 and 314
      (2026-12-06). Pairs that share an expert read it once each, which stops paying
      somewhere past this;
    - up to 8 pairs per expert on average: the aligned kernels, blocks of 16 rows (the least
      tl.dot takes) and 128-column tiles, 128-byte rows of FP8 codes per load, on float16
      operands (f16_operands: 18-20% less a call at 8 and 32 tokens on an H200);
    - up to 32 pairs per expert on average (up to ~170 tokens): 32-row blocks, most experts
      in one block, 128-column tiles, down's in 4 stages: at 128 tokens on an H100
      (2026-12-07, benchmarks/engine-h100-moe-tiles-fp8/) gate/up took 196 us a call with
      128-column tiles against 267 with 64 (the tile the a8a948d sweep had picked), 410
      us the whole call; FP8 x (MoEConfig.fp8_x) took 187 us, 1% of the call, for 3.8% of
      output error, and is left off;
    - up to 256 pairs per expert (up to ~1,400 tokens): 64-row blocks, each weight tile
      reused by more rows, operands in x's dtype (not timed between 170 and 8,192 tokens);
    - more (a prefill's chunk): 128-row blocks and 4 stages. At 8,192 tokens on an H100
      (2026-12-07, benchmarks/engine-h100-prefill-tiles/) 8.4 ms a call against 10.3 with
      64-row blocks, the same output; 256 columns took 22 ms and block_k 128 9.2. FP8 x
      took 1.7-2.5x as long at every prefill tile, so it stays off. The cut at 256 pairs
      an expert is not timed: only 128 and 8,192 tokens were.
    Under the interpreter: small tiles (its cost is per element, not per launch).
    """
    if not on_gpu:
        return MoEConfig(block_m=16, block_n=64, block_k=64, num_warps=1, num_stages=1)
    if num_pairs <= num_experts:
        # Splits cut hidden and I into whole tiles, fewer where they do not divide.
        return MoEConfig(per_pair=True, block_m=1, block_n=128, block_k=64, num_warps=4, num_stages=1,
                         split_k=_whole_splits(hidden, 64, 4), down_split_k=_whole_splits(inter, 64, 2))
    if num_pairs <= 8 * num_experts:
        return MoEConfig(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=3)
    if num_pairs <= 32 * num_experts:
        return MoEConfig(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=3, down_block_k=64,
                         down_num_stages=4)
    # float16 operands took nothing off these tiles (128 tokens on an H200, 2026-12-06), so
    # they keep x's dtype and its range.
    if num_pairs <= 256 * num_experts:
        return MoEConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3, f16_operands=False)
    return MoEConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, f16_operands=False)


def routed_experts_triton(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          w_gate_up: torch.Tensor, w_down: torch.Tensor,
                          gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
                          config: MoEConfig | None = None, check_ids: bool = False,
                          h: torch.Tensor | None = None, pairs: torch.Tensor | None = None,
                          align_pairs=align, adds: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """The fused routed-expert kernels (module docstring): x's dtype [T, hidden]. On CUDA
    tensors compiled, on CPU tensors only under Triton's interpreter. Graph-safe: static
    grids (max_blocks x column tiles), no host sync unless check_ids. align_pairs: `align`
    or the same function compiled (remnant.engine.step_ops: some twenty small kernels become
    a few).

    h (x's dtype [T * k, I]) and pairs (float32 [down_split_k * T * k, hidden]): the
    intermediate (not allocated with gate/up splits, whose float32 sums are allocated here) and the
    per-pair output buffers, allocated here when None; every element read is written first
    (tests pass them poisoned).

    adds: up to two [T, hidden] tensors (the shared expert's output, the residual) added to
    the pairs' float32 sums before the output's one rounding, in the launch that sums them.
    """
    T, k, E, hidden, inter = check_routed(x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_scale, down_scale,
                                          check_ids)
    _check_adds(adds, x)
    interp = interpreted()
    if not x.is_cuda and not interp:
        raise ValueError(f"routed_experts_triton runs on CUDA tensors or under Triton's interpreter "
                         f"(TRITON_INTERPRET=1), got device={x.device}")
    n = T * k
    cfg = config or default_config(n, E, x.is_cuda and not interp, hidden, inter)
    if cfg.block_m < 16 and not cfg.per_pair:
        raise ValueError(f"config.block_m={cfg.block_m} is not allowed; tl.dot needs block_m >= 16")
    for name in ("fp8_x", "fp8_h"):
        if getattr(cfg, name) and (cfg.per_pair or cfg.split_k != 1 or gate_up_scale is None):
            raise ValueError(f"config.{name}=True is not allowed with per_pair={cfg.per_pair}, "
                             f"split_k={cfg.split_k} or {_name(w_gate_up.dtype)} experts; allowed: FP8 experts, "
                             f"the aligned kernels, split_k 1")
    down = cfg.down_launch()
    for name, splits, axis, tile in (("split_k", cfg.split_k, hidden, cfg.block_k),
                                     ("down_split_k", cfg.down_split_k, inter, down["BLOCK_K"])):
        if splits < 1 or (splits > 1 and axis % (splits * tile)):
            raise ValueError(f"config.{name}={splits} must split {axis} into whole tiles of {tile} "
                             f"(the kernel's block_k)")
    for name, buf, shape, dtype in (("h", h, (n, inter), x.dtype),
                                    ("pairs", pairs, (cfg.down_split_k * n, hidden), torch.float32)):
        if buf is not None and (buf.shape != shape or buf.dtype != dtype or not buf.is_contiguous()
                                or buf.device != x.device):
            raise ValueError(f"{name} must be contiguous {_name(dtype)} {shape} on {x.device}, got "
                             f"{_name(buf.dtype)} {tuple(buf.shape)} on {buf.device}")
    if n == 0:
        return _finish(x.new_empty(0), 1, T, k, hidden, x.dtype, adds)
    x = x.contiguous()
    if h is None and cfg.split_k == 1:
        h = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    # With gate/up splits no h is read or written: x stands in (its dtype is the one read).
    h_arg = x if h is None else h
    pairs = torch.empty(cfg.down_split_k * n, hidden, dtype=torch.float32, device=x.device) if pairs is None else pairs
    # Split gate/up sums [split_k, n, 2I]; only real pairs' rows are written and read.
    partial = pairs if cfg.split_k == 1 else torch.empty(cfg.split_k, n, 2 * inter, dtype=torch.float32,
                                                         device=x.device)
    fp8 = gate_up_scale is not None
    # Scales are unread without FP8 experts; any float32 pointer fills the argument.
    gu_scale = gate_up_scale.contiguous() if fp8 else pairs
    dn_scale = down_scale.contiguous() if fp8 else pairs
    weights = topk_weights.reshape(-1).float().contiguous()
    partial_args = dict(partial_ptr=partial, stride_ps=n * 2 * inter, stride_pr=2 * inter)
    if cfg.per_pair:
        ids = topk_ids.reshape(-1).contiguous()
        sizes = dict(E=E, HIDDEN=hidden, INTER=inter, HAS_SCALE=fp8)
        _gate_up_pair_kernel[(n, triton.cdiv(inter, cfg.block_n), cfg.split_k)](
            x_ptr=x, stride_x=x.stride(0), ids_ptr=ids,
            w_ptr=w_gate_up, stride_we=w_gate_up.stride(0), stride_wk=w_gate_up.stride(1),
            stride_wn=w_gate_up.stride(2), scale_ptr=gu_scale, stride_se=2 * inter,
            h_ptr=h_arg, stride_h=h_arg.stride(0), K_TOP=k, SPLIT_K=cfg.split_k, **partial_args, **sizes,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        _down_pair_kernel[(n, triton.cdiv(hidden, down["BLOCK_N"]), cfg.down_split_k)](
            h_ptr=h_arg, stride_h=h_arg.stride(0), ids_ptr=ids,
            w_ptr=w_down, stride_we=w_down.stride(0), stride_wk=w_down.stride(1), stride_wn=w_down.stride(2),
            scale_ptr=dn_scale, stride_se=hidden, weights_ptr=weights, out_ptr=pairs, stride_os=n * hidden,
            stride_out=hidden, GATE_UP_SPLITS=cfg.split_k, SPLIT_K=cfg.down_split_k, **partial_args, **sizes,
            **down)
        return _finish(pairs, cfg.down_split_k, T, k, hidden, x.dtype, adds)
    al = align_pairs(topk_ids, E, cfg.block_m)
    blocks = al.block_expert.numel()
    common = dict(rows_ptr=al.rows, block_expert_ptr=al.block_expert, n_pairs=n, HIDDEN=hidden, INTER=inter,
                  HAS_SCALE=fp8, BLOCK_M=cfg.block_m, INTERPRETED=interp,
                  F16=cfg.f16_operands and fp8 and x.dtype == torch.bfloat16)
    f32 = x.dtype == torch.float32  # float32 operands: IEEE products, not TF32
    # FP8 operands: x's rows quantized here, h's between the kernels (scales unread otherwise).
    x_in, x_scale = quantize_rows_triton(x) if cfg.fp8_x else (x, pairs)
    _gate_up_kernel[(blocks, triton.cdiv(inter, cfg.block_n), cfg.split_k)](
        x_ptr=x_in, stride_x=x_in.stride(0), x_scale_ptr=x_scale,
        w_ptr=w_gate_up, stride_we=w_gate_up.stride(0), stride_wk=w_gate_up.stride(1),
        stride_wn=w_gate_up.stride(2), scale_ptr=gu_scale, stride_se=2 * inter,
        h_ptr=h_arg, stride_h=h_arg.stride(0), K_TOP=k, SPLIT_K=cfg.split_k, **partial_args, **common,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        IEEE=f32 and not cfg.fp8_x, F8=cfg.fp8_x)
    h_in, h_scale = quantize_rows_triton(h_arg) if cfg.fp8_h else (h_arg, pairs)
    _down_kernel[(blocks, triton.cdiv(hidden, down["BLOCK_N"]), cfg.down_split_k)](
        h_ptr=h_in, stride_h=h_in.stride(0), h_scale_ptr=h_scale,
        w_ptr=w_down, stride_we=w_down.stride(0), stride_wk=w_down.stride(1), stride_wn=w_down.stride(2),
        scale_ptr=dn_scale, stride_se=hidden,
        weights_ptr=weights, out_ptr=pairs, stride_os=n * hidden,
        stride_out=hidden, GATE_UP_SPLITS=cfg.split_k, SPLIT_K=cfg.down_split_k, **partial_args, **common, **down,
        IEEE=f32 and not cfg.fp8_h, F8=cfg.fp8_h)
    return _finish(pairs, cfg.down_split_k, T, k, hidden, x.dtype, adds)


def routed_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
                   impl: str = "auto", check_ids: bool = False, align_pairs=align,
                   adds: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """The routed experts' output, x's dtype [T, hidden].

    x: bf16 or float32 [T, hidden]; topk_ids: int [T, k], each token's experts;
    topk_weights: float [T, k], their routing weights; w_gate_up: [E, hidden, 2 * I] (gate
    columns 0..I-1, up columns I..2I-1); w_down: [E, I, hidden]; both bfloat16, float32 or
    float8_e4m3fn with gate_up_scale float32 [E, 2 * I] and down_scale float32 [E, hidden].
    impl: "auto" runs the Triton kernels on CUDA tensors and on CPU tensors under Triton's
    interpreter, routed_experts_torch otherwise; "triton" and "torch" force one. align_pairs,
    adds: as routed_experts_triton's (adds: tensors added before the one rounding).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not allowed; allowed: {', '.join(map(repr, IMPLS))}")
    if impl == "triton" or (impl == "auto" and (x.is_cuda or interpreted())):
        return routed_experts_triton(x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_scale, down_scale,
                                     check_ids=check_ids, align_pairs=align_pairs, adds=adds)
    if check_ids:
        check_routed(x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_scale, down_scale, check_ids=True)
    return routed_experts_torch(x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_scale, down_scale, adds=adds)
