"""top_k: the indexer's top-k, one program per row, by radix select.

A decode step picks, per CSA layer and sequence, the 512 best-scoring C4 records of up to
n = context / 4 (8,192 at 32k, 32,768 at 128k). torch.topk sorts the whole row, and the
engine's tie-exact form of it (remnant.engine.ops.index_top_k: int64 keys) took 143 us a
call on the H200 (benchmarks/engine-h200-profile/), 21 calls a step, 3 ms of a 23 ms step
at batch 1. Selection needs no sort. Each score becomes a 32-bit key ordered as the float
(-0 as +0); four passes over the row, one per byte from the top, histogram the keys that
match the bytes found so far and find the byte of the k-th largest key; then the threshold
T (the k-th largest key) and how many of the keys equal to T are taken are known, and one
last pass writes, for each row, the keys above T (in index order) then the lowest-index
keys equal to T (ties go to the lower index, as a stable descending sort's first k:
top_k_reference). Five reads of a row of 32 KB (at n = 8192), from L2, in one program: a
few microseconds, and a batch's rows run side by side.

Order: the chosen k come out as above (all keys above T by index, then the ties), not by
score; the decode step and prefill treat them as a set. `top_k_reference` is a stable sort
(scores in descending order); tests compare the two as sets, and values at the same
indices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from remnant.kernels.common import interpreted

#: Scores a program reads per iteration.
BLOCK = 2048


def top_k_reference(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A stable descending sort's first k scores and indices of each row of `scores` [..., n]
    (ties to the lower index)."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


@triton.jit
def _keys(x):
    """float32 -> uint32 keys in the float's order, -0.0 as 0.0 (NaN is not expected)."""
    bits = tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True))
    signed = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int32 in the float's order
    return (signed ^ -2147483648).to(tl.uint32, bitcast=True)  # the same order, unsigned


@triton.jit
def _top_k_kernel(s_ptr, stride_s, values_ptr, indices_ptr, stride_o, n, k, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride_s
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], dtype=tl.uint32)  # the bytes of the k-th key found so far
    known = tl.zeros([], dtype=tl.uint32)  # which bits of prefix are found
    remaining = k  # how many keys >= the k-th key are still to place below the known prefix
    for p in tl.static_range(4):
        shift = 24 - 8 * p  # constexpr (p is); annotated, Triton 3.6 refuses the rebinding
        hist = tl.zeros([256], dtype=tl.int32)
        for start in range(0, n, BLOCK):
            inside = start + offs < n
            key = _keys(tl.load(s_row + start + offs, mask=inside, other=0.0))
            match = inside & ((key & known) == prefix)
            digit = ((key >> shift) & 255).to(tl.int32)
            # Keys that do not match count in bin 0 and are taken back out of it.
            hist += tl.histogram(tl.where(match, digit, 0), 256)
            hist -= tl.where(bins == 0, tl.sum((~match).to(tl.int32)), 0)
        # at_least[d]: matching keys whose byte is >= d; the k-th key's byte is the largest
        # d with at_least[d] >= remaining.
        at_least = tl.sum(hist) - tl.cumsum(hist, 0) + hist
        byte = tl.sum((at_least >= remaining).to(tl.int32)) - 1
        remaining -= tl.sum(tl.where(bins > byte, hist, 0))
        prefix = prefix | (byte.to(tl.uint32) << shift)
        known = known | (tl.full([], 255, tl.uint32) << shift)
    # prefix is now the k-th key T: k - remaining keys lie above it, and the first
    # `remaining` keys equal to it (by index) complete the k.
    above_count = k - remaining
    above_seen = 0
    ties_seen = 0
    for start in range(0, n, BLOCK):
        inside = start + offs < n
        x = tl.load(s_row + start + offs, mask=inside, other=0.0)
        key = _keys(x)
        above = (inside & (key > prefix)).to(tl.int32)
        tie = (inside & (key == prefix)).to(tl.int32)
        above_slot = above_seen + tl.cumsum(above, 0) - above
        tie_rank = ties_seen + tl.cumsum(tie, 0) - tie
        take = (above == 1) | ((tie == 1) & (tie_rank < remaining))
        slot = tl.where(above == 1, above_slot, above_count + tie_rank)
        out = row * stride_o + slot
        tl.store(values_ptr + out, x, mask=take)
        tl.store(indices_ptr + out, (start + offs).to(tl.int64), mask=take)
        above_seen += tl.sum(above)
        ties_seen += tl.sum(tie)


def top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of `scores` float32 [B, n] (ties to the lower index), in
    the module docstring's order: (values float32 [B, k], indices int64 [B, k]). On CUDA
    tensors compiled, on CPU tensors under Triton's interpreter. Graph-safe (no sync)."""
    if scores.dtype != torch.float32 or scores.ndim != 2:
        raise ValueError(f"top_k takes float32 scores [B, n], got {scores.dtype} {tuple(scores.shape)}")
    B, n = scores.shape
    if not 0 <= k <= n:
        raise ValueError(f"k={k} is not allowed for rows of n={n}; allowed: 0..n")
    if not scores.is_cuda and not interpreted():
        raise ValueError(f"top_k runs on CUDA tensors or under Triton's interpreter (TRITON_INTERPRET=1), "
                         f"got device={scores.device}")
    values = torch.empty(B, k, dtype=torch.float32, device=scores.device)
    indices = torch.empty(B, k, dtype=torch.int64, device=scores.device)
    if B and k:
        scores = scores.contiguous()
        _top_k_kernel[(B,)](scores, scores.stride(0), values, indices, values.stride(0), n, k, BLOCK=BLOCK,
                            num_warps=8)
    return values, indices
