"""remnant-serve's HTTP API against SGLang 0.5.18's request and response shapes (docs/engine.md).

Every test drives the real `remnant-serve` child process (the session `server` fixture)
over loopback with httpx; nothing is mocked. The SGLang references name files under
`python/sglang/` of SGLang 0.5.18: `srt/entrypoints/http_server.py` (routes, error
bodies), `srt/managers/tokenizer_manager.py` (the out dicts and meta_info keys),
`srt/managers/schedule_batch.py` (finish reasons' to_json), `srt/managers/io_struct.py`
(GenerateReqInput validation) and `benchmark/serving.py` (how SGLang's own bench client
parses a /generate stream).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

TIMEOUT = httpx.Timeout(60.0)

# http_server.py flush_cache(): the body SGLang answers when the flush succeeded.
SGLANG_FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
# http_server.py flush_cache(): `ret.message or "Flush cache failed.\n"`; the scheduler's
# SchedulerFlushWrapper.handle() answers FlushCacheReqOutput(success=False) with the
# default message "" when requests are running (timeout 0), so the body is the fallback.
SGLANG_FLUSH_FAILED = "Flush cache failed.\n"

# tokenizer_manager.py _handle_batch_output() + _wait_one_response(): the meta_info of a
# finished non-stream /generate for a plain request (no logprobs, no hidden states, no
# speculative decoding, metrics disabled, single tokenizer worker):
#   {"id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions"}
#   + {"reasoning_tokens", "completion_tokens", "cached_tokens"}   (not an embedding)
#   + "cached_tokens_details"  (recv_obj.cached_tokens_details is a per-request list,
#                               [None] for a cold request, which is truthy)
#   + "dp_rank"                (output_streamer.to_payload always sends dp_ranks=[dp_rank]*n)
#   + "e2e_latency"            (set once finished)
#   + "response_sent_to_client_ts" (_wait_one_response sets it on the first response sent)
SGLANG_PLAIN_META_KEYS = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "num_retractions",
    "reasoning_tokens",
    "completion_tokens",
    "cached_tokens",
    "cached_tokens_details",
    "dp_rank",
    "e2e_latency",
    "response_sent_to_client_ts",
}
# The keys every remnant meta_info must carry (id, prompt_tokens, completion_tokens,
# cached_tokens, finish_reason, which clients read, plus the always-present scalars of
# SGLang's dict).
REQUIRED_META_KEYS = SGLANG_PLAIN_META_KEYS - {
    "cached_tokens_details", "dp_rank", "e2e_latency", "response_sent_to_client_ts"}

# http_server.py model_info(): the keys of GET /model_info for a generation model.
SGLANG_MODEL_INFO_KEYS = {
    "model_path",
    "served_model_name",
    "tokenizer_path",
    "is_generation",
    "preferred_sampling_params",
    "weight_version",
    "load_format",
    "reasoning_parser",
    "tool_call_parser",
    "has_image_understanding",
    "has_audio_understanding",
    "model_type",
    "architectures",
}


# Helpers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_config(tiny_model_dir) -> dict:
    return json.loads((Path(tiny_model_dir) / "config.json").read_text())


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(tiny_model_dir) / "tokenizer.json"))


def sp(n: int, **extra) -> dict:
    """sampling_params for exactly `n` new tokens."""
    return {"max_new_tokens": n, "ignore_eos": True, **extra}


def generate(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/generate", json=body, timeout=TIMEOUT)


@dataclass
class Stream:
    status: int
    content_type: str
    events: list[bytes] = field(default_factory=list)  # raw SSE blocks, "\n\n" removed
    times: list[float] = field(default_factory=list)  # perf_counter at each block's arrival
    tail: bytes = b""  # bytes after the last "\n\n" (must be empty)

    @property
    def payloads(self) -> list[bytes]:
        """Parsed the way sglang.benchmark.serving.async_request_sglang_generate does."""
        out = []
        for chunk in self.events:
            chunk = chunk.strip()
            if not chunk:
                continue
            out.append(chunk[6:] if chunk.startswith(b"data: ") else chunk)
        return out

    @property
    def frames(self) -> list[dict]:
        return [json.loads(p) for p in self.payloads if p != b"[DONE]"]

    @property
    def frame_times(self) -> list[float]:
        return [t for e, t in zip(self.events, self.times) if e.strip() != b"data: [DONE]"]


def stream_generate(base_url: str, body: dict, stop_after: int | None = None,
                    on_first: threading.Event | None = None) -> Stream:
    """POST /generate with stream=true; split the body into SSE blocks as they arrive.

    stop_after: close the connection after that many blocks (a client going away).
    """
    with httpx.stream("POST", f"{base_url}/generate", json={**body, "stream": True},
                      timeout=TIMEOUT) as r:
        s = Stream(r.status_code, r.headers.get("content-type", ""))
        buf = b""
        for chunk in r.iter_raw():
            buf += chunk
            while b"\n\n" in buf:
                block, buf = buf.split(b"\n\n", 1)
                s.events.append(block)
                s.times.append(time.perf_counter())
                if on_first is not None:
                    on_first.set()
                if stop_after is not None and len(s.events) >= stop_after:
                    return s
        s.tail = buf
    return s


def assert_error_body(r: httpx.Response) -> str:
    """SGLang's _create_error_response(): {"error": {"message": str(e)}}, status 400."""
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]["message"]


