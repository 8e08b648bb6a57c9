"""write_validated writes only valid records, atomically."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from remnant.records.schema import RecordError, write_validated

EXAMPLE = Path(str(resources.files("remnant.schemas"))) / "run/examples/valid/completed-cpu-embedded.json"


def test_writes_valid_doc_in_key_order(tmp_path):
    doc = json.loads(EXAMPLE.read_text())
    out = write_validated(tmp_path / "run" / "run.json", doc)
    text = out.read_text()
    assert text.endswith("}\n")
    assert json.loads(text) == doc
    assert list(json.loads(text)) == list(doc)  # insertion order kept, not sorted
    assert [p.name for p in out.parent.iterdir()] == ["run.json"]  # no temp file left


def test_refuses_invalid_doc_and_leaves_no_file(tmp_path):
    doc = json.loads(EXAMPLE.read_text())
    doc["metrics"]["ttft_ms"]["p50"] = "fast"
    target = tmp_path / "run.json"
    with pytest.raises(RecordError) as info:
        write_validated(target, doc)
    assert info.value.field == "metrics.ttft_ms.p50"
    assert str(target) in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_invalid_doc_does_not_clobber_existing_record(tmp_path):
    doc = json.loads(EXAMPLE.read_text())
    target = write_validated(tmp_path / "run.json", doc)
    before = target.read_bytes()
    doc["limits"] = []
    with pytest.raises(RecordError):
        write_validated(target, doc)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_a_line_is_appended_whole_or_not_at_all_on_a_full_disk(tmp_path):
    """A real 64 KB tmpfs filled to its last page: a line longer than what is left is cut
    back, never left half-written, and the error names the file."""
    from remnant.records.files import append_line
    from tests.tmpfs import fill, tmpfs

    with tmpfs(tmp_path / "disk", "64k") as disk:
        path = disk / "requests.jsonl"
        append_line(path, json.dumps({"id": "first"}))
        fill(disk)
        before = path.read_bytes()
        with pytest.raises(OSError) as err:
            append_line(path, json.dumps({"id": "second", "pad": "x" * 8192}))
        assert err.value.errno == 28 and str(path) in str(err.value)
        assert path.read_bytes() == before
        assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["first"]
