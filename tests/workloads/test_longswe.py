"""LongSWE: the session format, Mooncake import (the real public trace), the generator, and
the plan: every turn's prompt extends the previous one, reproducibly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remnant.config import LongSWEWorkloadConfig, ModelConfig
from remnant.records.schema import RecordError, validate
from remnant.workloads import plan_workload
from remnant.workloads.sessions import import_mooncake, load_sessions, synthetic_sessions, to_document

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake" / "synthetic_trace.jsonl"


@pytest.fixture
def trace() -> Path:
    if not TRACE.is_file():
        pytest.skip(f"the shared Mooncake trace is not at {TRACE}")
    return TRACE


def test_synthetic_sessions_plan_extending_prompts():
    cfg = LongSWEWorkloadConfig(concurrency=3, num_sessions=4, warmup_sessions=1, synthetic_turns=[3, 4],
                                synthetic_initial_tokens=[100, 200], synthetic_turn_tokens=[10, 20],
                                synthetic_output_tokens=[5, 9])
    plan = plan_workload(cfg, ModelConfig())
    warmup, measured = plan.phases
    assert len(warmup.sessions) == 1 and len(measured.sessions) == 4
    for session in measured.sessions:
        assert [r.turn for r in session] == list(range(len(session)))
        for prev, cur in zip(session, session[1:]):
            assert cur.input_ids[: len(prev.input_ids)] == prev.input_ids  # the prefix cache matters
            # It grows by the previous answer plus the new turn's 10..20 tokens.
            assert len(prev.input_ids) + prev.max_new_tokens + 10 <= len(cur.input_ids)
            assert len(cur.input_ids) <= len(prev.input_ids) + prev.max_new_tokens + 20
    assert plan.fingerprint() == plan_workload(cfg, ModelConfig()).fingerprint()
    assert plan.fingerprint() != plan_workload(LongSWEWorkloadConfig(**{**cfg.__dict__, "seed": 1}), ModelConfig()).fingerprint()


def test_session_file_round_trip_and_schema(tmp_path):
    doc = to_document(synthetic_sessions(3, seed=2), source="test")
    validate(doc)
    path = tmp_path / "sessions.json"
    path.write_text(json.dumps(doc))
    sessions, _ = load_sessions(path)
    assert [len(s.turns) for s in sessions] == [len(s["turns"]) for s in doc["sessions"]]
    bad = json.loads(json.dumps(doc))
    bad["sessions"][1]["turns"][0]["output_tokens"] = 0
    path.write_text(json.dumps(bad))
    with pytest.raises(RecordError, match=r"sessions\[1\].turns\[0\].output_tokens"):
        load_sessions(path)


def test_mooncake_import_of_the_real_trace(trace):
    sessions = import_mooncake(trace)
    assert sum(len(s.turns) for s in sessions) == 3993  # every request of the trace (SOURCE.md)
    multi = [s for s in sessions if len(s.turns) > 1]
    assert multi
    for s in multi:
        for prev, cur in zip(s.turns, s.turns[1:]):
            full = prev.input_tokens // 512
            assert full >= 1 and cur.hash_ids[:full] == prev.hash_ids[:full]
            assert cur.input_tokens > prev.input_tokens and cur.timestamp_s >= prev.timestamp_s
    assert sessions[0].turns[0].timestamp_s == 0.0


def test_mooncake_blocks_give_shared_tokens(trace):
    cfg = LongSWEWorkloadConfig(trace_path=str(trace), num_sessions=30, warmup_sessions=0, token_scale=0.02)
    plan = plan_workload(cfg, ModelConfig())
    assert plan.dataset["sha256"] == "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"
    first = {}
    for session in plan.phases[1].sessions:
        for r in session:
            first.setdefault(tuple(r.input_ids[:10]), []).append(r.id)
    assert any(len(ids) > 1 for ids in first.values())  # requests sharing hash_ids share tokens


def test_mooncake_linking_rules(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 10, "input_length": 1500, "output_length": 5, "hash_ids": [0, 2, 3]},  # extends the first
        {"timestamp": 20, "input_length": 1100, "output_length": 5, "hash_ids": [9, 8, 7]},  # a new session
        {"timestamp": 30, "input_length": 1200, "output_length": 5, "hash_ids": [9, 8, 6]},  # extends the third
        {"timestamp": 40, "input_length": 1200, "output_length": 5, "hash_ids": [9, 8, 5]},  # a sibling: new
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    sessions = import_mooncake(path)
    assert [[t.input_tokens for t in s.turns] for s in sessions] == [[700, 1500], [1100, 1200], [1200]]
    assert [t.timestamp_s for t in sessions[0].turns] == [0.0, 0.01]


def test_replayed_times_start_at_each_phase(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 1000 * i, "input_length": 600 + 600 * (i % 2), "output_length": 4,
             "hash_ids": [i // 2, 100 + i]} for i in range(6)]
    path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    cfg = LongSWEWorkloadConfig(trace_path=str(path), num_sessions=2, warmup_sessions=1, replay_timestamps=True,
                                token_scale=0.1)
    plan = plan_workload(cfg, ModelConfig())
    for phase in plan.phases:
        times = [r.not_before_s for s in phase.sessions for r in s]
        assert min(times) == 0.0
    assert [r.not_before_s for r in plan.phases[1].sessions[0]] == [0.0, 1.0]


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", r"bad.jsonl:2: not valid JSON"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 2}', r"bad.jsonl:2: field 'hash_ids' missing"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 2, "hash_ids": [-1]}',
     r"bad.jsonl:2: field 'hash_ids' must be a list of non-negative integers"),
    ('{"timestamp": "soon", "input_length": 10, "output_length": 2, "hash_ids": [1]}',
     r"bad.jsonl:2: field 'timestamp' must be a number"),
    ('{"timestamp": 1, "input_length": 0, "output_length": 2, "hash_ids": [1]}',
     r"bad.jsonl:2: field 'input_length' must be a positive integer"),
])
def test_malformed_trace_lines(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        import_mooncake(path)


def test_not_enough_sessions_and_two_sources(tmp_path, trace):
    with pytest.raises(ValueError, match="both set; give one"):
        plan_workload(LongSWEWorkloadConfig(trace_path=str(trace), sessions_path=str(trace)), ModelConfig())
    doc = to_document(synthetic_sessions(2), source="test")
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"needs 52 sessions \(warmup_sessions \+ num_sessions\); the source has 2 with >= 1 turns"):
        plan_workload(LongSWEWorkloadConfig(sessions_path=str(path)), ModelConfig())
