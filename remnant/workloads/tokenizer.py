"""The tokenizer a workload tokenizes text with: the served model's own."""

from __future__ import annotations

from pathlib import Path

from remnant.config import ModelConfig


def load_tokenizer(model: ModelConfig):
    """tokenizers.Tokenizer of `model`: tokenizer.json in model.path, or, for a model the
    embedded host generates, the byte-level tokenizer it writes."""
    if model.path:
        from tokenizers import Tokenizer

        path = Path(model.path) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"model.path={model.path} has no tokenizer.json to tokenize the workload with")
        return Tokenizer.from_file(str(path))
    from remnant.engine.model_dir import build_tokenizer

    return build_tokenizer()
