"""Find, load and apply the versioned JSON Schemas of Remnant's records.

A record names its own schema: `{"schema": "remnant/<name>", "schema_version": <v>, ...}`
is checked against `<name>/v<v>.schema.json` in the `remnant.schemas` package (the
repository's schemas/ directory, shipped as package data). New record kinds need no code
here: adding `schemas/<name>/v1.schema.json` makes `remnant/<name>` known. The version a
writer stamps is declared in remnant.records.kinds.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from remnant.records.files import atomic_write

PREFIX = "remnant/"
_SCHEMA_FILE = re.compile(r"^v([1-9][0-9]*)\.schema\.json$")
ROOT = "<root>"


class RecordError(ValueError):
    """A document that does not match its schema, or cannot be checked against one.

    source: where the document came from (a file path or "<document>").
    field: dotted path of the most relevant failing field, e.g. "metrics.ttft_ms.p50",
        "artifacts[0].sha256", or "<root>" for the document as a whole.
    reason: what is wrong, in the validator's words plus the schema's hint.
    errors: every problem found, as (field, reason) pairs, most relevant first.
    """

    def __init__(self, source: str, field: str, reason: str,
                 errors: list[tuple[str, str]] | None = None):
        self.source = source
        self.field = field
        self.reason = reason
        self.errors = errors if errors is not None else [(field, reason)]
        super().__init__(f"{source}: {field}: {reason}")


def _schema_root():
    """remnant.schemas when installed; the checkout's schemas/ when run from a source tree
    on PYTHONPATH (as on the GPU machine, where nothing is installed)."""
    try:
        return resources.files("remnant.schemas")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "schemas"


def known_schemas() -> dict[str, list[int]]:
    """Schema ids found under remnant.schemas, each with its sorted versions."""
    return {name: sorted(versions) for name, versions in _scan().items()}


@functools.cache
def _scan() -> dict[str, tuple[int, ...]]:
    found: dict[str, list[int]] = {}
    for folder in _schema_root().iterdir():
        if not folder.is_dir():
            continue
        for entry in folder.iterdir():
            m = _SCHEMA_FILE.match(entry.name)
            if m and entry.is_file():
                found.setdefault(PREFIX + folder.name, []).append(int(m.group(1)))
    return {name: tuple(v) for name, v in found.items()}


@functools.cache
def load_schema(schema: str, version: int) -> dict:
    """The parsed schema document for `schema` (e.g. "remnant/run") at `version`.

    Raises RecordError naming the allowed ids or versions when there is no such schema.
    """
    _check_known(schema, version, source="<schema registry>")
    name = schema[len(PREFIX):]
    text = _schema_root().joinpath(name, f"v{version}.schema.json").read_text(
        encoding="utf-8")
    return json.loads(text)


@functools.cache
def _validator(schema: str, version: int):
    # jsonschema is imported here, not at module import, so importing remnant.records stays
    # cheap for code that only builds records.
    from jsonschema import Draft202012Validator

    doc = load_schema(schema, version)
    # A broken schema file is a bug in Remnant, not in the user's record: fail loudly.
    Draft202012Validator.check_schema(doc)
    # No format checker: jsonschema's date-time check needs an extra package and silently
    # passes without it. The schema pins timestamps with a `pattern` instead.
    return Draft202012Validator(doc)


def _check_known(schema: Any, version: Any, source: str) -> None:
    known = known_schemas()
    allowed = ", ".join(sorted(known)) or "(none installed)"
    if not isinstance(schema, str) or schema not in known:
        raise RecordError(source, "schema",
                          f"{schema!r} is not a known record schema; allowed: {allowed}")
    versions = known[schema]
    # bool is an int in Python; `true` is not a version.
    if isinstance(version, bool) or not isinstance(version, int) or version not in versions:
        raise RecordError(source, "schema_version",
                          f"{version!r} is not a supported version of {schema}; allowed: "
                          + ", ".join(map(str, versions)))


def field_path(parts) -> str:
    """Render a JSON path (keys and list indices) as `a.b[0].c`; `<root>` when empty."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or ROOT