def assert_error_stream(s: Stream) -> str:
    """SGLang's stream_results(): a ValueError becomes 200 + one error frame + [DONE]."""
    assert s.status == 200
    assert s.content_type.startswith("text/event-stream")
    assert s.tail == b""
    assert [e[:6] for e in s.events] == [b"data: ", b"data: "], s.events
    assert s.payloads[-1] == b"[DONE]"
    err = json.loads(s.payloads[0])
    assert set(err) == {"error"}, err
    e = err["error"]
    assert set(e) == {"message", "type", "code", "retryable"}, e
    assert isinstance(e["message"], str) and e["message"]
    assert e["type"] == "invalid_request_error"
    assert e["code"] == 400
    assert e["retryable"] is False
    return e["message"]


def pool_state(base_url: str) -> dict:
    """The engine's pools and queues, from /server_info's internal_states."""
    return httpx.get(f"{base_url}/server_info", timeout=TIMEOUT).json()["internal_states"][0]


def pools_whole(state: dict, flushed: bool) -> dict:
    """What of an idle engine's pools is neither free nor held by the prefix cache (or, once
    flushed, not free): empty unless a request that ended kept something."""
    cached = {"pages": 0, "swa_blocks": 0, "request_slots": 0} if flushed else {
        "pages": state["pages_cached"], "swa_blocks": state["swa_blocks_cached"], "request_slots": 0}
    lost = {k: state[f"{k}_total"] - state[f"{k}_free"] - cached[k] for k in cached}
    return {k: v for k, v in lost.items() if v}


def assert_pools_at_totals(base_url: str, within_s: float = 10.0) -> None:
    """Once requests have ended (aborted ones included) and the cache is flushed, every
    page, SWA block and request slot of the engine is free again."""
    r = wait_flush_ok(base_url, within_s)
    assert r.status_code == 200, f"requests still held {within_s} s on: {pool_state(base_url)}"
    state = pool_state(base_url)
    assert not pools_whole(state, flushed=True), (pools_whole(state, flushed=True), state)


def wait_flush_ok(base_url: str, within_s: float = 5.0) -> httpx.Response:
    deadline = time.monotonic() + within_s
    while True:
        r = httpx.post(f"{base_url}/flush_cache", timeout=TIMEOUT)
        if r.status_code == 200 or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


# 1. Health -------------------------------------------------------------------------------


def test_health_is_200_with_empty_body(server):
    r = httpx.get(f"{server.base_url}/health", timeout=TIMEOUT)
    assert r.status_code == 200
    assert r.content == b""


def test_health_generate_is_200(server):
    r = httpx.get(f"{server.base_url}/health_generate", timeout=TIMEOUT)
    assert r.status_code == 200
    assert r.content == b""


# 2. Non-stream /generate -----------------------------------------------------------------


def check_plain_out(out: dict, n: int, prompt_tokens: int, vocab_size: int, tokenizer) -> dict:
    assert set(out) == {"text", "output_ids", "meta_info"}, set(out)
    assert isinstance(out["text"], str)
    ids = out["output_ids"]
    assert isinstance(ids, list) and len(ids) == n
    assert all(isinstance(t, int) and 0 <= t < vocab_size for t in ids)
    assert out["text"] == tokenizer.decode(ids)
    meta = out["meta_info"]
    assert REQUIRED_META_KEYS | {"e2e_latency"} <= set(meta), set(meta)
    assert isinstance(meta["id"], str) and meta["id"]
    # schedule_batch.py FINISH_LENGTH.to_json()
    assert meta["finish_reason"] == {"type": "length", "length": n}
    assert meta["prompt_tokens"] == prompt_tokens
    assert meta["completion_tokens"] == n
    assert isinstance(meta["cached_tokens"], int) and 0 <= meta["cached_tokens"] <= prompt_tokens
    assert isinstance(meta["e2e_latency"], (int, float)) and not isinstance(meta["e2e_latency"], bool)
    assert meta["e2e_latency"] >= 0
    assert meta["weight_version"] == "default"  # ServerArgs.weight_version's default
    assert meta["num_retractions"] == 0
    assert meta["reasoning_tokens"] == 0
    return meta


def test_generate_text(server, hf_config, tokenizer):
    r = generate(server, {"text": "hello", "sampling_params": sp(5)})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    ids = tokenizer.encode("hello").ids
    assert ids[0] == hf_config["bos_token_id"]  # the tokenizer prepends BOS, as SGLang counts it
    check_plain_out(r.json(), 5, len(ids), hf_config["vocab_size"], tokenizer)


def test_generate_input_ids(server, hf_config, tokenizer):
    prompt = [hf_config["bos_token_id"], 10, 20, 30, 40, 50, 60]
    r = generate(server, {"input_ids": prompt, "sampling_params": sp(4)})
    assert r.status_code == 200, r.text
    check_plain_out(r.json(), 4, len(prompt), hf_config["vocab_size"], tokenizer)


