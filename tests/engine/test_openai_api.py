"""remnant-serve's OpenAI-compatible routes against SGLang 0.5.18's shapes.

Every test drives the real `remnant-serve` child process (the session `server` fixture)
over loopback with httpx. The SGLang references name files under `python/sglang/srt/
entrypoints/` of SGLang 0.5.18: `http_server.py` (routes, validate_json_request, the
validation handler), `openai/protocol.py` (models and their serializers),
`openai/serving_completions.py` and `openai/serving_chat.py` (chunk sequences),
`openai/sse_utils.py` (chat chunks) and `openai/usage_processor.py` (usage).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from tests.engine.test_server_api import assert_pools_at_totals

TIMEOUT = httpx.Timeout(60.0)

# protocol.py ModelCard
MODEL_CARD_KEYS = {"id", "object", "created", "owned_by", "root", "parent", "max_model_len"}
# protocol.py UsageInfo, all fields (a non-stream response and a chat usage chunk)
USAGE_KEYS = {"prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details", "reasoning_tokens"}
# CompletionResponse / ChatCompletionResponse: sglext dropped when None by their serializers
RESPONSE_KEYS = {"id", "object", "created", "model", "choices", "usage", "metadata"}
# CompletionResponseChoice: hidden_states, token_ids, prompt_token_ids dropped when None
COMPLETION_CHOICE_KEYS = {"index", "text", "logprobs", "finish_reason", "matched_stop"}
# CompletionStreamResponse: sglext dropped, usage kept (null)
COMPLETION_CHUNK_KEYS = {"id", "object", "created", "model", "choices", "usage"}
# ChatCompletionResponseChoice: hidden_states, prompt/response token ids, meta_info dropped when None
CHAT_CHOICE_KEYS = {"index", "message", "logprobs", "finish_reason", "matched_stop"}
# ChatMessage
CHAT_MESSAGE_KEYS = {"role", "content", "reasoning_content", "tool_calls"}
# sse_utils.py StreamChunk (omit_defaults: usage absent when None) and StreamChoice
CHAT_CHUNK_KEYS = {"id", "object", "created", "model", "choices"}
CHAT_CHUNK_CHOICE_KEYS = {"index", "delta", "logprobs", "finish_reason", "matched_stop"}
# protocol.py ErrorResponse
ERROR_KEYS = {"object", "message", "type", "param", "code"}


@pytest.fixture(scope="module")
def hf_config(tiny_model_dir) -> dict:
    return json.loads((Path(tiny_model_dir) / "config.json").read_text())


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(tiny_model_dir) / "tokenizer.json"))


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=TIMEOUT)


def sse(server, path: str, body: dict) -> tuple[int, list]:
    """POST a stream; (status, payloads): each `data: ` payload parsed, "[DONE]" kept."""
    with httpx.stream("POST", f"{server.base_url}{path}", json={**body, "stream": True}, timeout=TIMEOUT) as r:
        raw = r.read()
        if r.status_code != 200:
            return r.status_code, [json.loads(raw)]
    blocks = raw.split(b"\n\n")
    assert blocks[-1] == b"", raw[-200:]
    out = []
    for block in blocks[:-1]:
        assert block.startswith(b"data: "), block
        payload = block[len(b"data: "):]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    assert out[-1] == "[DONE]" and out.count("[DONE]") == 1
    return 200, out[:-1]


def error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == ERROR_KEYS and body["object"] == "error" and body["code"] == status, body
    return body


def greedy_text(server, ids: list[int], n: int) -> str:
    r = post(server, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                                         "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["text"]


# /v1/models ------------------------------------------------------------------------------


def test_models_lists_the_served_model(server, hf_config):
    r = httpx.get(f"{server.base_url}/v1/models", timeout=TIMEOUT)
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"object", "data"} and body["object"] == "list"
    (card,) = body["data"]
    assert set(card) == MODEL_CARD_KEYS
    served = httpx.get(f"{server.base_url}/model_info", timeout=TIMEOUT).json()["served_model_name"]
    assert card["id"] == card["root"] == served
    assert card["object"] == "model" and card["owned_by"] == "sglang" and card["parent"] is None
    assert card["max_model_len"] == hf_config["max_position_embeddings"]
    one = httpx.get(f"{server.base_url}/v1/models/{served}", timeout=TIMEOUT)
    assert one.status_code == 200 and set(one.json()) == MODEL_CARD_KEYS and one.json()["id"] == served
    missing = httpx.get(f"{server.base_url}/v1/models/not-{served}", timeout=TIMEOUT)
    assert missing.status_code == 404
    assert missing.json() == {"error": {"message": f"The model 'not-{served}' does not exist",
                                        "type": "invalid_request_error", "param": "model",
                                        "code": "model_not_found"}}


# /v1/completions -------------------------------------------------------------------------


def test_completion(server, tokenizer):
    r = post(server, "/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 5, "temperature": 0,
                                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == RESPONSE_KEYS
    assert body["object"] == "text_completion" and body["model"] == "m"  # echoed, as SGLang does
    assert body["metadata"] == {"weight_version": "default"}
    (choice,) = body["choices"]
    assert set(choice) == COMPLETION_CHOICE_KEYS
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["matched_stop"] is None
    ids = tokenizer.encode("hello").ids
    assert choice["text"] == greedy_text(server, ids, 5)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 5, "total_tokens": len(ids) + 5,
                             "prompt_tokens_details": None, "reasoning_tokens": 0}


def test_completion_of_token_ids_and_a_one_prompt_list(server):
    for prompt in ([7, 8, 9], [[7, 8, 9]]):
        r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 3


def test_completion_stream(server):
    body = {"prompt": "stream me", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    status, chunks = sse(server, "/v1/completions", body)
    assert status == 200 and len(chunks) == 6  # one per token; no usage chunk unless asked
    for i, c in enumerate(chunks):
        assert set(c) == COMPLETION_CHUNK_KEYS and c["object"] == "text_completion" and c["usage"] is None
        (choice,) = c["choices"]
        assert set(choice) == COMPLETION_CHOICE_KEYS
        assert choice["finish_reason"] == ("length" if i == 5 else None)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert len({c["id"] for c in chunks}) == 1


def test_completion_stream_usage_last(server):
    status, chunks = sse(server, "/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True,
                                                     "stream_options": {"include_usage": True}})
    assert status == 200
    *tokens, last = chunks
    assert len(tokens) == 4 and all(c["usage"] is None for c in tokens)
    # serving_completions.py dumps the usage chunk with exclude_none=True
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 4, "completion_tokens": 4,
                                                        "total_tokens": 8, "reasoning_tokens": 0}


def test_completion_stream_continuous_usage(server):
    status, chunks = sse(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True,
                                                     "stream_options": {"continuous_usage_stats": True}})
    assert status == 200 and [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3]


# /v1/chat/completions --------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


def chat_ids(tiny_model_dir, messages) -> list[int]:
    """The prompt as transformers' own apply_chat_template builds it from the model dir."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_completion(server, tiny_model_dir):
    r = post(server, "/v1/chat/completions", {"model": "m", "messages": MESSAGES, "max_tokens": 5,
                                              "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == RESPONSE_KEYS and body["object"] == "chat.completion" and body["model"] == "m"
    (choice,) = body["choices"]
    assert set(choice) == CHAT_CHOICE_KEYS and choice["finish_reason"] == "length"
    assert set(choice["message"]) == CHAT_MESSAGE_KEYS and choice["message"]["role"] == "assistant"
    ids = chat_ids(tiny_model_dir, MESSAGES)
    assert body["usage"]["prompt_tokens"] == len(ids)  # the model dir's template, as transformers renders it
    assert choice["message"]["content"] == greedy_text(server, ids, 5)


def test_chat_max_completion_tokens_and_text_parts(server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi."}]}]
    a = post(server, "/v1/chat/completions", {"messages": parts, "max_completion_tokens": 3, "temperature": 0,
                                              "ignore_eos": True}).json()
    b = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3,
                                              "temperature": 0, "ignore_eos": True}).json()
    # SGLang joins a string-content template's text parts with spaces
    assert a["usage"] == b["usage"] and a["usage"]["completion_tokens"] == 3
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def test_chat_stream(server):
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    whole = post(server, "/v1/chat/completions", body).json()
    status, chunks = sse(server, "/v1/chat/completions", body)
    assert status == 200
    first, *content, finish, usage = chunks
    for c in (first, *content, finish):
        assert set(c) == CHAT_CHUNK_KEYS and c["object"] == "chat.completion.chunk"
        (choice,) = c["choices"]
        assert set(choice) == CHAT_CHUNK_CHOICE_KEYS
    assert first["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    assert all(set(c["choices"][0]["delta"]) == {"reasoning_content", "content"} for c in content)
    assert all(c["choices"][0]["finish_reason"] is None for c in (first, *content))
    assert finish["choices"][0]["delta"] == {"reasoning_content": None}
    assert finish["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert text == whole["choices"][0]["message"]["content"]
    # serving_chat.py dumps its usage chunk whole (prompt_tokens_details: null kept)
    assert usage["choices"] == [] and set(usage["usage"]) == USAGE_KEYS
    assert usage["usage"] == whole["usage"]


# Refusals: the flat ErrorResponse, status 400, before any stream starts -------------------


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens: must be positive, got 0"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, "max_tokens",
     "max_tokens: Input should be a valid integer, got 2.5"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "several prompts are a batch"),
    ("/v1/completions", {"prompt": ""}, "prompt", "Prompt cannot be empty"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n", "n=2 is not supported by the embedded engine; allowed: 1"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, "seed", "is outside the allowed range"),
    ("/v1/completions", {"prompt": [1, 10**6]}, "prompt", "token id 1000000 outside the vocabulary"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, "max_tokens", "longer than the model's context length"),
    ("/v1/chat/completions", {"messages": []}, "messages", "Messages cannot be empty."),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                         "image_url": {"url": "x"}}]}]},
     "messages[0].content", "the model is text-only"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role",
     "Input should be 'system', 'developer', 'user', 'assistant' or 'tool'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools", "is not supported by the embedded engine; allowed: null"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "temperature": -1}, "temperature",
     "temperature must be a finite number >= 0, got -1"),
], ids=["zero-max", "float-max", "batch", "empty", "n", "seed", "vocab", "context", "no-messages", "image",
        "role", "tools", "temperature"])
