"""Property-based fuzz of remnant-serve's HTTP edge (hypothesis): any request, any bytes.

For each endpoint that takes a body (/generate, /v1/completions, /v1/chat/completions) at
least FUZZ_CASES generated requests: JSON bodies with wrong types, out-of-range and
non-finite numbers, huge, empty and lone-surrogate strings, unknown fields and keys;
raw bodies (not UTF-8, truncated, deeply nested, not JSON, odd content types); streams the
client leaves mid-way; valid requests reusing the rid of one in flight (refused as
SGLang refuses them: "Duplicate request ID detected"). After every case: its answer is
2xx or 4xx (a stream's frames carry no 5xx error either), /health is 200, a valid
request completes, and, when no request runs, every page and SWA block is free or held
by the prefix cache and every request slot is free. After each endpoint's run the engine
has let go of every request and, the cache flushed, the pools are back to their totals.
The examples are derandomized: every run sends the same requests.

One real server for the module, the tiny model. Valid generations are kept short (a few
tokens; the large counts drawn are all beyond the context), so a case costs a few ms.
The case count and time of each run are printed.
"""

from __future__ import annotations

import json
import reprlib
import socket
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import start_server, stop_server
from tests.engine.test_server_api import assert_pools_at_totals, pools_whole

FUZZ_CASES = 1000
TIMEOUT = httpx.Timeout(30.0)


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir, tmp_path_factory):
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("fuzz"))
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def client(fuzz_server):
    # TCP_NODELAY: without it each request's body waits on the server's delayed ACK.
    transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    with httpx.Client(base_url=fuzz_server.base_url, timeout=TIMEOUT, transport=transport) as c:
        yield c


# Strategies ------------------------------------------------------------------------------

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=5)
NOT_NULL_JUNK = JUNK.filter(lambda v: v is not None)
# Counts: small valid ones, then only values past the context (65,536) or of another type,
# so that no accepted request generates long.
HUGE = st.sampled_from([70_000, 10**6, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**70, 10**30,
                        -(2**63) - 1, -(2**70)])
COUNT = st.integers(-3, 6) | HUGE | st.floats() | st.sampled_from([2.7, 3.0, -0.0, True, False, "4", [4], {}])
NUMBER = (st.floats() | st.integers(-3, 3) | HUGE
          | st.sampled_from([0.0, 1e-45, 1e308, float("nan"), float("inf"), -float("inf"), True, "1", None]))
SEED = st.integers(-5, 5) | HUGE | st.sampled_from([-(2**63), 2**63 - 1, 2**64 - 1, None, 1.5, "7"])
# Huge values are built by a map, so that a strategy's repr stays short.
HUGE_TEXT = st.sampled_from([("x", 70_000), ("é", 40_000)]).map(lambda t: t[0] * t[1])
TEXT = st.text(max_size=40) | HUGE_TEXT | st.sampled_from(
    ["", " ", "\ud800", "a\udfffb", "\x00\x01", "é✓🙂", "<｜User｜>"])
ANY_TEXT = TEXT | NOT_NULL_JUNK
BOOL = st.booleans() | JUNK
IDS = (st.lists(st.integers(-2, 300), max_size=24) | st.lists(st.integers(), max_size=4)
       | st.sampled_from([1, 1.5]).map(lambda v: [v] * 70_000)
       | st.sampled_from([[], [[1, 2], [3]], [2**70], [1.0, 2.0], [True]]) | NOT_NULL_JUNK)
RID = st.text(max_size=12) | st.sampled_from(["\ud800", ""]) | st.just(5000).map(lambda n: "x" * n) | JUNK
UNKNOWN = st.dictionaries(st.text(max_size=8), JUNK, max_size=2)


def _with_unknown(body: st.SearchStrategy) -> st.SearchStrategy:
    """Bodies plus fields the schema does not have (mostly none), now and then replaced by
    a value that is not an object at all."""
    merged = st.tuples(body, st.one_of(st.just({}), UNKNOWN)).map(lambda t: {**t[1], **t[0]})
    return st.one_of(merged, merged, merged, NOT_NULL_JUNK)


