"""`remnant-serve`: the embedded reference engine behind SGLang's HTTP API (DESIGN section 6).

Routes and shapes follow SGLang 0.5.18's http_server (GenerateReqInput in, the tokenizer
manager's out dicts out) and its OpenAI-compatible endpoints, so a client written for
SGLang works unchanged:

    remnant-serve --model-dir models/tiny --port 30000
    curl -s localhost:30000/generate -H 'Content-Type: application/json' \
        -d '{"text": "hi", "sampling_params": {"max_new_tokens": 8}}'

Request schemas live in remnant.engine.api, the OpenAI routes in remnant.engine.openai_api,
the bridge to the engine thread in remnant.engine.frontend; this module builds the app.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

import remnant
from remnant.config import MODES
from remnant.engine.api import (
    BadRequest,
    GenerateRequest,
    ModelLimits,
    Utf8JSONRoute,
    describe_errors,
    error_body,
    generate_error,
    generate_error_stream,
)
from remnant.engine.args import EngineArgs, RetentionArgs
from remnant.engine.engine import Engine

log = logging.getLogger("remnant.serve")

FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def create_app(model_dir: Path, mode: str = "native", retention: RetentionArgs | None = None,
               engine_args: EngineArgs | None = None) -> FastAPI:
    """Load the model directory and build the FastAPI app (the engine starts with the app)."""
    import torch
    from tokenizers import Tokenizer

    from remnant.engine.model import Model, ModelArgs
    from remnant.engine.retention_setup import setup_retention

    if mode not in MODES:
        raise ValueError(f"mode={mode} is not a mode; allowed: {', '.join(MODES)}")
    retention = retention or RetentionArgs()
    engine_args = engine_args or EngineArgs()
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    try:
        hf = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{config_path} does not exist; write one with python -m remnant.engine.model_dir --out {model_dir}") from None
    args = ModelArgs.from_hf_config(hf)
    t0 = time.perf_counter()
    model = Model(args, device=engine_args.device, decode_path=engine_args.decode_path,
                  native_decode=engine_args.native_decode)
    served_name = hf.get("remnant", {}).get("preset") or model_dir.name
    rmap = setup_retention(model, mode, served_name, retention.retention, retention.per_layer,
                           retention.map_path, retention.policy)
    load_s = time.perf_counter() - t0
    tokenizer_path = model_dir / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise ValueError(f"{tokenizer_path} does not exist; the model directory needs a tokenizer")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    from remnant.engine.capacity import size_pools
    from remnant.engine.pools import KVPools, geometry_of
    from remnant.engine.prefix_cache import PrefixCache

    geometry = geometry_of(model, engine_args.page_size, engine_args.swa_ratio, engine_args.max_running_requests)
    sizes = size_pools(geometry, engine_args.kv_budget_bytes)
    if sizes.full_tokens == 0 or sizes.swa_tokens < geometry.window_size:
        raise ValueError(
            f"kv budget {engine_args.kv_budget_bytes} bytes holds {sizes.full_tokens} tokens and "
            f"{sizes.swa_tokens} window slots after {sum(sizes.fixed_bytes.values())} fixed bytes; "
            f"raise the budget or lower max_running_requests"
        )
    pools = KVPools(geometry, sizes, model.device)
    engine = Engine(model, hf["eos_token_id"], pools, PrefixCache(pools, engine_args.prefix_cache),
                    engine_args.chunked_prefill_size)
    capacity = {
        "max_total_num_tokens": sizes.full_tokens,
        "swa_max_total_num_tokens": sizes.swa_tokens,
        "page_size": geometry.page_size,
        "swa_full_tokens_ratio": geometry.swa_ratio,
        "kv_budget_bytes": engine_args.kv_budget_bytes,
        "bytes_per_token": sizes.bytes_per_full_token,
        "fixed_bytes": sizes.fixed_bytes,
        "accounted_bytes": pools.accounted_bytes(),
        "allocated_bytes": pools.allocated_bytes(),
        "c4_records": sizes.c4_records,
        "c128_records": sizes.c128_records,
        "max_running_requests": pools.slots.n,
    }
    started = time.time()
    # Provenance is collected here, where the work runs, not by whoever started the server.
    from remnant.records.provenance import environment

    server_environment = environment()
    server_args = {
        "model_path": str(model_dir),
        "tokenizer_path": str(model_dir),
        "served_model_name": served_name,
        "dtype": "float32",
        "kv_cache_dtype": "fp8_e4m3",
        "chunked_prefill_size": engine_args.chunked_prefill_size,
        "max_running_requests": pools.slots.n,
        "max_total_num_tokens": sizes.full_tokens,
        "page_size": geometry.page_size,
        "disable_radix_cache": not engine_args.prefix_cache,
        "remnant_mode": mode,
        "device": model.device.type,  # as SGLang's ServerArgs.device: "cuda" or "cpu"
        "remnant_decode_path": model.decode_path,
        # Which kernel decode steps ran over native records, and why not FlashMLA.
        "remnant_native_decode": {"kernel": model.native_decode, "reason": model.native_decode_reason,
                                  "flashmla_version": _flashmla_version(model.native_decode)},
        "remnant_retention": None if rmap is None else {
            "per_layer": {str(i): rmap.retention(i) for i in model.csa_layers},
            "policy": rmap.policy,
            "map_path": retention.map_path,
            "calibration": rmap.calibration,
        },
        "c4_record_bytes": [model.c4_formats[i].record_bytes for i in model.csa_layers],
        "random_seed": args.seed,
        "torch_num_threads": torch.get_num_threads(),
    }

    from remnant.engine.chat_template import ChatTemplate
    from remnant.engine.frontend import Frontend
    from remnant.engine.openai_api import router as openai_router

    pool_tokens = pools.num_pages * geometry.page_size
    # Without max_new_tokens a request may generate one request's share of the pool (see
    # remnant.engine.api.engine_params): 113,664 / 32 = 3,552 tokens at the defaults.
    limits = ModelLimits(args.vocab_size, args.max_position_embeddings, pool_tokens,
                         default_new_tokens=max(1, pool_tokens // pools.slots.n))
    frontend = Frontend(engine, tokenizer, limits, served_name, ChatTemplate.from_model_dir(model_dir))

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start()
        log.info("engine ready: model loaded in %.2fs", load_s)
        yield
        engine.stop()

    app = FastAPI(title="remnant-serve", lifespan=lifespan)
    app.router.route_class = Utf8JSONRoute
    app.state.engine = engine
    app.state.frontend = frontend
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/health_generate")
    async def health_generate(http: HttpRequest) -> Response:
        if not engine.alive:
            return Response(status_code=503)
        gen = frontend.health_check(hf["bos_token_id"])
        try:
            out = await asyncio.wait_for(gen.final(http), timeout=20)
        except asyncio.TimeoutError:
            out = None
        finally:
            gen.close()
        ok = out is not None and out["meta_info"]["finish_reason"].get("type") != "abort"
        return Response(status_code=200 if ok else 503)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(req: GenerateRequest, http: HttpRequest) -> Response:
        try:
            # prepare() tokenizes: in a worker thread, so that a huge text stalls no stream.
            gen = frontend.submit(await asyncio.to_thread(req.prepare, limits, tokenizer))
        except BadRequest as exc:
            return generate_error_stream(str(exc)) if req.stream else generate_error(str(exc))
        if req.stream:
            async def frames():
                try:
                    async for out in gen.outputs():
                        yield b"data: " + json.dumps(out).encode() + b"\n\n"
                    yield b"data: [DONE]\n\n"
                finally:
                    gen.close()  # frees a disconnected client's request; a no-op once finished

            # The background task frees the request even if the stream never started.
            return StreamingResponse(frames(), media_type="text/event-stream", background=BackgroundTask(gen.close))
        try:
            out = await gen.final(http)
        finally:
            gen.close()
        if out is None:  # the client went away
            return Response(status_code=499)
        reason = out["meta_info"]["finish_reason"]
        if reason and reason.get("type") == "abort":
            return generate_error(reason.get("message"), reason.get("status_code") or 500)
        return JSONResponse(out)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        ok, detail = engine.flush_cache()
        log.info("flush_cache %s: %s", "done" if ok else "refused", detail)
        if not ok:
            return Response(content="Flush cache failed.\n", status_code=400)
        return Response(content=FLUSH_OK, status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(content=prometheus_text(engine.stats(), server_args["served_model_name"]),
                        media_type="text/plain; version=0.0.4")

    @app.get("/server_info")
    @app.get("/get_server_info")  # SGLang's older name, still served
    async def server_info() -> dict:
        stats = engine.stats()
        return {
            **server_args,
            "startup_time": started,
            "version": remnant.__version__,
            "engine": "remnant-embedded",
            "environment": server_environment,
            "model_config": {k: v for k, v in hf.items() if k != "remnant"},
            "capacity": capacity,
            "internal_states": [stats],
        }

    @app.get("/model_info")
    @app.get("/get_model_info")  # SGLang's older name, still served
    async def model_info() -> dict:
        return {
            "model_path": str(model_dir),
            "served_model_name": server_args["served_model_name"],
            "tokenizer_path": str(model_dir),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "dummy",  # random weights generated from the seed
            "reasoning_parser": None,
            "tool_call_parser": None,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": hf.get("model_type"),
            "architectures": hf.get("architectures"),
        }

    app.include_router(openai_router)
    return app


def prometheus_text(stats: dict, model_name: str) -> str:
    """/metrics in SGLang's metric names (a subset)."""
    label = f'{{model_name="{model_name}"}}'
    gauges = {
        "sglang:token_usage": stats["token_usage"],
        "sglang:num_running_reqs": stats["num_running_reqs"],
        "sglang:num_queue_reqs": stats["num_waiting_reqs"],
        "sglang:cache_hit_rate": stats["cache_hit_rate"],
    }
    counters = {
        "sglang:prompt_tokens_total": stats["prompt_tokens"],
        "sglang:generation_tokens_total": stats["generated_tokens"],
        "sglang:cached_tokens_total": stats["cached_tokens"],
    }
    lines = []
    for name, value in gauges.items():
        lines += [f"# TYPE {name} gauge", f"{name}{label} {float(value)}"]
    for name, value in counters.items():
        lines += [f"# TYPE {name} counter", f"{name}{label} {float(value)}"]
    return "\n".join(lines) + "\n"


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


def _flashmla_version(kernel: str) -> str | None:
    if kernel != "flashmla":
        return None
    from remnant.kernels.flashmla import version

    return version()


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
    p.add_argument("--mode", default="native", choices=MODES)
    RetentionArgs.add_arguments(p)
    EngineArgs.add_arguments(p)
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
        sock = _bind(a.host, a.port)  # before loading: a taken port fails fast
        app = create_app(a.model_dir, a.mode, retention, engine_args)
    except (ValueError, OSError) as exc:
        print(f"remnant-serve: error: {exc}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=a.log_level, access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    if a.port_file:
        tmp = a.port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        os.replace(tmp, a.port_file)
    log.info("remnant-serve listening on http://%s:%d (pid %d)", a.host, port, os.getpid())
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
