"""route: a DeepSeek-style MoE router's choice of experts in two launches.

For x [T, hidden] and router [hidden, E] (float32), each token's k experts are those of the
k largest logits x @ router (float32 products and sums: close scores must not swap experts
through bf16 rounding), and their weights sigmoid(logit) normalised to sum to `scaling`.
That is remnant.engine.moe.route_tokens, the plain reference; in a batch-1 decode step its
torch ops cost eight launches a layer (a cuBLAS dot and its reduction, casts, sigmoid,
torch.topk's gather and sort, the sums; ~20 us on an H100, 2026-12-06):

1. `_logits_kernel`: programs over (16-token tiles, splits of hidden), each writing its
   split's float32 partial logits (tl.dot in IEEE float32), so that at one token the
   router's 4096 x E floats are read by many programs at once, not by one;
2. `_select_kernel`: per token tile, the splits summed in split order (deterministic), then
   k rounds of take the largest logit (the lowest expert among equal ones), its sigmoid,
   and the weights normalised.

Graph-safe (static shapes, no host sync). On CUDA tensors, or CPU ones under Triton's
interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16  # tokens a program (tl.dot's least M)
BLOCK_H = 64  # hidden inputs a loop step
#: Most experts one select program holds (a [16, E] tile of logits in registers).
MAX_EXPERTS = 256


@triton.jit
def _logits_kernel(x_ptr, stride_x, r_ptr, stride_r, part_ptr, stride_ps, T,
                   HIDDEN: tl.constexpr, E: tl.constexpr, E_P: tl.constexpr, SPLITS: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    e = tl.arange(0, E_P)
    e_ok = e < E
    split = tl.program_id(1)
    h_lo = split * (HIDDEN // SPLITS)
    acc = tl.zeros((BLOCK_T, E_P), dtype=tl.float32)
    for h0 in range(0, HIDDEN // SPLITS, BLOCK_H):
        h = h_lo + h0 + tl.arange(0, BLOCK_H)
        a = tl.load(x_ptr + t.to(tl.int64)[:, None] * stride_x + h[None, :], mask=t_ok[:, None], other=0.0)
        r = tl.load(r_ptr + h.to(tl.int64)[:, None] * stride_r + e[None, :], mask=e_ok[None, :], other=0.0)
        acc += tl.dot(a.to(tl.float32), r, input_precision="ieee")
    out = part_ptr + split.to(tl.int64) * stride_ps + t.to(tl.int64)[:, None] * E + e[None, :]
    tl.store(out, acc, mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def _select_kernel(part_ptr, stride_ps, ids_ptr, weights_ptr, T, scaling,
                   E: tl.constexpr, E_P: tl.constexpr, K: tl.constexpr, K_P: tl.constexpr,
                   SPLITS: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    e = tl.arange(0, E_P)
    ok = t_ok[:, None] & (e < E)[None, :]
    rows = part_ptr + t.to(tl.int64)[:, None] * E + e[None, :]
    logits = tl.zeros((BLOCK_T, E_P), dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # in split order (the same sums every call), unrolled
        logits += tl.load(rows + s * stride_ps, mask=ok, other=0.0)
    # NaN logits (a row gone non-finite upstream) rank lowest: every pick must be an expert,
    # since the per-pair MoE kernels index the weights by it.
    logits = tl.where(ok & (logits == logits), logits, float("-inf"))
    free = tl.broadcast_to((e < E)[None, :], (BLOCK_T, E_P))  # not yet taken
    j = tl.arange(0, K_P)
    ids = tl.zeros((BLOCK_T, K_P), dtype=tl.int32)
    scores = tl.zeros((BLOCK_T, K_P), dtype=tl.float32)
    for slot in range(K):
        best = tl.max(tl.where(free, logits, float("-inf")), 1)
        # The lowest free expert of the largest logit (of equal ones; -inf ones too).
        pick = tl.min(tl.where(free & (logits == best[:, None]), e[None, :], E_P), 1)
        ids = tl.where(j[None, :] == slot, pick[:, None], ids)
        scores = tl.where(j[None, :] == slot, tl.sigmoid(best)[:, None], scores)
        free = free & (e[None, :] != pick[:, None])
    total = tl.sum(scores, 1)
    total = tl.where(total > 0, total, 1.0)  # rows past T, or all -inf: no 0 / 0
    weights = scores / total[:, None] * scaling
    out = t.to(tl.int64)[:, None] * K + j[None, :]
    out_ok = t_ok[:, None] & (j < K)[None, :]
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=out_ok)
    tl.store(weights_ptr + out, weights, mask=out_ok)


def _splits(hidden: int, tokens: int) -> int:
    """Splits of hidden into whole BLOCK_H steps: about 128 programs in all (the router's
    floats spread over programs), up to 32 splits a token tile. Fewer programs left the
    float32 dots of a 128-token step to 32 programs, 12 us a call on an H200 (2026-12-06)."""
    # A power of two, so that halving below keeps dividing hidden (24 from 5 tiles would not).
    splits = 1 << min(5, max(0, (128 // triton.cdiv(tokens, BLOCK_T)).bit_length() - 1))
    while splits > 1 and hidden % (splits * BLOCK_H):
        splits //= 2
    return splits


def route_triton(x: torch.Tensor, router: torch.Tensor, k: int, scaling: float, fallback=None):
    """route_tokens' (ids int64 [T, k], weights float32 [T, k]) in two launches, for
    x [T, hidden] (any float dtype) and a float32 router [hidden, E] with hidden a multiple
    of 64 and E <= 256; others go to `fallback` (route_tokens or the same compiled; None
    raises). Experts in order of falling logit, as torch.topk gives them."""
    T, hidden = x.shape
    E = router.shape[1]
    if router.dtype != torch.float32 or hidden % BLOCK_H or E > MAX_EXPERTS or router.shape[0] != hidden:
        if fallback is None:
            raise ValueError(f"route_triton takes a float32 router [hidden, E<={MAX_EXPERTS}] with hidden a multiple "
                             f"of {BLOCK_H} matching x's {hidden}; got {router.dtype} {tuple(router.shape)}")
        return fallback(x, router, k, scaling)
    if not 1 <= k <= E:
        raise ValueError(f"k={k} experts per token is not allowed; allowed: 1..E={E}")
    ids = torch.empty(T, k, dtype=torch.int64, device=x.device)
    weights = torch.empty(T, k, dtype=torch.float32, device=x.device)
    if T == 0:
        return ids, weights
    x = x if x.stride(-1) == 1 else x.contiguous()
    router = router.contiguous()
    splits = _splits(hidden, T)
    parts = torch.empty(splits, T, E, dtype=torch.float32, device=x.device)
    e_p = max(16, triton.next_power_of_2(E))
    tiles = triton.cdiv(T, BLOCK_T)
    _logits_kernel[(tiles, splits)](x, x.stride(0), router, router.stride(0), parts, T * E, T, HIDDEN=hidden, E=E,
                                    E_P=e_p, SPLITS=splits, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, num_warps=4)
    _select_kernel[(tiles,)](parts, T * E, ids, weights, T, float(scaling), E=E, E_P=e_p, K=k,
                             K_P=triton.next_power_of_2(k), SPLITS=splits, BLOCK_T=BLOCK_T, num_warps=4)
    return ids, weights
