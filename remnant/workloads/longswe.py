"""LongSWE workload: recorded multi-turn sessions replayed by a fixed number of users.

See remnant.workloads.sessions for the format, the Mooncake import and the generator.
Sessions are planned in order: the first warmup_sessions warm the cache up, the next
num_sessions are measured; both phases start from a flushed cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from remnant.config import ModelConfig
from remnant.config_errors import at_least, positive_finite, range_pair
from remnant.workloads.base import WORKLOADS, Phase, PlannedRequest, WorkloadConfig, WorkloadPlan
from remnant.workloads.random import SYNTHETIC_PROMPTS
from remnant.workloads.sessions import (
    MOONCAKE_BLOCK,
    Session,
    load_sessions,
    prompt_tokens,
    read_trace,
    sessions_from_trace,
    synthetic_sessions,
)


@WORKLOADS.register
@dataclass
class LongSWEWorkloadConfig(WorkloadConfig):
    """Recorded multi-turn sessions replayed by `concurrency` active users.

    Sessions come from sessions_path (remnant/sessions JSON), from trace_path (a
    Mooncake-style JSONL trace, imported), or from the synthetic generator. Each user
    replays one session's turns in order, the next turn starting when the previous answer
    ends (plus recorded think time); a user whose session ends takes the next session.
    token_scale shrinks recorded lengths (for small engines); replay_timestamps also holds
    each turn until its recorded time. The first warmup_sessions sessions warm up.
    """

    name: str = "longswe"
    kind: str = "longswe"
    concurrency: int = 24
    sessions_path: str | None = None
    trace_path: str | None = None
    num_sessions: int = 48
    warmup_sessions: int = 4
    #: Replay only sessions with at least this many turns (traces mix in single requests).
    min_turns: int = 1
    token_scale: float = 1.0
    max_input_len: int = 1048576
    replay_timestamps: bool = False
    synthetic_turns: list[int] = field(default_factory=lambda: [3, 6])
    synthetic_initial_tokens: list[int] = field(default_factory=lambda: [2048, 8192])
    synthetic_turn_tokens: list[int] = field(default_factory=lambda: [256, 2048])
    synthetic_output_tokens: list[int] = field(default_factory=lambda: [64, 512])

    def validate(self) -> None:
        super().validate()
        at_least(self, "workload.", ("max_input_len", "num_sessions", "min_turns"), 1)
        positive_finite(self.token_scale, "workload.token_scale")
        at_least(self, "workload.", ("warmup_sessions",), 0)
        for name in ("synthetic_turns", "synthetic_initial_tokens", "synthetic_turn_tokens", "synthetic_output_tokens"):
            range_pair(getattr(self, name), f"workload.{name}")

    def limits(self) -> list[str]:
        return [SYNTHETIC_PROMPTS,
                "replayed turns carry recorded-length synthetic answers, not the server's own output, "
                "so pages cached during decode are not reused as real multi-turn serving would"]

    def plan(self, model: ModelConfig, server_info: dict | None = None) -> WorkloadPlan:
        return build_plan(self, model.prompt_vocab_size)


def _source(cfg: LongSWEWorkloadConfig) -> tuple[list[Session], dict | None, int]:
    if cfg.sessions_path and cfg.trace_path:
        raise ValueError("workload.sessions_path and workload.trace_path are both set; give one")
    if cfg.sessions_path:
        sessions, doc, tally = load_sessions(Path(cfg.sessions_path))
        return sessions, tally.dataset(), doc.get("block_size", MOONCAKE_BLOCK)
    if cfg.trace_path:
        requests, tally = read_trace(Path(cfg.trace_path))
        return sessions_from_trace(requests), tally.dataset(), MOONCAKE_BLOCK
    total = cfg.warmup_sessions + cfg.num_sessions
    return synthetic_sessions(total, cfg.seed, tuple(cfg.synthetic_turns), tuple(cfg.synthetic_initial_tokens),
                              tuple(cfg.synthetic_turn_tokens), tuple(cfg.synthetic_output_tokens)), None, MOONCAKE_BLOCK


def _rebased(sessions: list[list[PlannedRequest]]) -> list[list[PlannedRequest]]:
    """Recorded times relative to the phase's first turn, so a phase does not sit idle
    until the trace time of its first session."""
    times = [r.not_before_s for s in sessions for r in s if r.not_before_s is not None]
    if times:
        t0 = min(times)
        for s in sessions:
            for r in s:
                if r.not_before_s is not None:
                    r.not_before_s -= t0
    return sessions


def build_plan(cfg: LongSWEWorkloadConfig, prompt_vocab_size: int) -> WorkloadPlan:
    sessions, dataset, block = _source(cfg)
    sessions = [s for s in sessions if len(s.turns) >= cfg.min_turns]
    need = cfg.warmup_sessions + cfg.num_sessions
    if len(sessions) < need:
        raise ValueError(f"workload needs {need} sessions (warmup_sessions + num_sessions); the source has "
                         f"{len(sessions)} with >= {cfg.min_turns} turns")
    block_scaled = max(1, round(block * cfg.token_scale))

    def planned(session: Session, phase: str) -> list[PlannedRequest]:
        out = []
        for k, turn in enumerate(session.turns):
            scaled = dataclasses.replace(turn, input_tokens=max(1, round(turn.input_tokens * cfg.token_scale)),
                                         output_tokens=max(1, round(turn.output_tokens * cfg.token_scale)))
            ids = prompt_tokens(session, scaled, prompt_vocab_size, cfg.seed, block_scaled)[: cfg.max_input_len]
            out.append(PlannedRequest(
                f"{phase}-{session.id}-t{k:03d}", scaled.output_tokens, input_ids=ids, session=session.id, turn=k,
                think_time_s=turn.think_time_s,
                not_before_s=turn.timestamp_s if cfg.replay_timestamps else None))
        return out

    warm = _rebased([planned(s, "warmup") for s in sessions[: cfg.warmup_sessions]])
    measured = _rebased([planned(s, "measured") for s in sessions[cfg.warmup_sessions : need]])
    phases = [
        Phase("warmup", [r for s in warm for r in s], cfg.concurrency, sessions=warm),
        Phase("measured", [r for s in measured for r in s], cfg.concurrency, sessions=measured),
    ]
    params = {**dataclasses.asdict(cfg), "turns_measured": sum(len(s) for s in measured)}
    return WorkloadPlan(cfg.name, cfg.seed, phases, params=params, dataset=dataset)
