"""A minimal HTTP/1.1 client for streamed responses, built for the load client's ingestion rate.

The load client spends its CPU on the frames of streamed /generate answers: SGLang sends one
`data: {json}` frame per token, each in its own HTTP chunk. A general HTTP stack (httpx's
pure-Python h11, aiohttp's stream reader) wakes a coroutine per chunk or per line; here the
connection's `data_received` de-chunks what one read returned and hands every complete line
to a callback on the spot, with the time the read returned (the lines' arrival time). No
coroutine runs per frame; the request's coroutine waits once, for the end of the response.

Scope, as the load client needs it: POST with a body, `http` and `https`, keep-alive
connections pooled per client, responses with chunked, Content-Length or close-delimited
bodies, a connect timeout and a read timeout (no data for `read_timeout_s`). No proxies,
redirects, compression or pipelining; `remnant.client.runner` uses httpx (its plain
reference path) where a proxy applies to the server's URL.

Errors are raised as StreamError with the message the runner records, named as httpx names
them: "ConnectError: ...", "ConnectTimeout: ...", "ReadTimeout: ...", "RemoteProtocolError: ...".
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

#: on_line(buf, start, end, t): one non-empty line of the body, buf[start:end] without its
#: "\n" (a trailing "\r" is stripped too), arriving at perf_counter() time t. It returns CONTINUE,
#: STOP (end the request now: the connection is closed) or END (the caller has what it
#: wanted, e.g. `data: [DONE]`: the request ends with the body, or with the read that
#: brought this line if the body goes on; later lines are not passed).
LineCallback = Callable[[bytes, int, int, float], int]
CONTINUE, STOP, END = 0, 1, 2

_HEAD_LIMIT = 64 * 1024


class StreamError(Exception):
    """A transport failure, its message as the runner records it ("ReadTimeout: ...")."""


class Response:
    """What a streamed request ended with: status, headers (lower-case names) and, unless
    the status was 200, the body (bytes) for the error message."""

    __slots__ = ("status", "headers", "body", "stopped", "end_t")

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        self.stopped = False  # on_line returned STOP, or END before the body ended
        self.end_t = 0.0  # perf_counter() time of the read that ended the request


class _Retry(Exception):
    """A pooled connection that the server had closed: send again on a fresh one."""


class _Conn(asyncio.Protocol):
    """One connection; one request at a time. States: head, chunk size, chunk data,
    chunk trailer, length-delimited body, close-delimited body, idle."""

    def __init__(self, pool: "StreamPool"):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self._reset(None, None)

    def _reset(self, on_line, fut, on_head=None) -> None:
        self.on_line: LineCallback | None = on_line
        self.on_head: Callable[[], None] | None = on_head
        self.ending = False  # on_line returned END
        self.fut: asyncio.Future | None = fut
        self.resp = Response()
        self.state = "head"
        self.buf = b""
        self.partial = bytearray()  # a line not yet ended by "\n"
        self.remaining = 0  # bytes left in the current chunk or length-delimited body
        self.keep_alive = False
        self.got_data = False
        self.last_rx = 0.0
        self.collect: bytearray | None = None  # the body of a non-200 answer

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.pool._forget(self)
        fut = self.fut
        if fut is None or fut.done():
            return
        if self.state == "until_close":
            t = time.perf_counter()
            self._flush_partial(t)
            self._finish(t)
        elif self.reused and not self.got_data:
            fut.set_exception(_Retry())
        else:
            where = "before the response" if not self.got_data else "before the response ended"
            detail = f" ({exc})" if exc else ""
            fut.set_exception(StreamError(f"RemoteProtocolError: the server closed the connection {where}{detail}"))

    def data_received(self, data: bytes) -> None:
        t = time.perf_counter()
        self.got_data = True
        self.last_rx = t
        if self.fut is None or self.fut.done():
            return  # bytes after a stopped or finished response: the connection is dropped
        try:
            self._consume(self.buf + data if self.buf else data, t)
            if self.ending and not self.fut.done():
                self._stop(t)
        except StreamError as exc:
            self._fail(exc)
        except Exception as exc:  # noqa: BLE001 - a callback's error ends its request, not the loop
            self._fail(exc)

    # -- parsing ----------------------------------------------------------------------

    def _consume(self, buf: bytes, t: float) -> None:
        pos, n = 0, len(buf)
        self.buf = b""
        while pos < n:
            state = self.state
            if state == "chunk_data":
                take = min(self.remaining, n - pos)
                if self._body(buf, pos, pos + take, t):
                    return
                pos += take
                self.remaining -= take
                if self.remaining == 0:
                    self.state = "chunk_end"
            elif state == "chunk_size":
                i = buf.find(b"\n", pos)
                if i < 0:
                    if n - pos > 1024:
                        raise StreamError("RemoteProtocolError: a chunk size line longer than 1024 bytes")
                    self.buf = buf[pos:]
                    return
                try:
                    size = int(buf[pos:i], 16)
                except ValueError:  # chunk extensions (";name=value"), or garbage
                    size = self._chunk_size(buf[pos:i])
                if size < 0:
                    raise StreamError(f"RemoteProtocolError: negative chunk size {bytes(buf[pos:i][:40])!r}")
                pos = i + 1
                if size == 0:
                    self.state = "trailer"
                elif pos + size + 2 <= n:
                    # The whole chunk and its CRLF are here: the common case, in one step.
                    if self._body(buf, pos, pos + size, t):
                        return
                    pos += size
                    if buf[pos : pos + 2] != b"\r\n":
                        raise StreamError("RemoteProtocolError: a chunk's data is not followed by CRLF")
                    pos += 2
                else:
                    self.remaining = size
                    self.state = "chunk_data"
            elif state == "chunk_end":
                # The CRLF after a chunk's data.
                if n - pos < 2:
                    self.buf = buf[pos:]
                    return
                if buf[pos : pos + 2] != b"\r\n":
                    raise StreamError("RemoteProtocolError: a chunk's data is not followed by CRLF")
                pos += 2
                self.state = "chunk_size"
            elif state == "trailer":
                # Trailer fields, if any, then an empty line.
                i = buf.find(b"\n", pos)
                if i < 0:
                    self.buf = buf[pos:]
                    return
                empty = not buf[pos:i].strip()
                pos = i + 1
                if empty:
                    self._flush_partial(t)
                    self._finish(t)
                    return
            elif state == "length":
                take = min(self.remaining, n - pos)
                if self._body(buf, pos, pos + take, t):
                    return
                pos += take
                self.remaining -= take
                if self.remaining == 0:
                    self._flush_partial(t)
                    self._finish(t)
                    return
            elif state == "until_close":
                if self._body(buf, pos, n, t):
                    return
                pos = n
            elif state == "head":
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    if n - pos > _HEAD_LIMIT:
                        raise StreamError(f"RemoteProtocolError: response head longer than {_HEAD_LIMIT} bytes")
                    self.buf = buf[pos:]
                    return
                self._head(buf[pos:end].decode("latin-1"))
                pos = end + 4
                if self.on_head is not None:
                    self.on_head()
                if self.state == "done":
                    self._finish(t)
                    return
            else:  # idle or done: bytes nobody asked for
                raise StreamError("RemoteProtocolError: data after the end of the response")

    @staticmethod
    def _chunk_size(line: bytes) -> int:
        try:
            return int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise StreamError(f"RemoteProtocolError: bad chunk size line {bytes(line[:40]).strip()!r}") from None

    def _head(self, head: str) -> None:
        lines = head.split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise StreamError(f"RemoteProtocolError: bad status line {lines[0][:80]!r}")
        resp = self.resp
        resp.status = int(parts[1])
        headers = resp.headers
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        conn = headers.get("connection", "").lower()
        self.keep_alive = parts[0] == "HTTP/1.1" and conn != "close" or conn == "keep-alive"
        if resp.status != 200:
            self.collect = bytearray()
        if resp.status in (204, 304) or 100 <= resp.status < 200:
            self.state = "done"
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self.state = "chunk_size"
        elif "content-length" in headers:
            try:
                self.remaining = int(headers["content-length"])
            except ValueError:
                raise StreamError(f"RemoteProtocolError: bad Content-Length {headers['content-length']!r}") from None
            self.state = "length" if self.remaining else "done"
        else:
            self.keep_alive = False
            self.state = "until_close"

    def _body(self, buf: bytes, start: int, end: int, t: float) -> bool:
        """Body bytes buf[start:end]: complete lines to the callback; True to stop."""
        if self.collect is not None:
            self.collect += buf[start:end]
            return False
        if self.ending:
            return False
        partial = self.partial
        if partial:
            i = buf.find(b"\n", start, end)
            if i < 0:
                partial += buf[start:end]
                return False
            partial += buf[start:i]
            line = bytes(partial)
            partial.clear()
            if line and self._line(line, 0, len(line), t):
                return True
            start = i + 1
        while start < end:
            i = buf.find(b"\n", start, end)
            if i < 0:
                partial += buf[start:end]
                return False
            if i > start and self._line(buf, start, i, t):
                return True
            start = i + 1
        return False

    def _line(self, buf: bytes, start: int, end: int, t: float) -> bool:
        """One line to on_line (empty lines, SSE's event separators, are not passed); True
        when no more lines are wanted."""
        if buf[end - 1] == 13:  # "\r"
            end -= 1
            if end == start:
                return False
        what = self.on_line(buf, start, end, t)
        if not what:
            return False
        if what == STOP:
            self._stop(t)
            return True
        self.ending = True
        return False

    def _flush_partial(self, t: float) -> None:
        """A last line without its "\\n" at the end of the body."""
        if self.partial and self.collect is None and self.fut is not None and not self.fut.done():
            line = bytes(self.partial)
            self.partial.clear()
            if line:
                self._line(line, 0, len(line), t)

    # -- ends -------------------------------------------------------------------------

    def _finish(self, t: float) -> None:
        fut = self.fut
        self.resp.end_t = t
        if self.collect is not None:
            self.resp.body = bytes(self.collect)
        self.state = "idle"
        if fut is not None and not fut.done():
            fut.set_result(self.resp)
        if self.keep_alive and not self.closed and not self.buf:
            self.pool._release(self)
        else:
            self.close()

    def _stop(self, t: float) -> None:
        fut = self.fut
        self.resp.stopped = True
        self.resp.end_t = t
        self.close()
        if fut is not None and not fut.done():
            fut.set_result(self.resp)

    def _fail(self, exc: BaseException) -> None:
        fut = self.fut
        self.close()
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    def close(self) -> None:
        self.closed = True
        self.pool._forget(self)
        if self.transport is not None:
            self.transport.close()


class StreamPool:
    """Pooled HTTP/1.1 connections to the origin of `base_url` (scheme, host, port).

    max_connections: most connections open at once (others wait for one to be free).
    connect_timeout_s: for TCP (and TLS) setup. read_timeout_s: longest wait for data once
        a request is sent; None: no limit. headers: sent with every request (an API key's
        Authorization).
    """

    def __init__(self, base_url: str, max_connections: int, connect_timeout_s: float = 10.0,
                 read_timeout_s: float | None = 600.0, headers: dict[str, str] | None = None):
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"base_url={base_url!r} is not an http:// or https:// URL with a host")
        self.scheme, self.host = u.scheme, u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.prefix = u.path.rstrip("/")
        default_port = self.port == (443 if u.scheme == "https" else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if default_port else f"{host}:{self.port}"
        self.connect_timeout_s = connect_timeout_s
        for name, value in (headers or {}).items():
            if any(c in f"{name}{value}" for c in "\r\n"):
                raise ValueError(f"header {name} holds a line break; a header is one line")
        self._extra_headers = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        self.read_timeout_s = read_timeout_s
        self._ssl = ssl.create_default_context() if u.scheme == "https" else None
        self._idle: list[_Conn] = []
        self._open: set[_Conn] = set()
        self._slots = asyncio.Semaphore(max_connections)

    def _release(self, conn: _Conn) -> None:
        conn.on_line = conn.fut = None
        self._idle.append(conn)

    def _forget(self, conn: _Conn) -> None:
        self._open.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(self), self.host, self.port, ssl=self._ssl,
                                       server_hostname=self.host if self._ssl else None),
                self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise StreamError(f"ConnectTimeout: no connection within {self.connect_timeout_s:g}s") from None
        except OSError as exc:
            raise StreamError(f"ConnectError: {exc}") from None
        self._open.add(conn)
        return conn

    def _request_bytes(self, method: str, path: str, body: bytes) -> bytes:
        return (f"{method} {self.prefix}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
                f"Content-Type: application/json\r\nAccept: */*\r\n{self._extra_headers}"
                f"Content-Length: {len(body)}\r\n\r\n"
                ).encode("latin-1") + body

    async def post_lines(self, path: str, body: bytes, on_line: LineCallback,
                         on_head: Callable[[], None] | None = None) -> Response:
        """POST `body` (JSON) to `path`; each line of a 200 answer's body goes to `on_line`
        as it arrives; `on_head` runs when the response's head has come. Returns when the
        body ended or `on_line` ended it; raises StreamError on a transport failure."""
        request = self._request_bytes("POST", path, body)
        async with self._slots:
            for attempt in (0, 1):
                conn = None
                while self._idle:
                    c = self._idle.pop()
                    if not c.closed and not c.transport.is_closing():
                        conn = c
                        break
                if conn is None:
                    conn = await self._connect()
                    conn.reused = False
                else:
                    conn.reused = True
                fut = asyncio.get_running_loop().create_future()
                conn._reset(on_line, fut, on_head)
                conn.transport.write(request)
                try:
                    return await self._wait(conn, fut)
                except _Retry:
                    continue
                except BaseException:
                    conn.close()
                    raise
            raise StreamError("RemoteProtocolError: the server closed the connection before the response")

    async def _wait(self, conn: _Conn, fut: asyncio.Future) -> Response:
        """The response, or ReadTimeout when no data came for read_timeout_s. The timer
        is re-armed from the last arrival, not reset per read."""
        limit = self.read_timeout_s
        if limit is None:
            return await fut
        loop = asyncio.get_running_loop()
        conn.last_rx = time.perf_counter()
        handle = None

        def check() -> None:
            nonlocal handle
            if fut.done():
                return
            idle = time.perf_counter() - conn.last_rx
            if idle >= limit:
                conn.fut = None
                conn.close()
                fut.set_exception(StreamError(f"ReadTimeout: no data for {limit:g}s"))
            else:
                handle = loop.call_later(limit - idle, check)

        handle = loop.call_later(limit, check)
        try:
            return await fut
        finally:
            handle.cancel()

    async def aclose(self) -> None:
        for conn in list(self._open) + list(self._idle):
            conn.close()
        self._idle.clear()
        self._open.clear()
