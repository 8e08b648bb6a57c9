"""Shared-prefix workload: G prefix groups with unique suffixes (DESIGN section 7).

Warm-up: the cache is flushed, then one request per group fills it. Measured: every group
sends `requests_per_group` requests in a seeded shuffle, with no flush, so each request
hits its group's cached prefix if the working set (G x prefix_len tokens) still fits.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from remnant.config import SharedPrefixWorkloadConfig
from remnant.workloads.base import Phase, PlannedRequest, WorkloadPlan


def plan(cfg: SharedPrefixWorkloadConfig, prompt_vocab_size: int) -> WorkloadPlan:
    rng = np.random.default_rng(cfg.seed)
    prefixes = [rng.integers(0, prompt_vocab_size, cfg.prefix_len).tolist() for _ in range(cfg.groups)]

    def request(name: str, i: int, group: int) -> PlannedRequest:
        suffix = rng.integers(0, prompt_vocab_size, cfg.suffix_len).tolist()
        return PlannedRequest(f"{name}-{i:05d}-g{group:03d}", cfg.output_len, input_ids=prefixes[group] + suffix)

    warmup = [request("warmup", g, g) for g in range(cfg.groups)]
    order = rng.permutation(np.repeat(np.arange(cfg.groups), cfg.requests_per_group))
    measured = [request("measured", i, int(g)) for i, g in enumerate(order)]
    phases = [
        Phase("warmup", warmup, cfg.concurrency, flush_before=True),
        Phase("measured", measured, cfg.concurrency, flush_before=False),
    ]
    return WorkloadPlan(cfg.name, cfg.seed, phases, params=dataclasses.asdict(cfg))