# /generate: sampling_params always holds a max_new_tokens from COUNT (SGLang's default is
# 128 tokens and null means "to the context": valid, but slow to fuzz with).
GENERATE_SAMPLING = st.one_of(
    st.fixed_dictionaries({"max_new_tokens": COUNT}, optional={
        "temperature": NUMBER, "ignore_eos": BOOL, "sampling_seed": SEED, "top_p": NUMBER, "top_k": COUNT,
        "stop": ANY_TEXT, "n": COUNT, "skip_special_tokens": BOOL, "min_new_tokens": COUNT}),
    st.fixed_dictionaries({"max_new_tokens": COUNT}).flatmap(
        lambda d: UNKNOWN.map(lambda u: {**u, **d})),
    NOT_NULL_JUNK)
GENERATE = _with_unknown(st.fixed_dictionaries({"sampling_params": GENERATE_SAMPLING}, optional={
    "text": ANY_TEXT, "input_ids": IDS, "rid": RID, "stream": BOOL, "return_logprob": BOOL,
    "lora_path": JUNK, "logprob_start_len": COUNT, "image_data": JUNK}))

COMPLETION = _with_unknown(st.fixed_dictionaries({"prompt": ANY_TEXT | IDS}, optional={
    "model": ANY_TEXT, "max_tokens": COUNT, "temperature": NUMBER, "top_p": NUMBER, "seed": SEED, "n": COUNT,
    "stream": BOOL, "stream_options": st.fixed_dictionaries({}, optional={"include_usage": BOOL,
                                                                         "continuous_usage_stats": BOOL}) | JUNK,
    "ignore_eos": BOOL, "rid": RID, "echo": BOOL, "logprobs": COUNT, "stop": ANY_TEXT, "best_of": COUNT}))

MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "developer"])
                                 | ANY_TEXT}, optional={
    "content": ANY_TEXT | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | JUNK,
                                                          "text": ANY_TEXT}), max_size=3),
    "name": ANY_TEXT, "tool_calls": JUNK})
# Chat always names a max_tokens from COUNT: without one a request runs to EOS or the pool.
CHAT = _with_unknown(st.fixed_dictionaries({"max_tokens": COUNT}, optional={
    "messages": st.lists(MESSAGE, max_size=3) | NOT_NULL_JUNK, "model": ANY_TEXT,
    "max_completion_tokens": COUNT, "temperature": NUMBER, "seed": SEED, "stream": BOOL,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": BOOL}) | JUNK, "ignore_eos": BOOL,
    "rid": RID, "tools": JUNK, "logprobs": BOOL, "n": COUNT}))

# Valid bodies with one or two fields set to a fuzzed value: the paths past the schema.
VALID_BODIES = {
    "/generate": {"text": "hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0.5}},
    "/v1/completions": {"prompt": "hello", "max_tokens": 3},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3},
}
MUTABLE = {
    "/generate": {"text": ANY_TEXT, "input_ids": IDS, "rid": RID, "stream": BOOL, "return_logprob": BOOL,
                  "lora_path": JUNK, "sampling_params": NOT_NULL_JUNK, "sampling_params.max_new_tokens": COUNT,
                  "sampling_params.temperature": NUMBER, "sampling_params.sampling_seed": SEED,
                  "sampling_params.ignore_eos": BOOL, "sampling_params.top_k": COUNT,
                  "sampling_params.stop": ANY_TEXT, "sampling_params.skip_special_tokens": BOOL},
    "/v1/completions": {"prompt": ANY_TEXT | IDS, "model": ANY_TEXT, "max_tokens": COUNT, "temperature": NUMBER,
                        "seed": SEED, "stream": BOOL, "stream_options": JUNK, "stream_options.include_usage": BOOL,
                        "ignore_eos": BOOL, "rid": RID, "n": COUNT, "echo": BOOL, "top_p": NUMBER},
    "/v1/chat/completions": {"messages": NOT_NULL_JUNK | st.lists(MESSAGE, max_size=3), "messages.0": MESSAGE | JUNK,
                             "messages.0.content": ANY_TEXT, "messages.0.role": ANY_TEXT, "model": ANY_TEXT,
                             "max_tokens": COUNT, "max_completion_tokens": COUNT, "temperature": NUMBER,
                             "seed": SEED, "stream": BOOL, "stream_options.include_usage": BOOL, "rid": RID,
                             "tools": JUNK, "ignore_eos": BOOL},
}


def _set(body, dotted: str, value):
    """`body` with the field at `dotted` (a.b, list indexes as digits) set to `value`; as
    it was where an earlier change left no object or list on that path."""
    changed = json.loads(json.dumps(body, allow_nan=True))
    *parents, last = [int(p) if p.isdigit() else p for p in dotted.split(".")]
    node = changed
    try:
        for key in parents:
            if isinstance(node, dict) and not isinstance(node.get(key), (dict, list)):
                node[key] = {}
            node = node[key]
        node[last] = value
    except (KeyError, IndexError, TypeError):
        return body
    return changed


