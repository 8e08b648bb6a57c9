"""The routed-expert kernels under Nsight Compute: what bounds them at a batch's tokens.

    ncu --clock-control none -k regex:'_gate_up|_down' [sections] \
        python3 runners/device/moe_ncu.py 32 128

For each token count: V4-Flash's expert shape (moe_topk_timings.v4_experts: 32 FP8 experts
of hidden 4096, moe_intermediate_size 2048, top-6), tokens routed uniformly at random as a
step's different requests are, and one call of remnant.kernels.moe.routed_experts_triton
at default_config after one warm-up call (its Triton compile). Prints each count's config
and grid before its calls, so that ncu's report (printed at exit, in launch order) can be
read back to its count: two launches of each kernel per count. engine_h200.sh's `ncu` stage
runs it."""

from __future__ import annotations

import sys

import torch

from remnant.kernels.moe import default_config, routed_experts_triton

from moe_topk_timings import E, HIDDEN, INTER, K, routed_tokens, v4_experts  # beside this file: sys.path[0]


def main(argv: list[str]) -> int:
    counts = [int(a) for a in argv] or [32, 128]
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts = v4_experts(gen)
    for T in counts:
        x, ids, weights, distinct = routed_tokens(T, gen)
        cfg = default_config(T * K, E, True, HIDDEN, INTER)
        print(f"tokens {T}: {distinct} distinct experts, {distinct * 3 * HIDDEN * INTER / 1e6:.0f} MB of FP8 "
              f"weights, {cfg}", flush=True)
        for _ in range(2):
            routed_experts_triton(x, ids, weights, *experts, config=cfg)
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
