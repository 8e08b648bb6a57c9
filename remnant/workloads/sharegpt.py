"""ShareGPT workload: real conversations from BENCH_DATASET_PATH (never downloaded).

File format: a list of {"id": str, "conversations": [{"from": "human"|"gpt", "value": str},
...]} (ShareGPT_V3_unfiltered_cleaned_split; "conversation" is accepted too), as one JSON
document or JSONL (one record per line), gzip or not (remnant.workloads.dataset_file). As
sglang.bench_serving does: the first turn is the prompt and the second the reference answer
whose token count is the output length, the order is shuffled (seeded), and pairs with a
prompt or output under 2 tokens are dropped. Prompts longer than max_input_len tokens are
truncated, outputs capped at max_output_len. When the file holds fewer usable
conversations than the run needs, they are reused in order and the plan says how many times.

A record that cannot be used is skipped and counted, never dropped without a word: one
that is not JSON or not an object, has no list of conversations or fewer than two turns,
whose first two turns are not a prompt from the user and an answer from the model, whose
values are not strings, or whose prompt or answer is under 2 tokens. SGLang's client skips
records of fewer than two turns and too-short pairs the same way; it takes the first two
turns whatever their roles, and stops at a record it cannot read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from remnant.config import MISSING, ModelConfig
from remnant.config_errors import at_least
from remnant.workloads.base import WORKLOADS, Phase, PlannedRequest, WorkloadConfig, WorkloadPlan
from remnant.workloads.dataset_file import Record, Tally, read_file, read_records


@WORKLOADS.register
@dataclass
class ShareGPTWorkloadConfig(WorkloadConfig):
    """Conversations from a ShareGPT file, JSON or JSONL, gzip or not (never downloaded).

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


#: ShareGPT's speakers ("from"): who asks, and who answers (V3 names the model gpt, or
#: chatgpt, bing and bard by where a conversation was shared; other exports say user and
#: assistant). A turn without "from" is taken as it comes.
PROMPT_ROLES = ("human", "user")
ANSWER_ROLES = ("gpt", "assistant", "chatgpt", "bing", "bard", "model")


def conversation(record: Record) -> tuple[str, str] | str:
    """(prompt, answer) of a ShareGPT record, or why it cannot be used."""
    if record.error is not None:
        return record.error
    value = record.value
    if not isinstance(value, dict):
        return f"expected an object with 'conversations', got {type(value).__name__}"
    turns = value.get("conversations", value.get("conversation"))
    if turns is None:
        return "no field 'conversations'"
    if not isinstance(turns, list):
        return f"field 'conversations' is a {type(turns).__name__}, not a list"
    if len(turns) < 2:
        return f"{len(turns)} turn{'' if len(turns) == 1 else 's'}; a prompt and an answer need two"
    texts = []
    for t, (turn, roles) in enumerate(zip(turns, (PROMPT_ROLES, ANSWER_ROLES))):
        if not isinstance(turn, dict):
            return f"turn {t} is a {type(turn).__name__}, not an object"
        role = turn.get("from")
        if role is not None and role not in roles:
            return f"turn {t} is from {role!r}; expected {' or '.join(roles)}"
        text = turn.get("value")
        if not isinstance(text, str):
            return f"turn {t}: field 'value' {'missing' if text is None else 'is not a string'}"
        texts.append(text)
    return texts[0], texts[1]


def read_conversations(path: Path) -> tuple[list[tuple[str, str, str, Record]], Tally]:
    """(id, prompt, answer, record) of every record that can be used, and the file's Tally
    (the others, skipped with their reasons). ValueError naming the file where it cannot
    be read, is neither a JSON list nor JSONL, or has no usable record."""
    text, sha = read_file(path, "workload.dataset_path")
    records = read_records(path, text, "conversations")
    tally = Tally(path, sha, noun="conversation", records=len(records))
    out = []
    for record in records:
        got = conversation(record)
        if isinstance(got, str):
            tally.skip(record, got)
            continue
        cid = record.value.get("id", record.index)
        out.append((str(cid), got[0], got[1], record))
    tally.refuse_if_unusable()
    return out, tally


def _tokens(n: int) -> str:
    return f"{n} token{'' if n == 1 else 's'}"


def build_plan(cfg: ShareGPTWorkloadConfig, model: ModelConfig) -> WorkloadPlan:
    from remnant.workloads.tokenizer import load_tokenizer

    path = Path(cfg.dataset_path)
    conversations, tally = read_conversations(path)
    tok = load_tokenizer(model)
    tokenized = []
    # In file order, so the tally's first reasons are the file's first skipped records.
    for cid, prompt, answer, record in conversations:
        ids = tok.encode(prompt).ids[: cfg.max_input_len]
        answer_len = len(tok.encode(answer, add_special_tokens=False).ids)
        out_len = min(answer_len if cfg.output_len is None else cfg.output_len, cfg.max_output_len)
        if len(ids) < 2:
            tally.skip(record, f"a prompt of {_tokens(len(ids))}; at least 2 are needed")
        elif cfg.output_len is None and answer_len < 2:
            tally.skip(record, f"an answer of {_tokens(answer_len)}; at least 2 are needed")
        elif out_len < 2:
            tally.skip(record, f"an output of {_tokens(out_len)} (workload.output_len, workload.max_output_len); "
                               "at least 2 are needed")
        tokenized.append((cid, ids, out_len) if len(ids) >= 2 and out_len >= 2 else None)
    tally.refuse_if_unusable()
    # Shuffled before the short pairs are dropped, as sglang.bench_serving does: the same
    # file gives the same order whatever the tokenizer drops.
    order = np.random.default_rng(cfg.seed).permutation(len(tokenized))
    usable = [tokenized[int(i)] for i in order if tokenized[int(i)] is not None]
    warmup_n, measured_n = cfg.concurrency, cfg.num_prompts
    picks = [usable[k % len(usable)] for k in range(warmup_n + measured_n)]
    phases = []
    for name, chosen in (("warmup", picks[:warmup_n]), ("measured", picks[warmup_n:])):
        requests = [PlannedRequest(f"{name}-{k:05d}-{cid}", out_len, input_ids=ids)
                    for k, (cid, ids, out_len) in enumerate(chosen)]
        phases.append(Phase(name, requests, cfg.concurrency))
    params = {**dataclasses.asdict(cfg), "usable_conversations": len(usable),
              "reuse_factor": (warmup_n + measured_n) / len(usable)}
    return WorkloadPlan(cfg.name, cfg.seed, phases, params=params, dataset=tally.dataset())
