"""Random workload: random token-id prompts (docs/workloads.md).

C warm-up requests, then 3C measured requests (C = concurrency, which limits requests in
flight, not total work); the prefix cache is flushed before each phase. Lengths are drawn
uniformly from [len * range_ratio, len], as sglang.bench_serving's random dataset does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from remnant.config import ModelConfig
from remnant.config_errors import ConfigError, at_least
from remnant.workloads.base import WORKLOADS, Phase, PlannedRequest, WorkloadConfig, WorkloadPlan

#: The caveat of every workload whose prompts are drawn token ids.
SYNTHETIC_PROMPTS = "synthetic random-token prompts, not real text"


@WORKLOADS.register
@dataclass
class RandomWorkloadConfig(WorkloadConfig):
    """Random token ids: C warm-up requests, then 3C measured (counts overridable).

    Lengths are drawn uniformly from [len * range_ratio, len]; range_ratio=1 fixes them.
    """

    name: str = "random"
    kind: str = "random"
    input_len: int = 256
    output_len: int = 32
    range_ratio: float = 1.0
    warmup_requests: int | None = None
    measured_requests: int | None = None

    def counts(self) -> tuple[int, int]:
        warmup = self.concurrency if self.warmup_requests is None else self.warmup_requests
        measured = 3 * self.concurrency if self.measured_requests is None else self.measured_requests
        return warmup, measured

    def validate(self) -> None:
        super().validate()
        at_least(self, "workload.", ("output_len", "input_len"), 1)
        if not (math.isfinite(self.range_ratio) and 0 < self.range_ratio <= 1):
            raise ConfigError(f"workload.range_ratio={self.range_ratio} must be in (0, 1]")
        at_least(self, "workload.", ("warmup_requests", "measured_requests"), 0)

    def request_tokens(self) -> tuple[int, str] | None:
        return (self.input_len + self.output_len,
                f"workload.input_len={self.input_len} + workload.output_len={self.output_len}")

    def limits(self) -> list[str]:
        return [SYNTHETIC_PROMPTS]

    def plan(self, model: ModelConfig, server_info: dict | None = None) -> WorkloadPlan:
        return build_plan(self, model.prompt_vocab_size)


def _lengths(rng: np.random.Generator, n: int, full: int, ratio: float) -> np.ndarray:
    low = max(1, int(full * ratio))
    return rng.integers(low, full + 1, size=n)


def build_plan(cfg: RandomWorkloadConfig, prompt_vocab_size: int) -> WorkloadPlan:
    """Draw the whole request stream from `cfg.seed`: same config, same requests."""
    if cfg.concurrency < 1:
        raise ValueError(f"workload.concurrency={cfg.concurrency} must be >= 1")
    if not 0.0 < cfg.range_ratio <= 1.0:
        raise ValueError(f"workload.range_ratio={cfg.range_ratio} must be in (0, 1]")
    if cfg.input_len < 1 or cfg.output_len < 1:
        raise ValueError(
            f"workload.input_len={cfg.input_len} and workload.output_len={cfg.output_len} must be >= 1"
        )
    rng = np.random.default_rng(cfg.seed)
    phases = []
    for name, count in zip(("warmup", "measured"), cfg.counts()):
        ins = _lengths(rng, count, cfg.input_len, cfg.range_ratio)
        outs = _lengths(rng, count, cfg.output_len, cfg.range_ratio)
        requests = [
            PlannedRequest(
                id=f"{name}-{i:05d}",
                max_new_tokens=int(o),
                input_ids=rng.integers(0, prompt_vocab_size, size=int(n)).tolist(),
            )
            for i, (n, o) in enumerate(zip(ins, outs))
        ]
        phases.append(Phase(name, requests, cfg.concurrency))
    return WorkloadPlan(cfg.name, cfg.seed, phases, params=dataclasses.asdict(cfg))
