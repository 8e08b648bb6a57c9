"""remnant.records.kinds: one declaration per record kind, held to schemas/, and used by
every writer."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from remnant.records import kinds
from remnant.records.kinds import KINDS, RecordKind
from remnant.records.schema import known_schemas, load_schema, validate

PACKAGE = Path(kinds.__file__).resolve().parents[1]


def _by_name() -> dict[str, list[RecordKind]]:
    found = defaultdict(list)
    for kind in KINDS:
        found[kind.name].append(kind)
    return found


def test_every_declaration_is_registered():
    declared = {name: v for name, v in vars(kinds).items() if isinstance(v, RecordKind)}
    assert set(declared.values()) == set(KINDS), "a RecordKind in remnant.records.kinds is missing from KINDS"
    assert len(set(KINDS)) == len(KINDS), "a kind is registered twice"


def test_every_checked_kind_has_its_schema_and_every_schema_a_kind():
    known = known_schemas()
    for kind in KINDS:
        if kind.unchecked:
            assert kind.name not in known, f"{kind.name} has a schema: drop `unchecked`"
            continue
        assert kind.version in known.get(kind.name, []), f"{kind.name}: no schemas/{kind.schema_file}"
        assert load_schema(kind.name, kind.version)["$id"] == f"urn:remnant:schema:{kind.folder}:v{kind.version}"
    declared = {kind.name for kind in KINDS}
    assert set(known) <= declared, f"schemas without a declaration: {sorted(set(known) - declared)}"


def test_a_kind_writes_its_newest_schema_and_says_why_of_any_other_version():
    known = known_schemas()
    for name, declared in _by_name().items():
        current = [k for k in declared if k.why is None]
        assert len(current) == 1, f"{name}: {len(current)} current versions declared"
        if name in known:
            assert current[0].version == max(known[name]), f"{name}: v{max(known[name])} exists but is not written"
        others = [k.version for k in declared if k.why is not None]
        assert len(set(others)) == len(others) and current[0].version not in others, name


def test_fidelity_names_both_versions_it_writes():
    """Two commands write remnant/fidelity: the comparison at v2, the single-capture report at
    v1, a layout v2 cannot hold (it requires the split, scorer and plots)."""
    assert (kinds.FIDELITY.name, kinds.FIDELITY.version, kinds.FIDELITY.why) == ("remnant/fidelity", 2, None)
    single = kinds.FIDELITY_SINGLE_CAPTURE
    assert (single.name, single.version) == ("remnant/fidelity", 1) and "single-capture" in single.why
    v2_required = set(load_schema("remnant/fidelity", 2)["required"])
    v1_properties = set(load_schema("remnant/fidelity", 1)["properties"])
    assert {"split", "scorer", "plots"} <= v2_required - v1_properties


def test_header_starts_a_document_and_validates_with_it():
    assert list(kinds.RUN.header().items()) == [("schema", "remnant/run"), ("schema_version", kinds.RUN.version)]
    assert kinds.RUN.schema_file == f"run/v{kinds.RUN.version}.schema.json"
    assert kinds.MODAL_SERVE_REQUEST.schema_file is None
    turn = {"input_tokens": 8, "output_tokens": 2}
    doc = {**kinds.SESSIONS.header(), "source": "test", "sessions": [{"id": "s0", "turns": [turn]}]}
    validate(doc)


@pytest.mark.parametrize("name, version, field", [
    ("run", 1, "name='run'"), ("remnant/", 1, "name='remnant/'"),
    ("remnant/run", 0, "version=0"), ("remnant/run", True, "version=True"), ("remnant/run", "5", "version='5'"),
])
def test_a_declaration_names_what_is_wrong(name, version, field):
    with pytest.raises(ValueError, match=field):
        RecordKind(name, version)


def _version_literals(path: Path) -> list[int]:
    """Lines of `path` where a dict literal has a "schema_version" key of its own."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Dict)
            and any(isinstance(k, ast.Constant) and k.value == "schema_version" for k in node.keys)]


def test_no_writer_stamps_a_version_of_its_own():
    """Every document gets its schema and version from its declaration (KIND.header())."""
    own = {PACKAGE / "records" / "kinds.py"}
    found = {str(p.relative_to(PACKAGE.parent)): lines for p in sorted(PACKAGE.rglob("*.py"))
             if p not in own and (lines := _version_literals(p))}
    assert found == {}, f"write these through remnant.records.kinds: {found}"
