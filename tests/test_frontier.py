"""The frontier search's logic, without a server: doubling then bisection against synthetic
pass/fail functions, judging a step against an SLO, and the config rules."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from remnant.cli.frontier import register_frontier_configs, to_frontier_config
from remnant.cli.run import register_configs
from remnant.config_errors import ConfigError
from remnant.frontier import (
    FrontierConfig,
    SearchConfig,
    SloConfig,
    bounded_search,
    goodput,
    judge,
    step_dir,
    with_load,
)


def threshold(frontier: float):
    """A load that passes up to `frontier`, and a log of the loads it was asked about."""
    asked: list[float] = []

    def probe(level: float) -> bool:
        asked.append(level)
        return level <= frontier

    return probe, asked


@pytest.mark.parametrize("true_frontier", range(1, 65))
def test_finds_every_frontier_within_the_bound(true_frontier):
    search = SearchConfig(start=1, max=64, resolution=1, max_steps=20)
    probe, asked = threshold(true_frontier)
    result = bounded_search(search, probe)
    assert result.frontier == true_frontier
    assert result.probed == asked and len(set(asked)) == len(asked)  # no level twice
    # Doubling takes at most log2(64) + 1 steps, bisection at most log2 of the bracket.
    assert len(asked) <= 7 + 5
    assert all(isinstance(x, int) for x in asked)
    if true_frontier == 64:
        assert result.stopped == "max_passed" and result.bracket == (64, None)
    else:
        assert result.stopped == "resolved"
        assert result.bracket == (true_frontier, true_frontier + 1)


def test_doubling_then_bisection_order():
    probe, asked = threshold(11)
    result = bounded_search(SearchConfig(start=1, max=64), probe)
    # 1 2 4 8 pass, 16 misses; then bisect [8, 16]: 12 misses, 10 passes, 11 passes.
    assert asked == [1, 2, 4, 8, 16, 12, 10, 11]
    assert (result.frontier, result.bracket, result.stopped) == (11, (11, 12), "resolved")


def test_max_caps_doubling_and_is_probed_itself():
    probe, asked = threshold(100)
    result = bounded_search(SearchConfig(start=3, max=20), probe)
    assert asked == [3, 6, 12, 20]
    assert (result.frontier, result.stopped) == (20, "max_passed")


def test_start_that_misses_stops_at_once():
    probe, asked = threshold(0)
    result = bounded_search(SearchConfig(start=4, max=64), probe)
    assert asked == [4]
    assert (result.frontier, result.bracket, result.stopped) == (None, (None, 4), "start_missed")


def test_resolution_stops_bisection_early():
    probe, asked = threshold(37)
    result = bounded_search(SearchConfig(start=1, max=128, resolution=8), probe)
    # 1..32 pass, 64 misses; [32, 64] -> 48 misses; [32, 48] -> 40 misses; [32, 40] is 8 wide.
    assert asked == [1, 2, 4, 8, 16, 32, 64, 48, 40]
    assert (result.frontier, result.bracket) == (32, (32, 40))


def test_max_steps_bounds_the_search():
    probe, asked = threshold(1000)
    result = bounded_search(SearchConfig(start=1, max=1024, max_steps=3), probe)
    assert asked == [1, 2, 4]
    assert (result.frontier, result.stopped) == (4, "max_steps")
    probe, asked = threshold(5)
    result = bounded_search(SearchConfig(start=1, max=64, max_steps=5), probe)
    assert asked == [1, 2, 4, 8, 6] and (result.frontier, result.bracket, result.stopped) == (4, (4, 6), "max_steps")


def test_a_step_without_verdict_stops_the_search():
    asked = []

    def probe(level):
        asked.append(level)
        return None if level == 4 else True

    result = bounded_search(SearchConfig(start=1, max=64), probe)
    assert asked == [1, 2, 4]
    assert (result.frontier, result.bracket, result.stopped) == (2, (2, None), "step_failed")


def test_non_monotone_pass_fail_still_ends_in_a_bracket():
    """Latency noise can make a higher load pass after a lower one missed: the search
    still ends, with a bracket whose ends it probed."""
    verdicts = {1: True, 2: True, 4: True, 8: False, 6: True, 7: False}
    result = bounded_search(SearchConfig(start=1, max=64), lambda c: verdicts[c])
    assert result.probed == [1, 2, 4, 8, 6, 7]
    assert (result.frontier, result.bracket) == (6, (6, 7))


def test_slo_judges_each_bound_and_says_why():
    slo = SloConfig(ttft_p99_ms=500, tpot_p99_ms=50)
    metrics = {"ttft_ms": {"p99": 400.0}, "tpot_ms": {"p99": 60.0}}
    assert judge(metrics, "completed", slo) == (False, "TTFT p99 400.0 ms <= 500, TPOT p99 60.0 ms > 50")
    assert judge(metrics, "completed", SloConfig(ttft_p99_ms=500))[0] is True
    assert judge(metrics, "completed", SloConfig(ttft_p99_ms=399))[0] is False
    # A bound with no sample (one-token answers have no TPOT) is not met.
    assert judge({"ttft_ms": {"p99": 1.0}, "tpot_ms": {"p99": None}}, "completed", slo) == (
        False, "TTFT p99 1.0 ms <= 500, TPOT p99 has no sample")
    assert judge(None, "degraded", slo)[0] is False
    assert judge(None, "failed", slo) == (None, "the run failed")
    # Stopped as over-saturated: a miss (the load is past what the server sustains), where a
    # stall or deadline stop gives no verdict.
    assert judge(None, "failed", slo, {"reason": "oversaturated"})[0] is False
    assert judge(None, "failed", slo, {"reason": "stall"}) == (None, "the run failed")


def test_goodput_counts_requests_that_meet_every_bound(tmp_path):
    def line(i, phase, ttft, e2e, n, success=True):
        return json.dumps({"id": str(i), "phase": phase, "success": success, "intended_start_s": 0.0,
                           "start_s": 0.0, "end_s": e2e, "ttft_s": ttft, "prompt_tokens": 4,
                           "completion_tokens": n, "cached_tokens": 0, "chunk_times_s": [], "chunk_tokens": []})

    (tmp_path / "requests.jsonl").write_text("\n".join([
        line(0, "warmup", 0.1, 0.2, 5),           # warm-up: never counted
        line(1, "measured", 0.1, 0.5, 5),         # TTFT 100 ms, TPOT 100 ms: good
        line(2, "measured", 0.3, 0.4, 5),         # TTFT 300 ms: misses
        line(3, "measured", 0.1, 1.1, 5),         # TPOT 250 ms: misses
        line(4, "measured", 0.1, 0.1, 1),         # one token: no TPOT to miss
        line(5, "measured", None, None, 0, success=False),
    ]) + "\n")
    slo = SloConfig(ttft_p99_ms=200, tpot_p99_ms=150)
    assert goodput(tmp_path, slo, duration_s=2.0) == pytest.approx(2 / 2.0)
    assert goodput(tmp_path, SloConfig(ttft_p99_ms=200), duration_s=2.0) == pytest.approx(3 / 2.0)
    assert goodput(tmp_path, slo, duration_s=None) is None


@pytest.fixture(autouse=True)
def _run_config_restored():
    """register_frontier_configs makes `run_config` FrontierConfig in this process: give
    remnant-run's schema back, for the tests that compose after these in the same worker."""
    yield
    GlobalHydra.instance().clear()
    register_configs()


