"""Every kind of record Remnant writes, declared once: its schema id, the version its
writers stamp, and the schema that checks it (docs/records.md).

A writer starts its document with `KIND.header()`, so a kind's version is named here
and in no writer. Readers go by the `schema` and `schema_version` a document names
(remnant.records.schema), which also accepts the older versions kept under schemas/.

A kind with two layouts written today declares the second with `also_at`, saying why
the current version does not hold it. A kind no JSON Schema checks says why in
`unchecked`. tests/records/test_kinds.py holds every declaration to schemas/: each
checked kind has its schema file, each schema folder a declaration, and a kind's
current version is its newest schema.

Adding a kind: its schema (CONTRIBUTING.md, "Add a record schema"), one declaration
here listed in KINDS, its writer using it, and its tests.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from remnant.records.schema import PREFIX


@dataclass(frozen=True)
class RecordKind:
    """One kind of record at the version a writer stamps.

    name: the schema id, "remnant/<folder under schemas/>".
    version: the version written.
    why: for a layout still written at another version than the kind's current one
        (declared with `also_at`), why the current version does not hold it; None for the
        current one.
    unchecked: for a kind with no JSON Schema, why none checks it; None where
        schemas/<folder>/v<version>.schema.json does.
    """

    name: str
    version: int
    why: str | None = None
    unchecked: str | None = None

    def __post_init__(self) -> None:
        if not self.name.startswith(PREFIX) or self.name == PREFIX:
            raise ValueError(f"record kind name={self.name!r} must be {PREFIX}<name>")
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 1:
            raise ValueError(f"{self.name}: version={self.version!r} must be an integer >= 1")

    @property
    def folder(self) -> str:
        """The kind's folder under schemas/."""
        return self.name.removeprefix(PREFIX)

    @property
    def schema_file(self) -> str | None:
        """The schema's path under schemas/ (`run/v5.schema.json`); None for an unchecked kind."""
        return None if self.unchecked else f"{self.folder}/v{self.version}.schema.json"

    def header(self) -> dict[str, str | int]:
        """The keys a document of this kind starts with: `schema` and `schema_version`."""
        return {"schema": self.name, "schema_version": self.version}

    def also_at(self, version: int, why: str) -> RecordKind:
        """The same kind written at `version` for documents the current version does not
        hold; `why` says what they are and why."""
        return dataclasses.replace(self, version=version, why=why)


RUN = RecordKind("remnant/run", 5)
FRONTIER = RecordKind("remnant/frontier", 1)
COLLECTION = RecordKind("remnant/collection", 1)
#: v5: v4 plus remnant/fidelity-parts (v4: v3 plus remnant/engine-bench; v3: v2 plus
#: remnant/learned-scorer; v2: v1 plus remnant/client-bench).
INDEX = RecordKind("remnant/index", 5)
#: v2: v1 plus the standard combinations of stored parts (packed window and C128 records,
#: MXFP4 indexer keys, bf16 compressor state) and settings.combination_retention.
CAPACITY = RecordKind("remnant/capacity", 3)
KERNEL_BENCH = RecordKind("remnant/kernel-bench", 14)
CLIENT_BENCH = RecordKind("remnant/client-bench", 1)
SESSIONS = RecordKind("remnant/sessions", 1)
LEARNED_SCORER = RecordKind("remnant/learned-scorer", 1)

#: A map of the learned policy: v2 is v1 plus the policy name "learned" and its scorer's
#: provenance.
RETENTION_MAP = RecordKind("remnant/retention-map", 2)
RETENTION_MAP_TRAINING_FREE = RETENTION_MAP.also_at(
    1, "a map of a training-free policy (magnitude, attention, prefix, random) is written as before v2 existed: "
       "v1 says all of it and code that knows only v1 still loads it; v2 adds only what v1 cannot name")

#: The comparison of every policy, the learned one included, on a split by capture source
#: (`python -m remnant.cli.fidelity compare`: remnant.calibration.fidelity_compare).
FIDELITY = RecordKind("remnant/fidelity", 2)
FIDELITY_SINGLE_CAPTURE = FIDELITY.also_at(
    1, "the single-capture report (`python -m remnant.cli.fidelity`: remnant.calibration.fidelity) splits one capture "
       "by token and has no train/eval split, scorer or plots, which v2 requires: another layout, not an "
       "older form of v2")

#: The fidelity of the KV parts beyond C4 records, per layer and part (`python -m
#: remnant.cli.fidelity parts`: remnant.calibration.fidelity_parts). A kind of its own, not
#: a remnant/fidelity version: it measures parts at one map, not policies across retentions.
FIDELITY_PARTS = RecordKind("remnant/fidelity-parts", 1)

ENGINE_BENCH = RecordKind("remnant/engine-bench", 6)
MODAL_SERVE_REQUEST = RecordKind(
    "remnant/modal-serve-request", 1,
    unchecked="a message to runners/modal/app.py, never stored: ServeRequest.from_json (remnant.hosts.modal) "
              "checks it field by field")

#: The registration: every declaration above.
KINDS: tuple[RecordKind, ...] = (
    RUN, FRONTIER, COLLECTION, INDEX, CAPACITY, KERNEL_BENCH, CLIENT_BENCH, SESSIONS, LEARNED_SCORER,
    RETENTION_MAP, RETENTION_MAP_TRAINING_FREE, FIDELITY, FIDELITY_SINGLE_CAPTURE, FIDELITY_PARTS,
    ENGINE_BENCH,
    MODAL_SERVE_REQUEST,
)
