"""top_k: the indexer's top-k by radix select, each row split over several programs.

A decode step picks, per CSA layer and sequence, the 512 best-scoring C4 records of up to
n = context / 4 (8,192 at 32k, 32,768 at 128k). torch.topk sorts the whole row, and the
engine's tie-exact form of it (remnant.engine.ops.index_top_k: int64 keys) took 143 us a
call on the H200 (benchmarks/engine-h200-profile/), 21 calls a step, 3 ms of a 23 ms step
at batch 1. Selection needs no sort. Each score becomes a 32-bit key ordered as the float
(-0 as +0); four passes over the row, one per byte from the top, histogram the keys that
match the bytes found so far and find the byte of the k-th largest key; then the threshold
T (the k-th largest key) and how many of the keys equal to T are taken are known, and a
last pass writes, for each row, the keys above T (in index order) then the lowest-index
keys equal to T (ties go to the lower index, as a stable descending sort's first k:
top_k_reference).

With one program per row, a batch-1 step selected on one SM: 65 us a call on an H100
(benchmarks/engine-h100-c24/), 1.4 ms of its 18.7 ms step. So each row is split in parts
(plan_parts: up to 16, so that a batch fills about 256 programs) and each pass is a launch
of rows x parts programs: a radix pass writes its part's histogram (no atomics, nothing to
zero), and the next pass's programs sum the row's histograms to find the byte. A count
pass finds T and counts each part's keys above T and equal to T; the write pass places a
part's keys after those of the parts before it. Six launches, each reading n / parts
scores per program; the output is the same as one program per row's, bit for bit. On an
H100, in CUDA graphs (benchmarks/engine-h100-split/): 17.8 us a call for 1 x 8,192, 42 us
for 128 x 8,192, against torch.topk's 53 and 81; at 128 x 32,768 no faster (125 us against
117: each part is read six times).

Rows of different lengths (counts): a decode step's rows are padded to the page-table
bucket's n (a power of two of pages: at 32k + 1 tokens 16,384 C4 records, 8,192 of them
visible), and the indexer writes -inf past each row's count. Given those counts, the passes
read a row's scores only up to its count and take the rest as -inf keys they count without
reading (their histogram bin, their ties, and -1 locations where ties among them are
taken), so the choice, and its order, are those of the whole row.

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

#: Most scores a program reads per iteration.
BLOCK = 2048
#: Programs the selection aims to spread a batch's rows over (the H100 and H200 have 132
#: SMs): a row of the batch-1 step is split in up to MAX_PARTS parts.
TARGET_PROGRAMS = 256
MAX_PARTS = 16


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


#: _keys(-inf): the key of a score past a row's count, which the passes count unread.
NEG_INF_KEY = tl.constexpr(0x007FFFFF)


@triton.jit
def _row_limit(limits_ptr, row, n, LIMITED: tl.constexpr):
    """The end of the scores a row's passes read: its count (below n), or n."""
    if LIMITED:
        return tl.minimum(tl.maximum(tl.load(limits_ptr + row), 0), n)
    return n


@triton.jit
def _unread(lo, chunk, n, limit):
    """How many of a part's positions [lo, lo + chunk) below n lie at or past the row's
    limit: -inf keys, counted unread."""
    return tl.maximum(tl.minimum(lo + chunk, n) - tl.maximum(lo, limit), 0)


@triton.jit
def _state_after(hist_ptr, state_ptr, row, parts, k, PASS: tl.constexpr):
    """(prefix, remaining) after radix passes 0..PASS-1 of `row`: the stored state at the
    start of pass PASS - 1 (state slot PASS - 1; the implicit (0, k) for pass 0) and the
    byte pass PASS - 1's histograms (summed over the row's parts) give."""
    bins = tl.arange(0, 256)
    if PASS == 1:
        prefix = tl.zeros([], dtype=tl.uint32)
        remaining = k
    else:
        prefix = tl.load(state_ptr + (row * 5 + PASS - 1) * 2).to(tl.uint32, bitcast=True)
        remaining = tl.load(state_ptr + (row * 5 + PASS - 1) * 2 + 1)
    hist = tl.zeros([256], dtype=tl.int32)
    for part in range(parts):
        hist += tl.load(hist_ptr + ((row * 4 + PASS - 1) * parts + part) * 256 + bins)
    # at_least[d]: matching keys whose byte is >= d; the k-th key's byte is the largest d
    # with at_least[d] >= remaining.
    at_least = tl.sum(hist) - tl.cumsum(hist, 0) + hist
    byte = tl.sum((at_least >= remaining).to(tl.int32)) - 1
    remaining -= tl.sum(tl.where(bins > byte, hist, 0))
    prefix = prefix | (byte.to(tl.uint32) << (32 - 8 * PASS))
    return prefix, remaining