def _compose(overrides: list[str]) -> FrontierConfig:
    GlobalHydra.instance().clear()
    register_frontier_configs()
    with initialize_config_module(config_module="remnant.conf", version_base=None):
        return to_frontier_config(compose(config_name="frontier_config", overrides=overrides))


@pytest.mark.parametrize("option", ["cpu_smoke", "interactive"])
def test_every_slo_file_composes(option):
    cfg = _compose([f"slo={option}", "workload=smoke"])
    assert cfg.slo.bounds()


@pytest.mark.slow
def test_preset_composes_each_of_its_cells():
    GlobalHydra.instance().clear()
    register_frontier_configs()
    with initialize_config_module(config_module="remnant.conf", version_base=None):
        raw = compose(config_name="frontier_config", overrides=["frontier=modes_smoke"], return_hydra_config=True)
    params = raw.hydra.sweeper.params
    assert params.mode == "native,triton,kernel"
    for experiment in params.experiment.split(","):
        for mode in params.mode.split(","):
            cfg = _compose(["frontier=modes_smoke", f"experiment={experiment}", f"mode={mode}"])
            assert cfg.workload.kind in ("long_context", "longswe") and cfg.model.name == "tiny"
            assert cfg.search.max <= 4 and cfg.slo.bounds()


@pytest.mark.parametrize(("overrides", "message"), [
    (["workload=smoke"], "slo.ttft_p99_ms and slo.tpot_p99_ms are both null; set at least one"),
    (["workload=smoke", "slo.ttft_p99_ms=-1"], "slo.ttft_p99_ms=-1.0 is not allowed; it must be a number of "
                                               "milliseconds > 0, or null"),
    (["workload=smoke", "slo=interactive", "search.load=tokens"],
     "search.load=tokens is not a load axis; allowed: concurrency, request_rate"),
    (["workload=smoke", "slo=interactive", "search.start=1.5"],
     "search.start=1.5 is not allowed; with search.load=concurrency it must be a whole number"),
    (["workload=smoke", "slo=interactive", "search.start=8", "search.max=4"],
     "search.max=4 is less than search.start=8; it must be >= start"),
    (["workload=smoke", "slo=interactive", "search.start=0"], "search.start=0 is not allowed; workload.concurrency "
                                                              "must be >= 1"),
    (["workload=smoke", "slo=interactive", "search.load=request_rate", "search.start=0"],
     "search.start=0 is not allowed; workload.request_rate must be > 0"),
    (["workload=smoke", "slo=interactive", "search.load=request_rate", "search.start=-2"],
     "search.start=-2 is not allowed; workload.request_rate must be > 0"),
    (["experiment=longswe_c24_smoke", "slo=interactive", "search.max=8"],
     "search.max=8 is more than workload.num_sessions=6"),
    (["experiment=ctx128k_out8k_ceiling_smoke", "slo=interactive"], "workload.at_ceiling=true sets the concurrency"),
    (["workload=smoke", "slo=interactive", "workload.request_rate=2"],
     "workload.request_rate=2 sends open loop, where concurrency only caps the requests in flight"),
])
def test_config_mistakes_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(".", r"\.").replace("+", r"\+")):
        _compose(overrides)


