"""Load generator: drives /generate over HTTP, phase by phase, and records every request.

Per phase: flush the prefix cache (retrying while the server answers 400 because requests
still run), then send the phase's requests with at most `concurrency` in flight, each as
a streaming /generate. Each request's record is appended to requests.jsonl the moment it
ends, so a crash or Ctrl-C loses nothing that finished.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import httpx
from tqdm import tqdm

from remnant.client.request_record import RequestRecord
from remnant.workloads.base import Phase, PlannedRequest


def _interrupt_message(signum: int) -> str:
    """KeyboardInterrupt's message for a signal: remnant-run records "interrupted by Ctrl-C"
    for an empty one."""
    return "" if signum == signal.SIGINT else f"signal {signum}"


class ServerGone(RuntimeError):
    """The server stopped during a phase; the message says why (exit code, log tail)."""


@dataclass
class FlushResult:
    ok: bool
    status_code: int | None
    attempts: int
    elapsed_s: float
    message: str


@dataclass
class PhaseResult:
    name: str
    flush: FlushResult | None
    started_at_s: float
    duration_s: float
    requests: int
    failed: int
    records: list[RequestRecord]

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "flush": None if self.flush is None else asdict(self.flush),
            "started_at_s": self.started_at_s,
            "duration_s": self.duration_s,
            "requests": self.requests,
            "failed": self.failed,
        }


class LoadClient:
    """Sends planned requests to `base_url`; times are seconds since this client's t0."""

    def __init__(
        self,
        base_url: str,
        requests_path: Path,
        request_timeout_s: float = 600.0,
        flush_timeout_s: float = 60.0,
        server_failure: Callable[[], str | None] = lambda: None,
        progress: bool | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.requests_path = Path(requests_path)
        self.request_timeout_s = request_timeout_s
        self.flush_timeout_s = flush_timeout_s
        self.server_failure = server_failure
        self.progress = progress
        self.t0 = time.perf_counter()
        # Request ids stay readable and joinable across runs; the rid sent to the server is
        # made unique per client so repeated runs against one server never collide.
        self._rid_prefix = uuid.uuid4().hex[:8]

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def run(self, phases: list[Phase], on_phase_end: Callable[[PhaseResult], None] = lambda _: None) -> list[PhaseResult]:
        """Run the phases; Ctrl-C or SIGTERM cancels what is in flight and raises KeyboardInterrupt
        (its message "signal 15" for SIGTERM, empty for Ctrl-C). Records of finished
        requests are already on disk.

        From the loop's start to its close, both signals only cancel the main task. A
        KeyboardInterrupt raised by a signal handler inside a task (as remnant-run's SIGTERM
        handler raises it) instead leaves that task's exception unretrieved, and asyncio
        logs its traceback whenever the task is collected, after the run has printed where
        its run.json is. A second signal still breaks out at once, as a second Ctrl-C does
        under asyncio.Runner.
        """
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            return asyncio.run(self.run_async(phases, on_phase_end))
        received: list[int] = []
        main: list[asyncio.Task] = []

        def on_signal(signum, frame) -> None:
            received.append(signum)
            if len(received) > 1:
                raise KeyboardInterrupt(_interrupt_message(received[0]))
            if main:
                main[0].cancel()
                main[0].get_loop().call_soon_threadsafe(lambda: None)  # wake the loop if it waits

        async def cancellable() -> list[PhaseResult]:
            main.append(asyncio.current_task())
            if received:  # a signal came before this task existed
                raise asyncio.CancelledError
            return await self.run_async(phases, on_phase_end)

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            with asyncio.Runner() as runner:
                try:
                    results = runner.run(cancellable())
                except asyncio.CancelledError:
                    if not received:
                        raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if received:  # also when the signal came as the last phase ended
            raise KeyboardInterrupt(_interrupt_message(received[0]))
        return results

    async def run_async(self, phases: list[Phase], on_phase_end=lambda _: None) -> list[PhaseResult]:
        total = sum(len(p.requests) for p in phases)
        limits = httpx.Limits(max_connections=max(p.concurrency for p in phases) + 4)
        timeout = httpx.Timeout(self.request_timeout_s, connect=10.0)
        results = []
        with tqdm(total=total, unit="req", disable=None if self.progress is None else not self.progress, dynamic_ncols=True) as bar:
            async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
                for phase in phases:
                    bar.set_description(phase.name)
                    result = await self._run_phase(client, phase, bar)
                    results.append(result)
                    on_phase_end(result)
        return results

    async def flush(self, client: httpx.AsyncClient) -> FlushResult:
        """POST /flush_cache, retried while the server says requests still run (HTTP 400)."""
        start = time.perf_counter()
        attempts, status, message = 0, None, ""
        while True:
            attempts += 1
            try:
                r = await client.post(f"{self.base_url}/flush_cache", timeout=10.0)
                status, message = r.status_code, r.text.strip()
                if r.status_code == 200:
                    return FlushResult(True, status, attempts, time.perf_counter() - start, message)
                if r.status_code != 400:
                    break  # e.g. 404: the server has no flush endpoint; retrying will not help
            except httpx.HTTPError as exc:
                status, message = None, f"{type(exc).__name__}: {exc}"
                if why := self.server_failure():
                    raise ServerGone(why) from None
            if time.perf_counter() - start > self.flush_timeout_s:
                message = f"gave up after {self.flush_timeout_s:g}s: {message}"
                break
            await asyncio.sleep(0.25)
        return FlushResult(False, status, attempts, time.perf_counter() - start, message)

    async def _run_phase(self, client: httpx.AsyncClient, phase: Phase, bar: tqdm) -> PhaseResult:
        flush = await self.flush(client) if phase.flush_before else None
        started = self.now()
        # Closed loop: each of the C slots holds the time it became free; a request is due
        # then, so dispatch delay shows how late the client really sent it.
        free_since: asyncio.Queue[float] = asyncio.Queue()
        for _ in range(phase.concurrency):
            free_since.put_nowait(started)
        records: list[RequestRecord] = []
        gone: list[str] = []

        async def send(index: int, req: PlannedRequest, intended: float) -> RequestRecord:
            try:
                rec = await self._send(client, req, phase.name, index, intended=intended)
            except Exception as exc:  # noqa: BLE001 - one odd answer must not sink the phase
                rec = RequestRecord(id=req.id, phase=phase.name, index=index, intended_start_s=intended,
                                    start_s=self.now(), error=f"client error: {exc!r}")
            rec.session, rec.turn = req.session, req.turn
            self._append(rec)
            records.append(rec)
            bar.update(1)
            if not rec.success and (why := self.server_failure()):
                gone.append(why)
            return rec

        async def one(index: int, req: PlannedRequest) -> None:
            intended = await free_since.get()
            try:
                if not gone:
                    await send(index, req, intended)
            finally:
                free_since.put_nowait(self.now())

        counter = iter(range(len(phase.requests)))
        sessions = list(phase.sessions or [])

        async def user() -> None:
            """Replay sessions one after another: each turn after the previous answer."""
            while sessions and not gone:
                session = sessions.pop(0)
                ready = self.now()
                for k, req in enumerate(session):
                    due = ready + (req.think_time_s or 0.0 if k else 0.0)
                    if req.not_before_s is not None:
                        due = max(due, started + req.not_before_s)
                    if due > self.now():
                        await asyncio.sleep(due - self.now())
                    rec = await send(next(counter), req, due)
                    if gone:
                        break
                    if not rec.success:
                        # A session without its previous turn is not the recorded one: the
                        # rest of it is recorded as skipped, so planned and recorded agree.
                        for later in session[k + 1 :]:
                            skipped = RequestRecord(id=later.id, phase=phase.name, index=next(counter),
                                                    intended_start_s=self.now(), start_s=self.now(),
                                                    error=f"skipped: turn {req.turn} of the session failed",
                                                    session=later.session, turn=later.turn)
                            self._append(skipped)
                            records.append(skipped)
                            bar.update(1)
                        break
                    ready = self.now()

        if phase.sessions is not None:
            tasks = [asyncio.create_task(user()) for _ in range(phase.concurrency)]
        else:
            tasks = [asyncio.create_task(one(i, r)) for i, r in enumerate(phase.requests)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        if gone:
            raise ServerGone(gone[0])
        failed = sum(not r.success for r in records)
        return PhaseResult(phase.name, flush, started, self.now() - started, len(records), failed, records)

    async def _send(self, client, req: PlannedRequest, phase: str, index: int, intended: float) -> RequestRecord:
        rec = RequestRecord(id=req.id, phase=phase, index=index, intended_start_s=intended,
                            expected_output_tokens=req.max_new_tokens)
        payload = {
            "rid": f"{self._rid_prefix}-{req.id}",
            "sampling_params": {"max_new_tokens": req.max_new_tokens, "temperature": 0.0, "ignore_eos": True},
            "stream": True,
        }
        if req.input_ids is not None:
            payload["input_ids"] = req.input_ids
        else:
            payload["text"] = req.text
        seen = 0
        rec.start_s = self.now()
        try:
            async with client.stream("POST", f"{self.base_url}/generate", json=payload) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")[:500]
                    rec.error = f"HTTP {resp.status_code}: {body}"
                    return rec
                done = False
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        done = True
                        break
                    frame = json.loads(data)
                    if "error" in frame:
                        err = frame["error"]
                        rec.error = f"server error: {err.get('message') if isinstance(err, dict) else err}"
                        return rec
                    t = self.now()
                    meta = frame.get("meta_info") or {}
                    # Tokens so far, as bench_serving counts them: completion_tokens (output_ids
                    # holds only the new ids when SGLang streams incrementally).
                    n = meta.get("completion_tokens")
                    if n is None:
                        n = len(frame.get("output_ids") or [])
                    if n > seen:
                        if rec.ttft_s is None:
                            rec.ttft_s = t - rec.start_s
                        rec.chunk_times_s.append(t)
                        rec.chunk_tokens.append(n - seen)
                        seen = n
                    rec.prompt_tokens = meta.get("prompt_tokens", rec.prompt_tokens)
                    rec.completion_tokens = meta.get("completion_tokens", seen)
                    rec.cached_tokens = meta.get("cached_tokens", rec.cached_tokens) or 0
                    reason = meta.get("finish_reason")
                    if reason:
                        rec.finish_reason = reason.get("type") if isinstance(reason, dict) else str(reason)
                rec.end_s = self.now()
                if rec.finish_reason == "abort":
                    rec.error = "server aborted the request"
                elif not done:
                    rec.error = "stream ended before [DONE]"
                else:
                    rec.success = True
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        return rec

    def _append(self, rec: RequestRecord) -> None:
        with open(self.requests_path, "a") as f:
            f.write(json.dumps(rec.to_dict()) + "\n")
