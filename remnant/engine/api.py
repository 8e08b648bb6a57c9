"""Request schemas of remnant-serve's HTTP edge (docs/engine.md): one per endpoint.

Every request body passes two checks before the engine sees it, as in SGLang 0.5.18:

1. Its schema (a pydantic model that FastAPI parses the JSON body into): types. A body
   that is not UTF-8, not JSON or not an object, or a field of the wrong type, is answered
   400 with SGLang's flat ErrorResponse (`error_body`) whose message names each field, the
   value it got and what is allowed.
2. `prepare()`: values against the model (ranges, vocabulary, context length, KV pool)
   and the features the embedded engine lacks. A refusal raises `BadRequest` (status
   400); /generate answers it as SGLang's tokenizer manager does ({"error": {"message"}},
   or, in a stream, a 200 with one error frame), the /v1 endpoints with the flat
   ErrorResponse. prepare() tokenizes, so the routes run it in a worker thread
   (`encode` lets go of the GIL), never on the event loop that serves the streams.

Types are strict: an integer field takes a JSON integer only (2.7, 3.0, "3" and true are
refused, never truncated); a number field takes integers and floats, never booleans or
strings. Fields that SGLang's request types do not have are ignored, as SGLang ignores
them, so a client written for SGLang works unchanged; SGLang's fields for features the
embedded engine lacks (logprobs, LoRA, images, stop strings, top-p, ...) are accepted at
their "off" value and refused at any other, naming the allowed value. Inside
sampling_params an unknown key is refused (SGLang's SamplingParams takes no others).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict, StrictBool, StrictFloat, StrictInt, field_validator
from pydantic_core import PydanticCustomError

from remnant.engine.engine import SamplingParams

#: A refusal names at most this many of a body's problems.
MAX_ERRORS_SHOWN = 5
#: sampling_seed must fit the int64 SGLang keeps seeds in (torch takes -2**63 .. 2**64-1).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class BadRequest(ValueError):
    """A request the engine refuses (status 400): `param` names the field at fault, when
    one is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: token ids below `vocab_size`; prompt plus new
    tokens within `context_len` (positions) and `pool_tokens` (KV one request can hold).
    `default_new_tokens`: what a request that names no max_new_tokens may generate, one
    request's share of the KV pool (pool_tokens / max_running_requests)."""

    vocab_size: int
    context_len: int
    pool_tokens: int
    default_new_tokens: int


@dataclass
class EngineInput:
    """A validated request, ready for the engine: prompt ids, sampling, request id."""

    ids: list[int]
    params: SamplingParams
    rid: str | None = None
    skip_special_tokens: bool = True


# Error bodies ----------------------------------------------------------------------------


def error_body(message: str, status: int = 400, err_type: str = "Bad Request",
               param: str | None = None) -> JSONResponse:
    """SGLang's ErrorResponse: its validation handler's and the /v1 endpoints' error shape."""
    return JSONResponse({"object": "error", "message": message, "type": err_type, "param": param, "code": status},
                        status_code=status)


def generate_error(message: str, status: int = 400) -> JSONResponse:
    """SGLang's _create_error_response(): a non-stream /generate that the engine refused."""
    return JSONResponse({"error": {"message": message}}, status_code=status)


def generate_error_stream(message: str, status: int = 400) -> StreamingResponse:
    """SGLang's stream_results(): a refused stream is 200 with one error frame and [DONE]."""

    async def frames():
        err = {"error": {"message": message, "type": "invalid_request_error", "code": status, "retryable": False}}
        yield b"data: " + json.dumps(err).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(frames(), media_type="text/event-stream")


