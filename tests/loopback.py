"""Small real HTTP servers on loopback that answer as SGLang does where a test needs a
server other than remnant-serve (no flush endpoint, incremental streaming, no mode)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator


@contextlib.contextmanager
def loopback_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve `handler` on a free loopback port in a thread; yields the base URL."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}"
    finally:
        srv.shutdown()


def stream_generate(handler: BaseHTTPRequestHandler, n: int, prompt_tokens: int, incremental: bool,
                    delay_s: float = 0.0) -> None:
    """Answer a /generate with n streamed frames, SGLang's SSE: output_ids all ids so far,
    or only the new one (incremental, as with --incremental-streaming-output);
    completion_tokens counts them all."""
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.end_headers()
    for i in range(n):
        frame = {"text": "x", "output_ids": [i] if incremental else list(range(i + 1)), "meta_info": {
            "id": "r", "prompt_tokens": prompt_tokens, "completion_tokens": i + 1, "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": n} if i == n - 1 else None}}
        handler.wfile.write(b"data: " + json.dumps(frame).encode() + b"\n\n")
        handler.wfile.flush()
        if delay_s:
            time.sleep(delay_s)
    handler.wfile.write(b"data: [DONE]\n\n")


def generate_request(handler: BaseHTTPRequestHandler) -> dict | None:
    """The JSON body of a POST to /generate; any other POST path is answered 200 with an
    empty body (flush_cache and the like) and gives None."""
    req = json.loads(handler.rfile.read(int(handler.headers.get("Content-Length", 0))) or b"{}")
    if handler.path == "/generate":
        return req
    handler.send_response(200)
    handler.send_header("Content-Length", "0")
    handler.end_headers()
    return None


class GenerateServer(BaseHTTPRequestHandler):
    """A quiet SGLang stand-in: GET /server_info answers {}, other GETs "ok"; POST /generate
    streams max_new_tokens frames (stream_generate), other POSTs (/flush_cache) answer 200.
    Subclasses change what they test (a /server_info without a mode, no /metrics)."""

    #: GET paths that answer; others 404 (None: every path answers).
    routes: tuple[str, ...] | None = None

    def do_GET(self):  # noqa: N802 - http.server's naming
        if self.routes is not None and self.path not in self.routes:
            self.send_error(404)
            return
        body = b"{}" if self.path == "/server_info" else b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        req = generate_request(self)
        if req is not None:
            stream_generate(self, req["sampling_params"]["max_new_tokens"], prompt_tokens=len(req["input_ids"]),
                            incremental=False)

    def log_message(self, *args):
        pass
