"""ShareGPT workload: real conversations from BENCH_DATASET_PATH (never downloaded).

File format: a JSON list of {"id": str, "conversations": [{"from": "human"|"gpt",
"value": str}, ...]} (ShareGPT_V3_unfiltered_cleaned_split; "conversation" is accepted
too). As sglang.bench_serving does: records with fewer than two turns are skipped, the
first turn is the prompt and the second the reference answer whose token count is the
output length, the order is shuffled (seeded), and pairs with a prompt or output under 2
tokens are dropped. Prompts longer than max_input_len tokens are truncated, outputs capped
at max_output_len. When the file holds fewer usable conversations than the run needs,
they are reused in order and the plan says how many times.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from remnant.config import MISSING, WORKLOADS, ModelConfig, WorkloadConfig, at_least
from remnant.workloads.base import Phase, PlannedRequest, WorkloadPlan
from remnant.workloads.json_error import describe_json_error


@WORKLOADS.register
@dataclass
class ShareGPTWorkloadConfig(WorkloadConfig):
    """Conversations from a ShareGPT-format JSON file (never downloaded).

    The first human turn is the prompt and the first reply's token count the output length
    (or output_len when set), as sglang.bench_serving samples ShareGPT; prompts are
    truncated to max_input_len tokens and outputs capped at max_output_len. C warm-up
    requests, then num_prompts measured, cache flushed before each phase.
    """

    name: str = "sharegpt"
    kind: str = "sharegpt"
    dataset_path: str = MISSING
    num_prompts: int = 12
    max_input_len: int = 1024
    max_output_len: int = 128
    output_len: int | None = None

    def validate(self) -> None:
        super().validate()
        at_least(self, "workload.", ("output_len", "num_prompts", "max_input_len", "max_output_len"), 1)

    def request_tokens(self) -> tuple[int, str] | None:
        out = self.max_output_len if self.output_len is None else min(self.output_len, self.max_output_len)
        return self.max_input_len + out, f"workload.max_input_len={self.max_input_len} + {out} output tokens"

    def plan(self, model: ModelConfig, server_info: dict | None = None) -> WorkloadPlan:
        return build_plan(self, model)


def read_conversations(path: Path) -> list[tuple[str, str, str]]:
    """(id, prompt, answer) of every usable record; ValueError names file, record and field."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"workload.dataset_path={path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"workload.dataset_path={path}: cannot read it: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({describe_json_error(exc)})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations, got {type(data).__name__}")
    out = []
    for i, record in enumerate(data):
        where = f"{path}: record {i}"
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected an object with 'conversations', got {type(record).__name__}")
        if isinstance(record.get("id"), str):
            where += f" (id {record['id']})"
        turns = record.get("conversations", record.get("conversation"))
        if not isinstance(turns, list):
            raise ValueError(f"{where}: field 'conversations' missing or not a list")
        if len(turns) < 2:
            continue
        values = []
        for t, turn in enumerate(turns[:2]):
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                raise ValueError(f"{where} turn {t}: field 'value' missing or not a string")
            values.append(turn["value"])
        out.append((str(record.get("id", i)), values[0], values[1]))
    if not out:
        raise ValueError(f"{path}: no conversation has two turns")
    return out


def build_plan(cfg: ShareGPTWorkloadConfig, model: ModelConfig) -> WorkloadPlan:
    from remnant.workloads.tokenizer import load_tokenizer

    path = Path(cfg.dataset_path)
    conversations = read_conversations(path)
    order = np.random.default_rng(cfg.seed).permutation(len(conversations))
    tok = load_tokenizer(model)
    usable = []
    for i in order:
        cid, prompt, answer = conversations[int(i)]
        ids = tok.encode(prompt).ids[: cfg.max_input_len]
        out_len = cfg.output_len if cfg.output_len is not None else len(tok.encode(answer, add_special_tokens=False).ids)
        out_len = min(out_len, cfg.max_output_len)
        if len(ids) >= 2 and out_len >= 2:
            usable.append((cid, ids, out_len))
    if not usable:
        raise ValueError(f"{path}: no conversation has a prompt and an answer of >= 2 tokens")
    warmup_n, measured_n = cfg.concurrency, cfg.num_prompts
    picks = [usable[k % len(usable)] for k in range(warmup_n + measured_n)]
    phases = []
    for name, chosen in (("warmup", picks[:warmup_n]), ("measured", picks[warmup_n:])):
        requests = [PlannedRequest(f"{name}-{k:05d}-{cid}", out_len, input_ids=ids)
                    for k, (cid, ids, out_len) in enumerate(chosen)]
        phases.append(Phase(name, requests, cfg.concurrency))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    params = {**dataclasses.asdict(cfg), "usable_conversations": len(usable),
              "reuse_factor": (warmup_n + measured_n) / len(usable)}
    return WorkloadPlan(cfg.name, cfg.seed, phases, params=params, dataset={"path": str(path), "sha256": sha})
