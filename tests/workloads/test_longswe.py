"""LongSWE: the session format, Mooncake import (the real public trace), the generator, and
the plan: every turn's prompt extends the previous one, reproducibly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remnant.config import ModelConfig
from remnant.workloads.longswe import LongSWEWorkloadConfig
from remnant.records.schema import RecordError, validate
from remnant.workloads import plan_workload
from remnant.workloads.sessions import (
    import_mooncake,
    load_sessions,
    read_trace,
    synthetic_sessions,
    to_document,
)

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
    sessions, _, tally = load_sessions(path)
    assert [len(s.turns) for s in sessions] == [len(s["turns"]) for s in doc["sessions"]]
    assert (tally.records, tally.usable, tally.skipped) == (3, 3, 0)
    # A header that breaks the schema refuses the file; a session that does is skipped.
    bad = json.loads(json.dumps(doc))
    bad["schema_version"] = 7
    path.write_text(json.dumps(bad))
    with pytest.raises(RecordError, match=r"schema_version: 7 is not a supported version"):
        load_sessions(path)


def test_unusable_sessions_are_skipped_counted_and_named(tmp_path):
    """A gzip session file (named .json) with a session that breaks the schema, one with no
    turns, one with a NaN think time (not JSON) and one whose id is taken: each skipped
    with the reason, the others replayed."""
    import gzip

    doc = to_document(synthetic_sessions(6, seed=2), source="test")
    ids = [s["id"] for s in doc["sessions"]]
    doc["sessions"][1]["turns"][0]["output_tokens"] = 0
    doc["sessions"][2]["turns"] = []
    doc["sessions"][3]["turns"][0]["think_time_s"] = float("nan")
    doc["sessions"][5]["id"] = ids[0]
    path = tmp_path / "sessions.json"
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    sessions, _, tally = load_sessions(path)
    assert [s.id for s in sessions] == [ids[0], ids[4]]
    assert [(s.record, s.id, s.reason) for s in tally.first] == [
        (1, ids[1], "turns[0].output_tokens: 0 is less than the minimum of 1"),
        (2, ids[2], "turns: [] should be non-empty"),
        (3, ids[3], "turns[0].think_time_s: nan is not valid JSON; use null for a missing value"),
        (5, ids[0], f"session id {ids[0]!r} is taken by sessions[0]; session ids must be unique")]
    cfg = LongSWEWorkloadConfig(sessions_path=str(path), num_sessions=2, warmup_sessions=0, token_scale=0.01)
    ds = plan_workload(cfg, ModelConfig()).dataset
    assert (ds["records"], ds["usable"], ds["skipped"]) == (6, 2, 4)
    doc["sessions"] = [doc["sessions"][i] for i in (1, 2)]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as err:
        load_sessions(path)
    assert str(err.value) == (f"{path}: no usable session (2 skipped; record 0 (id {ids[1]}): turns[0].output_tokens: "
                              f"0 is less than the minimum of 1; record 1 (id {ids[2]}): turns: [] should be non-empty)")


def test_mooncake_import_of_the_real_trace(trace):
    sessions = import_mooncake(trace)
    assert sum(len(s.turns) for s in sessions) == 3993  # every request of the trace (SOURCE.md)
    multi = [s for s in sessions if len(s.turns) > 1]
    # docs/workloads.md states these counts. Most requests are questions over documents
    # that other requests share; linked on the document alone they made 439 "sessions",
    # most of whose turns grew by fewer tokens than the answer before them.
    assert (len(sessions), len(multi)) == (3973, 19)
    for s in multi:
        for prev, cur in zip(s.turns, s.turns[1:]):
            full = prev.input_tokens // 512
            assert full >= 1 and cur.hash_ids[:full] == prev.hash_ids[:full]
            assert cur.input_tokens > prev.input_tokens and cur.timestamp_s > prev.timestamp_s
    assert sessions[0].turns[0].timestamp_s == 0.0


def test_mooncake_blocks_give_shared_tokens(trace):
    # Sessions 42 and 49 of the trace start with the same block (the first 10 tokens here).
    cfg = LongSWEWorkloadConfig(trace_path=str(trace), num_sessions=60, warmup_sessions=0, token_scale=0.02)
    plan = plan_workload(cfg, ModelConfig())
    assert plan.dataset["sha256"] == "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"
    first: dict = {}
    for i, session in enumerate(plan.phases[1].sessions):
        for r in session:
            first.setdefault(tuple(r.input_ids[:10]), set()).add(i)
    assert any(len(s) > 1 for s in first.values())  # sessions sharing hash_ids share tokens


def test_mooncake_linking_rules(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]},
        # extends the first: through the block the first ended in (now full, a new hash)
        {"timestamp": 10, "input_length": 1500, "output_length": 5, "hash_ids": [0, 2, 3]},
        {"timestamp": 20, "input_length": 1100, "output_length": 5, "hash_ids": [9, 8, 7]},  # a new session
        # ends within the same block as the third, differently: two requests on a shared
        # prefix (8), so neither this one nor the next extends the third
        {"timestamp": 30, "input_length": 1200, "output_length": 5, "hash_ids": [9, 8, 6]},
        {"timestamp": 40, "input_length": 1600, "output_length": 5, "hash_ids": [9, 8, 5, 4]},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    sessions = import_mooncake(path)
    assert [[t.input_tokens for t in s.turns] for s in sessions] == [[700, 1500], [1100], [1200], [1600]]
    assert [t.timestamp_s for t in sessions[0].turns] == [0.0, 0.01]


def _write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _system_prompt_trace() -> tuple[list[dict], list[list[int]]]:
    """Every request starts with block 0, a 512-token system prompt: five conversations of
    three turns, interleaved in time, each turn's prompt the previous one plus more than a
    block; and five one-off requests of the system prompt plus a partial block. Returns
    the rows in time order and the true sessions as lists of row indexes."""
    blocks = iter(range(1, 10_000))
    events = []
    for c in range(5):
        private = [next(blocks)]
        for t in range(3):
            private.append(next(blocks))  # the turn's partial last block; full next turn
            length = 512 * len(private) + 100 + t  # system block + all but the last private one full
            events.append((1000 * t + 10 * c, ("conv", c), {"input_length": length, "output_length": 8,
                                                             "hash_ids": [0, *private]}))
            private.append(next(blocks))  # the next turn has one more full block
    for k in range(5):
        events.append((1000 * k + 5, ("one-off", k), {"input_length": 512 + 50 + 100 * k, "output_length": 4,
                                                      "hash_ids": [0, next(blocks)]}))
    events.sort(key=lambda e: e[0])
    rows = [{"timestamp": ts, **row} for ts, _, row in events]
    truth: dict = {}
    for i, (_, who, _) in enumerate(events):
        truth.setdefault(who, []).append(i)
    return rows, list(truth.values())


def _as_rows(sessions, rows) -> list[list[int]]:
    index = {r["timestamp"]: i for i, r in enumerate(rows)}
    return sorted(sorted(index[round(t.timestamp_s * 1000)] for t in s.turns) for s in sessions)


def test_mooncake_a_shared_system_prompt_links_nothing(tmp_path):
    """Linked on the system prompt's block alone, one-off requests became turns of each
    other and of the conversations (some under a second after the turn they "answered");
    a link needs blocks past the prefix the trace shares."""
    rows, truth = _system_prompt_trace()
    assert all(r["hash_ids"][0] == 0 for r in rows)
    sessions = import_mooncake(_write_trace(tmp_path / "t.jsonl", rows))
    assert _as_rows(sessions, rows) == sorted(truth)
    for s in sessions:
        for prev, cur in zip(s.turns, s.turns[1:]):
            assert cur.timestamp_s - prev.timestamp_s >= 0.99  # the conversations' own pace


def test_mooncake_short_questions_on_a_system_prompt_are_sessions_of_their_own(tmp_path):
    """Every request is the system prompt's block and a short question ending within the
    next block, each a second after the last: no request continues another (they used
    to be one four-turn session: the block after the system prompt never filled, so the
    trace never "diverged" there)."""
    rows = [{"timestamp": 1000 * i, "input_length": 600 + 100 * i, "output_length": 4, "hash_ids": [0, 1 + i]}
            for i in range(4)]
    sessions = import_mooncake(_write_trace(tmp_path / "t.jsonl", rows))
    assert [[t.input_tokens for t in s.turns] for s in sessions] == [[600], [700], [800], [900]]


def test_mooncake_a_branch_keeps_the_turns_before_it(tmp_path):
    """One conversation whose third turn was sent twice, differently (a regenerated
    answer): its first two turns stay one session, each branch starts one of its own
    (the branch point is shared; the blocks before it, whose requests form one chain,
    are not: all four turns used to become sessions of one turn)."""
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 4, "hash_ids": [10, 11, 12]},
        {"timestamp": 1000, "input_length": 1700, "output_length": 4, "hash_ids": [10, 11, 13, 14]},
        {"timestamp": 2000, "input_length": 2300, "output_length": 4, "hash_ids": [10, 11, 13, 15, 16]},
        {"timestamp": 3000, "input_length": 2300, "output_length": 4, "hash_ids": [10, 11, 13, 17, 18]},
    ]
    sessions = import_mooncake(_write_trace(tmp_path / "t.jsonl", rows))
    assert [[t.input_tokens for t in s.turns] for s in sessions] == [[1100, 1700], [2300], [2300]]
    sessions = import_mooncake(_write_trace(tmp_path / "t.jsonl", rows[:3]))  # no branch
    assert [[t.input_tokens for t in s.turns] for s in sessions] == [[1100, 1700, 2300]]


def test_mooncake_a_shared_document_is_shared_prefix_too(tmp_path):
    """Two conversations over the same two-block document after the system prompt: the
    document's blocks are shared as well (the trace continues differently after them)."""
    rows = [
        {"timestamp": 0, "input_length": 1600, "output_length": 4, "hash_ids": [0, 1, 2, 3]},      # A1: doc only
        {"timestamp": 10, "input_length": 2100, "output_length": 4, "hash_ids": [0, 1, 2, 10, 11]},  # B1
        {"timestamp": 20, "input_length": 2200, "output_length": 4, "hash_ids": [0, 1, 2, 20, 21]},  # C1
        {"timestamp": 30, "input_length": 2700, "output_length": 4, "hash_ids": [0, 1, 2, 10, 12, 13]},  # B2
    ]
    sessions = import_mooncake(_write_trace(tmp_path / "t.jsonl", rows))
    assert [[t.input_tokens for t in s.turns] for s in sessions] == [[1600], [2100, 2700], [2200]]