def mutated(path: str) -> st.SearchStrategy:
    field = st.sampled_from(sorted(MUTABLE[path])).flatmap(lambda k: MUTABLE[path][k].map(lambda v: (k, v)))
    return st.lists(field, min_size=1, max_size=2).map(
        lambda changes: _apply(VALID_BODIES[path], changes))


def _apply(body, changes):
    for dotted, value in changes:
        body = _set(body, dotted, value)
    return body


RAW = st.binary(max_size=64) | st.sampled_from([
    b"", b"{", b"}", b"null", b"[]", b'"text"', b"1e999", b"NaN", b'{"text": "caf\xe9"}', b"\xff\xfe{\x00}\x00",
    b'{"text": "\\ud800"}', b'{"text": "hi"' + b"\x00"]) | st.sampled_from([
        (b"", b"[", 50_000, b""), (b"", b'{"a": ', 20_000, b""), (b'{"prompt": 1', b"9", 5000, b"}"),
        (b'{"text": "hi", "sampling_params": {"max_new_tokens": 1}}', b" ", 100_000, b"")]).map(
    lambda t: t[0] + t[1] * t[2] + t[3])  # deep nesting, an int of 5,000 digits, 100 kB of blanks
CONTENT_TYPE = st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain",
                                "application/x-www-form-urlencoded", "APPLICATION/JSON", None])

# Long valid streams for the disconnect and duplicate-rid cases.
LONG = {"/generate": {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}},
        "/v1/completions": {"prompt": [1, 2, 3], "max_tokens": 300, "ignore_eos": True},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300,
                                 "ignore_eos": True}}
