"""The decode step's heaviest Triton kernels under Nsight Compute: what bounds them at a
batch's size. Arguments name a part and a batch:

    ncu --clock-control none -k regex:'_gate_up|_down|_row_scores' [sections] \
        python3 runners/device/step_ncu.py moe:32 moe:128 indexer:32 indexer:128

- moe:T: V4-Flash's expert shape (moe_topk_timings.v4_experts: 32 FP8 experts of hidden
  4096, moe_intermediate_size 2048, top-6), T tokens routed uniformly at random as a
  step's different requests are, remnant.kernels.moe.routed_experts_triton at
  default_config;
- indexer:B: remnant.kernels.indexer.index_scores of B rows over 8,192 FP8 index keys each
  (64 heads of 128, a CSA layer's decode at 32k context) at ScoresConfig's defaults, the
  keys spread over 256 MB of pages as a step's layers find them.

Each part runs one warm-up call (its Triton compile) and one more call, and prints what it
runs before its calls, so that ncu's report (printed at exit, in launch order) can be read
back to it: two launches of each kernel per part. engine_h200.sh's `ncu` stage runs it."""

from __future__ import annotations

import sys

import torch

from remnant.kernels.moe import default_config, routed_experts_triton

from moe_topk_timings import E, HIDDEN, INTER, K, routed_tokens, v4_experts  # beside this file: sys.path[0]

PARTS = ("moe", "indexer")


def moe(T: int, gen: torch.Generator) -> None:
    experts = v4_experts(gen)
    x, ids, weights, distinct = routed_tokens(T, gen)
    cfg = default_config(T * K, E, True, HIDDEN, INTER)
    print(f"moe:{T}: {distinct} distinct experts, {distinct * 3 * HIDDEN * INTER / 1e6:.0f} MB of FP8 weights, "
          f"{cfg}", flush=True)
    for _ in range(2):
        routed_experts_triton(x, ids, weights, *experts, config=cfg)
    torch.cuda.synchronize()


def indexer(B: int, gen: torch.Generator, n: int = 8192) -> None:
    from remnant.engine.pools import SplitPages
    from remnant.kernels.indexer import ScoresConfig, index_scores
    from remnant.kv.index_keys import quantize_index_keys

    per_page, key_bytes = 64, 132
    pages = (256 << 20) // (per_page * key_bytes) + 1
    pool = SplitPages(pages, per_page, key_bytes, 4, device="cuda")
    keys = quantize_index_keys(torch.randn(pages * per_page, 128, device="cuda", generator=gen))
    pool.layout.write(pool.buf, torch.arange(pages * per_page, device="cuda"), keys)
    q = torch.randn(B, 64, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(B, 64, device="cuda", generator=gen)
    counts = torch.full((B,), n, device="cuda", dtype=torch.int32)
    # Each row's keys anywhere in the pool (rows may share some, as no two sequences do).
    locs = torch.randint(0, pages * per_page, (B, n), device="cuda", generator=gen, dtype=torch.int32)
    print(f"indexer:{B}: {B} rows x {n} keys, {B * n * key_bytes / 1e6:.0f} MB of keys, {ScoresConfig()}", flush=True)
    for _ in range(2):
        index_scores(q, w, pool.buf, pool.layout, locs, counts)
    torch.cuda.synchronize()


def main(argv: list[str]) -> int:
    runs = []
    for arg in argv or ["moe:32", "moe:128"]:
        part, _, size = arg.partition(":")
        if part not in PARTS or not size.isdigit():
            print(f"{arg!r} is not allowed; allowed: PART:SIZE with PART one of {', '.join(PARTS)}", file=sys.stderr)
            return 2
        runs.append((part, int(size)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for part, size in runs:
        {"moe": moe, "indexer": indexer}[part](size, gen)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
