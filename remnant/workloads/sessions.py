"""Recorded multi-turn sessions: the format LongSWE replay reads (schema remnant/sessions).

A session is a list of turns; turn k's prompt is the session's token stream up to
input_tokens_k, so a later turn extends an earlier one and the prefix cache matters.
Tokens are synthesized deterministically: from hash_ids (512-token blocks, Mooncake
traces: equal ids give equal tokens, across sessions too) or, without them, from a stream
seeded by the session id. Mooncake-style traces import into this format; a generator makes
synthetic LongSWE-like sessions for tests.

Files are read as they come (remnant.workloads.dataset_file): gzip or not; a session that
breaks the schema, or a trace line that cannot be used, is skipped with the reason and
counted, and a file with none usable is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from remnant.records.kinds import SESSIONS
from remnant.workloads.dataset_file import Record, Tally, jsonl_records, read_file
from remnant.workloads.json_error import describe_json_error

MOONCAKE_BLOCK = 512


@dataclass
class Turn:
    input_tokens: int
    output_tokens: int
    think_time_s: float | None = None
    timestamp_s: float | None = None
    hash_ids: list[int] | None = None


@dataclass
class Session:
    id: str
    turns: list[Turn] = field(default_factory=list)


def to_document(sessions: list[Session], source: str, block_size: int | None = None) -> dict:
    doc = {**SESSIONS.header(), "source": source,
           "sessions": [{"id": s.id, "turns": [{k: v for k, v in t.__dict__.items() if v is not None}
                                                for t in s.turns]} for s in sessions]}
    if block_size is not None:
        doc["block_size"] = block_size
    return doc


def load_sessions(path: Path) -> tuple[list[Session], dict, Tally]:
    """The usable sessions of a remnant/sessions file (JSON, gzip or not), the document,
    and the file's Tally: a session that breaks the schema, or repeats an earlier
    session's id, is skipped with the reason. ValueError (RecordError) names the file and
    field where the document itself is not one (its header, or no list of sessions), or
    where no session is usable."""
    path = Path(path)
    text, sha = read_file(path, "workload.sessions_path")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({describe_json_error(exc)})") from None
    bad = _bad_sessions(doc, str(path))
    tally = Tally(path, sha, noun="session", records=len(doc["sessions"]))
    sessions, first_at = [], {}
    for i, s in enumerate(doc["sessions"]):
        record = Record(i, None, s)
        if i in bad:
            tally.skip(record, bad[i])
        elif s["id"] in first_at:
            # Request ids are built from session ids: two sessions of one id would collide.
            tally.skip(record, f"session id {s['id']!r} is taken by sessions[{first_at[s['id']]}]; "
                               "session ids must be unique")
        else:
            first_at[s["id"]] = i
            sessions.append(Session(s["id"], [Turn(**t) for t in s["turns"]]))
    tally.refuse_if_unusable()
    return sessions, doc, tally


def _bad_sessions(doc: object, source: str) -> dict[int, str]:
    """Why each session of a sessions document that breaks the schema does, by index.
    RecordError where the document itself does (its header, or no list of sessions).
    The rest are checked again until they pass: a value that is not JSON (NaN) is
    reported before the schema is applied."""
    from remnant.records.schema import RecordError, validate

    bad: dict[int, str] = {}
    while True:
        listed = isinstance(doc, dict) and isinstance(doc.get("sessions"), list)
        kept = [i for i in range(len(doc["sessions"])) if i not in bad] if listed else []
        try:
            validate({**doc, "sessions": [doc["sessions"][i] for i in kept]} if bad else doc, source)
            return bad
        except RecordError as exc:
            for name, reason in exc.errors:
                m = re.fullmatch(r"sessions\[(\d+)\]\.?(.*)", name)
                if m is None or not listed:
                    raise  # the document itself, not one of its sessions
                bad.setdefault(kept[int(m.group(1))], f"{m.group(2) or 'the session'}: {reason}")
        if len(bad) == len(doc["sessions"]):
            return bad  # none left to check


def import_mooncake(path: Path) -> list[Session]:
    """Sessions from a Mooncake trace file (see sessions_from_trace); lines that cannot be
    used are skipped (read_trace)."""
    return sessions_from_trace(read_trace(Path(path))[0])


def sessions_from_trace(records: list[dict]) -> list[Session]:
    """Sessions from a Mooncake trace's requests (each a dict of timestamp ms,
    input_length, output_length and hash_ids, as read_trace gives them). Timestamps become
    timestamp_s, relative to the first request.

    A request continues the session whose latest turn's full blocks are the longest prefix
    of its own hash_ids, when that turn is shorter, started earlier, and its last full
    block is not shared. Blocks are chained hashes (an id names its whole prefix), so the
    trace's blocks form a tree. A full block is shared when the requests through it
    continue in ways one conversation could not: after it, two different full blocks (two
    conversations, or one that branched), two different partial blocks
    (prompts ending at different points of the next block: a system prompt and short
    questions), or a shorter request after a longer one. One conversation continues in
    one time-ordered chain: a turn ending exactly there, then one ending within the next
    block, then turns through a full next block (the partial block got a new hash when
    it filled). A link on shared blocks alone would join unrelated requests into one
    session; they start sessions of their own and still share tokens through their
    hash_ids. Where one conversation branches, its turns before the branch stay one
    session (the blocks before the branch are not shared: their requests form a chain)
    and each branch starts its own."""
    shared = _shared_blocks(records)
    sessions: list[Session] = []
    # Open sessions by the full blocks of their latest turn (the last, partial block gets a
    # new hash once it fills, so it cannot link turns).
    open_by_blocks: dict[tuple, int] = {}
    t0 = next((rec["timestamp"] for rec in records if rec.get("timestamp") is not None), None)
    for rec in records:
        ids, ts = rec["hash_ids"], rec.get("timestamp")
        turn = Turn(rec["input_length"], rec["output_length"],
                    timestamp_s=None if ts is None else (ts - t0) / 1000.0, hash_ids=list(ids))
        owner = None
        for k in range(len(ids), 0, -1):
            candidate = open_by_blocks.get(tuple(ids[:k]))
            if candidate is None:
                continue
            latest = sessions[candidate].turns[-1]
            later = latest.timestamp_s is None or turn.timestamp_s is None or turn.timestamp_s > latest.timestamp_s
            if latest.input_tokens < turn.input_tokens and later:
                owner = candidate  # a longer prompt, sent later, extending that session's latest one
                break
        if owner is None:
            sessions.append(Session(f"mooncake-{len(sessions):05d}", [turn]))
            owner = len(sessions) - 1
        else:
            previous = sessions[owner].turns[-1]
            open_by_blocks.pop(tuple(previous.hash_ids[: previous.input_tokens // MOONCAKE_BLOCK]), None)
            sessions[owner].turns.append(turn)
        full = tuple(ids[: turn.input_tokens // MOONCAKE_BLOCK])
        if full and full[-1] not in shared:
            open_by_blocks[full] = owner
    return sessions


def read_trace(path: Path) -> tuple[list[dict], Tally]:
    """The usable requests of a Mooncake trace (JSONL, gzip or not), and the file's Tally:
    a line that is not JSON, or whose fields are missing or malformed, is skipped with the
    reason. ValueError names the file where it cannot be read or no line is usable."""
    text, sha = read_file(path, "workload.trace_path")
    records = list(jsonl_records(text))
    tally = Tally(path, sha, noun="request", records=len(records))
    usable = []
    for record in records:
        why = record.error or _trace_problem(record.value)
        if why is None:
            usable.append(record.value)
        else:
            tally.skip(record, why)
    tally.refuse_if_unusable()
    return usable, tally


def _trace_problem(rec: object) -> str | None:
    """Why one line of a Mooncake trace cannot be used; None where it can."""
    if not isinstance(rec, dict):
        return f"expected an object with input_length, output_length and hash_ids, got {type(rec).__name__}"
    for key in ("input_length", "output_length", "hash_ids"):
        if key not in rec:
            return f"field '{key}' missing"
    ids = rec["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return "field 'hash_ids' must be a list of non-negative integers"
    for key in ("input_length", "output_length"):
        if not isinstance(rec[key], int) or isinstance(rec[key], bool) or rec[key] < 1:
            return f"field '{key}' must be a positive integer"
    ts = rec.get("timestamp")
    if ts is not None and (not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts)):
        return "field 'timestamp' must be a number (ms)"
    return None


def _shared_blocks(records: list[dict]) -> set[int]:
    """Full blocks after which the trace's requests do not continue as one conversation
    (see import_mooncake): their continuations, grouped by the next block (None where a
    request ends with that block), are not one time-ordered chain of at most one group
    ending there, then one ending within the next block, then one through a full block."""
    # block -> next block -> [kind, first request, last request] (kinds: 0 ends here,
    # 1 ends within the next block, 2 goes through it; requests by (timestamp, line))
    groups: dict[int, dict[int | None, list]] = {}
    for n, rec in enumerate(records):
        ids = rec["hash_ids"]
        full = min(rec["input_length"] // MOONCAKE_BLOCK, len(ids))
        when = (rec.get("timestamp") or 0, n)
        for k in range(full):
            nxt = ids[k + 1] if k + 1 < len(ids) else None
            kind = 0 if nxt is None else 2 if k + 1 < full else 1
            group = groups.setdefault(ids[k], {}).setdefault(nxt, [kind, when, when])
            group[0], group[1], group[2] = max(group[0], kind), min(group[1], when), max(group[2], when)
    shared = set()
    for block, by_next in groups.items():
        chain = sorted(by_next.values(), key=lambda g: g[1])
        if any(a[0] >= b[0] or a[2] >= b[1] for a, b in zip(chain, chain[1:])):
            shared.add(block)
    return shared


def synthetic_sessions(count: int, seed: int = 0, turns: tuple[int, int] = (3, 6),
                       initial_tokens: tuple[int, int] = (2048, 8192), turn_tokens: tuple[int, int] = (256, 2048),
                       output_tokens: tuple[int, int] = (64, 512), think_time_s: float = 0.0) -> list[Session]:
    """LongSWE-like sessions: a large initial context (repository, task), then turns that
    each add tool output and the previous answer; every turn's prompt extends the last."""
    rng = np.random.default_rng(seed)
    sessions = []
    for i in range(count):
        length = int(rng.integers(initial_tokens[0], initial_tokens[1] + 1))
        ts = []
        for _ in range(int(rng.integers(turns[0], turns[1] + 1))):
            out = int(rng.integers(output_tokens[0], output_tokens[1] + 1))
            ts.append(Turn(length, out, think_time_s=think_time_s or None))
            length += out + int(rng.integers(turn_tokens[0], turn_tokens[1] + 1))
        sessions.append(Session(f"synthetic-{seed}-{i:05d}", ts))
    return sessions


def prompt_tokens(session: Session, turn: Turn, vocab: int, seed: int, block_size: int = MOONCAKE_BLOCK) -> list[int]:
    """The token ids of a turn's prompt (deterministic; see the module docstring)."""
    if turn.hash_ids:
        out: list[int] = []
        for block in turn.hash_ids:
            rng = np.random.default_rng([seed, 1, block])
            out.extend(rng.integers(0, vocab, block_size).tolist())
        if len(out) < turn.input_tokens:  # a trace's last block may run past its ids
            rng = np.random.default_rng([seed, 2, *turn.hash_ids[-1:], turn.input_tokens])
            out.extend(rng.integers(0, vocab, turn.input_tokens - len(out)).tolist())
        return out[: turn.input_tokens]
    key = int.from_bytes(hashlib.blake2b(session.id.encode(), digest_size=8).digest(), "little")
    rng = np.random.default_rng([seed, 3, key])
    return rng.integers(0, vocab, turn.input_tokens).tolist()
