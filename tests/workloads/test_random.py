"""Random workload: C warm-up then 3C measured, lengths in range, reproducible from seed."""

from __future__ import annotations

import pytest

from remnant.config import ModelConfig
from remnant.workloads.random import RandomWorkloadConfig
from remnant.workloads import plan_workload


def test_counts_and_lengths():
    cfg = RandomWorkloadConfig(concurrency=5, input_len=100, output_len=20, range_ratio=0.5, seed=3)
    plan = plan_workload(cfg, ModelConfig())
    warmup, measured = plan.phases
    assert (warmup.name, len(warmup.requests), measured.name, len(measured.requests)) == ("warmup", 5, "measured", 15)
    assert plan.counts() == {"warmup": 5, "measured": 15}
    for r in warmup.requests + measured.requests:
        assert 50 <= len(r.input_ids) <= 100 and 10 <= r.max_new_tokens <= 20
        assert all(0 <= t < 256 for t in r.input_ids)
    assert len({len(r.input_ids) for r in measured.requests}) > 1
    assert all(p.concurrency == 5 and p.flush_before for p in plan.phases)


def test_fixed_lengths_and_overrides():
    cfg = RandomWorkloadConfig(concurrency=2, input_len=7, output_len=3, warmup_requests=0, measured_requests=4)
    plan = plan_workload(cfg, ModelConfig())
    assert plan.counts() == {"warmup": 0, "measured": 4}
    assert {len(r.input_ids) for r in plan.phases[1].requests} == {7}


def test_reproducible_and_fingerprinted():
    a = plan_workload(RandomWorkloadConfig(seed=1), ModelConfig())
    b = plan_workload(RandomWorkloadConfig(seed=1), ModelConfig())
    c = plan_workload(RandomWorkloadConfig(seed=2), ModelConfig())
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    assert len(a.fingerprint()) == 64


@pytest.mark.parametrize(("field", "value", "message"), [
    ("concurrency", 0, "workload.concurrency=0 must be >= 1"),
    ("range_ratio", 0.0, r"workload.range_ratio=0.0 must be in \(0, 1\]"),
    ("input_len", 0, "workload.input_len=0"),
])
def test_bad_values_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        plan_workload(RandomWorkloadConfig(**{field: value}), ModelConfig())
