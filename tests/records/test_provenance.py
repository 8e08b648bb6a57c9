"""Provenance helpers: digests, the code that ran, and the machine it ran on."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from importlib import resources
from pathlib import Path

import pytest

import remnant
from remnant.records import provenance
from remnant.records.provenance import artifact, environment, sha256_file, sources
from remnant.records.schema import load_schema, validate

EXAMPLE = Path(str(resources.files("remnant.schemas"))) / "run/examples/valid/completed-cpu-embedded.json"


def test_sha256_file_matches_hashlib(tmp_path):
    data = bytes(range(256)) * 9000  # over one read chunk, not a multiple of it
    f = tmp_path / "blob.bin"
    f.write_bytes(data)
    assert sha256_file(f, chunk_bytes=4096) == hashlib.sha256(data).hexdigest()


def test_artifact_is_relative_to_run_dir(tmp_path):
    f = tmp_path / "logs" / "server.log"
    f.parent.mkdir()
    f.write_text("ready\n")
    assert artifact(f, tmp_path) == {"path": "logs/server.log",
                                     "sha256": hashlib.sha256(b"ready\n").hexdigest(),
                                     "bytes": 6}


def test_artifact_outside_run_dir_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    f = tmp_path / "other.log"
    f.write_text("x")
    with pytest.raises(ValueError, match="not inside the run directory"):
        artifact(f, tmp_path / "run")


def test_sources_of_this_checkout():
    s = sources()
    assert set(s) == set(load_schema("remnant/run", 1)["$defs"]["sources"]["required"])
    assert s["remnant_version"] == remnant.__version__
    # The tests run from the repository, a git checkout with commits.
    assert re.fullmatch(r"[0-9a-f]{40}", s["git_sha"]), s
    assert isinstance(s["git_dirty"], bool)
    assert s["image_digest"] is None


@pytest.mark.parametrize(("named", "want"), [("0123456789abcdef0123456789abcdef01234567", True), ("HEAD", False),
                                            ("", False)])
def test_sources_outside_a_checkout_take_the_commit_it_is_given(monkeypatch, named, want):
    # A copy of the tree without its .git (a lent GPU machine's) names its commit in the
    # environment; anything but a full hex sha is not taken for one.
    monkeypatch.setattr(provenance, "_checkout_root", lambda: None)
    monkeypatch.setenv(provenance.GIT_COMMIT_ENV, named)
    s = sources()
    assert s["git_sha"] == (named if want else None) and s["git_dirty"] is None


def test_a_named_commit_wins_over_the_checkout(monkeypatch):
    # A lent GPU machine's copy may carry a stale .git (the session start's): the commit the
    # caller names is the one that ran, and whether the tree was dirty is unknown.
    named = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv(provenance.GIT_COMMIT_ENV, named)
    s = sources()
    assert s["git_sha"] == named and s["git_dirty"] is None
    monkeypatch.setenv(provenance.GIT_COMMIT_ENV, "HEAD")  # not a sha: the checkout's own
    assert re.fullmatch(r"[0-9a-f]{40}", sources()["git_sha"]) and sources()["git_sha"] != named


def test_environment_validates_as_the_run_environment():
    env = environment()
    required = load_schema("remnant/run", 1)["$defs"]["environment"]["required"]
    assert set(env) == set(required)
    assert env["collected_by"] == f"remnant {remnant.__version__}"
    doc = copy.deepcopy(json.loads(EXAMPLE.read_text()))
    doc["environment"] = env
    doc["sources"] = sources()
    validate(doc, source="environment()")
