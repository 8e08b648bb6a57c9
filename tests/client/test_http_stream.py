"""http_stream against real sockets on loopback: bodies cut anywhere, keep-alive, ends, errors."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import socketserver
import threading
import time
from typing import Callable, Iterator

import pytest

from remnant.client.http_stream import CONTINUE, END, STOP, StreamError, StreamPool

Handler = Callable[[socket.socket, bytes], bool]  # (connection, request bytes) -> keep the connection open


def _read_request(conn: socket.socket, buf: bytearray) -> bytes | None:
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            return None
        buf += data
    head_end = buf.index(b"\r\n\r\n") + 4
    length = 0
    for line in bytes(buf[:head_end]).split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    while len(buf) < head_end + length:
        buf += conn.recv(65536)
    request = bytes(buf[: head_end + length])
    del buf[: head_end + length]
    return request


@contextlib.contextmanager
def raw_server(handler: Handler) -> Iterator[tuple[str, dict]]:
    """A TCP server on loopback whose connections call `handler` per request; yields the
    base URL and counters (connections accepted, requests served)."""
    counts = {"connections": 0, "requests": 0}

    class H(socketserver.BaseRequestHandler):
        def handle(self):
            counts["connections"] += 1
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buf = bytearray()
            while True:
                request = _read_request(self.request, buf)
                if request is None:
                    return
                counts["requests"] += 1
                try:
                    if not handler(self.request, request):
                        return
                except OSError:
                    return

    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", counts
    finally:
        srv.shutdown()
        srv.server_close()


def _chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
FRAMES = [b'data: {"n": %d}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]


def _post(base_url: str, *, read_timeout_s: float | None = 5.0, requests: int = 1, stop_at: bytes | None = None,
          end_at: bytes | None = None):
    """POST `requests` times one after another; returns ([lines per request], [responses])."""

    async def go():
        pool = StreamPool(base_url, 4, connect_timeout_s=2.0, read_timeout_s=read_timeout_s)
        out, resps = [], []
        try:
            for _ in range(requests):
                lines = []

                def on_line(buf, start, end, t, lines=lines):
                    line = buf[start:end]
                    lines.append(line)
                    return STOP if line == stop_at else END if line == end_at else CONTINUE

                resps.append(await pool.post_lines("/generate", b"{}", on_line))
                out.append(lines)
        finally:
            await pool.aclose()
        return out, resps

    return asyncio.run(go())


def _lines_of(frames: list[bytes]) -> list[bytes]:
    return [f.rstrip(b"\n") for f in frames]


@pytest.mark.parametrize("piece", [1, 3, 7, 1 << 20], ids=["bytewise", "3-bytes", "7-bytes", "whole"])
def test_a_body_cut_anywhere_gives_the_same_lines(piece):
    """Frames split across reads at every offset (bytewise: one byte a send, with pauses so
    each arrives in its own read) arrive whole and in order."""
    wire = STREAM_HEAD + _chunked(*FRAMES[:3], FRAMES[3] + FRAMES[4], b"data: [DO", b"NE]\n\n")

    def handler(conn, request):
        for i in range(0, len(wire), piece):
            conn.sendall(wire[i : i + piece])
            if piece < 8:
                time.sleep(0.0005)
        return True

    with raw_server(handler) as (url, _):
        (lines,), (resp,) = _post(url)
    assert resp.status == 200 and not resp.stopped
    assert lines == _lines_of(FRAMES)


def test_chunk_extensions_trailers_and_crlf_lines():
    wire = (STREAM_HEAD + b"b;name=value\r\ndata: 1\r\n\r\n\r\n" + b"8\r\ndata: 2\n\r\n"
            + b"0\r\nX-Trailer: yes\r\n\r\n")
    with raw_server(lambda conn, req: conn.sendall(wire) or True) as (url, counts):
        (lines,), (resp,) = _post(url)
    assert lines == [b"data: 1", b"data: 2"] and resp.status == 200


def test_length_and_close_delimited_bodies_and_a_last_line_without_newline():
    def length(conn, request):
        body = b"data: a\n\ndata: b"
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
        return True

    def close(conn, request):
        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: a\n\ndata: b")
        return False  # closes the connection: the body's end

    for handler in (length, close):
        with raw_server(handler) as (url, counts):
            lines, resps = _post(url, requests=2)
        assert lines == [[b"data: a", b"data: b"]] * 2
        assert counts["connections"] == (1 if handler is length else 2)


def test_keep_alive_reuses_one_connection_and_retries_one_the_server_closed():
    served = []

    def handler(conn, request):
        conn.sendall(STREAM_HEAD + _chunked(*FRAMES))
        served.append(1)
        return len(served) != 2  # after the second answer, close the idle connection

    with raw_server(handler) as (url, counts):
        lines, resps = _post(url, requests=4)
    assert lines == [_lines_of(FRAMES)] * 4
    # 1 and 2 on the first connection; 3 finds it closed, is sent again on a second one, 4 reuses that.
    assert counts["connections"] == 2 and counts["requests"] == 4


def test_end_finishes_with_the_read_when_the_body_goes_on():
    """[DONE] then a body that never ends: the request ends at once, not at the read timeout."""

    def handler(conn, request):
        conn.sendall(STREAM_HEAD + b"".join(b"%x\r\n%b\r\n" % (len(f), f) for f in FRAMES))
        time.sleep(3)
        return False

    with raw_server(handler) as (url, _):
        t0 = time.monotonic()
        (lines,), (resp,) = _post(url, read_timeout_s=10, end_at=b"data: [DONE]")
        elapsed = time.monotonic() - t0
    assert elapsed < 2 and resp.stopped and lines == _lines_of(FRAMES)


def test_stop_ends_the_request_at_that_line():
    with raw_server(lambda conn, req: conn.sendall(STREAM_HEAD + _chunked(*FRAMES)) or True) as (url, _):
        (lines,), (resp,) = _post(url, stop_at=b'data: {"n": 1}')
    assert lines == _lines_of(FRAMES[:2]) and resp.stopped


def test_an_error_status_returns_its_body():
    body = b'{"error": {"message": "too long"}}'

    def handler(conn, request):
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
        return True

    with raw_server(handler) as (url, _):
        (lines,), (resp,) = _post(url)
    assert resp.status == 400 and resp.body == body and lines == []


def test_read_timeout_connect_error_and_a_cut_stream_are_named():
    def silent(conn, request):
        time.sleep(2)
        return False

    with raw_server(silent) as (url, _):
        with pytest.raises(StreamError, match=r"^ReadTimeout: no data for 0.3s$"):
            _post(url, read_timeout_s=0.3)

    def cut(conn, request):
        conn.sendall(STREAM_HEAD + b"%x\r\n%b\r\n" % (len(FRAMES[0]), FRAMES[0]))
        return False

    with raw_server(cut) as (url, _):
        with pytest.raises(StreamError, match=r"^RemoteProtocolError: the server closed the connection before "
                                              r"the response ended"):
            _post(url)

    def garbage(conn, request):
        conn.sendall(STREAM_HEAD + b"zz\r\n")
        return False

    with raw_server(garbage) as (url, _):
        with pytest.raises(StreamError, match=r"^RemoteProtocolError: bad chunk size line b'zz'"):
            _post(url)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(StreamError, match=r"^ConnectError: "):
            _post(f"http://127.0.0.1:{port}")


def test_base_urls_it_refuses():
    for url in ("ftp://x", "localhost:30000", "http://"):
        with pytest.raises(ValueError, match="is not an http:// or https:// URL"):
            StreamPool(url, 1)