def test_rate_axis_bisects_real_numbers_to_the_resolution():
    """Open loop: levels are requests/s, midpoints are not floored, and bisection stops
    when the bracket is no wider than search.resolution."""
    probe, asked = threshold(3.3)
    result = bounded_search(SearchConfig(load="request_rate", start=0.5, max=16, resolution=0.25), probe)
    # 0.5 1 2 pass, 4 misses; bisect [2, 4]: 3 passes, 3.5 misses, 3.25 passes -> [3.25, 3.5].
    assert asked == [0.5, 1.0, 2.0, 4.0, 3.0, 3.5, 3.25]
    assert (result.frontier, result.bracket, result.stopped) == (3.25, (3.25, 3.5), "resolved")
    assert all(isinstance(x, float) for x in asked)


def test_rate_search_composes_with_a_closed_loop_workload_and_sets_only_the_rate():
    cfg = _compose(["workload=smoke", "slo=interactive", "search.load=request_rate", "search.start=0.5"])
    base = cfg.run_config()
    assert base.workload.request_rate is None  # each step sets it
    step = with_load(base, cfg.search.axis(), 1.5)
    assert step.workload.request_rate == 1.5 and step.workload.concurrency == base.workload.concurrency
    assert dataclasses.replace(step.workload, request_rate=None) == base.workload
    assert step_dir(Path("s"), cfg.search.axis(), 1.5) == Path("s/r1.5")
    assert step_dir(Path("s"), cfg.search.axis(), 2.0) == Path("s/r2")


def test_steps_vary_only_the_load(tmp_path):
    cfg = _compose(["workload=smoke", "slo=interactive"])
    base = cfg.run_config()
    assert type(base).__name__ == "RunConfig" and not hasattr(base, "slo")
    axis = cfg.search.axis()
    step = with_load(base, axis, 8)
    assert step.workload.concurrency == 8 and base.workload.concurrency == 2
    assert dataclasses.replace(step.workload, concurrency=2) == base.workload
    assert step_dir(tmp_path, axis, 8) == tmp_path / "c0008"
