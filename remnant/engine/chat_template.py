"""The chat template of a model directory: messages -> prompt text, as HF tokenizers apply it.

/v1/chat/completions renders its messages with the `chat_template` of the model
directory's tokenizer_config.json (the Jinja template transformers' apply_chat_template
runs, rendered the same way: a sandboxed environment, trim_blocks and lstrip_blocks,
`add_generation_prompt`, the special tokens as variables). Directories written before
model_dir.py wrote a template get its DeepSeek-style default. The text is tokenized
without adding special tokens: the template writes BOS itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from remnant.engine.model_dir import CHAT_TEMPLATE


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(source)
        self._special = dict(special_tokens)

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ChatTemplate:
        path = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
        return cls(config.get("chat_template") or CHAT_TEMPLATE, special)

    def render(self, messages: list[dict]) -> str:
        """The prompt for `messages` ({"role", "content": str}) ending in the assistant's
        turn; ValueError says why a template refused them."""
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self._special)
        except TemplateError as exc:
            raise ValueError(str(exc)) from None
