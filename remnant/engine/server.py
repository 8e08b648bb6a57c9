"""The embedded reference engine's HTTP app: what `remnant-serve` (remnant.cli.serve)
serves, behind SGLang's HTTP API (docs/engine.md).

Routes and shapes follow SGLang 0.5.18's http_server (GenerateReqInput in, the tokenizer
manager's out dicts out) and its OpenAI-compatible endpoints, so a client written for
SGLang works unchanged.

This module is the app factory and its listening socket. What is served (the model loaded
into an engine, its description) comes from remnant.engine.served, kept in `app.state`;
the routes are routers reading it there: SGLang's own in remnant.engine.sglang_api, the
OpenAI ones in remnant.engine.openai_api. Request schemas live in remnant.engine.api, the
bridge to the engine thread in remnant.engine.frontend.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from pathlib import Path

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from remnant.engine.api import describe_errors, error_body
from remnant.engine.args import EngineArgs, RetentionArgs
from remnant.engine.auth import ApiKeyMiddleware
from remnant.engine.openai_api import router as openai_router
from remnant.engine.served import Served, load_served
from remnant.engine.sglang_api import router as sglang_router

log = logging.getLogger("remnant.serve")


def create_app(model_dir: Path, mode: str = "native", retention: RetentionArgs | None = None,
               engine_args: EngineArgs | None = None, capture=None, api_key: str | None = None) -> FastAPI:
    """Load the model directory and build the FastAPI app (the engine starts with the app).
    capture: remnant.calibration.capture_recorder.CaptureSettings, or None. api_key: see app_for."""
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


def bind(host: str, port: int) -> socket.socket:
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
