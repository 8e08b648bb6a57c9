"""remnant.run_dir: what becomes of an earlier attempt's files, with no server."""

from __future__ import annotations

import json

import pytest

from remnant.cli.check import RUN_MARKERS
from remnant.config import ModelConfig, RunConfig, recorded_config
from remnant.hosts.embedded import EmbeddedHostConfig
from remnant.run_dir import (ATTEMPT_FILES, KILLED, RESERVE, RESERVE_BYTES, SERVER_PORT, Earlier, claim, leftovers,
                             make_way, set_aside)
from remnant.workloads import plan_workload
from remnant.workloads.random import RandomWorkloadConfig


def _cfg(**workload) -> RunConfig:
    cfg = RunConfig(workload=RandomWorkloadConfig(input_len=16, **workload), host=EmbeddedHostConfig(),
                    model=ModelConfig())
    cfg.workload.validate()
    return cfg


def _recorded(run_dir, cfg: RunConfig, status: str = "completed") -> None:
    """The run.json fields resume_check reads, as a run of `cfg` writes them."""
    fingerprint = plan_workload(cfg.workload, cfg.model).fingerprint()
    doc = {"status": status, "config": recorded_config(cfg), "workload": {"fingerprint": fingerprint}}
    (run_dir / "run.json").write_text(json.dumps(doc, default=str))
    (run_dir / "requests.jsonl").write_text("{}\n")


def test_set_aside_never_overwrites_an_earlier_attempt(tmp_path):
    for attempt in ("first", "second"):
        (tmp_path / "requests.jsonl").write_text(attempt)
        (tmp_path / ".hydra").mkdir()
        (tmp_path / "server.port").write_text("1")
        assert sorted(leftovers(tmp_path)) == [".hydra", "requests.jsonl", "server.port"]
        moved = set_aside(tmp_path, "killed")
        assert {p.name.split(".killed-")[0] for p in moved} == {"requests", ".hydra"}
        assert leftovers(tmp_path) == []
    kept = sorted(p.read_text() for p in tmp_path.glob("requests.killed-*.jsonl"))
    assert kept == ["first", "second"]


def test_an_empty_directory_makes_way_at_once(tmp_path):
    assert make_way(tmp_path, _cfg()) == Earlier()
    assert make_way(tmp_path / "absent", None) == Earlier()


def test_a_completed_run_of_this_very_cell_is_kept(tmp_path):
    cfg = _cfg()
    _recorded(tmp_path, cfg)
    earlier = make_way(tmp_path, cfg)
    assert (earlier.outcome, earlier.reuse, earlier.moved) == ("completed", True, [])
    assert sorted(leftovers(tmp_path)) == ["requests.jsonl", "run.json"]


@pytest.mark.parametrize("status, change, why", [
    ("completed", {"output_len": 7}, "its config differs (workload.output_len: "),
    ("failed", {}, "its run.json says failed"),
])
def test_any_other_run_is_set_aside_under_its_outcome(tmp_path, status, change, why):
    _recorded(tmp_path, _cfg(), status)
    earlier = make_way(tmp_path, _cfg(**change))
    assert (earlier.outcome, earlier.reuse) == (status, False) and earlier.why.startswith(why)
    assert {p.name.split(f".{status}-")[0] for p in earlier.moved} == {"run", "requests"}
    assert leftovers(tmp_path) == []


def test_force_runs_a_completed_cell_again(tmp_path):
    _recorded(tmp_path, _cfg())
    cfg = _cfg()
    cfg.force = True
    assert make_way(tmp_path, cfg).why == "force=true"


def test_files_without_a_run_json_are_a_killed_attempt(tmp_path):
    (tmp_path / "server.log").write_text("log")
    (tmp_path / SERVER_PORT).write_text("1")
    earlier = make_way(tmp_path, _cfg())
    assert (earlier.outcome, earlier.why, earlier.reuse) == (KILLED, None, False)
    assert [p.name.split(f".{KILLED}-")[0] for p in earlier.moved] == ["server"]
    assert leftovers(tmp_path) == []


def test_with_no_config_to_compare_every_earlier_run_is_set_aside(tmp_path):
    """A cell whose config broke a rule keeps nothing of an earlier attempt."""
    _recorded(tmp_path, _cfg())
    earlier = make_way(tmp_path, None)
    assert (earlier.outcome, earlier.reuse, earlier.why) == ("completed", False, None)
    assert leftovers(tmp_path) == []


def test_claim_refuses_a_recorded_run_and_holds_room_for_run_json(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".hydra").mkdir()  # the CLI writes it for this attempt
    (run_dir / "requests.jsonl").write_text("a killed attempt's\n")
    reserve = claim(run_dir)
    assert reserve == run_dir / RESERVE and reserve.stat().st_size == RESERVE_BYTES
    assert leftovers(run_dir) == [".hydra"]
    (run_dir / "run.json").write_text("{}")
    with pytest.raises(FileExistsError, match="a run directory holds one run"):
        claim(run_dir)


def test_remnant_check_knows_what_a_run_leaves():
    """remnant-check finds a killed run by the files a run leaves before its run.json."""
    assert set(RUN_MARKERS) <= {*ATTEMPT_FILES, SERVER_PORT}
