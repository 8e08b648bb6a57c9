"""Dataset files as they come: gzip by its magic bytes, JSON or JSONL, and the tally of
skipped records (ShareGPT's and the session formats' own rules are in their tests)."""

from __future__ import annotations

import gzip
import hashlib
import json

import pytest

from remnant.workloads.dataset_file import (
    FIRST_SKIPPED,
    Record,
    Tally,
    read_file,
    read_records,
    skipped_line,
    skipped_records,
)


def test_gzip_is_found_by_its_magic_bytes_and_hashed_as_stored(tmp_path):
    text = '[{"id": "a"}]'
    for name in ("d.json.gz", "d.json", "d"):  # the name says nothing either way
        path = tmp_path / name
        path.write_bytes(gzip.compress(text.encode()))
        assert read_file(path, "workload.dataset_path") == (text, hashlib.sha256(path.read_bytes()).hexdigest())
    plain = tmp_path / "plain.json.gz"  # named gzip, but not: read as it is
    plain.write_text(text)
    assert read_file(plain, "workload.dataset_path")[0] == text


@pytest.mark.parametrize(("name", "text", "values", "lines"), [
    ("d.json", '[{"a": 1},\n {"a": 2}]', [{"a": 1}, {"a": 2}], [None, None]),
    ("d.jsonl", '{"a": 1}\n\n{"a": 2}\n', [{"a": 1}, {"a": 2}], [1, 3]),
    ("d.json", '{"a": 1}\n{"a": 2}\n', [{"a": 1}, {"a": 2}], [1, 2]),  # JSONL named .json
    ("d.jsonl.gz", '[1, 2]\n', [[1, 2]], [1]),                         # a list is one JSONL record
])
def test_json_or_jsonl(tmp_path, name, text, values, lines):
    records = read_records(tmp_path / name, text, "conversations")
    assert [r.value for r in records] == values and [r.line for r in records] == lines
    assert [r.index for r in records] == list(range(len(values)))


def test_what_is_neither_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "d.json"
    with pytest.raises(ValueError, match=r"d.json: expected a JSON list of conversations \(or JSONL, one per "
                                         r"line\), got dict$"):
        read_records(path, '{"id": "one record on one line"}', "conversations")
    with pytest.raises(ValueError, match=r"d.json: not valid JSON \(Expecting value at line 1 column 1\)$"):
        read_records(path, "nope", "conversations")
    path.write_bytes(b"\x1f\x8b\x08not really gzip")
    with pytest.raises(ValueError, match=r"d.json: a gzip file that cannot be decompressed"):
        read_file(path, "workload.dataset_path")
    with pytest.raises(ValueError, match=r"^workload.dataset_path=.*missing.json: no such file$"):
        read_file(tmp_path / "missing.json", "workload.dataset_path")


def test_the_tally_keeps_the_first_reasons_and_counts_the_rest(tmp_path):
    tally = Tally(tmp_path / "d.jsonl", "0" * 64, records=10)
    for i in range(7):
        tally.skip(Record(i, i + 1, {"id": f"r{i}"} if i % 2 else [i]), f"reason {i}")
    ds = tally.dataset()
    assert (ds["records"], ds["usable"], ds["skipped"], len(ds["first_skipped"])) == (10, 3, 7, FIRST_SKIPPED)
    assert ds["first_skipped"][:2] == [{"record": 0, "line": 1, "id": None, "reason": "reason 0"},
                                       {"record": 1, "line": 2, "id": "r1", "reason": "reason 1"}]
    line = skipped_line(ds)
    assert line == (f"{tmp_path / 'd.jsonl'}: skipped 7 of 10 records as unusable (3 usable): line 1: reason 0; "
                    "line 2 (id r1): reason 1; line 3: reason 2; line 4 (id r3): reason 3; line 5: reason 4 ...")
    (limit,) = skipped_records(ds)
    assert limit.startswith("7 of 10 records of the dataset were skipped as unusable")
    tally.refuse_if_unusable()  # three are usable
    json.dumps(ds)  # as run.json holds it


def test_no_usable_record_is_refused(tmp_path):
    empty = Tally(tmp_path / "d.json", "0" * 64, noun="session")
    with pytest.raises(ValueError, match=r"d.json: no session in the file$"):
        empty.refuse_if_unusable()
    tally = Tally(tmp_path / "d.json", "0" * 64, noun="session", records=1)
    tally.skip(Record(0, None, {"id": "s"}), "turns: [] should be non-empty")
    with pytest.raises(ValueError, match=r"d.json: no usable session \(1 skipped; record 0 \(id s\): turns: \[\] "
                                         r"should be non-empty\)$"):
        tally.refuse_if_unusable()
