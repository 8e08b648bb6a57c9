"""`remnant-serve`: the embedded reference engine behind SGLang's HTTP API (docs/engine.md).

Routes and shapes follow SGLang 0.5.18's http_server (GenerateReqInput in, the tokenizer
manager's out dicts out) and its OpenAI-compatible endpoints, so a client written for
SGLang works unchanged:

    remnant-serve --model-dir models/tiny --port 30000
    curl -s localhost:30000/generate -H 'Content-Type: application/json' \
        -d '{"text": "hi", "sampling_params": {"max_new_tokens": 8}}'

This module is the app factory and the command line. What is served (the model loaded into
an engine, its description) comes from remnant.engine.served, kept in `app.state`; the
routes are routers reading it there: SGLang's own in remnant.engine.sglang_api, the OpenAI
ones in remnant.engine.openai_api. Request schemas live in remnant.engine.api, the bridge
to the engine thread in remnant.engine.frontend.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
from pathlib import Path

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from remnant.api_key import SERVER_ENV as API_KEY_ENV
from remnant.engine.api import describe_errors, error_body
from remnant.engine.args import EngineArgs, RetentionArgs, add_capture_arguments, capture_from_namespace
from remnant.engine.auth import ApiKeyMiddleware
from remnant.engine.openai_api import router as openai_router
from remnant.engine.served import Served, load_served
from remnant.engine.sglang_api import router as sglang_router
from remnant.kv.modes import MODE_NAMES

log = logging.getLogger("remnant.serve")


def create_app(model_dir: Path, mode: str = "native", retention: RetentionArgs | None = None,
               engine_args: EngineArgs | None = None, capture=None, api_key: str | None = None) -> FastAPI:
    """Load the model directory and build the FastAPI app (the engine starts with the app).
    capture: remnant.kv.capture_recorder.CaptureSettings, or None. api_key: see app_for."""
    return app_for(load_served(model_dir, mode, retention, engine_args, capture), api_key)


def app_for(served: Served, api_key: str | None = None) -> FastAPI:
    """The app serving `served`: its engine runs while the app does; the routers
    (remnant.engine.sglang_api, remnant.engine.openai_api) read it from app.state. With an
    api_key, routes need it as SGLang's --api-key does (remnant.engine.auth)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        served.engine.start()
        log.info("engine ready: model loaded in %.2fs", served.load_s)
        yield
        served.engine.stop()
        if served.recorder is not None:
            # A capture short of its budget is still written when the server stops.
            served.recorder.close()

    app = FastAPI(title="remnant-serve", lifespan=lifespan)
    app.state.engine = served.engine
    app.state.frontend = served.frontend
    app.state.info = served.info
    app.state.recorder = served.recorder
    _add_error_handlers(app)
    app.include_router(sglang_router)
    app.include_router(openai_router)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, key=api_key)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Error bodies as SGLang's http_server answers them, and never a bare 500 page."""

    @app.exception_handler(RequestValidationError)
    async def invalid(_http: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_errors(exc.errors())
        return error_body(message, 400, "Bad Request", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_http: HttpRequest, exc: StarletteHTTPException) -> JSONResponse:
        return error_body(str(exc.detail), exc.status_code, str(exc.status_code))

    @app.exception_handler(Exception)
    async def internal(http: HttpRequest, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", http.method, http.url.path)
        return error_body(f"Internal server error: {exc!r}", 500, "InternalServerError")


def _bind(host: str, port: int) -> socket.socket:
    """Bind the listening socket here so --port 0 gets a free port with no race.

    The protocol is named (IPPROTO_TCP, not 0) because asyncio sets TCP_NODELAY only on
    connections whose socket says TCP: without it Nagle's algorithm held each response
    write until the client's delayed ACK, adding ~40 ms to back-to-back requests and
    stream frames on a keep-alive connection."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="remnant-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, type=Path, help="HF-style model directory (config.json + tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    p.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    p.add_argument("--mode", default="native", choices=MODE_NAMES)
    # The key's default comes from the environment, where ps and recorded command lines
    # cannot see it (the hosts pass it so).
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"require 'Authorization: Bearer <key>' on every route but /health* and /metrics* "
                        f"(default: ${API_KEY_ENV}; prefer it, a flag shows in ps)")
    RetentionArgs.add_arguments(p)
    EngineArgs.add_arguments(p)
    add_capture_arguments(p)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch
    import uvicorn

    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        retention = RetentionArgs.from_namespace(a)
        engine_args = EngineArgs.from_namespace(a)
        capture = capture_from_namespace(a)
        sock = _bind(a.host, a.port)  # before loading: a taken port fails fast
        app = create_app(a.model_dir, a.mode, retention, engine_args, capture, a.api_key)
    except (ValueError, OSError) as exc:
        print(f"remnant-serve: error: {exc}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=a.log_level, access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    if a.port_file:
        from remnant.records.files import WriteError, atomic_write

        try:
            atomic_write(a.port_file, str(port).encode())
        except WriteError as exc:
            print(f"remnant-serve: error: {exc}", file=sys.stderr)
            return 1
    log.info("remnant-serve listening on http://%s:%d (pid %d)%s", a.host, port, os.getpid(),
             "; API key required on every route but /health* and /metrics*" if a.api_key else "")
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
