"""Long-context workload: input_len random tokens in, output_len out (docs/workloads.md).

At a fixed concurrency C (matched across modes: C24 in the research runs), or at the
allocator ceiling: the most requests of input_len + output_len tokens that the server's
max_total_num_tokens holds at once (page-rounded), read from /server_info for each mode,
so packed modes run more requests side by side. C warm-up requests, then
C x requests_per_slot measured.
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
class LongContextWorkloadConfig(WorkloadConfig):
    """Long random prompts: input_len in, output_len out, at a fixed concurrency or at the
    allocator ceiling (the most requests the server's max_total_num_tokens holds at once,
    read from /server_info per mode and recorded)."""

    name: str = "long_context"
    kind: str = "long_context"
    concurrency: int = 24
    input_len: int = 131072
    output_len: int = 8192
    at_ceiling: bool = False
    requests_per_slot: int = 1

    def validate(self) -> None:
        super().validate()
        at_least(self, "workload.", ("output_len", "input_len", "requests_per_slot"), 1)

    def request_tokens(self) -> tuple[int, str] | None:
        return (self.input_len + self.output_len,
                f"workload.input_len={self.input_len} + workload.output_len={self.output_len}")

    def needs_server_info(self) -> bool:
        return self.at_ceiling

    def limits(self) -> list[str]:
        return [SYNTHETIC_PROMPTS]

    def plan(self, model: ModelConfig, server_info: dict | None = None) -> WorkloadPlan:
        return build_plan(self, model.prompt_vocab_size, server_info)


def ceiling(server_info: dict, request_tokens: int) -> int:
    """Requests of `request_tokens` that fit in the server's token pool at once."""
    cap = server_info.get("capacity") or {}
    total = cap.get("max_total_num_tokens", server_info.get("max_total_num_tokens"))
    page = cap.get("page_size", server_info.get("page_size", 1)) or 1
    if not total:
        raise ValueError("workload.at_ceiling=true needs max_total_num_tokens in the server's /server_info")
    per_request = -(-request_tokens // page) * page
    slots = cap.get("max_running_requests", server_info.get("max_running_requests"))
    fit = total // per_request
    return max(1, min(fit, slots) if slots else fit)


def build_plan(cfg: LongContextWorkloadConfig, prompt_vocab_size: int, server_info: dict | None) -> WorkloadPlan:
    concurrency = cfg.concurrency
    params = dataclasses.asdict(cfg)
    if cfg.at_ceiling:
        # Before the server answers, plan C requests to check the config; the run plans
        # again with the server's capacity.
        if server_info is not None:
            concurrency = ceiling(server_info, cfg.input_len + cfg.output_len)
        params["ceiling_concurrency"] = concurrency if server_info is not None else None
    rng = np.random.default_rng(cfg.seed)
    phases = []
    for name, count in (("warmup", concurrency), ("measured", concurrency * cfg.requests_per_slot)):
        requests = [PlannedRequest(f"{name}-{i:05d}", cfg.output_len,
                                   input_ids=rng.integers(0, prompt_vocab_size, cfg.input_len).tolist())
                    for i in range(count)]
        phases.append(Phase(name, requests, concurrency))
    return WorkloadPlan(cfg.name, cfg.seed, phases, params=params)
