"""Shared-prefix workload: G prefix groups with unique suffixes (docs/workloads.md).

Warm-up: the cache is flushed, then one request per group fills it. Measured: every group
sends `requests_per_group` requests in a seeded shuffle, with no flush, so each request
hits its group's cached prefix if the working set (G x prefix_len tokens) still fits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from remnant.config import ModelConfig
from remnant.config_errors import at_least
from remnant.workloads.base import WORKLOADS, Phase, PlannedRequest, WorkloadConfig, WorkloadPlan
from remnant.workloads.random import SYNTHETIC_PROMPTS


@WORKLOADS.register
@dataclass
class SharedPrefixWorkloadConfig(WorkloadConfig):
    """G prefix groups: each request is its group's prefix plus a unique suffix.

    Warm-up sends one request per group after a cache flush; the measured requests
    (requests_per_group per group, shuffled) then run on the warm cache, so the cache-hit
    rate shows whether the groups' working set fits in the KV pool.
    """

    name: str = "shared_prefix"
    kind: str = "shared_prefix"
    concurrency: int = 16
    groups: int = 16
    prefix_len: int = 1024
    suffix_len: int = 64
    output_len: int = 16
    requests_per_group: int = 4

    def validate(self) -> None:
        super().validate()
        at_least(self, "workload.", ("groups", "prefix_len", "suffix_len", "output_len", "requests_per_group"), 1)

    def request_tokens(self) -> tuple[int, str] | None:
        return (self.prefix_len + self.suffix_len + self.output_len,
                f"workload.prefix_len={self.prefix_len} + workload.suffix_len={self.suffix_len} + "
                f"workload.output_len={self.output_len}")

    def limits(self) -> list[str]:
        return [SYNTHETIC_PROMPTS]

    def plan(self, model: ModelConfig, server_info: dict | None = None) -> WorkloadPlan:
        return build_plan(self, model.prompt_vocab_size)


def build_plan(cfg: SharedPrefixWorkloadConfig, prompt_vocab_size: int) -> WorkloadPlan:
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
