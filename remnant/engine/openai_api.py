"""OpenAI-compatible routes of remnant-serve, answered as SGLang 0.5.18 answers them.

GET /v1/models and /v1/models/{model}; POST /v1/completions and /v1/chat/completions,
streaming or not. Shapes follow python/sglang/srt/entrypoints/openai/ (protocol.py's
response models as they serialize, serving_completions.py and serving_chat.py for the
chunk sequence, usage_processor.py): a stream ends with a usage chunk when
stream_options.include_usage is set, and with `data: [DONE]`. Requests are checked by
remnant.engine.api; every refusal is SGLang's flat ErrorResponse with status 400, before
any stream starts: type "Bad Request" for a body its schema refuses (http_server.py's
validation handler), "BadRequestError" for one prepare() refuses (serving_base.py
create_error_response). An engine abort is an ErrorResponse of its status (type
"BadRequestError" for a 400, else the status number, as SGLang answers the HTTPException
it raises); within a stream it is an error chunk whose type is the status's name
("INTERNAL_SERVER_ERROR"), as serving_chat.py and serving_completions.py send it.
`model` is echoed back as SGLang echoes it.
"""

from __future__ import annotations

import asyncio
import json
import time
from http import HTTPStatus
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from remnant.engine.api import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    EngineInput,
    OpenAIRequest,
    Utf8JSONRoute,
    error_body,
)
from remnant.engine.frontend import Frontend, until_disconnect


async def json_content_type(http: HttpRequest) -> None:
    """http_server.py validate_json_request(): /v1 bodies must say application/json."""
    media = http.headers.get("content-type", "").lower().split(";", 1)[0].strip()
    if media != "application/json":
        raise RequestValidationError([{"loc": ("header", "content-type"), "type": "value_error",
                                       "msg": f"Unsupported Media Type {media or '(none)'}: "
                                              "Only 'application/json' is allowed"}])


router = APIRouter(route_class=Utf8JSONRoute)
#: serving_base.py create_error_response()'s default type: what a refused request gets.
BAD_REQUEST = "BadRequestError"
_json_only = [Depends(json_content_type)]


def frontend_of(http: HttpRequest) -> Frontend:
    return http.app.state.frontend


def _card(fe: Frontend, name: str) -> dict:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": name,
            "parent": None, "max_model_len": fe.limits.context_len}


@router.get("/v1/models")
async def models(http: HttpRequest) -> dict:
    fe = frontend_of(http)
    return {"object": "list", "data": [_card(fe, fe.served_model_name)]}


@router.get("/v1/models/{model:path}")
async def model(model: str, http: HttpRequest) -> Response:
    fe = frontend_of(http)
    if model != fe.served_model_name:
        return JSONResponse({"error": {"message": f"The model '{model}' does not exist", "type": "invalid_request_error",
                                       "param": "model", "code": "model_not_found"}}, status_code=404)
    return JSONResponse(_card(fe, model))


@router.post("/v1/completions", dependencies=_json_only)
async def completions(req: CompletionRequest, http: HttpRequest) -> Response:
    fe = frontend_of(http)
    return await _serve(fe, req, http, lambda: req.prepare(fe.limits, fe.tokenizer), _Completion(req))


@router.post("/v1/chat/completions", dependencies=_json_only)
async def chat_completions(req: ChatCompletionRequest, http: HttpRequest) -> Response:
    fe = frontend_of(http)
    return await _serve(fe, req, http, lambda: req.prepare(fe.limits, fe.tokenizer, fe.chat_template), _Chat(req))


# One request, both APIs ------------------------------------------------------------------


def _usage(out: dict, exclude_none: bool = False) -> dict:
    """usage_processor.py calculate_token_usage (no cache report, text only)."""
    meta = out["meta_info"]
    usage = {"prompt_tokens": meta["prompt_tokens"], "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"],
             "completion_tokens": meta["completion_tokens"], "prompt_tokens_details": None,
             "reasoning_tokens": meta["reasoning_tokens"]}
    return {k: v for k, v in usage.items() if v is not None} if exclude_none else usage


def _finish(out: dict) -> tuple[str | None, int | str | None]:
    reason = out["meta_info"]["finish_reason"]
    return (reason["type"], reason.get("matched")) if reason else (None, None)


def _abort_status(out: dict) -> tuple[int, str] | None:
    """(status, message) of an engine abort that carries a status: an error answer."""
    reason = out["meta_info"]["finish_reason"] or {}
    if reason.get("type") == "abort" and reason.get("status_code"):
        return reason["status_code"], reason.get("message", "Generation aborted.")
    return None


def _abort_body(status: int, message: str) -> Response:
    """An abort before any stream: SGLang's ValueError (400) or HTTPException (others)."""
    return error_body(message, status, BAD_REQUEST if status == 400 else str(status))


def _abort_chunk(status: int, message: str) -> bytes:
    """An abort within a stream: create_streaming_error_response(message, code.name, code)."""
    return _sse({"error": {"object": "error", "message": message, "type": HTTPStatus(status).name, "param": None,
                           "code": status}})



