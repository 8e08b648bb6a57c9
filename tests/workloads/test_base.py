"""Open-loop arrival schedules: seeded, at the asked rate, and only in open loop."""

from __future__ import annotations

import numpy as np
import pytest

from remnant.config import ModelConfig
from remnant.workloads import plan_workload
from remnant.workloads.base import arrival_times
from remnant.workloads.longswe import LongSWEWorkloadConfig
from remnant.workloads.random import RandomWorkloadConfig


def test_a_seeded_poisson_schedule_is_reproducible_and_has_the_asked_mean():
    rate, n = 40.0, 20000
    times = arrival_times(n, rate, "poisson", seed=3, phase=1)
    assert times == arrival_times(n, rate, "poisson", seed=3, phase=1)
    assert times != arrival_times(n, rate, "poisson", seed=4, phase=1)
    assert times != arrival_times(n, rate, "poisson", seed=3, phase=0)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    # Exponential gaps: mean 1/rate (standard error 1/rate/sqrt(n): 0.7 % here), and a
    # standard deviation equal to the mean, which constant or uniform gaps would not have.
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() == pytest.approx(1 / rate, rel=0.05)


def test_a_constant_schedule_spaces_arrivals_evenly():
    assert arrival_times(4, 2.0, "constant", seed=0, phase=0) == [0.0, 0.5, 1.0, 1.5]
    assert arrival_times(0, 2.0, "constant", seed=0, phase=0) == []
    with pytest.raises(ValueError, match="workload.arrival=bursty is not allowed; allowed: poisson, constant"):
        arrival_times(3, 1.0, "bursty", seed=0, phase=0)


def test_closed_loop_plans_keep_their_fingerprint_and_open_loop_ones_differ():
    model = ModelConfig()
    closed = plan_workload(RandomWorkloadConfig(), model)
    assert all(p.arrivals_s is None for p in closed.phases)
    # The default random plan's fingerprint before request_rate existed: closed-loop request
    # streams (and resumed sweeps of them) are unchanged.
    assert closed.fingerprint() == "f3be346e93d79ac01fd29fd2a168a858018ad5cfe96890d5fd4a0f785b14dfc5"
    opened = plan_workload(RandomWorkloadConfig(request_rate=5.0), model)
    assert [len(p.arrivals_s) for p in opened.phases] == [len(p.requests) for p in opened.phases]
    assert opened.fingerprint() != closed.fingerprint()
    assert opened.fingerprint() == plan_workload(RandomWorkloadConfig(request_rate=5.0), model).fingerprint()
    assert opened.fingerprint() != plan_workload(RandomWorkloadConfig(request_rate=5.0, arrival="constant"),
                                                 model).fingerprint()


def test_session_workloads_get_one_arrival_per_session():
    cfg = LongSWEWorkloadConfig(num_sessions=5, warmup_sessions=2, concurrency=2, request_rate=1.0,
                                synthetic_initial_tokens=[64, 128], synthetic_turn_tokens=[16, 32],
                                synthetic_output_tokens=[4, 8])
    plan = plan_workload(cfg, ModelConfig())
    assert [len(p.arrivals_s) for p in plan.phases] == [len(p.sessions) for p in plan.phases] == [2, 5]