def test_generate_accepts_put(server, hf_config, tokenizer):
    # http_server.py: @app.api_route("/generate", methods=["POST", "PUT"])
    r = httpx.put(f"{server.base_url}/generate",
                  json={"input_ids": [1, 2, 3], "sampling_params": sp(2)}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    check_plain_out(r.json(), 2, 3, hf_config["vocab_size"], tokenizer)


def test_meta_info_keys_match_sglang(server):
    """The exact meta_info key set SGLang returns for a plain non-stream request."""
    r = generate(server, {"input_ids": [5, 6, 7], "sampling_params": sp(2)})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert set(meta) == SGLANG_PLAIN_META_KEYS, (
        f"missing {sorted(SGLANG_PLAIN_META_KEYS - set(meta))}, "
        f"extra {sorted(set(meta) - SGLANG_PLAIN_META_KEYS)}"
    )


# 3. Streaming ----------------------------------------------------------------------------


def test_stream_frames(server, hf_config, tokenizer):
    n = 10
    body = {"text": "hello", "sampling_params": sp(n, temperature=0)}
    s = stream_generate(server.base_url, body)
    assert s.status == 200
    assert s.content_type.startswith("text/event-stream")
    # Framing: every block is `data: <payload>` followed by a blank line, nothing else.
    assert s.tail == b""
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in s.events), s.events
    assert s.payloads[-1] == b"[DONE]" and s.payloads.count(b"[DONE]") == 1
    frames = s.frames
    assert len(frames) == n  # one frame per token (stream_interval 1)
    prompt_tokens = len(tokenizer.encode("hello").ids)
    prev: list[int] = []
    for i, f in enumerate(frames):
        assert set(f) == {"text", "output_ids", "meta_info"}, set(f)
        ids, meta = f["output_ids"], f["meta_info"]
        # Non-incremental streaming (SGLang's default): output_ids are cumulative.
        assert len(ids) == i + 1 and ids[: len(prev)] == prev
        assert isinstance(f["text"], str)
        assert REQUIRED_META_KEYS <= set(meta), set(meta)
        assert meta["completion_tokens"] == i + 1
        assert meta["prompt_tokens"] == prompt_tokens
        if i < n - 1:
            assert meta["finish_reason"] is None
            assert "e2e_latency" not in meta  # SGLang sets it only once finished
        prev = ids
    last = frames[-1]["meta_info"]
    assert last["finish_reason"] == {"type": "length", "length": n}
    assert isinstance(last["e2e_latency"], (int, float)) and last["e2e_latency"] >= 0
    assert len({f["meta_info"]["id"] for f in frames}) == 1
    # The finished frame carries the same output as a non-stream request.
    plain = generate(server, body).json()
    assert frames[-1]["output_ids"] == plain["output_ids"]
    assert frames[-1]["text"] == plain["text"] == tokenizer.decode(plain["output_ids"])


def _splits_a_utf8_char(ids: list[int]) -> bool:
    """Whether some frame boundary falls inside a multi-byte UTF-8 character."""
    return any(0xC2 <= a <= 0xF4 and 0x80 <= b <= 0xBF for a, b in zip(ids, ids[1:]))


def test_stream_text_is_cumulative(server, hf_config):
    """Each frame's text extends the previous one, so `text[len(prev):]` is the new text.

    SGLang's DetokenizerManager holds back an incomplete UTF-8 tail (it emits only
    find_printable_text() of a chunk ending in U+FFFD and commits nothing), and
    TokenizerManager builds the cumulative text by state.append_text(delta), so text only
    grows. Clients rely on it: sglang's test/send_one.py prints `ret["text"][last_len:]`.
    """
    checked = False
    for prompt in ("hello", "The quick brown fox", "abc", "zzz"):
        s = stream_generate(server.base_url, {"text": prompt, "sampling_params": sp(32, temperature=0)})
        frames = s.frames
        assert len(frames) == 32
        texts = [f["text"] for f in frames]
        for i in range(1, len(texts)):
            assert texts[i].startswith(texts[i - 1]), (
                f"prompt {prompt!r}: frame {i} text {texts[i]!r} does not extend frame {i - 1} "
                f"text {texts[i - 1]!r} (output_ids {frames[i]['output_ids'][-3:]})"
            )
        checked = checked or _splits_a_utf8_char(frames[-1]["output_ids"])
        if checked:
            break
    if not checked:
        pytest.skip("no output split a multi-byte UTF-8 character; the property was not exercised")


# 4. rid ----------------------------------------------------------------------------------


def test_rid_is_echoed(server):
    r = generate(server, {"input_ids": [1, 2, 3], "rid": "my-rid-42", "sampling_params": sp(2)})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["id"] == "my-rid-42"
    s = stream_generate(server.base_url, {"input_ids": [1, 2, 3], "rid": "my-rid-43", "sampling_params": sp(3)})
    assert [f["meta_info"]["id"] for f in s.frames] == ["my-rid-43"] * 3


def test_generated_rids_are_unique(server):
    a = generate(server, {"input_ids": [1, 2], "sampling_params": sp(1)}).json()["meta_info"]["id"]
    b = generate(server, {"input_ids": [1, 2], "sampling_params": sp(1)}).json()["meta_info"]["id"]
    assert a != b


# 5. Errors -------------------------------------------------------------------------------


