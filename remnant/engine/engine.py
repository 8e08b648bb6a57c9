"""Continuous batching loop of the embedded engine (v0).

One engine thread owns the model and every sequence. Each step it admits waiting
requests, gives each running request either its next prefill chunk (at most
`chunked_prefill_size` prompt tokens per step over all requests, so long prompts do not
stall decodes) or one decode token, runs them as one batch, samples, and reports tokens
through each request's `emit` callback (called on the engine thread).
"""

from __future__ import annotations

import logging
import threading
import zlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from remnant.engine.model import Model
from remnant.engine.sequence import SequenceState

log = logging.getLogger(__name__)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    ignore_eos: bool = False
    seed: int | None = None


@dataclass
class TokenEvent:
    """What a request has produced so far; `finish_reason` is set on its last event."""

    output_ids: list[int]
    finish_reason: dict | None
    cached_tokens: int = 0


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    emit: Callable[[TokenEvent], None]
    state: SequenceState | None = None
    prefilled: int = 0
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    aborted: bool = False


class Engine:
    def __init__(
        self,
        model: Model,
        eos_token_id: int,
        chunked_prefill_size: int = 512,
        max_running_requests: int = 64,
    ):
        self.model = model
        self.eos_token_id = eos_token_id
        self.chunked_prefill_size = chunked_prefill_size
        self.max_running_requests = max_running_requests
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="remnant-engine", daemon=True)
        self.steps = 0
        self.generated_tokens = 0

    # Thread-safe API ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: Request) -> None:
        with self._cv:
            self._waiting.append(request)
            self._cv.notify()

    def abort(self, rid: str) -> None:
        """Stop a request (client went away); it is dropped at the next step."""
        with self._cv:
            for r in (*self._waiting, *self._running):
                if r.rid == rid:
                    r.aborted = True

    def load(self) -> tuple[int, int]:
        """(running, waiting) request counts."""
        with self._cv:
            return len(self._running), len(self._waiting)

    # Engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._running:
                    self._cv.wait()
                if self._stop:
                    return
                self._running = [r for r in self._running if not r.aborted]
                while self._waiting and len(self._running) < self.max_running_requests:
                    r = self._waiting.popleft()
                    if not r.aborted:
                        self._running.append(r)
                batch = list(self._running)
            if batch:
                self._step(batch)

    def _step(self, running: list[Request]) -> None:
        budget = self.chunked_prefill_size
        batch, chunks = [], []
        for r in running:
            if r.state is None:
                r.state = SequenceState.empty(
                    self.model.args.compress_ratios, self.model.args.index_head_dim,
                    self.model.record_bytes(),
                )
                seed = r.sampling.seed if r.sampling.seed is not None else zlib.crc32(r.rid.encode())
                r.generator = torch.Generator().manual_seed(seed)
            remaining = len(r.input_ids) - r.prefilled
            if remaining > 0:
                if budget <= 0:
                    continue
                take = min(remaining, budget)
                budget -= take
                chunks.append(r.input_ids[r.prefilled : r.prefilled + take])
                r.prefilled += take
            else:
                chunks.append([r.output_ids[-1]])
            batch.append(r)
        if not batch:
            return
        try:
            with torch.inference_mode():
                logits = self.model.forward([r.state for r in batch], chunks)
        except Exception as exc:  # noqa: BLE001 - a failed step must answer, not kill the loop
            log.exception("engine step failed")
            for r in batch:
                self._finish(r, {"type": "abort", "message": f"engine error: {exc}",
                                 "status_code": 500, "err_type": type(exc).__name__})
            return
        self.steps += 1
        for r, row in zip(batch, logits):
            if r.prefilled < len(r.input_ids):
                continue  # mid-prompt chunk: nothing to sample yet
            if r.sampling.max_new_tokens == 0:
                self._finish(r, {"type": "length", "length": 0})
                continue
            token = self._sample(r, row)
            r.output_ids.append(token)
            self.generated_tokens += 1
            finish = None
            if not r.sampling.ignore_eos and token == self.eos_token_id:
                finish = {"type": "stop", "matched": token}
            elif len(r.output_ids) >= r.sampling.max_new_tokens:
                finish = {"type": "length", "length": r.sampling.max_new_tokens}
            if finish:
                self._finish(r, finish)
            else:
                r.emit(TokenEvent(list(r.output_ids), None))

    def _sample(self, r: Request, logits: torch.Tensor) -> int:
        if r.sampling.temperature <= 0:
            return int(logits.argmax())
        probs = torch.softmax(logits / r.sampling.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=r.generator))

    def _finish(self, r: Request, reason: dict) -> None:
        with self._cv:
            if r in self._running:
                self._running.remove(r)
        r.state = None  # free its KV
        r.emit(TokenEvent(list(r.output_ids), reason))