def _describe(error) -> tuple[str, str]:
    """(field, reason) for one jsonschema ValidationError, naming the offending key itself
    for a missing or unexpected property rather than the object that holds it."""
    parts = list(error.absolute_path)
    reason = error.message
    schema = error.schema if isinstance(error.schema, dict) else {}
    instance = error.instance
    if error.validator == "required" and isinstance(instance, dict):
        missing = [k for k in error.validator_value if k not in instance]
        # jsonschema reports each missing key as its own error, by message only.
        key = next((k for k in missing if reason == f"{k!r} is a required property"),
                   missing[0] if missing else None)
        if key is not None:
            parts.append(key)
            reason = "required key is missing"
    elif error.validator == "dependentRequired" and isinstance(instance, dict):
        # "'skipped' is a dependency of 'records'": the key that is missing, as for required.
        m = re.fullmatch(r"'(.+)' is a dependency of '(.+)'", reason)
        if m:
            parts.append(m.group(1))
            reason = f"required key is missing (it comes with {m.group(2)!r})"
    elif error.validator == "additionalProperties" and isinstance(instance, dict):
        extra = [k for k in instance if k not in schema.get("properties", {})]
        if extra:
            parts.append(extra[0])
            allowed = ", ".join(schema.get("properties", {}))
            reason = f"unexpected key {extra[0]!r}; allowed keys: {allowed}"
    elif error.validator == "pattern" and "description" in schema:
        # The regex itself helps nobody; the schema says in words what it wants.
        reason = f"{instance!r} does not have the expected form: {schema['description']}"
    elif "description" in schema:
        reason = f"{reason} ({schema['description']})"
    return field_path(parts), reason


def _non_json(value: Any, parts: tuple = ()) -> Iterator[tuple[str, str]]:
    """Values json.dumps would reject or write as non-standard JSON (NaN, Infinity).

    Checked before the schema because a schema cannot see them: NaN is a "number" to
    jsonschema, and pandas gives NaN for the std of a single sample.
    """
    if isinstance(value, float) and not math.isfinite(value):
        yield field_path(parts), f"{value} is not valid JSON; use null for a missing value"
    elif isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                yield field_path(parts), f"key {k!r} is not a string"
            else:
                yield from _non_json(v, parts + (k,))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _non_json(v, parts + (i,))
    elif not (value is None or isinstance(value, (str, int, float, bool))):
        yield field_path(parts), f"{type(value).__name__} is not a JSON value"


def validate(doc: Any, source: str = "<document>") -> None:
    """Check `doc` against the schema its `schema` and `schema_version` keys name.

    Raises RecordError(source, field, reason) with the most relevant problem (and all of
    them in `.errors`); returns None when the document is valid.
    """
    if not isinstance(doc, dict):
        raise RecordError(source, ROOT,
                          f"expected a JSON object with a 'schema' key, got {type(doc).__name__}")
    if "schema" not in doc:
        allowed = ", ".join(sorted(known_schemas()))
        raise RecordError(source, "schema", f"required key is missing; allowed: {allowed}")
    _check_known(doc.get("schema"), doc.get("schema_version"), source)

    problems = list(_non_json(doc))
    if problems:
        raise RecordError(source, *problems[0], errors=problems)
    # Validate what a reader will see: tuples become lists, as in the written file.
    plain = json.loads(json.dumps(doc))

    from jsonschema.exceptions import best_match

    validator = _validator(doc["schema"], doc["schema_version"])
    errors = list(validator.iter_errors(plain))
    if not errors:
        return
    best = best_match(errors)
    # Each top-level error may wrap alternatives (anyOf): report its most relevant leaf.
    described = [_describe(best_match([e])) for e in errors]
    first = _describe(best)
    rest = [d for d in described if d != first]
    raise RecordError(source, *first, errors=[first, *rest])


def read_json(path: str | os.PathLike, what: str = "file") -> Any:
    """Parsed JSON of `path`; RecordError naming the file for an unreadable file ("cannot
    read <what>") or malformed JSON (its line and column)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RecordError(str(path), ROOT, f"cannot read {what}: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordError(str(path), ROOT,
                          f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


def write_validated(path: str | os.PathLike, doc: dict) -> Path:
    """Validate `doc`, then write it to `path` as indented JSON with a trailing newline.

    The write is atomic (temporary file in the same directory, then os.replace), so a
    reader never sees half a record; nothing is written when validation fails. Keys keep
    their insertion order. Returns the path written.
    """
    path = Path(path)
    validate(doc, source=str(path))
    text = json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    atomic_write(path, text.encode("utf-8"))
    return path