def test_neither_text_nor_input_ids(server):
    # io_struct.py GenerateReqInput._validate_inputs(): ValueError
    # "Either text, input_ids or input_embeds should be provided." -> 400 / error frame.
    assert_error_body(generate(server, {"sampling_params": sp(2)}))
    assert_error_stream(stream_generate(server.base_url, {"sampling_params": sp(2)}))


def test_both_text_and_input_ids_uses_input_ids(server):
    """SGLang accepts both: io_struct.py _validate_inputs() rejects only when text,
    input_ids AND input_embeds are all set, and tokenizer_manager.py
    _tokenize_one_request() takes `elif obj.input_ids is not None: input_ids = obj.input_ids`
    before it would tokenize the text. So the answer is 200 generated from input_ids."""
    r = generate(server, {"text": "hello world", "input_ids": [1, 2, 3], "sampling_params": sp(2)})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["prompt_tokens"] == 3


def test_token_id_outside_vocab(server, hf_config):
    v = hf_config["vocab_size"]
    msg = assert_error_body(generate(server, {"input_ids": [1, v + 7, 2], "sampling_params": sp(2)}))
    assert str(v + 7) in msg
    msg = assert_error_stream(stream_generate(server.base_url, {"input_ids": [1, v + 7], "sampling_params": sp(2)}))
    assert str(v + 7) in msg


def test_negative_max_new_tokens(server):
    # sampling_params.py verify(): "max_new_tokens must be at least 0, got -1."
    msg = assert_error_body(generate(server, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}))
    assert "max_new_tokens" in msg
    msg = assert_error_stream(stream_generate(server.base_url, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}))
    assert "max_new_tokens" in msg


def _post_raw(server, content: bytes) -> httpx.Response:
    return httpx.post(f"{server.base_url}/generate", content=content,
                      headers={"content-type": "application/json"}, timeout=TIMEOUT)


def test_malformed_json_is_400(server):
    r = _post_raw(server, b'{"text": "hi", ')
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")


@pytest.mark.parametrize("content", [b'{"text": "hi", ', b"", b"[1, 2]"],
                         ids=["malformed", "empty", "not-an-object"])
def test_unparsable_body_error_shape_matches_sglang(server, content):
    """SGLang's /generate body is a GenerateReqInput parsed by FastAPI: a JSON decode error
    (type json_invalid), a missing body or a non-object body raise RequestValidationError,
    and SGLang's handler (http_server.py validation_exception_handler for
    RequestValidationError) answers 400 with ErrorResponse(message=..., type="Bad Request",
    code=400).model_dump(): a flat {"object", "message", "type", "param", "code"} body,
    not the {"error": {...}} body of _create_error_response()."""
    r = _post_raw(server, content)
    assert r.status_code == 400
    body = r.json()
    assert set(body) == {"object", "message", "type", "param", "code"}, body
    assert body["object"] == "error"
    assert body["type"] == "Bad Request"
    assert body["param"] is None
    assert body["code"] == 400
    assert isinstance(body["message"], str) and body["message"]


# 6. max_new_tokens = 0 -------------------------------------------------------------------