def test_refusals_name_the_field(server, path, body, param, message):
    for stream in (False, True):
        r = post(server, path, {**body, "stream": stream})
        e = error(r)
        assert e["param"] == param and message in e["message"], e
        # schema errors: http_server.py's validation handler; the rest: create_error_response
        assert e["type"] == ("Bad Request" if r.json()["message"].startswith(f"{param}: ") else "BadRequestError"), e


def test_non_finite_numbers_are_refused(server):
    for value in ("NaN", "Infinity", "-Infinity"):
        r = httpx.post(f"{server.base_url}/v1/completions", timeout=TIMEOUT,
                       content=b'{"prompt": "x", "max_tokens": 2, "temperature": %s}' % value.encode(),
                       headers={"content-type": "application/json"})
        assert error(r)["param"] == "temperature"


def test_json_content_type_is_required(server):
    """http_server.py validate_json_request(): /v1 POST bodies must say application/json."""
    for headers in ({}, {"content-type": "text/plain"}):
        r = httpx.post(f"{server.base_url}/v1/completions", content=b'{"prompt": "x"}', headers=headers,
                       timeout=TIMEOUT)
        assert "Only 'application/json' is allowed" in error(r)["message"]


@pytest.mark.slow
def test_duplicate_rid_is_refused_while_in_flight(server):
    started = threading.Event()
    done: dict = {}

    def long_stream():
        with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=TIMEOUT,
                          json={"prompt": [1, 2], "max_tokens": 300, "ignore_eos": True, "rid": "oai-dup",
                                "stream": True}) as r:
            for _ in r.iter_raw():
                started.set()
        done["ok"] = True

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(30)
    e = error(post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "rid": "oai-dup"}))
    assert e["message"] == "Duplicate request ID detected: oai-dup" and e["param"] == "rid"
    t.join(60)
    assert done.get("ok")
    r = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "rid": "oai-dup"})
    assert r.status_code == 200 and r.json()["id"] == "oai-dup"


