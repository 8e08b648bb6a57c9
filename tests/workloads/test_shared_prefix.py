"""Shared-prefix workload: groups share a prefix, suffixes are unique, measured on a warm cache."""

from __future__ import annotations

import pytest

from remnant.config import ModelConfig
from remnant.workloads import plan_workload
from remnant.workloads.shared_prefix import SharedPrefixWorkloadConfig


def test_groups_prefixes_and_phases():
    cfg = SharedPrefixWorkloadConfig(groups=5, prefix_len=40, suffix_len=7, output_len=3, requests_per_group=4, seed=2)
    plan = plan_workload(cfg, ModelConfig())
    warmup, measured = plan.phases
    assert (warmup.flush_before, measured.flush_before) == (True, False)
    assert len(warmup.requests) == 5 and len(measured.requests) == 20
    prefixes = {}
    suffixes = set()
    for r in warmup.requests + measured.requests:
        group = int(r.id.split("-g")[1])
        assert len(r.input_ids) == 47 and r.max_new_tokens == 3
        prefixes.setdefault(group, r.input_ids[:40])
        assert r.input_ids[:40] == prefixes[group]
        suffixes.add(tuple(r.input_ids[40:]))
    assert len(prefixes) == 5 and len({tuple(p) for p in prefixes.values()}) == 5
    assert len(suffixes) == 25  # every suffix unique
    groups_in_order = [int(r.id.split("-g")[1]) for r in measured.requests]
    assert sorted(groups_in_order) == sorted(list(range(5)) * 4) and groups_in_order != sorted(groups_in_order)
    assert plan.fingerprint() == plan_workload(cfg, ModelConfig()).fingerprint()


@pytest.mark.parametrize("field", ["groups", "prefix_len", "requests_per_group"])
def test_bad_sizes_name_the_field(field):
    from remnant.config_errors import ConfigError

    with pytest.raises(ConfigError, match=f"workload.{field}=0 must be >= 1"):
        SharedPrefixWorkloadConfig(**{field: 0}).validate()