def test_max_new_tokens_zero(server):
    # schedule_batch.py Req.update_finish_state(): len(output_ids) >= max_new_tokens ->
    # FINISH_LENGTH(length=0), finished_len 0, so output_ids_through_stop is empty and
    # completion_tokens 0.
    r = generate(server, {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 0}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == [] and out["text"] == ""
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0
    assert meta["prompt_tokens"] == 4
    s = stream_generate(server.base_url, {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 0}})
    assert s.payloads[-1] == b"[DONE]"
    assert len(s.frames) == 1
    assert s.frames[0]["output_ids"] == []
    assert s.frames[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert s.frames[0]["meta_info"]["completion_tokens"] == 0


# 7. Determinism --------------------------------------------------------------------------


def test_temperature_zero_is_deterministic(server):
    body = {"text": "determinism", "sampling_params": sp(8, temperature=0)}
    a, b = generate(server, {**body, "rid": "det-a"}).json(), generate(server, {**body, "rid": "det-b"}).json()
    assert a["output_ids"] == b["output_ids"]
    assert a["text"] == b["text"]


def test_same_sampling_seed_is_deterministic(server):
    body = {"text": "seeded", "sampling_params": sp(8, temperature=1.0, sampling_seed=1234)}
    a, b = generate(server, {**body, "rid": "seed-a"}).json(), generate(server, {**body, "rid": "seed-b"}).json()
    assert a["output_ids"] == b["output_ids"]


# 8. /flush_cache -------------------------------------------------------------------------


def test_flush_cache_idle(server):
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{server.base_url}/flush_cache", timeout=TIMEOUT)
        assert r.status_code == 200, (method, r.text)
        assert r.text == SGLANG_FLUSH_OK


@pytest.fixture(scope="module")
def flush_while_busy(server):
    """Flush (GET and POST) while a long stream runs, then again after it finished."""
    first = threading.Event()
    result: dict = {}

    def run():
        result["stream"] = stream_generate(
            server.base_url, {"input_ids": [1, 2, 3], "sampling_params": sp(400)}, on_first=first)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert first.wait(30), "the long stream never produced a frame"
    busy = {m: httpx.request(m, f"{server.base_url}/flush_cache", timeout=TIMEOUT) for m in ("GET", "POST")}
    t.join(60)
    assert not t.is_alive()
    after = {m: httpx.request(m, f"{server.base_url}/flush_cache", timeout=TIMEOUT) for m in ("GET", "POST")}
    return {"busy": busy, "after": after, "stream": result["stream"]}


def test_flush_cache_refused_while_running(flush_while_busy):
    for method, r in flush_while_busy["busy"].items():
        assert r.status_code == 400, (method, r.text)
    s = flush_while_busy["stream"]
    assert len(s.frames) == 400  # the refused flush did not disturb the request
    assert s.frames[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 400}
    for method, r in flush_while_busy["after"].items():
        assert r.status_code == 200, (method, r.text)
        assert r.text == SGLANG_FLUSH_OK


def test_flush_cache_refused_body_matches_sglang(flush_while_busy):
    for method, r in flush_while_busy["busy"].items():
        assert r.text == SGLANG_FLUSH_FAILED, (method, r.text)


# 9. /server_info and /model_info ---------------------------------------------------------


def test_server_info(server, tiny_model_dir):
    r = httpx.get(f"{server.base_url}/server_info", timeout=TIMEOUT)
    assert r.status_code == 200
    info = r.json()
    assert isinstance(info["version"], str) and info["version"]
    assert info["model_path"] == str(tiny_model_dir)
    assert isinstance(info["internal_states"], list) and info["internal_states"]
    assert all(isinstance(s, dict) for s in info["internal_states"])
    assert isinstance(info["chunked_prefill_size"], int) and info["chunked_prefill_size"] > 0
    assert isinstance(info["max_running_requests"], int) and info["max_running_requests"] > 0
    assert isinstance(info["startup_time"], (int, float))


def test_model_info(server, tiny_model_dir, hf_config):
    r = httpx.get(f"{server.base_url}/model_info", timeout=TIMEOUT)
    assert r.status_code == 200
    info = r.json()
    assert info["model_path"] == str(tiny_model_dir)
    assert info["tokenizer_path"] == str(tiny_model_dir)
    assert info["is_generation"] is True
    assert info["model_type"] == hf_config["model_type"]
    assert info["architectures"] == hf_config["architectures"]
    assert isinstance(info["served_model_name"], str) and info["served_model_name"]
    assert info["weight_version"] == "default"


def test_model_info_keys_match_sglang(server):
    info = httpx.get(f"{server.base_url}/model_info", timeout=TIMEOUT).json()
    assert set(info) == SGLANG_MODEL_INFO_KEYS, (
        f"missing {sorted(SGLANG_MODEL_INFO_KEYS - set(info))}, "
        f"extra {sorted(set(info) - SGLANG_MODEL_INFO_KEYS)}"
    )


# 10. Concurrency -------------------------------------------------------------------------


@pytest.mark.slow
def test_concurrent_streams_are_batched(server):
    n_req, n_tok = 8, 64  # long enough that thread start-up skew cannot hide the overlap
    barrier = threading.Barrier(n_req)
    results: list[Stream | BaseException | None] = [None] * n_req

    def run(i: int) -> None:
        try:
            barrier.wait(10)
            results[i] = stream_generate(
                server.base_url, {"input_ids": [1, 2, 3 + i], "rid": f"conc-{i}", "sampling_params": sp(n_tok)})
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n_req)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, s in enumerate(results):
        assert isinstance(s, Stream), (i, s)
        assert s.status == 200 and s.payloads[-1] == b"[DONE]"
        assert len(s.frames) == n_tok
        assert [f["meta_info"]["completion_tokens"] for f in s.frames] == list(range(1, n_tok + 1))
        assert s.frames[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": n_tok}
        assert {f["meta_info"]["id"] for f in s.frames} == {f"conc-{i}"}
    firsts = [s.frame_times[0] for s in results]
    lasts = [s.frame_times[-1] for s in results]
    # Continuous batching: every request had streamed a token before any of them finished.
    assert max(firsts) < min(lasts), (firsts, lasts)


# 11. A client that goes away -------------------------------------------------------------


def test_disconnect_mid_stream_does_not_wedge(server):
    s = stream_generate(server.base_url, {"input_ids": [1, 2, 3], "sampling_params": sp(1000)}, stop_after=2)
    assert len(s.events) == 2 and s.events[0].startswith(b"data: ")
    r = wait_flush_ok(server.base_url, within_s=5.0)
    assert r.status_code == 200, f"server still busy 5 s after the client left: {r.text!r}"
    assert_pools_at_totals(server.base_url)
    r = generate(server, {"input_ids": [4, 5, 6], "sampling_params": sp(3)})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 3


# 12. A third-party tokenizer loader ------------------------------------------------------


def test_transformers_autotokenizer_matches_server(server, tiny_model_dir, tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = tok.encode("hello")
    assert ids == tokenizer.encode("hello").ids
    by_text = generate(server, {"text": "hello", "sampling_params": sp(6, temperature=0)}).json()
    assert by_text["meta_info"]["prompt_tokens"] == len(ids)
    # Same ids: sending them as input_ids reproduces the text request exactly.
    by_ids = generate(server, {"input_ids": ids, "sampling_params": sp(6, temperature=0)}).json()
    assert by_ids["meta_info"]["prompt_tokens"] == len(ids)
    assert by_ids["output_ids"] == by_text["output_ids"]
    assert tok.decode(by_text["output_ids"], skip_special_tokens=True) == by_text["text"]


def test_non_finite_temperature_is_refused(server):
    for bad in ("NaN", "Infinity", -1):
        r = httpx.post(f"{server.base_url}/generate", content=(
            '{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "temperature": %s}}' % bad),
            headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 400 and "temperature must be a finite number >= 0" in r.json()["error"]["message"]
    # A temperature below 1e-6 is greedy, as in SGLang: no overflow, an answer.
    r = httpx.post(f"{server.base_url}/generate", json={"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 2, "temperature": 1e-45}}, timeout=30)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


def test_non_stream_disconnect_frees_the_engine(server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
            "max_new_tokens": 5000, "ignore_eos": True}}, timeout=1.0)
    assert_pools_at_totals(server.base_url)  # the abandoned request no longer runs, nor holds anything


def test_metrics_use_sglang_names(server):
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    for name in ("sglang:token_usage", "sglang:num_running_reqs", "sglang:num_queue_reqs",
                 "sglang:cache_hit_rate", "sglang:prompt_tokens_total", "sglang:generation_tokens_total"):
        assert f'{name}{{model_name="tiny"}}' in text


def test_accepted_connections_get_tcp_nodelay():
    """remnant-serve hands uvicorn its own listening socket (server.bind); asyncio turns
    Nagle off only on connections whose socket names IPPROTO_TCP, and with Nagle on a
    keep-alive client waited ~40 ms (delayed ACK) for each response after the first."""
    import asyncio
    import socket

    from remnant.engine.server import bind

    async def accepted_nodelay() -> int:
        sock = bind("127.0.0.1", 0)
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        def on_connect(reader, writer):
            got.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        try:
            return await asyncio.wait_for(got, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0


# 13. Any client, any bad input (issue 31) ------------------------------------------------


def _alive(server) -> None:
    """/health answers 200 and a valid request completes: the engine is still serving."""
    assert httpx.get(f"{server.base_url}/health", timeout=TIMEOUT).status_code == 200
    r = generate(server, {"input_ids": [1, 2, 3], "sampling_params": sp(2)})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2, r.text


@pytest.mark.parametrize("seed", [2**63, 2**70, -(2**63) - 1])
def test_a_seed_outside_int64_is_refused_and_the_engine_keeps_serving(server, seed):
    """A seed torch cannot take used to end the engine loop: 500 "engine loop died", then 503
    for every request. It is refused at the edge, naming the field and the range."""
    msg = assert_error_body(generate(server, {"input_ids": [1, 2], "sampling_params": sp(2, sampling_seed=seed)}))
    assert f"sampling_params.sampling_seed={seed} is outside the allowed range" in msg
    _alive(server)
    r = generate(server, {"input_ids": [1, 2], "sampling_params": sp(2, sampling_seed=2**63 - 1)})
    assert r.status_code == 200, r.text  # the largest allowed seed samples


def _schema_error(r: httpx.Response) -> dict:
    """SGLang's RequestValidationError answer: 400 with the flat ErrorResponse."""
    assert r.status_code == 400, r.text
    body = r.json()
    assert set(body) == {"object", "message", "type", "param", "code"} and body["code"] == 400, body
    return body


@pytest.mark.parametrize(("content", "field", "got"), [
    (b'{"text": "hi", "sampling_params": {"max_new_tokens": Infinity}}', "sampling_params.max_new_tokens", "Infinity"),
    (b'{"text": "hi", "sampling_params": {"max_new_tokens": NaN}}', "sampling_params.max_new_tokens", "NaN"),
    (b'{"text": "hi", "sampling_params": {"max_new_tokens": 2.7}}', "sampling_params.max_new_tokens", "2.7"),
    (b'{"text": "hi", "sampling_params": {"max_new_tokens": "8"}}', "sampling_params.max_new_tokens", '"8"'),
    (b'{"text": "hi", "sampling_params": {"max_new_tokens": true}}', "sampling_params.max_new_tokens", "true"),
    (b'{"input_ids": [1, 2.5]}', "input_ids[1]", "2.5"),
    (b'{"text": 7}', "text", "7"),
    (b'{"text": "hi", "stream": "yes"}', "stream", '"yes"'),
], ids=["inf", "nan", "float", "string", "bool", "float-id", "int-text", "str-stream"])
def test_wrong_types_are_400_naming_field_and_value(server, content, field, got):
    body = _schema_error(_post_raw(server, content))
    assert body["param"] == field
    assert body["message"].startswith(f"{field}: Input should be a valid ") and body["message"].endswith(f"got {got}")


def test_a_body_that_is_not_utf8_is_400(server):
    body = _schema_error(_post_raw(server, b'{"text": "caf\xe9"}'))
    assert body["message"] == ("the request body is not UTF-8: byte 0xe9 at offset 13; send JSON encoded as UTF-8")
    _alive(server)


def test_unknown_sampling_params_are_refused_unknown_fields_ignored(server):
    body = _schema_error(generate(server, {"text": "hi", "sampling_params": {"max_new_token": 4}}))
    assert body["param"] == "sampling_params.max_new_token"
    assert "unknown key; allowed: max_new_tokens, temperature" in body["message"]
    # SGLang ignores top-level fields it does not know; so does remnant-serve.
    r = generate(server, {"text": "hi", "sampling_params": sp(2), "no_such_field": {"x": 1}})
    assert r.status_code == 200, r.text


def test_fields_sglang_bench_sends_are_accepted(server):
    """sglang.benchmark.serving's async_request_sglang_generate payload at its defaults."""
    r = generate(server, {"text": "hi", "sampling_params": {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True},
                          "stream": False, "lora_path": None, "return_logprob": False,
                          "return_routed_experts": False, "logprob_start_len": -1})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3, r.text


@pytest.mark.parametrize(("body", "message"), [
    ({"return_logprob": True}, "return_logprob=true is not supported by the embedded engine; allowed: false"),
    ({"lora_path": "adapter"}, 'lora_path="adapter" is not supported by the embedded engine; allowed: null'),
    ({"sampling_params": {"max_new_tokens": 2, "top_p": 0.5}},
     "sampling_params.top_p=0.5 is not supported by the embedded engine; allowed: 1.0"),
    ({"sampling_params": {"max_new_tokens": 2, "stop": ["x"]}},
     'sampling_params.stop=["x"] is not supported by the embedded engine; allowed: null'),
    ({"sampling_params": {"max_new_tokens": 2, "n": 2}},
     "sampling_params.n=2 is not supported by the embedded engine; allowed: 1"),
], ids=["logprob", "lora", "top_p", "stop", "n"])
def test_features_the_engine_lacks_are_refused_by_name(server, body, message):
    assert assert_error_body(generate(server, {"input_ids": [1, 2], **body})) == message
    assert assert_error_stream(stream_generate(server.base_url, {"input_ids": [1, 2], **body})) == message


def test_batches_are_refused_by_name(server):
    for body, field in (({"text": ["a", "b"]}, "text"), ({"input_ids": [[1], [2]]}, "input_ids"),
                        ({"text": "a", "rid": ["x"]}, "rid")):
        out = _schema_error(generate(server, body))
        assert out["param"] == field and "batch of requests" in out["message"], out


@pytest.mark.slow
def test_duplicate_rid_in_flight_is_refused_as_sglang_does(server):
    """tokenizer_manager.py: `Duplicate request ID detected: {rid}` (a ValueError: 400, or an
    error frame in a stream); the id is free again once its request ends."""
    first = threading.Event()
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("s", stream_generate(
        server.base_url, {"input_ids": [1, 2, 3], "rid": "dup", "sampling_params": sp(300)}, on_first=first)))
    t.start()
    assert first.wait(30)
    msg = assert_error_body(generate(server, {"input_ids": [4, 5], "rid": "dup", "sampling_params": sp(2)}))
    assert msg == "Duplicate request ID detected: dup"
    msg = assert_error_stream(stream_generate(server.base_url, {"input_ids": [4, 5], "rid": "dup",
                                                                "sampling_params": sp(2)}))
    assert msg == "Duplicate request ID detected: dup"
    t.join(60)
    assert result["s"].frames[-1]["meta_info"]["completion_tokens"] == 300  # undisturbed
    r = generate(server, {"input_ids": [4, 5], "rid": "dup", "sampling_params": sp(2)})
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == "dup", r.text


def test_a_disconnected_stream_frees_its_rid(server):
    s = stream_generate(server.base_url, {"input_ids": [1, 2, 3], "rid": "gone", "sampling_params": sp(1000)},
                        stop_after=2)
    assert len(s.events) == 2
    deadline = time.monotonic() + 10
    while True:
        r = generate(server, {"input_ids": [4, 5], "rid": "gone", "sampling_params": sp(1)})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert r.status_code == 200, r.text


def test_get_prefixed_info_routes_answer_as_the_current_ones(server):
    for old, new in (("/get_model_info", "/model_info"), ("/get_server_info", "/server_info")):
        a, b = (httpx.get(f"{server.base_url}{p}", timeout=TIMEOUT) for p in (old, new))
        assert a.status_code == b.status_code == 200
        assert set(a.json()) == set(b.json())


def test_unknown_route_and_method_answer_json(server):
    r = httpx.post(f"{server.base_url}/no_such_route", json={}, timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["code"] == 404
    r = httpx.get(f"{server.base_url}/generate", timeout=TIMEOUT)
    assert r.status_code == 405 and r.json()["code"] == 405


def test_body_problems_say_what_to_send(server):
    r = httpx.post(f"{server.base_url}/generate", content=b'{"text": "hi"}', headers={"content-type": "text/plain"},
                   timeout=TIMEOUT)
    assert _schema_error(r)["message"] == ("the request body was not read as JSON: send it with "
                                           "Content-Type: application/json")
    assert _schema_error(_post_raw(server, b""))["message"] == "the request body is empty; send a JSON object"
    assert _schema_error(_post_raw(server, b"[1, 2]"))["message"] == "the request body must be a JSON object, got list"
    msg = _schema_error(_post_raw(server, b'{"text": "hi",}'))["message"]
    assert msg.startswith("the request body is not valid JSON: ") and msg.endswith("at character 14")


def test_many_problems_are_counted_not_all_listed(server):
    body = _schema_error(generate(server, {"input_ids": [1.5] * 20_000, "sampling_params": sp(1)}))
    assert body["param"] == "input_ids[0]"
    assert body["message"].endswith("; and 19995 more") and body["message"].count("input_ids[") == 5


@pytest.mark.slow
def test_requests_that_end_give_back_every_page_block_and_slot(server):
    """Requests that finish, are refused, stream, leave mid-stream, or resume from a cached
    prefix (a page-long shared prompt, one of them sent while the window pool is busy)
    leave the pools as they found them, once the cache is flushed."""
    assert_pools_at_totals(server.base_url)
    shared = list(range(1, 256)) * 2  # two pages: the second request resumes from the first
    threads = [threading.Thread(target=stream_generate, args=(server.base_url, {
        "input_ids": shared[:300] + [i], "sampling_params": sp(40)}), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    for body in ({"input_ids": shared + [7], "sampling_params": sp(3)}, {"input_ids": [1, 10**6]},
                 {"text": "x", "sampling_params": sp(3), "rid": "whole"}):
        generate(server, body)
    stream_generate(server.base_url, {"input_ids": shared, "sampling_params": sp(500)}, stop_after=2)
    for t in threads:
        t.join(60)
    assert_pools_at_totals(server.base_url)


# 14. The event loop is never the one that works ------------------------------------------


class DecodeSpy:
    """The real tokenizer, counting the ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls, self.ids = tokenizer, 0, 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        self.ids += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _generation(tokenizer):
    from remnant.engine.api import EngineInput, ModelLimits
    from remnant.engine.engine import SamplingParams
    from remnant.engine.frontend import Frontend, Generation

    frontend = Frontend(None, DecodeSpy(tokenizer), ModelLimits(258, 65536, 65536, 4096), "tiny")
    return Generation(frontend, "spy", EngineInput([1, 2], SamplingParams(4000))), frontend.tokenizer


def _outputs(n: int) -> list[int]:
    """n output ids of UTF-8 text: ASCII, two- to four-byte characters, a stray byte, EOS."""
    text = "héllo wörld ✓ 🙂 ".encode() * (n // 20 + 1)
    ids = list(text[:n])
    ids[n // 2] = 0xFF  # never valid UTF-8
    ids[-1] = 257
    return ids


def test_a_non_stream_answer_is_decoded_once(tokenizer):
    """final() used to build an out dict (decoding every output id so far) for each of a
    request's events: ~1.7 s of the event loop per 4,000-token answer."""
    import asyncio

    from remnant.engine.engine import TokenEvent

    gen, spy = _generation(tokenizer)
    ids = _outputs(4000)
    for k in range(1, len(ids) + 1):
        gen.queue.put_nowait(TokenEvent(ids[:k], {"type": "length", "length": k} if k == len(ids) else None))
    out = asyncio.run(gen.final())
    assert out["text"] == tokenizer.decode(ids) and out["output_ids"] == ids
    assert (spy.calls, spy.ids) == (1, len(ids))


def test_stream_text_is_decoded_incrementally(tokenizer):
    """Each frame decodes the ids since the last printable text (twice: with the ones
    before), not every id again; frames extend each other, the last is the whole text."""
    import asyncio

    from remnant.engine.engine import TokenEvent

    gen, spy = _generation(tokenizer)
    ids = _outputs(2000)
    for k in range(1, len(ids) + 1):
        gen.queue.put_nowait(TokenEvent(ids[:k], {"type": "length", "length": k} if k == len(ids) else None))

    async def frames():
        return [out["text"] async for out in gen.outputs()]

    texts = asyncio.run(frames())
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == tokenizer.decode(ids) and "\ufffd" not in texts[-2][-1:]
    assert spy.ids < 10 * len(ids), spy.ids  # every id again per frame: 2,000,000


@pytest.mark.slow
def test_a_huge_prompt_is_tokenized_off_the_event_loop(server):
    """A 5 MB text used to be tokenized on the event loop: every stream stalled until it
    was done. A stream running beside it now keeps its pace (its longest gap between
    frames is a small part of the time the huge request takes to be refused)."""
    first, done = threading.Event(), threading.Event()
    times: list[float] = []

    def stream() -> None:
        body = {"input_ids": [1, 2, 3], "sampling_params": sp(5000), "stream": True}
        with httpx.stream("POST", f"{server.base_url}/generate", json=body, timeout=TIMEOUT) as r:
            for _ in r.iter_raw():
                times.append(time.perf_counter())
                first.set()
                if done.is_set():
                    return  # the client leaves; the server drops the request

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert first.wait(30)
    t0 = time.perf_counter()
    r = generate(server, {"text": "x" * 5_000_000, "sampling_params": sp(1)})
    t1 = time.perf_counter()
    done.set()
    t.join(30)
    assert r.status_code == 400 and "longer than the model's context length" in r.json()["error"]["message"]
    during = [x for x in times if t0 <= x <= t1]
    gaps = [b - a for a, b in zip([t0, *during], [*during, t1])]
    assert t1 - t0 > 0.5 and max(gaps) < (t1 - t0) / 3, (t1 - t0, max(gaps))
    assert_pools_at_totals(server.base_url)