def _show(value: Any, limit: int = 60) -> str:
    """A value as JSON would spell it, cut to `limit` characters."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _where(loc: tuple) -> str:
    """A field path: sampling_params.max_new_tokens, messages[0].content; a key that is
    not a plain name (a client's unknown key) quoted and escaped as JSON."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        name = str(part) if str(part).isidentifier() and str(part).isascii() else _show(str(part))
        out += f".{name}" if out else name
    return out


def describe_errors(errors: list[dict]) -> tuple[str, str | None]:
    """A validation error list (pydantic's or FastAPI's) as one message naming each field,
    what it got and what is allowed; and the first field's path (ErrorResponse.param)."""
    parts, param = [], None
    for e in errors:
        loc = tuple(e.get("loc", ()))
        kind = e.get("type")
        if loc[:1] == ("header",):
            parts.append(f"{'.'.join(map(str, loc[1:]))} header: {e.get('msg')}")
            continue
        loc = loc[1:] if loc[:1] == ("body",) else loc
        if kind == "json_invalid":
            detail = (e.get("ctx") or {}).get("error", "")
            at = f" at character {loc[0]}" if loc and isinstance(loc[0], int) else ""
            parts.append(f"the request body is not valid JSON: {detail}{at}")
            continue
        if kind == "missing" and not loc:
            parts.append("the request body is empty; send a JSON object")
            continue
        if not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
            got = e.get("input")
            if isinstance(got, bytes):  # FastAPI parses JSON only under a JSON content type
                parts.append("the request body was not read as JSON: send it with Content-Type: application/json")
            else:
                parts.append(f"the request body must be a JSON object, got {type(got).__name__}")
            continue
        field = _where(loc)
        param = param or field
        message = e.get("msg", "invalid")
        if kind == "missing":
            parts.append(f"{field}: required, missing")
        elif kind == "extra_forbidden":  # only sampling_params forbids unknown keys
            parts.append(f"{field}: unknown key; allowed: {', '.join(GenerateSampling.model_fields)}")
        elif kind in ("batch_unsupported", "content_part", "unicode"):
            parts.append(f"{field}: {message}")
        else:
            parts.append(f"{field}: {message}, got {_show(e.get('input'))}")
    if len(parts) > MAX_ERRORS_SHOWN:  # 70,000 floats in input_ids are 70,000 errors
        parts = parts[:MAX_ERRORS_SHOWN] + [f"and {len(parts) - MAX_ERRORS_SHOWN} more"]
    return "; ".join(parts) or "invalid request", param


class Utf8JSONRoute(APIRoute):
    """A route whose body must be UTF-8 (RFC 8259), refused with a 400 that says so.

    FastAPI hands the body to json.loads, which raises UnicodeDecodeError on other bytes;
    FastAPI answers that with a bare "There was an error parsing the body"."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request):
            body = await request.body()  # Starlette keeps it for the handler's own read
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as exc:
                return error_body(f"the request body is not UTF-8: byte 0x{body[exc.start]:02x} at offset "
                                  f"{exc.start}; send JSON encoded as UTF-8")
            return await handler(request)

        return route


# Schema pieces ---------------------------------------------------------------------------


def _unicode(value: str) -> str:
    """JSON may spell a lone surrogate (\\ud800), which Python keeps and neither the
    tokenizer nor a UTF-8 response can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError("unicode", "contains a lone surrogate (U+{code}) at index {at}; strings must be "
                                  "valid Unicode", {"code": f"{ord(value[exc.start]):04X}", "at": exc.start}) from None
    return value


#: A JSON string (never a number or boolean) that is valid Unicode.
Str = Annotated[str, Strict(), AfterValidator(_unicode)]


def _stop(value: Any) -> Any:
    """A stop field: null, a string, or a list of strings (SGLang's Union, one error)."""
    strings = [value] if isinstance(value, str) else value
    if value is not None and not (isinstance(strings, list) and all(isinstance(v, str) for v in strings)):
        raise PydanticCustomError("stop_type", "Input should be null, a string or a list of strings")
    for v in strings or ():
        _unicode(v)
    return value


Stop = Annotated[Any, BeforeValidator(_stop)]


class Schema(BaseModel):
    """Fields SGLang does not have are ignored, as SGLang's own request types ignore them."""

    model_config = ConfigDict(extra="ignore")


def _refuse_batch(value: Any, what: str, nested: bool = False) -> Any:
    """`value`, unless it is a list (of lists, when `nested`): SGLang's batch form."""
    if isinstance(value, list) and (not nested or any(isinstance(v, list) for v in value)):
        raise PydanticCustomError(
            "batch_unsupported",
            "a list here is a batch of requests, which the embedded engine does not take; send one {what} "
            "per request", {"what": what})
    return value


def _same(a: Any, b: Any) -> bool:
    """Equal, and a boolean only to the same boolean (in Python False == 0)."""
    return a is b if isinstance(a, bool) or isinstance(b, bool) else a == b


def refuse_unsupported(obj: BaseModel, allowed: dict[str, tuple], prefix: str = "") -> None:
    """BadRequest for the first field of `obj` whose value is not among its allowed ones
    (`allowed[name]`, the first of which the message shows)."""
    for name, values in allowed.items():
        value = getattr(obj, name)
        if not any(_same(value, v) for v in values):
            raise BadRequest(f"{prefix}{name}={_show(value)} is not supported by the embedded engine; "
                             f"allowed: {_show(values[0])}", param=f"{prefix}{name}")


def engine_params(prompt_len: int, limits: ModelLimits, max_new_tokens: int | None, temperature: float | None,
                  ignore_eos: bool | None, seed: int | None, names: dict[str, str]) -> SamplingParams:
    """Engine sampling for a prompt of `prompt_len` tokens, checked against `limits`.

    max_new_tokens None means "up to the context length" in SGLang, whose scheduler
    reserves no output up front. The engine reserves a request's whole output when it
    admits it, in arrival order, so "to the context" (a random model may never sample
    EOS) would hold most of the pool and keep every later request waiting: here it is at
    most `limits.default_new_tokens` (one request's share of the pool), and what the
    context and the pool leave after the prompt. `names` spells the fields as the request
    did (max_tokens, seed, ...)."""
    if max_new_tokens is None:
        room = min(limits.context_len, limits.pool_tokens) - prompt_len
        if room < 1:
            raise BadRequest(f"the prompt ({prompt_len} tokens) leaves no room to generate: the context holds "
                             f"{limits.context_len} tokens and the KV pool {limits.pool_tokens}",
                             param=names["max_new_tokens"])
        max_new_tokens = min(room, limits.default_new_tokens)
    elif max_new_tokens < 0:
        # sampling_params.py verify()'s message
        raise BadRequest(f"{names['max_new_tokens']} must be at least 0, got {max_new_tokens}.",
                         param=names["max_new_tokens"])
    temperature = 1.0 if temperature is None else temperature
    if not math.isfinite(temperature) or temperature < 0:
        raise BadRequest(f"{names['temperature']} must be a finite number >= 0, got {_show(temperature)}",
                         param=names["temperature"])
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise BadRequest(f"{names['seed']}={seed} is outside the allowed range [-2**63, 2**63 - 1]",
                         param=names["seed"])
    total = prompt_len + max_new_tokens
    if total > limits.context_len:
        raise BadRequest(f"The input ({prompt_len} tokens) plus {names['max_new_tokens']} ({max_new_tokens}) "
                         f"is longer than the model's context length ({limits.context_len} tokens).",
                         param=names["max_new_tokens"])
    if total > limits.pool_tokens:
        raise BadRequest(f"the request needs {total} tokens of KV ({prompt_len} prompt + {max_new_tokens} new); "
                         f"the pool holds {limits.pool_tokens} tokens", param=names["max_new_tokens"])
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                          ignore_eos=bool(ignore_eos), seed=seed)


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`. The batch call releases the GIL while it works (Tokenizer.encode
    holds it: 5 MB of text stalled every stream for seconds); `_fast` skips the offsets."""
    batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    return batch([text], add_special_tokens=add_special_tokens)[0].ids


def check_ids(ids: list[int], limits: ModelLimits, field: str) -> list[int]:
    """`ids`; BadRequest if they are empty, as long as the context or longer (the message of
    tokenizer_manager.py _validate_one_request; checked before the ids are read one by
    one), or hold an id outside the vocabulary."""
    if not ids:
        raise BadRequest("the prompt is empty", param=field)
    if len(ids) >= limits.context_len:
        raise BadRequest(f"The input ({len(ids)} tokens) is longer than the model's context length "
                         f"({limits.context_len} tokens).", param=field)
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise BadRequest(f"{field} contains token id {bad} outside the vocabulary [0, {limits.vocab_size})",
                         param=field)
    return ids


# /generate -------------------------------------------------------------------------------


class GenerateSampling(BaseModel):
    """sampling_params of /generate: SGLang's SamplingParams keys (python/sglang/srt/
    sampling/sampling_params.py), no others."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: StrictInt | None = 128
    temperature: StrictFloat | None = 1.0
    ignore_eos: StrictBool | None = False
    sampling_seed: StrictInt | None = None
    skip_special_tokens: StrictBool | None = True
    spaces_between_special_tokens: StrictBool | None = True  # no effect on a byte-level tokenizer
    no_stop_trim: StrictBool | None = False  # trims stop strings, of which there are none
    stream_interval: StrictInt | None = None
    stop: Stop = None
    stop_token_ids: list[StrictInt] | None = None
    stop_regex: Stop = None
    top_p: StrictFloat | None = 1.0
    top_k: StrictInt | None = -1
    min_p: StrictFloat | None = 0.0
    frequency_penalty: StrictFloat | None = 0.0
    presence_penalty: StrictFloat | None = 0.0
    repetition_penalty: StrictFloat | None = 1.0
    min_new_tokens: StrictInt | None = 0
    n: StrictInt | None = 1
    json_schema: Str | None = None
    regex: Str | None = None
    ebnf: Str | None = None
    structural_tag: Str | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    custom_params: dict[str, Any] | None = None

    #: SGLang's defaults mean "off"; top_k 1 << 30 is its own spelling of "all".
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "stream_interval": (None, 1), "stop": (None, [], ""), "stop_token_ids": (None, []),
        "stop_regex": (None, [], ""), "top_p": (1.0, None), "top_k": (-1, None, 1 << 30), "min_p": (0.0, None),
        "frequency_penalty": (0.0, None), "presence_penalty": (0.0, None), "repetition_penalty": (1.0, None),
        "min_new_tokens": (0, None), "n": (1, None), "json_schema": (None, ""), "regex": (None, ""),
        "ebnf": (None, ""), "structural_tag": (None, ""), "logit_bias": (None, {}), "custom_params": (None, {}),
    }


class GenerateRequest(Schema):
    """POST /generate: SGLang's GenerateReqInput (python/sglang/srt/managers/io_struct.py),
    one request at a time."""

    text: Str | None = None
    input_ids: list[StrictInt] | None = None
    sampling_params: GenerateSampling | None = None
    rid: Str | None = None
    stream: StrictBool = False
    return_logprob: StrictBool | None = False
    logprob_start_len: StrictInt | None = -1  # only read with return_logprob
    top_logprobs_num: StrictInt | None = 0
    token_ids_logprob: list[StrictInt] | None = None
    return_text_in_logprobs: StrictBool | None = False
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    lora_path: Str | None = None
    return_hidden_states: StrictBool | None = False
    return_routed_experts: StrictBool | None = False
    session_params: dict[str, Any] | None = None
    custom_logit_processor: Str | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "return_logprob": (False, None), "top_logprobs_num": (0, None), "token_ids_logprob": (None, []),
        "image_data": (None, []), "video_data": (None, []), "audio_data": (None, []), "input_embeds": (None,),
        "lora_path": (None,), "return_hidden_states": (False, None), "return_routed_experts": (False, None),
        "session_params": (None, {}), "custom_logit_processor": (None,),
    }

    @field_validator("text", "input_ids", "sampling_params", "rid", mode="before")
    @classmethod
    def _one_request(cls, value: Any, info) -> Any:
        what = {"text": "prompt", "input_ids": "input_ids", "sampling_params": "sampling_params object",
                "rid": "rid"}[info.field_name]
        return _refuse_batch(value, what if info.field_name != "input_ids" else "list of token ids",
                             nested=info.field_name == "input_ids")

    def prepare(self, limits: ModelLimits, tokenizer) -> EngineInput:
        """The engine's input; BadRequest names what is refused (SGLang's messages where it
        has one)."""
        refuse_unsupported(self, self.UNSUPPORTED)
        sp = self.sampling_params or GenerateSampling()
        refuse_unsupported(sp, GenerateSampling.UNSUPPORTED, "sampling_params.")
        if self.text is None and self.input_ids is None:
            raise BadRequest("Either text or input_ids should be provided.", param="text")
        if self.input_ids is not None:  # as SGLang: given both, input_ids wins
            ids = check_ids(self.input_ids, limits, "input_ids")
        else:
            ids = check_ids(encode(tokenizer, self.text), limits, "text")
        names = {"max_new_tokens": "sampling_params.max_new_tokens", "temperature": "sampling_params.temperature",
                 "seed": "sampling_params.sampling_seed"}
        params = engine_params(len(ids), limits, sp.max_new_tokens, sp.temperature, sp.ignore_eos, sp.sampling_seed,
                               names)
        return EngineInput(ids, params, self.rid, sp.skip_special_tokens is not False)


# /v1/completions and /v1/chat/completions ------------------------------------------------


class StreamOptions(Schema):
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class OpenAIRequest(Schema):
    """The fields /v1/completions and /v1/chat/completions share (SGLang's
    python/sglang/srt/entrypoints/openai/protocol.py)."""

    model: Str = "default"
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    seed: StrictInt | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    rid: Str | None = None
    user: Str | None = None
    n: StrictInt = 1
    stop: Stop = None
    stop_token_ids: list[StrictInt] | None = None
    frequency_penalty: StrictFloat | None = 0.0
    presence_penalty: StrictFloat | None = 0.0
    logit_bias: dict[str, StrictFloat] | None = None
    min_tokens: StrictInt = 0
    regex: Str | None = None
    ebnf: Str | None = None
    lora_path: Str | None = None
    return_hidden_states: StrictBool = False
    return_routed_experts: StrictBool = False
    return_cached_tokens_details: StrictBool = False  # sglext: no device/host split to report
    session_params: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "n": (1,), "stop": (None, [], ""), "stop_token_ids": (None, []), "frequency_penalty": (0.0, None),
        "presence_penalty": (0.0, None), "logit_bias": (None, {}), "min_tokens": (0,), "regex": (None, ""),
        "ebnf": (None, ""), "lora_path": (None,), "return_hidden_states": (False,),
        "return_routed_experts": (False,), "session_params": (None, {}),
        "response_format": (None, {"type": "text"}),
    }

    @field_validator("rid", mode="before")
    @classmethod
    def _one_rid(cls, value: Any) -> Any:
        return _refuse_batch(value, "rid")

    def usage_flags(self) -> tuple[bool, bool]:
        """(usage in a last chunk, usage in every chunk), as SGLang's should_include_usage."""
        opts = self.stream_options
        return bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats)


def _prompt(value: Any) -> Any:
    """/v1/completions prompt: a string or a list of token ids, or a list holding one of
    them; several prompts (a batch) are refused."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return _unicode(value)
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if isinstance(value, list) and all(isinstance(p, (str, list)) for p in value):
        raise PydanticCustomError("batch_unsupported", "several prompts are a batch, which the embedded engine "
                                  "does not take; send one prompt per request")
    raise PydanticCustomError("prompt_type", "Input should be a string or a list of integer token ids")


class CompletionRequest(OpenAIRequest):
    """POST /v1/completions."""

    prompt: Any
    max_tokens: StrictInt = 16
    temperature: StrictFloat = 1.0
    top_p: StrictFloat = 1.0
    top_k: StrictInt = -1
    min_p: StrictFloat = 0.0
    repetition_penalty: StrictFloat = 1.0
    best_of: StrictInt | None = None
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: Str | None = None
    json_schema: Str | None = None
    return_token_ids: StrictBool = False

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **OpenAIRequest.UNSUPPORTED, "top_p": (1.0,), "top_k": (-1, 1 << 30), "min_p": (0.0,),
        "repetition_penalty": (1.0,), "best_of": (None, 1), "echo": (False,), "logprobs": (None,),
        "suffix": (None, ""), "json_schema": (None, ""), "return_token_ids": (False,),
    }

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        return _prompt(value)

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value <= 0:  # protocol.py's validator
            raise PydanticCustomError("greater_than", "must be positive")
        return value

    def prepare(self, limits: ModelLimits, tokenizer) -> EngineInput:
        refuse_unsupported(self, self.UNSUPPORTED)
        if not self.prompt:
            raise BadRequest("Prompt cannot be empty", param="prompt")  # serving_completions.py
        if isinstance(self.prompt, str):
            ids = check_ids(encode(tokenizer, self.prompt), limits, "prompt")
        else:
            ids = check_ids(list(self.prompt), limits, "prompt")
        params = engine_params(len(ids), limits, self.max_tokens, self.temperature, self.ignore_eos, self.seed,
                               {"max_new_tokens": "max_tokens", "temperature": "temperature", "seed": "seed"})
        return EngineInput(ids, params, self.rid, self.skip_special_tokens)


def _content(value: Any) -> Any:
    """A message's content: a string, null, or a list of text parts (joined with spaces, as
    SGLang flattens them for a string-content template); other parts are refused."""
    if value is None or isinstance(value, str):
        return value if value is None else _unicode(value)
    if not isinstance(value, list):
        raise PydanticCustomError("content_part", "must be a string or a list of text parts, got {got}",
                                  {"got": _show(value)})
    texts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "input_text") or not isinstance(part.get("text"), str):
            raise PydanticCustomError(
                "content_part", "part {i} is {got}: the model is text-only; allowed: parts of type text",
                {"i": i, "got": _show(part)})
        texts.append(_unicode(part["text"]))
    return " ".join(texts)


class Message(Schema):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: Str | None = None
    tool_call_id: Str | None = None
    reasoning_content: Str | None = None
    tool_calls: list[Any] | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _lower_role(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value  # SGLang's roles are case-insensitive

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        return _content(value)


class ChatCompletionRequest(OpenAIRequest):
    """POST /v1/chat/completions."""

    messages: list[Message]
    max_tokens: StrictInt | None = Field(default=None, gt=0)
    max_completion_tokens: StrictInt | None = Field(default=None, gt=0)
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    input_ids: list[StrictInt] | None = None
    return_token_ids: StrictBool = False
    return_prompt_token_ids: StrictBool = False
    return_meta_info: StrictBool = False

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **OpenAIRequest.UNSUPPORTED, "top_p": (None, 1.0), "top_k": (None, -1, 1 << 30), "min_p": (None, 0.0),
        "repetition_penalty": (None, 1.0), "logprobs": (False,), "top_logprobs": (None, 0), "tools": (None, []),
        "tool_choice": (None, "none", "auto"), "continue_final_message": (False,),
        "chat_template_kwargs": (None, {}), "input_ids": (None,), "return_token_ids": (False,),
        "return_prompt_token_ids": (False,), "return_meta_info": (False,),
    }

    def prepare(self, limits: ModelLimits, tokenizer, template) -> EngineInput:
        """`template`: a remnant.engine.chat_template.ChatTemplate."""
        refuse_unsupported(self, self.UNSUPPORTED)
        if not self.messages:
            raise BadRequest("Messages cannot be empty.", param="messages")  # serving_chat.py
        for i, m in enumerate(self.messages):
            if m.tool_calls:
                raise BadRequest(f"messages[{i}].tool_calls is not supported by the embedded engine; allowed: null",
                                 param=f"messages[{i}].tool_calls")
        try:
            text = template.render([{"role": m.role, "content": m.content or ""} for m in self.messages])
        except ValueError as exc:
            raise BadRequest(f"messages: the chat template cannot render them: {exc}", param="messages") from None
        ids = check_ids(encode(tokenizer, text, add_special_tokens=False), limits, "messages")
        field = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        params = engine_params(len(ids), limits, self.max_completion_tokens or self.max_tokens, self.temperature,
                               self.ignore_eos, self.seed,
                               {"max_new_tokens": field, "temperature": "temperature", "seed": "seed"})
        return EngineInput(ids, params, self.rid, self.skip_special_tokens)
