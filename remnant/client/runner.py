"""Load generator: drives /generate over HTTP, phase by phase, and records every request.

Per phase: flush the prefix cache (retrying while the server answers 400 because requests
still run), then send the phase's requests with at most `concurrency` in flight, each as
a streaming /generate: as soon as a slot frees (closed loop), or, where the phase has
arrival times (open loop, workload.request_rate), at its time or when a slot frees after
it. The phase records the CPU time its event loop and the whole process spent. Each
request's record is appended to requests.jsonl the moment it ends, whole or not at all,
so a crash, Ctrl-C or a full disk loses nothing that finished.

A watchdog stops the client early: when requests have been in flight for `stall_timeout_s`
with no answer from the server (no token, no response; a request that times out is no
answer), when the run passes `deadline_s`, or, where `oversaturation` is enabled, when the
server is driven past saturation (remnant.client.oversaturation: its queue, as the
server's /metrics give it, and the client's backlog grow, or goodput collapses). It stops
sending, records the requests in flight as failed, and raises ClientStopped with the times.

Streams are read by `remnant.client.http_stream` (a minimal HTTP/1.1 reader that hands
each line to the request's record as its bytes arrive) and frames by
`remnant.client.frames` (meta_info alone where the frame ends with it); `stream="httpx"`
reads them with httpx and whole-frame parsing instead, the plain reference path, also taken
where a proxy applies to the server's URL. Flushes go through httpx either way.
benchmarks/client/NOTES.md has what each costs.
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import signal
import threading
import time
import urllib.request
import uuid
from bisect import bisect_right
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import httpx
import orjson
from tqdm import tqdm

from remnant.api_key import bearer
from remnant.client.frames import JSONDecodeError, frame_fields, parse_frame
from remnant.client.http_stream import CONTINUE, END, STOP, StreamError, StreamPool
from remnant.client.oversaturation import Detector, Point, describe, point_step_s
from remnant.client.request_record import RequestRecord
from remnant.client.server_metrics import QUEUE, RUNNING, ServerMetricsScraper
from remnant.records.files import append_line
from remnant.signals import Interrupted
from remnant.workloads.base import OversaturationConfig, Phase, PlannedRequest

#: Longest error snippet kept from a response body.
SNIPPET_CHARS = 160


class ServerGone(RuntimeError):
    """The server stopped during a phase; the message says why (exit code, log tail)."""


class ClientStopped(RuntimeError):
    """The watchdog stopped the client: the server stalled, the run passed its deadline, or
    the server was over-saturated.

    stop: run.json's client_stop: reason ("stall" | "deadline" | "oversaturated"), limit_s
        (the stall timeout, the deadline, the over-saturation window), at_s,
        last_progress_s (when the server last answered), in_flight, phase (times in s since
        the client started); and, for "oversaturated", `oversaturation`: the rule that held
        and what it measured (remnant.client.oversaturation.Detector).
    phase: what the phase in progress had done when it stopped (its records included).
    """

    def __init__(self, stop: dict, phase: "PhaseResult | None"):
        self.stop, self.phase = stop, phase
        super().__init__(stop_message(stop))


def stop_message(stop: dict) -> str:
    """One line on why the client stopped, with its times."""
    last = "it never answered" if stop["last_progress_s"] is None else \
        f"it last answered at {stop['last_progress_s']:.1f}s"
    if stop["reason"] == "oversaturated":
        return (f"the server was over-saturated in the {stop['phase']} phase: {describe(stop['oversaturation'])}; "
                f"the client stopped at {stop['at_s']:.1f}s with {stop['in_flight']} requests in flight "
                "(workload.oversaturation; times since the client started)")
    if stop["reason"] == "stall":
        return (f"the server stalled: no token or response for {stop['limit_s']:g}s with requests in flight "
                f"(workload.stall_timeout_s; {stop['in_flight']} in flight at the stop); {last}, the client "
                f"stopped at {stop['at_s']:.1f}s (times since the client started)")
    return (f"the run passed its deadline (workload.deadline_s={stop['limit_s']:g}) at {stop['at_s']:.1f}s "
            f"with {stop['in_flight']} requests in flight; {last}")


def snippet(text: str, limit: int = SNIPPET_CHARS) -> str:
    """A response body as one short line: a JSON error's message, an HTML page's text
    without its markup, anything else with its whitespace collapsed; cut at `limit`."""
    text = text.strip()
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        err = doc.get("error", doc.get("detail", doc.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            text = err if isinstance(err, str) else json.dumps(err)
    elif text.startswith("<") and re.search(r"</?(html|body|head|p|h1|div|title)\b", text, re.I):
        text = re.sub(r"(?is)<(head|script|style)\b.*?</\1>", " ", text)
        text = html.unescape(re.sub(r"<[^>]*>", " ", text))
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def http_error(status_code: int, body: str) -> str:
    """A non-200 answer as a request's error: status code and a snippet of the body."""
    short = snippet(body)
    return f"HTTP {status_code}: {short}" if short else f"HTTP {status_code}"


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
    #: CPU seconds over the phase (after its flush): the event loop's thread, which reads
    #: every stream and cannot use more than one core, and the whole client process.
    loop_cpu_s: float = 0.0
    process_cpu_s: float = 0.0

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
    """Sends planned requests to `base_url`; times are seconds since this client's t0.

    stall_timeout_s: stop when requests have been in flight this long, in all, since the
        server last answered (a token, or a response's status); time with nothing in flight
        does not count (None: no watchdog). deadline_s: stop this long after t0 (None: never).
    stream: "fast" (remnant.client.http_stream and frames) or "httpx" (the reference path);
        "fast" falls back to "httpx" where a proxy applies to base_url (see `stream_path`).
    api_key: the server's API key, sent with every request as `Authorization: Bearer`
        (None: no key).
    server_metrics_interval_s, server_metrics_path: scrape the server's /metrics this often
        into this file while the phases run (remnant.client.server_metrics; `scraper`, its
        samples on this client's clock; 0 or no path: no scrape). The watchdog reads the
        latest sample where it is no older than three intervals and the scrape timeout.
    oversaturation: the over-saturation stop's rule (None, or enabled=False: no stop).
    """

    STREAMS = ("fast", "httpx")

    def __init__(
        self,
        base_url: str,
        requests_path: Path,
        request_timeout_s: float = 600.0,
        flush_timeout_s: float = 60.0,
        server_failure: Callable[[], str | None] = lambda: None,
        progress: bool | None = None,
        stall_timeout_s: float | None = None,
        deadline_s: float | None = None,
        stream: str = "fast",
        api_key: str | None = None,
        server_metrics_interval_s: float = 0.0,
        server_metrics_path: Path | None = None,
        oversaturation: OversaturationConfig | None = None,
    ):
        if stream not in self.STREAMS:
            raise ValueError(f"stream={stream!r} is not allowed; allowed: {', '.join(self.STREAMS)}")
        self.base_url = base_url.rstrip("/")
        self.stream = stream
        self.requests_path = Path(requests_path)
        self.request_timeout_s = request_timeout_s
        self.flush_timeout_s = flush_timeout_s
        self.server_failure = server_failure
        self.progress = progress
        self.stall_timeout_s = stall_timeout_s
        self.deadline_s = deadline_s
        self._headers = bearer(api_key)
        self.oversaturation = oversaturation if oversaturation is not None and oversaturation.enabled else None
        self.t0 = time.perf_counter()
        self.scraper: ServerMetricsScraper | None = None
        if server_metrics_interval_s and server_metrics_path is not None:
            self.scraper = ServerMetricsScraper(self.base_url, server_metrics_path, server_metrics_interval_s,
                                                self.t0, api_key)
        # Request ids stay readable and joinable across runs; the rid sent to the server is
        # made unique per client so repeated runs against one server never collide.
        self._rid_prefix = uuid.uuid4().hex[:8]
        # The watchdog's view: requests in flight; when the server last answered; seconds in
        # flight since then (quiet_s up to mark_s, plus now - mark_s while in flight); why
        # it stopped the client (None while it has not).
        self._in_flight = 0
        self._progress_s: float | None = None
        self._quiet_s = 0.0
        self._mark_s = 0.0
        self._stop: dict | None = None
        self._phase: dict | None = None
        self._pool: StreamPool | None = None
        # The over-saturation stop's view of the phase: output tokens received, open-loop
        # requests sent (arrivals that got a slot), the phase's detector and next point.
        self._tokens = 0
        self._sent_scheduled = 0
        self._detector: Detector | None = None
        self._next_point_s = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def stream_path(self) -> str:
        """The stream reader requests go through: "httpx" when asked for, or when a proxy
        from the environment applies to base_url (httpx honours it; http_stream does not)."""
        if self.stream == "httpx":
            return "httpx"
        u = urlsplit(self.base_url)
        proxies = urllib.request.getproxies()
        if (u.scheme in proxies or "all" in proxies) and not urllib.request.proxy_bypass(u.hostname or ""):
            return "httpx"
        return "fast"

    def run(self, phases: list[Phase], on_phase_end: Callable[[PhaseResult], None] = lambda _: None) -> list[PhaseResult]:
        """Run the phases; Ctrl-C or SIGTERM cancels what is in flight and raises
        remnant.signals.Interrupted (a KeyboardInterrupt; its message "signal 15" for SIGTERM,
        empty for Ctrl-C). Records of finished requests are already on disk. A stalled
        server or a passed deadline raises ClientStopped.

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
                raise Interrupted(received[0])
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
                except ClientStopped:
                    if not received:
                        raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if received:  # also when the signal came as the last phase ended
            raise Interrupted(received[0])
        return results

    async def run_async(self, phases: list[Phase], on_phase_end=lambda _: None) -> list[PhaseResult]:
        """The phases, with the server's /metrics scraped on its own thread meanwhile
        (stopped however they end, the file complete when this returns)."""
        if self.scraper is not None:
            self.scraper.start()
        work = asyncio.ensure_future(self._run_phases(phases, on_phase_end))
        watchdog = asyncio.create_task(self._watch(work))
        try:
            return await work
        except asyncio.CancelledError:
            # The watchdog cancelled the work, not someone cancelling this task (a signal).
            if self._stop is not None and not asyncio.current_task().cancelling():
                raise ClientStopped(self._stop, self._partial_phase()) from None
            raise
        finally:
            watchdog.cancel()
            work.cancel()
            if self.scraper is not None:
                self.scraper.stop()  # waits for the scrape in flight, if any (its timeout at most)

    async def _run_phases(self, phases: list[Phase], on_phase_end) -> list[PhaseResult]:
        total = sum(len(p.requests) for p in phases)
        limits = httpx.Limits(max_connections=max(p.concurrency for p in phases) + 4)
        timeout = httpx.Timeout(self.request_timeout_s, connect=10.0)
        results = []
        self._pool = None
        if self.stream_path == "fast":
            self._pool = StreamPool(self.base_url, limits.max_connections, connect_timeout_s=10.0,
                                    read_timeout_s=self.request_timeout_s, headers=self._headers)
        with tqdm(total=total, unit="req", disable=None if self.progress is None else not self.progress, dynamic_ncols=True) as bar:
            async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=self._headers) as client:
                try:
                    for phase in phases:
                        bar.set_description(phase.name)
                        result = await self._run_phase(client, phase, bar)
                        results.append(result)
                        on_phase_end(result)
                finally:
                    if self._pool is not None:
                        await self._pool.aclose()
        return results

    async def _watch(self, work: asyncio.Future) -> None:
        """Stop `work` when the server stalls, the deadline passes or the server is
        over-saturated (see the class doc)."""
        step = 0.25 if self.stall_timeout_s is None else min(0.25, self.stall_timeout_s / 8)
        if self.oversaturation is not None:
            step = min(step, point_step_s(self.oversaturation))
        while not work.done():
            await asyncio.sleep(step)
            now = self.now()
            reason = limit = measured = None
            if self.deadline_s is not None and now >= self.deadline_s:
                reason, limit = "deadline", self.deadline_s
            elif (self.stall_timeout_s is not None and self._in_flight
                  and self._quiet_s + now - self._mark_s >= self.stall_timeout_s):
                reason, limit = "stall", self.stall_timeout_s
            elif self.oversaturation is not None and (measured := self._oversaturation_point(now)) is not None:
                reason, limit = "oversaturated", self.oversaturation.window_s
            if reason is not None:
                self._stop = {"reason": reason, "limit_s": float(limit), "at_s": now,
                              "last_progress_s": self._progress_s, "in_flight": self._in_flight,
                              "phase": (self._phase or {}).get("name")}
                if measured is not None:
                    self._stop["oversaturation"] = measured
                work.cancel()
                return

    def _oversaturation_point(self, now: float) -> dict | None:
        """Take a point of the phase in progress for the over-saturation rule (at most one
        per point_step_s, none before the phase's flush is done) and check it."""
        phase = self._phase
        if phase is None or "concurrency" not in phase:
            return None
        rule = self.oversaturation
        if self._detector is None or self._detector.phase_start_s != phase["started"]:
            self._detector = Detector(rule, phase["started"])
            self._next_point_s = now
        if now < self._next_point_s:
            return None
        self._next_point_s = now + point_step_s(rule)
        sample = self.scraper.latest() if self.scraper is not None else None
        if sample is not None and now - sample["t"] > 3 * self.scraper.interval_s + self.scraper.timeout_s:
            sample = None  # the scraper has not answered lately: the server's queue is not known
        arrivals = phase["arrivals"]
        due = 0 if arrivals is None else bisect_right(arrivals, now - phase["started"])
        backlog = max(0, due - self._sent_scheduled)
        held = backlog > 0 or self._in_flight >= phase["concurrency"]
        return self._detector.add(Point(now, None if sample is None else sample.get(QUEUE), backlog,
                                        None if sample is None else sample.get(RUNNING), self._in_flight,
                                        self._tokens, held))

    def _progress(self) -> None:
        """The server answered: a token, or a response's status."""
        self._progress_s = self._mark_s = self.now()
        self._quiet_s = 0.0

    def _in_flight_change(self, delta: int) -> None:
        """Time with nothing in flight is not a stall: the quiet clock runs only while
        requests are in flight (a request that times out leaves it running)."""
        now = self.now()
        if self._in_flight:
            self._quiet_s += now - self._mark_s
        self._mark_s = now
        self._in_flight += delta

    def _partial_phase(self) -> PhaseResult | None:
        p = self._phase
        if p is None:
            return None
        records = p["records"]
        return PhaseResult(p["name"], p["flush"], p["started"], self.now() - p["started"], len(records),
                           sum(not r.success for r in records), records)

    async def flush(self, client: httpx.AsyncClient) -> FlushResult:
        """POST /flush_cache, retried while the server says requests still run (HTTP 400)."""
        start = time.perf_counter()
        attempts, status, message = 0, None, ""
        while True:
            attempts += 1
            try:
                r = await client.post(f"{self.base_url}/flush_cache", timeout=10.0)
                status, message = r.status_code, snippet(r.text)
                if r.status_code == 200:
                    return FlushResult(True, status, attempts, time.perf_counter() - start, message)
                if r.status_code != 400:
                    break  # e.g. 404: the server has no flush endpoint; retrying will not help
            except httpx.HTTPError as exc:
                status, message = None, self._transport_error(exc)
                if why := self.server_failure():
                    raise ServerGone(why) from None
            if time.perf_counter() - start > self.flush_timeout_s:
                message = f"gave up after {self.flush_timeout_s:g}s: {message}"
                break
            await asyncio.sleep(0.25)
        return FlushResult(False, status, attempts, time.perf_counter() - start, message)

    async def _run_phase(self, client: httpx.AsyncClient, phase: Phase, bar: tqdm) -> PhaseResult:
        records: list[RequestRecord] = []
        self._phase = {"name": phase.name, "flush": None, "started": self.now(), "records": records}
        flush = await self.flush(client) if phase.flush_before else None
        started = self.now()
        loop_cpu0, process_cpu0 = time.thread_time(), time.process_time()
        self._tokens = self._sent_scheduled = 0
        self._phase.update(flush=flush, started=started, concurrency=phase.concurrency, arrivals=phase.arrivals_s)
        # Closed loop: each of the C slots holds the time it became free; a request is due
        # then, so dispatch delay shows how late the client really sent it.
        free_since: asyncio.Queue[float] = asyncio.Queue()
        for _ in range(phase.concurrency):
            free_since.put_nowait(started)
        gone: list[str] = []

        def keep(rec: RequestRecord) -> None:
            self._append(rec)
            records.append(rec)
            bar.update(1)

        async def send(index: int, req: PlannedRequest, intended: float,
                       scheduled: float | None = None) -> RequestRecord:
            rec = RequestRecord(id=req.id, phase=phase.name, index=index, intended_start_s=intended,
                                expected_output_tokens=req.max_new_tokens, session=req.session, turn=req.turn,
                                scheduled_s=scheduled)
            self._in_flight_change(+1)
            if scheduled is not None:
                self._sent_scheduled += 1
            try:
                if self._pool is not None:
                    await self._send_fast(req, rec)
                else:
                    await self._send(client, req, rec)
            except asyncio.CancelledError:
                if self._stop is not None:  # stopped by the watchdog: keep what it had
                    rec.error = {
                        "stall": f"stopped: no answer from the server for {self._stop['limit_s']:g}s (stall)",
                        "deadline": f"stopped: workload.deadline_s={self._stop['limit_s']:g} passed",
                        "oversaturated": "stopped: the server was over-saturated (workload.oversaturation)",
                    }[self._stop["reason"]]
                    keep(rec)
                raise
            except Exception as exc:  # noqa: BLE001 - one odd answer must not sink the phase
                rec.error = f"client error: {exc!r}"
            finally:
                self._in_flight_change(-1)
            keep(rec)
            if not rec.success and (why := self.server_failure()):
                gone.append(why)
            return rec

        arrivals = phase.arrivals_s

        async def due(index: int) -> float | None:
            """Open loop: wait until arrival `index` is due and return its time."""
            if arrivals is None:
                return None
            at = started + arrivals[index]
            if at > self.now():
                await asyncio.sleep(at - self.now())
            return at

        async def one(index: int, req: PlannedRequest) -> None:
            scheduled = await due(index)
            free = await free_since.get()
            try:
                if not gone:
                    await send(index, req, free if scheduled is None else max(free, scheduled), scheduled)
            finally:
                free_since.put_nowait(self.now())

        counter = iter(range(len(phase.requests)))
        sessions = list(phase.sessions or [])

        async def user() -> None:
            """Replay sessions one after another: each turn after the previous answer."""
            while sessions and not gone:
                number = len(phase.sessions) - len(sessions)
                session = sessions.pop(0)
                ready = self.now()
                if arrivals is not None and started + arrivals[number] > ready:
                    ready = await due(number)
                scheduled = None if arrivals is None else started + arrivals[number]
                for k, req in enumerate(session):
                    at = ready + (req.think_time_s or 0.0 if k else 0.0)
                    if req.not_before_s is not None:
                        at = max(at, started + req.not_before_s)
                    if at > self.now():
                        await asyncio.sleep(at - self.now())
                    rec = await send(next(counter), req, at, None if k else scheduled)
                    if gone:
                        break
                    if not rec.success:
                        # A session without its previous turn is not the recorded one: the
                        # rest of it is recorded as skipped, so planned and recorded agree.
                        for later in session[k + 1 :]:
                            keep(RequestRecord(id=later.id, phase=phase.name, index=next(counter),
                                               intended_start_s=self.now(), start_s=self.now(),
                                               error=f"skipped: turn {req.turn} of the session failed",
                                               session=later.session, turn=later.turn))
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
        self._phase = None
        return PhaseResult(phase.name, flush, started, self.now() - started, len(records), failed, records,
                           loop_cpu_s=time.thread_time() - loop_cpu0, process_cpu_s=time.process_time() - process_cpu0)

    def _transport_error(self, exc: Exception) -> str:
        """An httpx error as one line; httpx's timeouts carry no message of their own."""
        text = snippet(str(exc))
        if text:
            return f"{type(exc).__name__}: {text}"
        if isinstance(exc, httpx.ReadTimeout):
            return (f"ReadTimeout: no data for {self.request_timeout_s:g}s (workload.request_timeout_s)")
        if isinstance(exc, httpx.ConnectTimeout):
            return "ConnectTimeout: no connection within 10s"
        return type(exc).__name__

    def _payload(self, req: PlannedRequest) -> dict:
        payload = {
            "rid": f"{self._rid_prefix}-{req.id}",
            "sampling_params": {"max_new_tokens": req.max_new_tokens, "temperature": 0.0, "ignore_eos": True},
            "stream": True,
        }
        if req.input_ids is not None:
            payload["input_ids"] = req.input_ids
        else:
            payload["text"] = req.text
        return payload

    async def _send(self, client, req: PlannedRequest, rec: RequestRecord) -> None:
        """Stream one /generate into `rec` (times, tokens, success or error): the reference
        path, httpx and whole-frame parsing; a chunk's time is when its frame was parsed."""
        frames = _Frames(self, rec)
        rec.start_s = self.now()
        try:
            async with client.stream("POST", f"{self.base_url}/generate", json=self._payload(req)) as resp:
                self._progress()
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    rec.error = http_error(resp.status_code, body)
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        frames.done = True
                        break
                    if frames.frame(parse_frame(data.encode()), self.now()):
                        return
                rec.end_s = self.now()
                frames.finish()
        except httpx.HTTPError as exc:
            rec.error = self._transport_error(exc)
        except JSONDecodeError as exc:
            rec.error = f"JSONDecodeError: {snippet(str(exc))}"

    async def _send_fast(self, req: PlannedRequest, rec: RequestRecord) -> None:
        """`_send` through http_stream: each line is read as its bytes arrive, a chunk's
        time is the arrival of the read that completed its frame."""
        frames = _Frames(self, rec)
        t0 = self.t0

        def on_line(buf: bytes, start: int, end: int, t: float) -> int:
            if not buf.startswith(b"data: ", start):
                return CONTINUE
            start += 6
            if end - start == 6 and buf.startswith(b"[DONE]", start):
                frames.done = True
                return END
            return STOP if frames.frame(frame_fields(buf, start, end), t - t0) else CONTINUE

        rec.start_s = self.now()
        try:
            resp = await self._pool.post_lines("/generate", _dumps(self._payload(req)), on_line, self._progress)
        except StreamError as exc:
            message = str(exc)
            if message.startswith("ReadTimeout:"):
                message = f"ReadTimeout: no data for {self.request_timeout_s:g}s (workload.request_timeout_s)"
            rec.error = message
            return
        except JSONDecodeError as exc:
            rec.error = f"JSONDecodeError: {snippet(str(exc))}"
            return
        if resp.status != 200:
            rec.error = http_error(resp.status, resp.body.decode(errors="replace"))
            return
        if rec.error is not None:  # a server error frame
            return
        rec.end_s = resp.end_t - t0
        frames.finish()

    def _append(self, rec: RequestRecord) -> None:
        append_line(self.requests_path, _dumps(rec.to_dict()).decode())


def _dumps(doc) -> bytes:
    """JSON of a payload or record: orjson, a tenth of json.dumps's time on a 512-token record."""
    return orjson.dumps(doc)


class _Frames:
    """One request's frames into its record, the same for both stream paths: tokens counted
    by meta_info.completion_tokens as bench_serving counts them (len(output_ids) where it is
    absent), TTFT and chunk times from the first frame that carried a token."""

    __slots__ = ("client", "rec", "seen", "done")

    def __init__(self, client: LoadClient, rec: RequestRecord):
        self.client, self.rec = client, rec
        self.seen = 0
        self.done = False

    def frame(self, frame: dict, t: float) -> bool:
        """Frame `frame` arrived at `t` (s since the client's t0); True: a server error
        ended the request (recorded)."""
        rec = self.rec
        if "error" in frame:
            err = frame["error"]
            message = err.get("message") if isinstance(err, dict) else err
            rec.error = f"server error: {snippet(str(message))}"
            return True
        meta = frame.get("meta_info") or {}
        # Tokens so far, as bench_serving counts them: completion_tokens (output_ids holds
        # only the new ids when SGLang streams incrementally).
        n = meta.get("completion_tokens")
        if n is None:
            n = len(frame.get("output_ids") or [])
        if n > self.seen:
            if rec.ttft_s is None:
                rec.ttft_s = t - rec.start_s
            rec.chunk_times_s.append(t)
            rec.chunk_tokens.append(n - self.seen)
            client = self.client
            client._tokens += n - self.seen
            self.seen = n
            client._progress_s = client._mark_s = t  # as LoadClient._progress(), at the arrival
            client._quiet_s = 0.0
        rec.prompt_tokens = meta.get("prompt_tokens", rec.prompt_tokens)
        rec.completion_tokens = meta.get("completion_tokens", self.seen)
        rec.cached_tokens = meta.get("cached_tokens", rec.cached_tokens) or 0
        reason = meta.get("finish_reason")
        if reason:
            rec.finish_reason = reason.get("type") if isinstance(reason, dict) else str(reason)
        return False

    def finish(self) -> None:
        """The stream ended (rec.end_s set): success, or why not."""
        rec = self.rec
        if rec.finish_reason == "abort":
            rec.error = "server aborted the request"
        elif not self.done:
            rec.error = "stream ended before [DONE]"
        else:
            rec.success = True
