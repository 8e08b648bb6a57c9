"""remnant-serve --api-key (REMNANT_API_KEY): SGLang 0.5.18's route semantics on a real
server on loopback, and a 401 with one clear line."""

from __future__ import annotations

import os

import httpx
import pytest

from remnant.engine.auth import refusal
from tests.conftest import start_server, stop_server

KEY = "sk-engine-test-4f1c2a9b"
GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def secured(tiny_model_dir, tmp_path_factory):
    """remnant-serve with its key in REMNANT_API_KEY, as the hosts start it."""
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("secured"), env={**os.environ, "REMNANT_API_KEY": KEY})
    yield s
    stop_server(s)


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("path", ["/health", "/health_generate", "/metrics"])
def test_probes_and_metrics_need_no_key(secured, path):
    assert httpx.get(secured.base_url + path, timeout=30).status_code == 200


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/generate", GENERATE),
    ("POST", "/flush_cache", None),
    ("GET", "/server_info", None),
    ("GET", "/get_server_info", None),
    ("GET", "/model_info", None),
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
    ("GET", "/no_such_route", None),  # as SGLang: the key is checked before the route
])
def test_every_other_route_needs_the_key(secured, method, path, body):
    url = secured.base_url + path
    for headers, why in (({}, "no API key"), (_auth("sk-wrong-key-12345"), "wrong API key"),
                         ({"Authorization": KEY}, "not 'Bearer <key>'")):
        r = httpx.request(method, url, json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        error = r.json()["error"]
        assert error.startswith("Unauthorized: ") and why in error and "\n" not in error and KEY not in r.text
    r = httpx.request(method, url, json=body, headers=_auth(KEY), timeout=30)
    assert r.status_code == (404 if path == "/no_such_route" else 200), r.text


def test_the_scheme_is_case_blind_and_streams_pass(secured):
    with httpx.stream("POST", secured.base_url + "/generate", json={**GENERATE, "stream": True},
                      headers={"authorization": f"bearer {KEY}"}, timeout=30) as r:
        assert r.status_code == 200
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"


def test_a_preflight_passes_without_the_key(secured):
    assert httpx.options(secured.base_url + "/generate", timeout=30).status_code != 401


def test_the_openai_client_sends_its_api_key(secured):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=secured.base_url + "/v1", api_key=KEY)
    assert client.models.list().data[0].id
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=secured.base_url + "/v1", api_key="sk-wrong-key-12345").models.list()


def test_the_flag_secures_the_server_and_the_log_keeps_no_key(tiny_model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REMNANT_API_KEY"}
    s = start_server(tiny_model_dir, tmp_path, "--api-key", KEY, env=env)
    try:
        assert httpx.get(s.base_url + "/server_info").status_code == 401
        assert httpx.get(s.base_url + "/server_info", headers=_auth(KEY)).status_code == 200
    finally:
        stop_server(s)
    log = s.log_path.read_text()
    assert "API key required" in log and "refused GET /server_info: no API key" in log and KEY not in log


def test_refusal():
    key = KEY.encode()
    assert refusal(f"Bearer {KEY}".encode(), key) is None
    assert refusal(f"BEARER {KEY}".encode(), key) is None
    assert refusal(None, key).startswith("no API key")
    assert refusal(b"Bearer ", key) == "the Authorization header is not 'Bearer <key>'"
    assert refusal(f"Basic {KEY}".encode(), key) == "the Authorization header is not 'Bearer <key>'"
    assert refusal(f"Bearer {KEY} ".encode(), key) == "wrong API key"
