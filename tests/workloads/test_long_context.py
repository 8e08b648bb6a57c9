"""Long-context workload: fixed concurrency, or the allocator ceiling from /server_info."""

from __future__ import annotations

import pytest

from remnant.config import ModelConfig
from remnant.workloads import plan_workload
from remnant.workloads.long_context import LongContextWorkloadConfig, ceiling


def test_matched_concurrency():
    plan = plan_workload(LongContextWorkloadConfig(input_len=50, output_len=5, concurrency=3), ModelConfig())
    assert plan.counts() == {"warmup": 3, "measured": 3}
    assert all(len(r.input_ids) == 50 and r.max_new_tokens == 5 for p in plan.phases for r in p.requests)
    assert not LongContextWorkloadConfig().needs_server_info()


def test_ceiling_from_server_info():
    cfg = LongContextWorkloadConfig(input_len=600, output_len=8, at_ceiling=True, concurrency=24)
    assert cfg.needs_server_info()
    info = {"capacity": {"max_total_num_tokens": 15104, "page_size": 256, "max_running_requests": 32}}
    assert ceiling(info, 608) == 15104 // 768 == 19
    plan = plan_workload(cfg, ModelConfig(), info)
    assert plan.counts() == {"warmup": 19, "measured": 19} and plan.params["ceiling_concurrency"] == 19
    assert ceiling({"capacity": {"max_total_num_tokens": 15104, "page_size": 256, "max_running_requests": 4}}, 608) == 4
    with pytest.raises(ValueError, match="needs max_total_num_tokens"):
        ceiling({}, 608)
