"""The model directory's chat template renders as transformers' apply_chat_template does, so
/v1/chat/completions builds the prompt a third-party client would build from the same
directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remnant.engine.chat_template import ChatTemplate
from remnant.engine.model_dir import CHAT_TEMPLATE

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Héllo, wörld ✓"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "tool", "content": "{}"},
     {"role": "user", "content": "c\n\n  d"}],
    [{"role": "developer", "content": "rules"}, {"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(tiny_model_dir) / "tokenizer.json"))


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system-unicode", "turns", "developer-empty"])
def test_renders_as_transformers(tiny_model_dir, hf_tokenizer, tokenizer, messages):
    text = ChatTemplate.from_model_dir(tiny_model_dir).render(messages)
    assert text == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert tokenizer.encode(text, add_special_tokens=False).ids == ids
    assert ids.count(hf_tokenizer.bos_token_id) == 1 and ids[0] == hf_tokenizer.bos_token_id


def test_a_directory_without_a_template_gets_the_default(tiny_model_dir, tmp_path):
    config = json.loads((Path(tiny_model_dir) / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = CONVERSATIONS[1]
    assert ChatTemplate.from_model_dir(tmp_path).render(messages) == \
        ChatTemplate.from_model_dir(tiny_model_dir).render(messages)


def test_a_role_the_template_refuses_is_a_value_error(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown role narrator"):
        ChatTemplate.from_model_dir(tiny_model_dir).render([{"role": "narrator", "content": "x"}])