@triton.jit
def _radix_pass(s_ptr, stride_s, hist_ptr, state_ptr, limits_ptr, n, k, chunk, PASS: tl.constexpr,
                BLOCK: tl.constexpr, LIMITED: tl.constexpr):
    """Pass PASS (0..3) over one part of a row: the histogram of byte PASS (from the top) of
    the part's keys whose higher bytes match the k-th key's, found by the passes before."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    if PASS == 0:  # nothing known yet (the next pass takes this state as implied)
        prefix = tl.zeros([], dtype=tl.uint32)
        remaining = k
        known = tl.zeros([], dtype=tl.uint32)
    else:
        prefix, remaining = _state_after(hist_ptr, state_ptr, row, parts, k, PASS)
        known = tl.full([], 0xFFFFFFFF, tl.uint32) << (32 - 8 * PASS)
        if part == 0:  # the row's state at this pass's start, for the next pass
            tl.store(state_ptr + (row * 5 + PASS) * 2, prefix.to(tl.int32, bitcast=True))
            tl.store(state_ptr + (row * 5 + PASS) * 2 + 1, remaining)
    hist = tl.zeros([256], dtype=tl.int32)
    s_row = s_ptr + row * stride_s
    lo = part * chunk
    limit = _row_limit(limits_ptr, row, n, LIMITED)
    end = tl.minimum(lo + chunk, limit)
    for start in range(lo, end, BLOCK):
        inside = start + offs < end
        key = _keys(tl.load(s_row + start + offs, mask=inside, other=0.0))
        match = inside & ((key & known) == prefix)
        digit = ((key >> (24 - 8 * PASS)) & 255).to(tl.int32)
        # Keys that do not match count in bin 0 and are taken back out of it.
        hist += tl.histogram(tl.where(match, digit, 0), 256)
        hist -= tl.where(bins == 0, tl.sum((~match).to(tl.int32)), 0)
    if LIMITED:  # (nested: a constexpr and a runtime test in one `if` do not always compile)
        if (NEG_INF_KEY & known) == prefix:
            digit = (NEG_INF_KEY >> (24 - 8 * PASS)) & 255
            hist += tl.where(bins == digit, _unread(lo, chunk, n, limit), 0)
    tl.store(hist_ptr + ((row * 4 + PASS) * parts + part) * 256 + bins, hist)


@triton.jit
def _count_pass(s_ptr, stride_s, hist_ptr, state_ptr, counts_ptr, limits_ptr, n, k, chunk, BLOCK: tl.constexpr,
                LIMITED: tl.constexpr):
    """The k-th key T from the four passes; each part counts its keys above T and equal to
    T (the write pass places each part's after the parts before it)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    offs = tl.arange(0, BLOCK)
    threshold, remaining = _state_after(hist_ptr, state_ptr, row, parts, k, 4)
    if part == 0:
        tl.store(state_ptr + (row * 5 + 4) * 2, threshold.to(tl.int32, bitcast=True))
        tl.store(state_ptr + (row * 5 + 4) * 2 + 1, remaining)
    s_row = s_ptr + row * stride_s
    lo = part * chunk
    above = 0
    ties = 0
    limit = _row_limit(limits_ptr, row, n, LIMITED)
    end = tl.minimum(lo + chunk, limit)
    for start in range(lo, end, BLOCK):
        inside = start + offs < end
        key = _keys(tl.load(s_row + start + offs, mask=inside, other=0.0))
        above += tl.sum((inside & (key > threshold)).to(tl.int32))
        ties += tl.sum((inside & (key == threshold)).to(tl.int32))
    if LIMITED:
        if threshold == NEG_INF_KEY:  # no key lies below -inf's: unread ones tie or fall short
            ties += _unread(lo, chunk, n, limit)
    tl.store(counts_ptr + (row * parts + part) * 2, above)
    tl.store(counts_ptr + (row * parts + part) * 2 + 1, ties)


@triton.jit
def _write_pass(s_ptr, stride_s, state_ptr, counts_ptr, values_ptr, indices_ptr, stride_o, locs_ptr, stride_l,
                limits_ptr, n, k, chunk, BLOCK: tl.constexpr, MAX_PARTS: tl.constexpr, LOCS: tl.constexpr,
                LIMITED: tl.constexpr):
    """Each part writes its keys above T at their rank among all keys above T (by index),
    then its keys equal to T at their rank among the ties, while the ties taken are fewer
    than `remaining` (the lowest-index ones complete the k). LOCS: instead of values and
    indices, indices_ptr gets int32 locs[row, index] where the score is above -inf, else -1.
    LIMITED: positions past the row's limit are -inf ties, after the part's read ones."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    offs = tl.arange(0, BLOCK)
    threshold = tl.load(state_ptr + (row * 5 + 4) * 2).to(tl.uint32, bitcast=True)
    remaining = tl.load(state_ptr + (row * 5 + 4) * 2 + 1)
    before = tl.arange(0, MAX_PARTS)
    earlier = before < part
    counts = counts_ptr + (row * parts + before) * 2
    above_seen = tl.sum(tl.load(counts, mask=earlier, other=0))
    ties_seen = tl.sum(tl.load(counts + 1, mask=earlier, other=0))
    above_count = k - remaining  # every key above T is taken
    s_row = s_ptr + row * stride_s
    lo = part * chunk
    limit = _row_limit(limits_ptr, row, n, LIMITED)
    end = tl.minimum(lo + chunk, limit)
    for start in range(lo, end, BLOCK):
        inside = start + offs < end
        x = tl.load(s_row + start + offs, mask=inside, other=0.0)
        key = _keys(x)
        above = (inside & (key > threshold)).to(tl.int32)
        tie = (inside & (key == threshold)).to(tl.int32)
        above_slot = above_seen + tl.cumsum(above, 0) - above
        tie_rank = ties_seen + tl.cumsum(tie, 0) - tie
        take = (above == 1) | ((tie == 1) & (tie_rank < remaining))
        slot = tl.where(above == 1, above_slot, above_count + tie_rank)
        out = row * stride_o + slot
        if LOCS:
            loc = tl.load(locs_ptr + row * stride_l + start + offs, mask=take, other=-1)
            tl.store(indices_ptr + out, tl.where(x > float("-inf"), loc, -1).to(tl.int32), mask=take)
        else:
            tl.store(values_ptr + out, x, mask=take)
            tl.store(indices_ptr + out, (start + offs).to(tl.int64), mask=take)
        above_seen += tl.sum(above)
        ties_seen += tl.sum(tie)
    if LIMITED:
        # The unread -inf positions, in index order after the read ones, are ties where T
        # is -inf's key: only the first `remaining - ties_seen` of them can be taken.
        first = tl.maximum(lo, limit)
        wanted = tl.where(threshold == NEG_INF_KEY, tl.maximum(remaining - ties_seen, 0), 0)
        last = tl.minimum(tl.minimum(lo + chunk, n), first + wanted)
        for start in range(first, last, BLOCK):
            tie = (start + offs < last).to(tl.int32)
            tie_rank = ties_seen + tl.cumsum(tie, 0) - tie
            take = (tie == 1) & (tie_rank < remaining)
            out = row * stride_o + above_count + tie_rank
            if LOCS:
                tl.store(indices_ptr + out, tl.full([BLOCK], -1, tl.int32), mask=take)
            else:
                tl.store(values_ptr + out, tl.full([BLOCK], float("-inf"), tl.float32), mask=take)
                tl.store(indices_ptr + out, (start + offs).to(tl.int64), mask=take)
            ties_seen += tl.sum(tie)


def plan_parts(rows: int, n: int) -> tuple[int, int, int]:
    """(parts per row, scores per part, scores per iteration): rows split so that the batch
    fills about TARGET_PROGRAMS programs, each part a whole number of iterations."""
    parts = max(1, min(MAX_PARTS, TARGET_PROGRAMS // max(rows, 1), triton.cdiv(n, 256)))
    per_part = triton.cdiv(n, parts)
    block = min(BLOCK, max(128, triton.next_power_of_2(per_part)))  # 128: a warp-wide tile at least
    chunk = triton.cdiv(per_part, block) * block
    return triton.cdiv(n, chunk), chunk, block


def _check(scores: torch.Tensor, k: int) -> None:
    if scores.dtype != torch.float32 or scores.ndim != 2:
        raise ValueError(f"top_k takes float32 scores [B, n], got {scores.dtype} {tuple(scores.shape)}")
    n = scores.shape[1]
    if not 0 <= k <= n:
        raise ValueError(f"k={k} is not allowed for rows of n={n}; allowed: 0..n")
    if not scores.is_cuda and not interpreted():
        raise ValueError(f"top_k runs on CUDA tensors or under Triton's interpreter (TRITON_INTERPRET=1), "
                         f"got device={scores.device}")


def _select(scores: torch.Tensor, k: int, values: torch.Tensor | None, out: torch.Tensor,
            locs: torch.Tensor | None, counts: torch.Tensor | None) -> None:
    """The six launches: indices into `out` with values into `values`, or (locs given)
    locations into `out`; with counts, each row read only below its count."""
    B, n = scores.shape
    if not (B and k):
        return
    scores = scores.contiguous()
    parts, chunk, block = plan_parts(B, n)
    dev = scores.device
    # Every element of these is written before it is read (no zeroing launch).
    hist = torch.empty(B, 4, parts, 256, dtype=torch.int32, device=dev)
    state = torch.empty(B, 5, 2, dtype=torch.int32, device=dev)
    part_counts = torch.empty(B, parts, 2, dtype=torch.int32, device=dev)
    limited = counts is not None
    # Unread when not limited: any int32 tensor fills the argument.
    limits = counts.to(torch.int32).contiguous() if limited else state
    grid = (B, parts)
    warps = 8 if block >= 1024 else 4
    for p in range(4):
        _radix_pass[grid](scores, scores.stride(0), hist, state, limits, n, k, chunk, PASS=p, BLOCK=block,
                          LIMITED=limited, num_warps=warps)
    _count_pass[grid](scores, scores.stride(0), hist, state, part_counts, limits, n, k, chunk, BLOCK=block,
                      LIMITED=limited, num_warps=warps)
    _write_pass[grid](scores, scores.stride(0), state, part_counts, out if values is None else values, out,
                      out.stride(0), out if locs is None else locs, 0 if locs is None else locs.stride(0), limits,
                      n, k, chunk, BLOCK=block, MAX_PARTS=MAX_PARTS, LOCS=locs is not None, LIMITED=limited,
                      num_warps=warps)


def _check_counts(counts: torch.Tensor | None, scores: torch.Tensor) -> None:
    if counts is not None and (counts.shape != scores.shape[:1] or counts.dtype not in (torch.int32, torch.int64)
                               or counts.device != scores.device):
        raise ValueError(f"counts must be int32 or int64 [{scores.shape[0]}] on {scores.device}, one per row, got "
                         f"{counts.dtype} {tuple(counts.shape)} on {counts.device}")


def top_k(scores: torch.Tensor, k: int, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of `scores` float32 [B, n] (ties to the lower index), in
    the module docstring's order: (values float32 [B, k], indices int64 [B, k]). counts
    (int [B], optional): every score of row b at j >= counts[b] is -inf, and is not read
    (the caller's promise; the choice is the whole row's). On CUDA tensors compiled, on
    CPU tensors under Triton's interpreter. Graph-safe (no sync)."""
    _check(scores, k)
    _check_counts(counts, scores)
    values = torch.empty(scores.shape[0], k, dtype=torch.float32, device=scores.device)
    indices = torch.empty(scores.shape[0], k, dtype=torch.int64, device=scores.device)
    _select(scores, k, values, indices, None, counts)
    return values, indices


def top_k_locations(scores: torch.Tensor, k: int, locs: torch.Tensor,
                    counts: torch.Tensor | None = None) -> torch.Tensor:
    """The locations of top_k's choice: int32 [B, k], locs [B, n] (int32 or int64) at the
    chosen indices, -1 where the chosen score is -inf (fewer than k visible), in top_k's
    order. What the decode step's indexer hands the attention, in the one write pass that
    would otherwise be followed by four launches (compare, gather, fill, where) and a cast
    (remnant.engine.ops.index_top_locations is the plain form). counts: as top_k's (the
    indexer's visible records per row: its scores are -inf past them). Graph-safe."""
    _check(scores, k)
    _check_counts(counts, scores)
    if locs.shape != scores.shape or locs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"locs must be int32 or int64 {tuple(scores.shape)} like the scores, got {locs.dtype} "
                         f"{tuple(locs.shape)}")
    out = torch.empty(scores.shape[0], k, dtype=torch.int32, device=scores.device)
    _select(scores, k, None, out, locs.contiguous(), counts)
    return out