@pytest.mark.slow
def test_a_sampled_chat_without_max_tokens_ends(server, tiny_model_dir):
    """Without max_tokens a request runs to EOS or the context, as in SGLang (here capped by
    what the KV pool holds); at a high temperature the random model reaches EOS soon."""
    r = post(server, "/v1/chat/completions", {"messages": MESSAGES, "temperature": 5.0, "seed": 3})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    hf = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == hf["eos_token_id"]
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_message_roles_are_case_insensitive(server):
    """protocol.py lower-cases a message's role before checking it."""
    lower = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "temperature": 0,
                                                  "ignore_eos": True})
    mixed = post(server, "/v1/chat/completions", {
        "messages": [{**m, "role": m["role"].upper() if i else m["role"].title()} for i, m in enumerate(MESSAGES)],
        "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert lower.status_code == mixed.status_code == 200, mixed.text
    assert mixed.json()["usage"] == lower.json()["usage"]
    assert mixed.json()["choices"][0]["message"] == lower.json()["choices"][0]["message"]


def test_an_engine_abort_is_answered_as_sglang_types_it():
    """serving_chat.py / serving_completions.py: an abort with a status inside a stream is an
    error chunk typed by the status's name; before a stream, a 400 is a BadRequestError
    (a ValueError) and another status its number (an HTTPException)."""
    from remnant.engine.openai_api import _abort_body, _abort_chunk

    chunk = json.loads(_abort_chunk(500, "engine error: boom")[len(b"data: "):])
    assert chunk == {"error": {"object": "error", "message": "engine error: boom", "type": "INTERNAL_SERVER_ERROR",
                               "param": None, "code": 500}}
    assert json.loads(_abort_chunk(503, "x")[len(b"data: "):])["error"]["type"] == "SERVICE_UNAVAILABLE"
    assert json.loads(_abort_body(400, "too long").body)["type"] == "BadRequestError"
    assert json.loads(_abort_body(500, "boom").body)["type"] == "500"


def test_without_max_tokens_a_request_gets_its_share_of_the_pool():
    """The engine reserves a request's whole output when it admits it; "up to the context"
    would reserve 65,536 tokens of the 113,664 the tiny model's pool holds."""
    from remnant.engine.api import ModelLimits, engine_params

    names = {"max_new_tokens": "max_tokens", "temperature": "temperature", "seed": "seed"}
    limits = ModelLimits(vocab_size=258, context_len=65536, pool_tokens=113_664, default_new_tokens=3552)
    assert engine_params(10, limits, None, 0.0, False, None, names).max_new_tokens == 3552
    assert engine_params(65_530, limits, None, 0.0, False, None, names).max_new_tokens == 6  # the context's end
    assert engine_params(10, limits, 20_000, 0.0, False, None, names).max_new_tokens == 20_000  # asked: as asked


def test_chats_without_max_tokens_leave_room_for_the_next_request(server):
    """The openai client sends no max_tokens by default. Each such chat used to reserve
    65,536 tokens of KV (256 of the pool's 444 pages) at admission, and admission is in
    arrival order: two of them kept every later request waiting, while greedy decoding on
    random weights may never reach EOS. Now three run, and a one-token request beside them
    is answered at once."""
    started = threading.Barrier(4)
    stop = threading.Event()

    def chat() -> None:
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=TIMEOUT, json={
                "messages": MESSAGES, "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_raw()):
                if i == 0:
                    started.wait(30)
                if stop.is_set():
                    return

    threads = [threading.Thread(target=chat, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        try:
            started.wait(30)  # all three stream
        except threading.BrokenBarrierError:
            state = httpx.get(f"{server.base_url}/server_info", timeout=TIMEOUT).json()["internal_states"][0]
            pytest.fail(f"three chats without max_tokens did not all run within 30 s: {state}")
        r = httpx.post(f"{server.base_url}/generate", timeout=15,
                       json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 1, r.text
        state = httpx.get(f"{server.base_url}/server_info", timeout=TIMEOUT).json()["internal_states"][0]
        assert state["num_running_reqs"] == 3 and state["num_waiting_reqs"] == 0, state
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert_pools_at_totals(server.base_url)
