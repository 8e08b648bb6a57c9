"""Workloads: each turns its config into a WorkloadPlan (phases of planned requests)."""

from __future__ import annotations

from remnant.config import ModelConfig, WorkloadConfig
from remnant.workloads.base import Phase, PlannedRequest, WorkloadPlan

KINDS = ("random", "shared_prefix")


def plan_workload(cfg: WorkloadConfig, model: ModelConfig) -> WorkloadPlan:
    """Plan the request stream of `cfg` for `model`; raises ValueError naming a bad field."""
    if cfg.kind == "random":
        from remnant.workloads import random

        return random.plan(cfg, model.prompt_vocab_size)
    if cfg.kind == "shared_prefix":
        from remnant.workloads import shared_prefix

        return shared_prefix.plan(cfg, model.prompt_vocab_size)
    raise ValueError(f"workload.kind={cfg.kind} is not a workload; allowed: {', '.join(KINDS)}")


__all__ = ["Phase", "PlannedRequest", "WorkloadPlan", "plan_workload"]