def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def _serve(fe: Frontend, req: OpenAIRequest, http: HttpRequest, prepare, api) -> Response:
    """Check (`prepare`), submit and answer one request, in `api`'s shapes (_Completion or
    _Chat): a JSON body, or a stream that frees the request however it ends."""
    try:
        inp: EngineInput = await asyncio.to_thread(prepare)  # it tokenizes: off the event loop
        gen = fe.submit(inp)
    except BadRequest as exc:
        return error_body(str(exc), 400, BAD_REQUEST, exc.param)
    if not req.stream:
        try:
            out = await gen.final(http)
        finally:
            gen.close()
        if out is None:  # the client went away
            return Response(status_code=499)
        if (err := _abort_status(out)) is not None:
            return _abort_body(*err)
        return JSONResponse(api.response(out))
    # As SGLang, wait for the first output before answering, so that a request the engine
    # refuses gets an error status rather than a 200 stream.
    outputs = gen.outputs()
    try:
        first = await until_disconnect(outputs.__anext__(), http)
    except BaseException:
        gen.close()
        raise
    if first is None:
        gen.close()
        return Response(status_code=499)
    if (err := _abort_status(first)) is not None:
        gen.close()
        return _abort_body(*err)

    async def frames() -> AsyncIterator[bytes]:
        try:
            async for chunk in api.stream(_chain(first, outputs)):
                yield chunk
        finally:
            gen.close()

    # The background task frees the request even if the stream never started (client gone).
    return StreamingResponse(frames(), media_type="text/event-stream", background=BackgroundTask(gen.close))


async def _chain(first: dict, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    yield first
    async for out in rest:
        yield out


class _Completion:
    """serving_completions.py's responses."""

    def __init__(self, req: CompletionRequest):
        self.req = req
        self.created = int(time.time())

    def response(self, out: dict) -> dict:
        reason, matched = _finish(out)
        return {"id": out["meta_info"]["id"], "object": "text_completion", "created": self.created,
                "model": self.req.model,
                "choices": [{"index": 0, "text": out["text"], "logprobs": None, "finish_reason": reason,
                             "matched_stop": matched}],
                "usage": _usage(out), "metadata": {"weight_version": out["meta_info"]["weight_version"]}}

    async def stream(self, outputs: AsyncIterator[dict]) -> AsyncIterator[bytes]:
        include_usage, continuous = self.req.usage_flags()
        offset, out = 0, None
        async for out in outputs:
            if (err := _abort_status(out)) is not None:
                yield _abort_chunk(*err)
                break
            reason, matched = _finish(out)
            chunk = {"id": out["meta_info"]["id"], "object": "text_completion", "created": self.created,
                     "model": self.req.model,
                     "choices": [{"index": 0, "text": out["text"][offset:], "logprobs": None,
                                  "finish_reason": reason, "matched_stop": matched}],
                     "usage": _usage(out) if continuous else None}
            offset = len(out["text"])
            yield _sse(chunk)
        if include_usage and out is not None:
            # model_dump_json(exclude_none=True) in serving_completions.py
            yield _sse({"id": out["meta_info"]["id"], "object": "text_completion", "created": self.created,
                        "model": self.req.model, "choices": [], "usage": _usage(out, exclude_none=True)})
        yield b"data: [DONE]\n\n"


class _Chat:
    """serving_chat.py's responses (no reasoning or tool-call parser)."""

    def __init__(self, req: ChatCompletionRequest):
        self.req = req
        self.created = int(time.time())

    def response(self, out: dict) -> dict:
        reason, matched = _finish(out)
        message = {"role": "assistant", "content": out["text"] or "", "reasoning_content": None, "tool_calls": None}
        return {"id": out["meta_info"]["id"], "object": "chat.completion", "created": self.created,
                "model": self.req.model,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reason,
                             "matched_stop": matched}],
                "usage": _usage(out), "metadata": {"weight_version": out["meta_info"]["weight_version"]}}

    def _chunk(self, out: dict, delta: dict, reason: str | None = None, matched=None, usage: dict | None = None) -> bytes:
        # sse_utils.py build_sse_content: the delta keeps reasoning_content (null) and
        # drops role/content when unset; the chunk drops usage when unset.
        chunk = {"id": out["meta_info"]["id"], "object": "chat.completion.chunk", "created": int(time.time()),
                 "model": self.req.model,
                 "choices": [{"index": 0, "delta": {"reasoning_content": None, **delta}, "logprobs": None,
                              "finish_reason": reason, "matched_stop": matched}]}
        if usage is not None:
            chunk["usage"] = usage
        return _sse(chunk)

    async def stream(self, outputs: AsyncIterator[dict]) -> AsyncIterator[bytes]:
        include_usage, continuous = self.req.usage_flags()
        offset, out, first, finished = 0, None, True, None
        async for out in outputs:
            if (err := _abort_status(out)) is not None:
                yield _abort_chunk(*err)
                break
            if first:
                yield self._chunk(out, {"role": "assistant", "content": ""})
                first = False
            delta = out["text"][offset:]
            offset = len(out["text"])
            if delta:
                yield self._chunk(out, {"content": delta}, usage=_usage(out) if continuous else None)
            finished = _finish(out) if out["meta_info"]["finish_reason"] else finished
        if finished is not None:
            yield self._chunk(out, {}, *finished)
        if include_usage and out is not None:
            yield _sse({"id": out["meta_info"]["id"], "object": "chat.completion.chunk", "created": int(time.time()),
                        "model": self.req.model, "choices": [], "usage": _usage(out)})
        yield b"data: [DONE]\n\n"
