"""Workloads: each kind's module (remnant/workloads/<kind>.py) holds its config class,
registered in remnant.workloads.base.WORKLOADS, whose plan() turns it into a WorkloadPlan
(phases of planned requests)."""

from __future__ import annotations

from remnant.config import ModelConfig
from remnant.workloads.base import WORKLOADS, Phase, PlannedRequest, WorkloadConfig, WorkloadPlan, arrival_times


def plan_workload(cfg: WorkloadConfig, model: ModelConfig, server_info: dict | None = None) -> WorkloadPlan:
    """Plan the request stream of `cfg` for `model`; raises ValueError naming a bad field,
    or the first request that is longer than the model's context.

    server_info: the server's /server_info, for workloads sized by the server (long_context
    at the allocator ceiling); None plans without it (the ceiling is then unknown).
    """
    WORKLOADS.get(cfg.kind)
    plan = cfg.plan(model, server_info)
    check_context(plan, model)
    if cfg.request_rate is not None:  # open loop, whatever the kind: every phase at that rate
        for i, phase in enumerate(plan.phases):
            n = len(phase.sessions) if phase.sessions is not None else len(phase.requests)
            phase.arrivals_s = arrival_times(n, cfg.request_rate, cfg.arrival, cfg.seed, i)
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


__all__ = ["Phase", "PlannedRequest", "WorkloadPlan", "check_context", "plan_workload"]
