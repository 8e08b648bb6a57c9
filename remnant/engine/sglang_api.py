"""SGLang's native routes of remnant-serve, answered as SGLang 0.5.18's http_server answers
them: GET /health, /health_generate, /metrics, /server_info, /model_info (and SGLang's
older /get_* names); POST /generate (text or input_ids, streaming or not) and
/flush_cache.

The routes read what they serve from `app.state` (remnant.engine.server puts it there):
`engine` (remnant.engine.engine.Engine), `frontend` (remnant.engine.frontend.Frontend) and
`info` (remnant.engine.served.ServerInfo). Request schemas live in remnant.engine.api.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import APIRouter, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from remnant.calibration.capture_recorder import write_requested
from remnant.engine.api import BadRequest, GenerateRequest, Utf8JSONRoute, generate_error, generate_error_stream

log = logging.getLogger("remnant.serve")

router = APIRouter(route_class=Utf8JSONRoute)

#: SGLang's answer to a flush that was done.
FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


@router.get("/health")
async def health(http: HttpRequest) -> Response:
    return Response(status_code=200 if http.app.state.engine.alive else 503)


@router.get("/health_generate")
async def health_generate(http: HttpRequest) -> Response:
    """200 once a one-token request runs through the engine (within 20 s)."""
    state = http.app.state
    if not state.engine.alive:
        return Response(status_code=503)
    gen = state.frontend.health_check(state.info.hf_config["bos_token_id"])
    try:
        out = await asyncio.wait_for(gen.final(http), timeout=20)
    except asyncio.TimeoutError:
        out = None
    finally:
        gen.close()
    ok = out is not None and out["meta_info"]["finish_reason"].get("type") != "abort"
    return Response(status_code=200 if ok else 503)


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(req: GenerateRequest, http: HttpRequest) -> Response:
    frontend = http.app.state.frontend
    try:
        # prepare() tokenizes: in a worker thread, so that a huge text stalls no stream.
        gen = frontend.submit(await asyncio.to_thread(req.prepare, frontend.limits, frontend.tokenizer))
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


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(http: HttpRequest) -> Response:
    """400 while requests run, as SGLang refuses it. A capture server also writes its
    capture here when the run asks (remnant.calibration.capture_recorder.write_requested)."""
    ok, detail = http.app.state.engine.flush_cache()
    log.info("flush_cache %s: %s", "done" if ok else "refused", detail)
    write_requested(getattr(http.app.state, "recorder", None))
    if not ok:
        return Response(content="Flush cache failed.\n", status_code=400)
    return Response(content=FLUSH_OK, status_code=200)


@router.get("/metrics")
async def metrics(http: HttpRequest) -> Response:
    state = http.app.state
    return Response(content=prometheus_text(state.engine.stats(), state.info.served_model_name),
                    media_type="text/plain; version=0.0.4")


@router.get("/server_info")
@router.get("/get_server_info")  # SGLang's older name, still served
async def server_info(http: HttpRequest) -> dict:
    state = http.app.state
    return state.info.server_info(state.engine.stats())


@router.get("/model_info")
@router.get("/get_model_info")  # SGLang's older name, still served
async def model_info(http: HttpRequest) -> dict:
    return http.app.state.info.model_info()


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
