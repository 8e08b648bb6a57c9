"""ShareGPT workload: the real public sample in ../shared/data; files as they come (JSON,
JSONL, gzip) with unusable records skipped and counted; malformed files refused."""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from remnant.config import ModelConfig
from remnant.engine.model_dir import build_tokenizer
from remnant.records.schema import validate
from remnant.workloads import plan_workload
from remnant.workloads.dataset_file import skipped_line, skipped_records
from remnant.workloads.sharegpt import ShareGPTWorkloadConfig

SAMPLE = Path(__file__).resolve().parents[3] / "shared" / "data" / "sharegpt" / "sharegpt_test.json"
SAMPLE_SHA256 = "d9191ab6d5a6f062c7707b9ba0f4b7f4fcbb3089bebbb5b486399e847b70c3d3"  # its SOURCE.md
BIN = Path(sys.executable).parent


@pytest.fixture
def sample() -> Path:
    if not SAMPLE.is_file():
        pytest.skip(f"the shared ShareGPT sample is not at {SAMPLE}")
    return SAMPLE


def test_plan_from_the_sample(sample):
    cfg = ShareGPTWorkloadConfig(dataset_path=str(sample), concurrency=2, num_prompts=6, max_input_len=300)
    plan = plan_workload(cfg, ModelConfig())
    assert plan.dataset == {"path": str(sample), "sha256": SAMPLE_SHA256, "records": 8, "usable": 8, "skipped": 0,
                            "first_skipped": []}
    assert skipped_line(plan.dataset) is None and skipped_records(plan.dataset) == []
    assert plan.counts() == {"warmup": 2, "measured": 6}
    tok = build_tokenizer()
    records = {r["id"]: r for r in json.loads(sample.read_text())}
    for phase in plan.phases:
        for req in phase.requests:
            cid = req.id.split("-", 2)[2]
            turns = records[cid]["conversations"]
            assert req.input_ids == tok.encode(turns[0]["value"]).ids[:300]
            answer = len(tok.encode(turns[1]["value"], add_special_tokens=False).ids)
            assert req.max_new_tokens == min(answer, 128)
    assert plan.params["usable_conversations"] == 8
    again = plan_workload(cfg, ModelConfig())
    assert again.fingerprint() == plan.fingerprint()
    other = plan_workload(ShareGPTWorkloadConfig(dataset_path=str(sample), seed=1, concurrency=2, num_prompts=6,
                                                 max_input_len=300), ModelConfig())
    assert other.fingerprint() != plan.fingerprint()


def _conversation(cid: str, prompt: str, answer: str) -> dict:
    return {"id": cid, "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer},
                                         {"from": "human", "value": "and then?"}]}


GOOD = [_conversation(f"good{i}", f"question {i}: " + "why " * (3 + i), "because " * (4 + i)) for i in range(4)]


def _write(path: Path, records: list, jsonl: bool, gz: bool) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in records) if jsonl else json.dumps(records, indent=1)
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return path


def _plan(path: Path, **kw):
    return plan_workload(ShareGPTWorkloadConfig(dataset_path=str(path), concurrency=2, num_prompts=6, **kw),
                         ModelConfig())


