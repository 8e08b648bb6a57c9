"""A model-free stream server: SGLang's /generate frames, as fast as one core can send them.

The client ceiling benchmark (`remnant.client.ceiling`) drives this server to find how many
tokens per second a load client can ingest: the server computes nothing, so whatever
limits the rate is the client (or this server, whose CPU use `/stats` reports per busy
period so a reader can tell which).

It answers what the two clients it serves ask for, with SGLang 0.5.18's shapes:

- POST /generate (`input_ids` or `text`, `sampling_params.max_new_tokens`, `stream`, `rid`):
  streamed as chunked `data: {json}\\n\\n` frames ending `data: [DONE]\\n\\n`, one frame per
  token, each as SGLang writes it (orjson's compact separators): cumulative `text` (4
  bytes a token), cumulative `output_ids` (only the new id with `incremental=True`, as
  SGLang's --incremental-streaming-output) and the `meta_info` keys of
  remnant.engine.frontend (id, finish_reason, prompt_tokens, completion_tokens,
  cached_tokens, ...). Not streamed: the last frame as one JSON body.
- POST /flush_cache, GET /health, /health_generate: 200.
- GET /v1/models, /model_info (the tokenizer path SGLang's bench client loads), /server_info.
- GET /stats: busy periods (from the first stream to the last one's end), each with its
  monotonic start and end (time.monotonic(), comparable across processes), this process's
  CPU seconds, requests, frames and bytes. POST /stats/reset forgets them.

Streams are sent the way a batched decoder emits them: each step writes one frame to every
stream whose socket takes data, then yields to the event loop. A stream whose transport
is paused (its client reads slower than the server writes) waits without costing CPU.
The command that starts it: remnant.cli.stream_server.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import time

#: Bytes of text per token: English averages about 4 characters a token.
TEXT_BYTES_PER_TOKEN = 4
#: SGLang's DeepSeek-V4 vocabulary is about 129k: ids of up to 6 digits.
VOCAB = 129280
SERVED_MODEL_NAME = "ceiling"
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024

_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed",
            413: b"Payload Too Large", 431: b"Request Header Fields Too Large"}


class _Tokens:
    """The output every request streams: token k's text and id, prefixes as bytes.

    text[: 4 * k] is the text of the first k tokens; ids[: ends[k]] their ids, comma
    separated (JSON array content). Grown on demand, never shrunk.
    """

    def __init__(self) -> None:
        self.n = 0
        self.text = b""
        self.ids = b""
        self.ends = [0]
        self.id_bytes: list[bytes] = []

    def ensure(self, n: int) -> None:
        if n <= self.n:
            return
        letters = b"abcdefghijklmnopqrstuvwxyz"
        text, ids, ends = bytearray(self.text), bytearray(self.ids), self.ends
        for k in range(self.n, n):
            text += b" " + bytes([letters[k % 26], letters[(k // 26) % 26], letters[(k * 7) % 26]])
            tok = str((1000 + k * 7919) % VOCAB).encode()
            self.id_bytes.append(tok)
            ids += (b"," + tok) if k else tok
            ends.append(len(ids))
        self.text, self.ids, self.n = bytes(text), bytes(ids), n


class _Stream:
    """One streaming /generate: which frame comes next and how to write it."""

    __slots__ = ("conn", "n", "k", "prompt_tokens", "incremental", "head", "t_recv")

    def __init__(self, conn: "_Connection", rid: str, n: int, prompt_tokens: int, incremental: bool):
        self.conn = conn
        self.n = n
        self.k = 0
        self.prompt_tokens = prompt_tokens
        self.incremental = incremental
        self.head = json.dumps(rid).encode()
        self.t_recv = time.perf_counter()


class StreamServer:
    """The server's state: open connections, streams in flight, busy-period statistics."""

    def __init__(self, tokenizer_dir: str | None = None, incremental: bool = False):
        self.tokenizer_dir = tokenizer_dir
        self.incremental = incremental
        self.tokens = _Tokens()
        self.streams: list[_Stream] = []
        self.wake = asyncio.Event()
        self.periods: list[dict] = []
        self._period: dict | None = None

    # -- statistics -------------------------------------------------------------------

    @staticmethod
    def _cpu_s() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    def _begin(self) -> None:
        if self._period is None:
            self._period = {"start_s": time.monotonic(), "cpu0": self._cpu_s(), "requests": 0, "frames": 0,
                            "bytes": 0}

    def _end_if_idle(self) -> None:
        if self._period is not None and not self.streams:
            p = self._period
            end = time.monotonic()
            self.periods.append({"start_s": p["start_s"], "end_s": end, "cpu_s": self._cpu_s() - p["cpu0"],
                                 "requests": p["requests"], "frames": p["frames"], "bytes": p["bytes"]})
            self._period = None

    def stats(self) -> dict:
        return {"periods": list(self.periods), "busy": self._period is not None,
                "cpus": sorted(os.sched_getaffinity(0)), "pid": os.getpid()}

    # -- streaming --------------------------------------------------------------------

    def start_stream(self, s: _Stream) -> None:
        self._begin()
        self._period["requests"] += 1
        self.tokens.ensure(s.n)
        self.streams.append(s)
        self.wake.set()

    def frame(self, s: _Stream) -> bytes:
        """Frame k (1-based) of `s` as one HTTP chunk."""
        k = s.k = s.k + 1
        t = self.tokens
        ids = t.id_bytes[k - 1] if s.incremental else t.ids[: t.ends[k]]
        if k < s.n:
            reason = b"null"
            extra = b""
        else:
            reason = b'{"type":"length","length":%d}' % s.n
            extra = b',"e2e_latency":%r,"response_sent_to_client_ts":%r' % (
                time.perf_counter() - s.t_recv, time.time())
        body = b"".join((
            b'data: {"text":"', t.text[: TEXT_BYTES_PER_TOKEN * k], b'","output_ids":[', ids,
            b'],"meta_info":{"id":', s.head, b',"finish_reason":', reason,
            b',"prompt_tokens":%d,"weight_version":"default","num_retractions":0,"reasoning_tokens":0,'
            b'"completion_tokens":%d,"cached_tokens":0,"cached_tokens_details":null,"dp_rank":0' % (
                s.prompt_tokens, k),
            extra, b"}}\n\n"))
        return b"%x\r\n%b\r\n" % (len(body), body)

    async def decode_loop(self) -> None:
        """Each step: one frame to every stream whose transport takes data; then yield."""
        done = b"%x\r\ndata: [DONE]\n\n\r\n0\r\n\r\n" % len(b"data: [DONE]\n\n")
        while True:
            if not self.streams:
                self.wake.clear()
                await self.wake.wait()
                continue
            wrote = 0
            nbytes = 0
            live = []
            for s in self.streams:
                conn = s.conn
                if conn.closed:
                    continue
                if conn.paused:
                    live.append(s)
                    continue
                chunk = self.frame(s)
                if s.k >= s.n:
                    chunk += done
                    conn.transport.write(chunk)
                    conn.stream_done()
                else:
                    conn.transport.write(chunk)
                    live.append(s)
                wrote += 1
                nbytes += len(chunk)
            self.streams = live
            if self._period is not None:
                self._period["frames"] += wrote
                self._period["bytes"] += nbytes
            self._end_if_idle()
            if wrote == 0 and self.streams:
                # Every live stream waits for its client: sleep until one resumes.
                self.wake.clear()
                await self.wake.wait()
            else:
                await asyncio.sleep(0)

    def stream_gone(self) -> None:
        """A connection closed: drop its stream (the next step skips it) and wake the loop."""
        self.wake.set()


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: requests one after another (keep-alive), no pipelining
    while a stream is open."""

    def __init__(self, server: StreamServer):
        self.server = server
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.paused = False
        self.closed = False
        self.streaming = False
        self.close_after = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.server.stream_gone()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.server.wake.set()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._serve_buffered()

    def stream_done(self) -> None:
        self.streaming = False
        if self.close_after:
            self.transport.close()
        else:
            self._serve_buffered()

    def _serve_buffered(self) -> None:
        while not self.streaming and not self.closed:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEADER_BYTES:
                    self._reply(431, {"error": "request headers too large"}, close=True)
                return
            head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            try:
                method, target, version = head[0].split(" ", 2)
            except ValueError:
                self._reply(400, {"error": f"bad request line {head[0][:80]!r}"}, close=True)
                return
            headers = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            if "chunked" in headers.get("transfer-encoding", "").lower():
                self._reply(400, {"error": "chunked request bodies are not supported; send Content-Length"},
                            close=True)
                return
            length = int(headers.get("content-length", "0") or 0)
            if length > MAX_BODY_BYTES:
                self._reply(413, {"error": f"body of {length} bytes; at most {MAX_BODY_BYTES}"}, close=True)
                return
            if len(self.buf) < end + 4 + length:
                return
            body = bytes(self.buf[end + 4 : end + 4 + length])
            del self.buf[: end + 4 + length]
            conn_header = headers.get("connection", "").lower()
            self.close_after = conn_header == "close" or (version == "HTTP/1.0" and conn_header != "keep-alive")
            self._route(method, target.split("?", 1)[0], body)

    def _reply(self, status: int, doc, close: bool = False) -> None:
        body = json.dumps(doc).encode()
        self.transport.write(b"HTTP/1.1 %d %b\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (
            status, _REASONS.get(status, b"Error"), len(body), body))
        if close or self.close_after:
            self.transport.close()
            self.closed = True

    def _route(self, method: str, path: str, body: bytes) -> None:
        srv = self.server
        if path == "/generate" and method in ("POST", "PUT"):
            self._generate(body)
        elif path in ("/health", "/health_generate", "/flush_cache"):
            self._reply(200, {})
        elif path == "/v1/models":
            self._reply(200, {"object": "list", "data": [{"id": SERVED_MODEL_NAME, "object": "model",
                                                          "owned_by": "remnant", "root": SERVED_MODEL_NAME}]})
        elif path in ("/model_info", "/get_model_info"):
            self._reply(200, {"model_path": srv.tokenizer_dir, "tokenizer_path": srv.tokenizer_dir,
                              "served_model_name": SERVED_MODEL_NAME, "is_generation": True})
        elif path in ("/server_info", "/get_server_info"):
            self._reply(200, {"server": "remnant.client.stream_server", "incremental": srv.incremental})
        elif path == "/stats":
            self._reply(200, srv.stats())
        elif path == "/stats/reset" and method == "POST":
            srv.periods.clear()
            self._reply(200, {})
        else:
            self._reply(404, {"error": f"{method} {path} is not served here"})

    def _generate(self, body: bytes) -> None:
        try:
            req = json.loads(body)
            params = req.get("sampling_params") or {}
            n = int(params.get("max_new_tokens", 128))
            if n < 1:
                raise ValueError(f"sampling_params.max_new_tokens={n}; it must be >= 1")
            if req.get("input_ids") is not None:
                prompt_tokens = len(req["input_ids"])
            else:
                # No tokenizer here: a prompt's token count is estimated at 4 bytes a token.
                prompt_tokens = max(1, len(str(req.get("text", ""))) // TEXT_BYTES_PER_TOKEN)
            rid = str(req.get("rid") or f"req-{id(self):x}-{time.perf_counter_ns():x}")
        except (ValueError, TypeError, AttributeError) as exc:
            self._reply(400, {"error": {"message": f"bad /generate body: {exc}"}})
            return
        s = _Stream(self, rid, n, prompt_tokens, self.server.incremental)
        if not req.get("stream"):
            self.server.tokens.ensure(n)
            s.k = n - 1
            frame = self.server.frame(s)
            doc = frame[frame.index(b"data: ") + 6 : frame.rindex(b"\n\n\r\n")]
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                                 % (len(doc), doc))
            if self.close_after:
                self.transport.close()
            return
        self.streaming = True
        self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
        self.server.start_stream(s)


async def serve(host: str, port: int, tokenizer_dir: str | None, incremental: bool, ready=None) -> None:
    """Serve until cancelled; `ready(port)` is called once the socket listens."""
    srv = StreamServer(tokenizer_dir, incremental)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(srv), host, port, backlog=4096)
    decoder = asyncio.create_task(srv.decode_loop())
    if ready is not None:
        ready(server.sockets[0].getsockname()[1])
    try:
        async with server:
            await server.serve_forever()
    finally:
        decoder.cancel()
