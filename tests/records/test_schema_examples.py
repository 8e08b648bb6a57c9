"""Every example next to a record schema is checked: valid ones pass, invalid ones fail on
the field recorded for them in examples/expected_errors.json."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from remnant.records.schema import RecordError, known_schemas, load_schema, validate

SCHEMAS = Path(str(resources.files("remnant.schemas")))
VALID = sorted(SCHEMAS.glob("*/examples/valid/*.json"))
INVALID = sorted(SCHEMAS.glob("*/examples/invalid/*.json"))


def _id(path: Path) -> str:
    return str(path.relative_to(SCHEMAS))


def _expected_field(path: Path) -> str:
    table = json.loads((path.parent.parent / "expected_errors.json").read_text())["expected"]
    if path.name not in table:
        pytest.fail(f"{path.parent.parent / 'expected_errors.json'} has no entry for {path.name}")
    return table[path.name]


def test_examples_exist_for_every_schema():
    for name in known_schemas():
        folder = name.removeprefix("remnant/")
        assert any(p.parts[-4] == folder for p in VALID), f"no valid example for {name}"
        assert any(p.parts[-4] == folder for p in INVALID), f"no invalid example for {name}"


@pytest.mark.parametrize("schema", sorted(known_schemas()))
def test_schema_is_well_formed_and_named_by_its_version(schema):
    for version in known_schemas()[schema]:
        doc = load_schema(schema, version)
        Draft202012Validator.check_schema(doc)
        name = schema.removeprefix("remnant/")
        assert doc["$id"] == f"urn:remnant:schema:{name}:v{version}"


@pytest.mark.parametrize("path", VALID, ids=_id)
def test_valid_example_passes(path):
    validate(json.loads(path.read_text()), source=str(path))


@pytest.mark.parametrize("path", INVALID, ids=_id)
def test_invalid_example_fails_on_its_field(path):
    field = _expected_field(path)
    with pytest.raises(RecordError) as info:
        validate(json.loads(path.read_text()), source=str(path))
    err = info.value
    assert err.field == field, str(err)
    assert str(path) in str(err) and field in str(err)
    # Each invalid example breaks exactly one thing, so it tests what its name says.
    assert len(err.errors) == 1, err.errors


def test_expected_errors_name_only_existing_files():
    for table_path in SCHEMAS.glob("*/examples/expected_errors.json"):
        names = set(json.loads(table_path.read_text())["expected"])
        on_disk = {p.name for p in (table_path.parent / "invalid").glob("*.json")}
        assert names == on_disk, table_path


@pytest.mark.parametrize(("doc", "field", "allowed"), [
    ({"schema_version": 1}, "schema", "remnant/run"),
    ({"schema": "remnant/nope", "schema_version": 1}, "schema", "remnant/run"),
    ({"schema": "remnant/run", "schema_version": 99}, "schema_version", "allowed: 1"),
    ({"schema": "remnant/run"}, "schema_version", "allowed: 1"),
])
def test_unknown_schema_or_version_names_allowed_values(doc, field, allowed):
    with pytest.raises(RecordError) as info:
        validate(doc, source="x.json")
    assert info.value.field == field
    assert allowed in str(info.value) and str(info.value).startswith("x.json: ")


def test_non_object_document_fails_at_root():
    with pytest.raises(RecordError) as info:
        validate([1, 2])
    assert info.value.field == "<root>"


def test_nan_is_rejected_with_its_field():
    # NaN passes a JSON Schema "number" check but is not JSON; pandas gives it for the std
    # of one sample.
    doc = json.loads(next(p for p in VALID if p.parts[-4] == "run" and "completed" in p.name).read_text())
    doc["metrics"]["ttft_ms"]["std"] = float("nan")
    with pytest.raises(RecordError) as info:
        validate(doc)
    assert info.value.field == "metrics.ttft_ms.std"


def test_all_errors_are_listed():
    doc = json.loads(next(p for p in VALID if p.parts[-4] == "run" and "completed" in p.name).read_text())
    doc["status"] = "done"
    del doc["limits"]
    with pytest.raises(RecordError) as info:
        validate(doc)
    assert {f for f, _ in info.value.errors} == {"status", "limits"}
