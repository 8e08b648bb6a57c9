"""The remnant-check console script, run as a user runs it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

EXAMPLES = Path(str(resources.files("remnant.schemas"))) / "run/examples"
VALID = EXAMPLES / "valid"
SCRIPT = Path(sys.executable).with_name("remnant-check")


def check(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=60)


def test_valid_examples_pass():
    r = check(VALID)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ok   ") == len(list(VALID.glob("*.json")))
    assert "(remnant/run v1)" in r.stdout


def test_corrupted_record_fails_naming_file_and_field(tmp_path):
    doc = json.loads((VALID / "completed-cpu-embedded.json").read_text())
    doc["metrics"]["ttft_ms"]["p50"] = "fast"
    bad = tmp_path / "run.json"
    bad.write_text(json.dumps(doc))
    r = check(VALID / "completed-cpu-embedded.json", bad)
    assert r.returncode == 1
    line = next(x for x in r.stdout.splitlines() if x.startswith("FAIL"))
    assert str(bad) in line and "metrics.ttft_ms.p50" in line


def test_quiet_prints_only_failures(tmp_path):
    bad = tmp_path / "run.json"
    bad.write_text(json.dumps({"schema": "remnant/run", "schema_version": 1}))
    r = check("--quiet", VALID, bad)
    assert r.returncode == 1
    assert r.stdout.splitlines() == [x for x in r.stdout.splitlines() if x.startswith("FAIL")]
    assert r.stdout.count("FAIL") == 1


def test_malformed_json_fails_without_traceback(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text('{"schema": "remnant/run",\n  "status": }\n')
    r = check(bad)
    assert r.returncode == 1
    assert f"FAIL {bad}" in r.stdout and "line 2" in r.stdout
    assert "Traceback" not in r.stdout + r.stderr


def test_missing_path_exits_2(tmp_path):
    r = check(VALID, tmp_path / "nope.json")
    assert r.returncode == 2
    assert "nope.json" in r.stderr


def test_explicit_file_without_schema_fails(tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    r = check(f)
    assert r.returncode == 1
    assert f"FAIL {f}: schema:" in r.stdout


def test_directory_walk_checks_records_and_skips_other_json(tmp_path):
    (tmp_path / "a" / ".hydra").mkdir(parents=True)
    shutil.copy(VALID / "completed-cpu-embedded.json", tmp_path / "a" / "run.json")
    (tmp_path / "a" / ".hydra" / "hidden.json").write_text("not json")  # hidden: not searched
    (tmp_path / "a" / "overrides.json").write_text('["mode=kernel"]')
    (tmp_path / "b.json").write_text('{"schema": "other/thing"}')
    r = check(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ok   ") == 1
    assert "skipped 2 JSON file(s)" in r.stdout


def test_directory_without_records_exits_2(tmp_path):
    (tmp_path / "x.json").write_text("{}")
    r = check(tmp_path)
    assert r.returncode == 2
    assert str(tmp_path) in r.stderr


def test_a_run_directory_without_run_json_fails(tmp_path):
    """A run killed outright leaves its requests.jsonl, server.log (and a stale server.port)
    but no run.json: the check fails and names the directory."""
    done = tmp_path / "sweep" / "0-native-smoke-s0"
    done.mkdir(parents=True)
    shutil.copy(VALID / "completed-cpu-embedded.json", done / "run.json")
    (done / "requests.jsonl").write_text("{}\n")
    killed = tmp_path / "sweep" / "1-kernel-r256-smoke-s0"
    (killed / ".hydra").mkdir(parents=True)
    (killed / "requests.jsonl").write_text("{}\n")
    (killed / "server.port").write_text("40000")
    r = check(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    fail = [x for x in r.stdout.splitlines() if x.startswith("FAIL")]
    assert len(fail) == 1 and str(killed) in fail[0] and "without run.json" in fail[0]
    assert "1 run directory without run.json" in r.stdout
    # A directory holding only killed runs is still checked (not "no records found").
    assert check(killed).returncode == 1