BODIES = {"/generate": GENERATE, "/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}


@dataclass(repr=False)
class Case:
    kind: str  # json | raw | disconnect | duplicate
    body: object = None
    raw: bytes = b""
    content_type: str | None = None
    cut_after: int = 0
    rid: str = ""

    def __repr__(self) -> str:  # bodies of 70,000 ids: a falsifying example must stay readable
        short = reprlib.Repr()
        short.maxstring, short.maxother, short.maxlist, short.maxdict, short.maxlevel = 80, 80, 8, 12, 4
        return (f"Case({self.kind!r}, body={short.repr(self.body)}, raw={short.repr(self.raw)}, "
                f"content_type={self.content_type!r}, cut_after={self.cut_after}, rid={self.rid!r})")


def cases(path: str) -> st.SearchStrategy[Case]:
    body = BODIES[path]
    return st.one_of(
        body.map(lambda b: Case("json", b)),
        mutated(path).map(lambda b: Case("json", b)),
        mutated(path).map(lambda b: Case("json", b)),
        st.builds(lambda raw, ct: Case("raw", raw=raw, content_type=ct), RAW, CONTENT_TYPE),
        st.builds(lambda b, cut: Case("disconnect", b, cut_after=cut), UNKNOWN,
                  st.sampled_from([0, 1, 40, 400, 4000])),
        st.builds(lambda stream, rid: Case("duplicate", {**VALID_BODIES[path], "stream": stream}, rid=rid),
                  st.booleans(), st.text(min_size=1, max_size=10)),
    )


# The harness -----------------------------------------------------------------------------


def _no_5xx_in_stream(path: str, raw: bytes) -> None:
    """A 200 stream's frames: an error frame, or an engine abort, must not carry a 5xx."""
    for block in raw.split(b"\n\n"):
        payload = block[len(b"data: "):] if block.startswith(b"data: ") else block
        if not payload.strip() or payload == b"[DONE]":
            continue
        frame = json.loads(payload)
        err = frame.get("error") or {}
        assert not (isinstance(err.get("code"), int) and err["code"] >= 500), (path, frame)
        reason = (frame.get("meta_info") or {}).get("finish_reason") or {}
        assert not (reason.get("status_code") or 0) >= 500, (path, frame)


def _post(client: httpx.Client, path: str, content: bytes, content_type: str | None) -> httpx.Response:
    headers = {} if content_type is None else {"content-type": content_type}
    with client.stream("POST", path, content=content, headers=headers) as r:
        r.read()
    return r


def _json(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


def run_case(client: httpx.Client, path: str, case: Case, seen: Counter) -> None:
    if case.kind in ("json", "raw"):
        content = _json(case.body) if case.kind == "json" else case.raw
        ctype = "application/json" if case.kind == "json" else case.content_type
        r = _post(client, path, content, ctype)
        assert r.status_code < 500, (path, case, r.status_code, r.text[:500])
        if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
            _no_5xx_in_stream(path, r.content)
        seen[f"{r.status_code // 100}xx"] += 1
    elif case.kind == "disconnect":
        # A long stream (with unknown fields) the client leaves after `cut_after` bytes.
        body = {**case.body, **LONG[path], "stream": True}
        with client.stream("POST", path, content=_json(body), headers={"content-type": "application/json"}) as r:
            assert r.status_code < 500, (path, case, r.status_code)
            got = 0
            for chunk in r.iter_raw():
                got += len(chunk)
                if got >= case.cut_after:
                    break
        seen["disconnects"] += 1
    else:
        # A valid request reuses the rid of a long stream in flight: refused as SGLang
        # refuses it, a 400 (a /generate stream: a 200 with one error frame).
        rid = case.rid
        long = {**LONG[path], "stream": True, "rid": rid}
        with client.stream("POST", path, content=_json(long), headers={"content-type": "application/json"}) as first:
            assert first.status_code == 200, (path, case, first.read()[:500])
            # In flight now. Keep the iterator: dropped, it closes the connection, and the
            # server lets the request (and its rid) go.
            frames = first.iter_raw()
            next(frames)
            with httpx.Client(base_url=str(client.base_url), timeout=TIMEOUT) as other:
                r = _post(other, path, _json({**case.body, "rid": rid}), "application/json")
            del frames
        assert duplicate_refusal(path, case.body["stream"], r) == f"Duplicate request ID detected: {rid}", (path, case)
        seen["duplicates"] += 1
    seen["cases"] += 1


def duplicate_refusal(path: str, stream: bool, r: httpx.Response) -> str:
    """The message of SGLang's answer to a refused request: /generate's {"error":
    {"message"}} (400, or a 200 stream of one error frame), /v1's flat ErrorResponse."""
    if path == "/generate" and stream:
        assert r.status_code == 200, r.text[:500]
        frames = [b[len(b"data: "):] for b in r.content.split(b"\n\n") if b]
        assert frames[-1] == b"[DONE]" and len(frames) == 2, frames
        return json.loads(frames[0])["error"]["message"]
    assert r.status_code == 400, r.text[:500]
    body = r.json()
    return body["error"]["message"] if path == "/generate" else body["message"]


VALID = {"/generate": {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}}


def still_serving(client: httpx.Client) -> None:
    """/health, a valid request, and, when nothing runs, pools whose every page, SWA block
    and slot is free or held by the prefix cache."""
    assert client.get("/health").status_code == 200
    r = client.post("/generate", json=VALID["/generate"])
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 1, r.text
    state = client.get("/server_info").json()["internal_states"][0]
    if state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0:
        assert not pools_whole(state, flushed=False), (pools_whole(state, flushed=False), state)


def drained(client: httpx.Client, within_s: float = 30.0) -> dict:
    """Wait until the engine runs and queues nothing (every abandoned stream let go)."""
    deadline = time.monotonic() + within_s
    while True:
        state = client.get("/server_info").json()["internal_states"][0]
        if state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0:
            return state
        assert time.monotonic() < deadline, f"requests still held {within_s} s after the fuzz: {state}"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("path", list(BODIES))
def test_fuzz_http_edge(fuzz_server, client, path, capsys):
    seen: Counter = Counter()

    @settings(max_examples=FUZZ_CASES, deadline=None, database=None, print_blob=True, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                     HealthCheck.large_base_example])
    @given(case=cases(path))
    def fuzz(case: Case) -> None:
        run_case(client, path, case, seen)
        still_serving(client)

    t0 = time.perf_counter()
    fuzz()
    elapsed = time.perf_counter() - t0
    drained(client)
    assert_pools_at_totals(fuzz_server.base_url)
    with capsys.disabled():
        detail = ", ".join(f"{k} {v}" for k, v in sorted(seen.items()) if k != "cases")
        print(f"\nfuzz {path}: {seen['cases']} cases in {elapsed:.1f} s ({detail})")
    assert seen["cases"] >= FUZZ_CASES
    assert seen["2xx"] and seen["4xx"] and seen["disconnects"] and seen["duplicates"], seen
