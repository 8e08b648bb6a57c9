"""Workloads: each turns its config into a WorkloadPlan (phases of planned requests)."""

from __future__ import annotations

from remnant.config import ModelConfig, WorkloadConfig
from remnant.workloads.base import Phase, PlannedRequest, WorkloadPlan


def needs_server_info(cfg: WorkloadConfig) -> bool:
    """Whether the plan depends on the server (planned again once it answers)."""
    return cfg.kind == "long_context" and bool(getattr(cfg, "at_ceiling", False))

KINDS = ("random", "shared_prefix", "sharegpt", "long_context", "longswe")


def plan_workload(cfg: WorkloadConfig, model: ModelConfig, server_info: dict | None = None) -> WorkloadPlan:
    """Plan the request stream of `cfg` for `model`; raises ValueError naming a bad field,
    or the first request that is longer than the model's context.

    server_info: the server's /server_info, for workloads sized by the server (long_context
    at the allocator ceiling); None plans without it (the ceiling is then unknown).
    """
    plan = _plan(cfg, model, server_info)
    check_context(plan, model)
    return plan


def check_context(plan: WorkloadPlan, model: ModelConfig) -> None:
    """Every request's prompt plus output within model.max_position_embeddings: a longer one
    would be refused by the server (data-driven workloads: sharegpt, longswe)."""
    limit = model.max_position_embeddings
    for phase in plan.phases:
        for r in phase.requests:
            if r.input_ids is None:
                continue
            need = len(r.input_ids) + r.max_new_tokens
            if need > limit:
                raise ValueError(
                    f"request {r.id} of workload={plan.name} needs {len(r.input_ids)} prompt + {r.max_new_tokens} "
                    f"output tokens, more than model={model.name}'s context length "
                    f"(model.max_position_embeddings={limit}); lower workload.max_input_len "
                    f"(or workload.token_scale) or choose a model with a longer context")


def _plan(cfg: WorkloadConfig, model: ModelConfig, server_info: dict | None) -> WorkloadPlan:
    if cfg.kind == "random":
        from remnant.workloads import random

        return random.plan(cfg, model.prompt_vocab_size)
    if cfg.kind == "shared_prefix":
        from remnant.workloads import shared_prefix

        return shared_prefix.plan(cfg, model.prompt_vocab_size)
    if cfg.kind == "sharegpt":
        from remnant.workloads import sharegpt

        return sharegpt.plan(cfg, model)
    if cfg.kind == "longswe":
        from remnant.workloads import longswe

        return longswe.plan(cfg, model.prompt_vocab_size)
    if cfg.kind == "long_context":
        from remnant.workloads import long_context

        return long_context.plan(cfg, model.prompt_vocab_size, server_info)
    raise ValueError(f"workload.kind={cfg.kind} is not a workload; allowed: {', '.join(KINDS)}")


__all__ = ["Phase", "PlannedRequest", "WorkloadPlan", "needs_server_info", "plan_workload"]