def test_mooncake_a_turn_must_start_after_the_one_it_extends(tmp_path):
    rows = [
        {"timestamp": 50, "input_length": 1100, "output_length": 4, "hash_ids": [7, 8, 9]},
        {"timestamp": 50, "input_length": 1700, "output_length": 4, "hash_ids": [7, 8, 10, 11]},  # same time
        {"timestamp": 60, "input_length": 2300, "output_length": 4, "hash_ids": [7, 8, 10, 11, 12]},  # later
    ]
    sessions = import_mooncake(_write_trace(tmp_path / "t.jsonl", rows))
    assert [[t.input_tokens for t in s.turns] for s in sessions] == [[1100], [1700, 2300]]




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


@pytest.mark.parametrize(("line", "reason"), [
    ("{not json", "not valid JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
    ('[1, 2]', "expected an object with input_length, output_length and hash_ids, got list"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 2}', "field 'hash_ids' missing"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 2, "hash_ids": [-1]}',
     "field 'hash_ids' must be a list of non-negative integers"),
    ('{"timestamp": "soon", "input_length": 10, "output_length": 2, "hash_ids": [1]}',
     "field 'timestamp' must be a number (ms)"),
    ('{"timestamp": 1, "input_length": 0, "output_length": 2, "hash_ids": [1]}',
     "field 'input_length' must be a positive integer"),
])
def test_malformed_trace_lines_are_skipped_with_the_reason(tmp_path, line, reason):
    good = '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n'
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n" + line + "\n" + good.replace("[0]", "[5]"))
    requests, tally = read_trace(path)
    assert [r["hash_ids"] for r in requests] == [[0], [5]]
    assert (tally.records, tally.skipped) == (3, 1)
    (skip,) = tally.first
    assert (skip.record, skip.line, skip.reason) == (1, 3, reason)  # the blank line 2 is no record
    path.write_text(line + "\n")
    with pytest.raises(ValueError) as err:
        import_mooncake(path)
    assert str(err.value) == f"{path}: no usable request (1 skipped; line 1: {reason})"