@pytest.mark.parametrize(("name", "jsonl", "gz"), [
    ("d.jsonl", True, False), ("d.json.gz", False, True), ("d.jsonl.gz", True, True),
    ("gzip-named-plain.json", False, True),     # gzip is found by its magic bytes, not the name
    ("gzip-jsonl-named-plain.json", True, True),
    ("jsonl-named.json", True, False),          # one record per line, named .json
])
def test_json_jsonl_and_gzip_give_the_same_requests(tmp_path, name, jsonl, gz):
    plain = _plan(_write(tmp_path / "d.json", GOOD, jsonl=False, gz=False))
    path = _write(tmp_path / name, GOOD, jsonl, gz)
    plan = _plan(path)
    assert plan.fingerprint() == plain.fingerprint()
    # The file's own bytes, as stored (compressed where it is), are what run.json hashes.
    assert plan.dataset["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() != plain.dataset["sha256"]
    assert (plan.dataset["records"], plan.dataset["usable"], plan.dataset["skipped"]) == (4, 4, 0)


BAD = [
    {"id": "no-turns-field", "text": "hello"},                                                   # missing conversations
    {"id": "gpt-first", "conversations": [{"from": "gpt", "value": "hello there"},
                                          {"from": "human", "value": "hi hi"}]},                 # wrong roles
    {"id": "number", "conversations": [{"from": "human", "value": "hello there"},
                                       {"from": "gpt", "value": 42}]},                           # not a string
    {"id": "empty", "conversations": []},                                                        # empty turns
    {"id": "one-turn", "conversations": [{"from": "human", "value": "hello there"}]},
    "not an object",
    {"id": "empty-prompt", "conversations": [{"from": "human", "value": ""},
                                             {"from": "gpt", "value": "an answer of words"}]},
    {"id": "empty-answer", "conversations": [{"from": "human", "value": "a question"},
                                             {"from": "gpt", "value": ""}]},
    {"id": "user-assistant", "conversations": [{"from": "user", "value": "another question"},
                                               {"from": "assistant", "value": "another answer"}]},  # usable
]
BAD_REASONS = [
    (0, "no-turns-field", "no field 'conversations'"),
    (2, "gpt-first", "turn 0 is from 'gpt'; expected human or user"),
    (3, "number", "turn 1: field 'value' is not a string"),
    (5, "empty", "0 turns; a prompt and an answer need two"),
    (6, "one-turn", "1 turn; a prompt and an answer need two"),
]


def test_unusable_records_are_skipped_counted_and_named(tmp_path):
    records = [BAD[0], GOOD[0], *BAD[1:3], GOOD[1], *BAD[3:], GOOD[2]]
    path = _write(tmp_path / "mixed.json", records, jsonl=False, gz=False)
    plan = _plan(path)
    ds = plan.dataset
    # Nine odd records, one of them usable after all (user/assistant): 8 skipped, of 12.
    assert (ds["records"], ds["usable"], ds["skipped"]) == (12, 4, 8)
    assert [(s["record"], s["id"], s["reason"]) for s in ds["first_skipped"]] == BAD_REASONS
    assert all(s["line"] is None for s in ds["first_skipped"])
    sent = {r.id.split("-", 2)[2] for phase in plan.phases for r in phase.requests}
    assert sent == {"good0", "good1", "good2", "user-assistant"}
    assert plan.params["usable_conversations"] == 4
    line = skipped_line(ds)
    assert line.startswith(f"{path}: skipped 8 of 12 records as unusable (4 usable): record 0 (id no-turns-field): "
                           "no field 'conversations'; record 2 (id gpt-first): turn 0 is from 'gpt'")
    assert line.endswith("record 6 (id one-turn): 1 turn; a prompt and an answer need two ...")
    assert "\n" not in line


def test_the_tokenizer_drops_are_counted_too(tmp_path):
    """Records whose prompt or answer is under 2 tokens (here: empty turns) are dropped as
    sglang.bench_serving drops them, but counted and named, not dropped without a word."""
    path = _write(tmp_path / "short.json", [GOOD[0], BAD[6], BAD[7], GOOD[1]], jsonl=False, gz=False)
    ds = _plan(path).dataset
    assert (ds["records"], ds["usable"], ds["skipped"]) == (4, 2, 2)
    assert [(s["record"], s["id"], s["reason"]) for s in ds["first_skipped"]] == [
        (1, "empty-prompt", "a prompt of 1 token; at least 2 are needed"),  # BOS alone
        (2, "empty-answer", "an answer of 0 tokens; at least 2 are needed")]
    # With a fixed output length the answer's own length does not matter.
    assert _plan(path, output_len=4).dataset["skipped"] == 1


def test_a_jsonl_line_that_is_not_json_is_one_skipped_record(tmp_path):
    path = tmp_path / "d.jsonl.gz"
    text = json.dumps(GOOD[0]) + "\n\n{not json\n" + json.dumps(BAD[3]) + "\n" + json.dumps(GOOD[1]) + "\n"
    path.write_bytes(gzip.compress(text.encode()))
    ds = _plan(path).dataset
    assert (ds["records"], ds["usable"], ds["skipped"]) == (4, 2, 2)
    assert [(s["record"], s["line"], s["id"]) for s in ds["first_skipped"]] == [(1, 3, None), (2, 4, "empty")]
    assert ds["first_skipped"][0]["reason"] == ("not valid JSON (Expecting property name enclosed in double quotes "
                                                "at line 1 column 2)")
    assert skipped_line(ds).split(": ", 1)[1].startswith("skipped 2 of 4 records as unusable (2 usable): line 3: not")


def test_the_dataset_record_is_valid_in_a_run_document(tmp_path):
    """workload.dataset as run.json v5 holds it: the example run with this plan's dataset."""
    from importlib import resources

    path = _write(tmp_path / "mixed.json", [*BAD, *GOOD], jsonl=False, gz=False)
    example = Path(str(resources.files("remnant.schemas"))) / "run/examples/valid/v5-completed-sharegpt-skipped.json"
    doc = json.loads(example.read_text())
    doc["workload"]["dataset"] = _plan(path).dataset
    validate(doc)


@pytest.mark.parametrize(("records", "reasons"), [
    (BAD[:6], "6 skipped; record 0 (id no-turns-field): no field 'conversations'; record 1 (id gpt-first): turn 0 "
              "is from 'gpt'; expected human or user; record 2 (id number): turn 1: field 'value' is not a string; "
              "record 3 (id empty): 0 turns; a prompt and an answer need two; record 4 (id one-turn): 1 turn; a "
              "prompt and an answer need two"),
    ([BAD[6], BAD[7]], "2 skipped; record 0 (id empty-prompt): a prompt of 1 token; at least 2 are needed; "
                       "record 1 (id empty-answer): an answer of 0 tokens; at least 2 are needed"),
])
def test_a_file_with_no_usable_record_is_refused_naming_it_and_the_first_reasons(tmp_path, records, reasons):
    path = _write(tmp_path / "bad.jsonl", records, jsonl=True, gz=False)
    with pytest.raises(ValueError) as err:
        _plan(_write(tmp_path / "bad.json", records, jsonl=False, gz=False))
    assert str(err.value) == f"{tmp_path / 'bad.json'}: no usable conversation ({reasons})"
    with pytest.raises(ValueError) as err:
        _plan(path)  # JSONL: records by line
    assert str(err.value).startswith(f"{path}: no usable conversation ({len(records)} skipped; line 1 (id ")


@pytest.mark.parametrize(("content", "message"), [
    (None, "workload.dataset_path=.*: no such file"),
    (b"{not json", r"not valid JSON \(.* at line 1 column 2\)"),
    # json's "Unterminated string starting at" takes the location once ("at at line" before)
    (b'[{"id": "a1", "conversations": [{"from": "hu', r"not valid JSON \(Unterminated string starting at line 1 "
                                                     r"column 42\)$"),
    (b'{"id": "x"}', r"expected a JSON list of conversations \(or JSONL, one per line\), got dict"),
    (b"[]", r"bad.json: no conversation in the file$"),
    (gzip.compress(b"[]", mtime=0)[:12], r"bad.json: a gzip file that cannot be decompressed"),
    (b'["\xff"]', r"bad.json: not UTF-8 text \(byte 2\)"),
])
def test_malformed_files_are_refused_naming_the_file(tmp_path, content, message):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        plan_workload(ShareGPTWorkloadConfig(dataset_path=str(path)), ModelConfig())


@pytest.mark.slow
def test_a_run_says_once_how_many_records_it_skipped(tmp_path):
    """remnant-run on a gzip JSONL file with unusable records: one warning line on stderr,
    and run.json's workload.dataset and limits say the same."""
    path = _write(tmp_path / "mixed.jsonl.gz", [*BAD, *GOOD], jsonl=True, gz=True)
    run_dir = tmp_path / "run"
    p = subprocess.run([str(BIN / "remnant-run"), "workload=sharegpt", f"workload.dataset_path={path}",
                        "workload.num_prompts=2", "workload.concurrency=1", "workload.max_output_len=4",
                        f"hydra.run.dir={run_dir}"], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    warned = [line for line in p.stderr.splitlines() if "as unusable" in line]
    assert warned == [f"WARNING remnant.workloads.dataset_file: {path}: skipped 8 of 13 records as unusable "
                      "(5 usable): line 1 (id no-turns-field): no field 'conversations'; line 2 (id gpt-first): "
                      "turn 0 is from 'gpt'; expected human or user; line 3 (id number): turn 1: field 'value' is "
                      "not a string; line 4 (id empty): 0 turns; a prompt and an answer need two; line 5 "
                      "(id one-turn): 1 turn; a prompt and an answer need two ..."]
    doc = json.loads((run_dir / "run.json").read_text())
    assert doc["schema_version"] == 5 and doc["status"] == "completed"
    ds = doc["workload"]["dataset"]
    assert (ds["records"], ds["usable"], ds["skipped"], len(ds["first_skipped"])) == (13, 5, 8, 5)
    assert ("8 of 13 records of the dataset were skipped as unusable (workload.dataset.first_skipped says why); "
            "the requests were drawn from the others") in doc["limits"]
