"""Load one function of the installed sglang package from its source, without importing
sglang (whose import chain needs GPU-only packages). Tests run SGLang's own code this way."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest


def sglang_file(relative: str) -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang 0.5.18 is not installed (pip install --no-deps sglang==0.5.18)")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        pytest.fail(f"{path} is missing: not the sglang version Remnant targets (0.5.18)")
    return path


def load_function(relative: str, name: str, namespace: dict) -> object:
    """Compile function `name` from sglang/<relative> into `namespace` and return it."""
    path = sglang_file(relative)
    tree = ast.parse(path.read_text())
    node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if node is None:
        pytest.fail(f"{path} has no function {name}: SGLang changed")
    module = ast.Module(body=[node], type_ignores=[])
    exec(compile(module, str(path), "exec"), namespace)  # noqa: S102 - SGLang's own source
    return namespace[name]