def test_a_gzip_trace_plans_as_the_plain_one(tmp_path):
    import gzip

    rows = [{"timestamp": 10 * i, "input_length": 600, "output_length": 4, "hash_ids": [i, 100 + i]}
            for i in range(4)]
    plain = _write_trace(tmp_path / "t.jsonl", rows)
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    cfg = dict(num_sessions=3, warmup_sessions=1, token_scale=0.1)
    a = plan_workload(LongSWEWorkloadConfig(trace_path=str(plain), **cfg), ModelConfig())
    b = plan_workload(LongSWEWorkloadConfig(trace_path=str(packed), **cfg), ModelConfig())
    assert a.fingerprint() == b.fingerprint() and a.dataset["sha256"] != b.dataset["sha256"]
    assert (b.dataset["records"], b.dataset["usable"], b.dataset["skipped"]) == (4, 4, 0)


def test_not_enough_sessions_and_two_sources(tmp_path, trace):
    with pytest.raises(ValueError, match="both set; give one"):
        plan_workload(LongSWEWorkloadConfig(trace_path=str(trace), sessions_path=str(trace)), ModelConfig())
    doc = to_document(synthetic_sessions(2), source="test")
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"needs 52 sessions \(warmup_sessions \+ num_sessions\); the source has 2 with >= 1 turns"):
        plan_workload(LongSWEWorkloadConfig(sessions_path=str(path)), ModelConfig())
