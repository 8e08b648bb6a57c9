"""ShareGPT workload on the real public sample in ../shared/data, and malformed variants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remnant.config import ModelConfig
from remnant.workloads.sharegpt import ShareGPTWorkloadConfig
from remnant.engine.model_dir import build_tokenizer
from remnant.workloads import plan_workload

SAMPLE = Path(__file__).resolve().parents[3] / "shared" / "data" / "sharegpt" / "sharegpt_test.json"
SAMPLE_SHA256 = "d9191ab6d5a6f062c7707b9ba0f4b7f4fcbb3089bebbb5b486399e847b70c3d3"  # its SOURCE.md


@pytest.fixture
def sample() -> Path:
    if not SAMPLE.is_file():
        pytest.skip(f"the shared ShareGPT sample is not at {SAMPLE}")
    return SAMPLE


def test_plan_from_the_sample(sample):
    cfg = ShareGPTWorkloadConfig(dataset_path=str(sample), concurrency=2, num_prompts=6, max_input_len=300)
    plan = plan_workload(cfg, ModelConfig())
    assert plan.dataset == {"path": str(sample), "sha256": SAMPLE_SHA256}
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


@pytest.mark.parametrize(("content", "message"), [
    (None, "workload.dataset_path=.*: no such file"),
    ("{not json", r"not valid JSON \(.* at line 1 column 2\)"),
    # json's "Unterminated string starting at" takes the location once ("at at line" before)
    ('[{"id": "a1", "conversations": [{"from": "hu', r"not valid JSON \(Unterminated string starting at line 1 "
                                                    r"column 42\)$"),
    ('{"id": "x"}', "expected a JSON list of conversations, got dict"),
    ('[{"id": "a1", "conversation_s": []}]', r"record 0 \(id a1\): field 'conversations' missing or not a list"),
    ('[{"id": "a1", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": 3}]}]',
     r"record 0 \(id a1\) turn 1: field 'value' missing or not a string"),
    ('[{"conversations": [{"from": "human", "value": "hi"}]}]', "no conversation has two turns"),
])
def test_malformed_files_name_file_record_and_field(tmp_path, content, message):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        plan_workload(ShareGPTWorkloadConfig(dataset_path=str(path)), ModelConfig())
