"""Third-party clients drive remnant-serve unchanged (README, "Clients").

SGLang 0.5.18's own benchmark client (`python -m sglang.benchmark.serving`), run as a user
runs it: readiness check on /v1/models, the model name found there, the tokenizer found
through /model_info, a warm-up request, streaming, for each of its SGLang backends
(native /generate, /v1/completions, /v1/chat/completions). Its token counts must match
what the server counted. And the `openai` package's client against the /v1 routes. Each
test uses the session's real server on loopback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import pytest

from tests.sglang.env import needs_sglang

BENCH_PROMPTS = 8


def generated_tokens(server) -> float:
    """The server's own count of generated tokens (/metrics, SGLang's metric name)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return float(re.search(r"^sglang:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M).group(1))


@needs_sglang
@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "sglang-oai-chat"])
def test_sglang_bench_client(server, backend, tmp_path):
    out = tmp_path / "bench.jsonl"
    before = generated_tokens(server)
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", backend, "--base-url", server.base_url,
           "--dataset-name", "random-ids", "--num-prompts", str(BENCH_PROMPTS), "--random-input-len", "32",
           "--random-output-len", "8", "--output-file", str(out), "--output-details"]
    # HF_HUB_OFFLINE: the client also asks the Hub whether the served name ("tiny") has a
    # chat template (a warning only); the answer must not depend on the network.
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "Server ready" in proc.stdout  # its readiness check on /v1/models passed
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["backend"] == backend
    assert result["completed"] == BENCH_PROMPTS and not any(result["errors"]), result["errors"]
    lens = result["output_lens"]
    assert len(lens) == BENCH_PROMPTS and result["total_output_tokens"] == sum(lens)
    # Every token the client counted, and its warm-up request's (the first prompt, at most
    # 32 tokens), is one the server generated: ignore_eos is on, so none ended early.
    assert generated_tokens(server) - before == sum(lens) + min(lens[0], 32)


# The openai package's client -------------------------------------------------------------


@pytest.fixture(scope="module")
def oai(server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def model_id(oai) -> str:
    (model,) = list(oai.models.list())
    return model.id


def test_openai_models(oai, server, model_id):
    assert model_id == httpx.get(f"{server.base_url}/model_info", timeout=30).json()["served_model_name"]
    assert oai.models.retrieve(model_id).id == model_id


def test_openai_completion(oai, model_id):
    r = oai.completions.create(model=model_id, prompt="Once upon", max_tokens=5, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and isinstance(r.choices[0].text, str)
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens == len("Once upon") + 1  # bytes + BOS
    stream = oai.completions.create(model=model_id, prompt="Once upon", max_tokens=5, temperature=0, stream=True,
                                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_openai_chat(oai, model_id):
    messages = [{"role": "user", "content": "Say hello."}]
    r = oai.chat.completions.create(model=model_id, messages=messages, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    stream = oai.chat.completions.create(model=model_id, messages=messages, max_tokens=6, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == r.usage


def test_openai_errors_name_the_field(oai, model_id):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model_id, prompt="x", max_tokens=0)
    assert err.value.status_code == 400 and "max_tokens: must be positive" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "x"}], max_tokens=2, n=2)
    assert "n=2 is not supported by the embedded engine; allowed: 1" in str(err.value)
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve(f"not-{model_id}")
