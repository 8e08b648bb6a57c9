"""Dataset files as they come: JSON or JSONL, gzip or not, unusable records skipped.

A file is gzip when it starts with gzip's magic bytes (1f 8b), whatever its name. Its text
is JSONL (one JSON value per line, blank lines ignored) when its name, less a `.gz`, ends
in `.jsonl`, or when it holds more than one JSON value (a `.json` file written as JSONL);
otherwise it is one JSON document. A JSONL line that is not JSON is one unusable record,
not a broken file.

A reader keeps a `Tally` of the file: it skips a record it cannot use, with the reason,
and the run says so once (`skipped_records`: one log line, a limit, and run.json's
`workload.dataset`: records, usable, skipped and the first FIRST_SKIPPED with their
reasons). A file with no usable record is refused, naming the file and the first reasons.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from remnant.workloads.json_error import describe_json_error

log = logging.getLogger(__name__)

GZIP_MAGIC = b"\x1f\x8b"
#: Skipped records kept with their reasons (run.json, the log line, the refusal).
FIRST_SKIPPED = 5


@dataclass
class Record:
    """One record of a file: its 0-based position, its 1-based line in a JSONL file (None
    in a JSON document), and its value, or why it is not JSON."""

    index: int
    line: int | None
    value: object = None
    error: str | None = None

    def id(self) -> str | None:
        """The record's own `id` where it has a string one."""
        value = self.value.get("id") if isinstance(self.value, dict) else None
        return value if isinstance(value, str) else None


@dataclass
class Skip:
    record: int
    line: int | None
    id: str | None
    reason: str

    def where(self) -> str:
        """e.g. "record 3 (id QWJhYvA_0)", "line 7"."""
        head = f"line {self.line}" if self.line is not None else f"record {self.record}"
        return head + (f" (id {self.id})" if self.id is not None else "")


@dataclass
class Tally:
    """What a reader made of a file: its records, and those it skipped (the first
    FIRST_SKIPPED with their reasons). `noun` names a record in messages."""

    path: Path
    sha256: str
    noun: str = "record"
    records: int = 0
    skipped: int = 0
    first: list[Skip] = field(default_factory=list)

    def skip(self, record: Record, reason: str) -> None:
        self.skipped += 1
        if len(self.first) < FIRST_SKIPPED:
            self.first.append(Skip(record.index, record.line, record.id(), reason))

    @property
    def usable(self) -> int:
        return self.records - self.skipped

    def reasons(self) -> str:
        return "; ".join(f"{s.where()}: {s.reason}" for s in self.first)

    def refuse_if_unusable(self) -> None:
        """ValueError naming the file and the first reasons where no record is usable."""
        if self.usable > 0:
            return
        if self.records == 0:
            raise ValueError(f"{self.path}: no {self.noun} in the file")
        raise ValueError(f"{self.path}: no usable {self.noun} ({self.skipped} skipped; {self.reasons()})")

    def dataset(self) -> dict:
        """run.json's workload.dataset (schema remnant/run v5)."""
        return {"path": str(self.path), "sha256": self.sha256, "records": self.records, "usable": self.usable,
                "skipped": self.skipped,
                "first_skipped": [{"record": s.record, "line": s.line, "id": s.id, "reason": s.reason}
                                  for s in self.first]}


def skipped_line(dataset: dict | None) -> str | None:
    """The one line that says how many records of a run's dataset were skipped, and the
    first reasons; None where none were (or no file was read)."""
    if not dataset or not dataset.get("skipped"):
        return None
    first = "; ".join(f"{Skip(**s).where()}: {s['reason']}" for s in dataset["first_skipped"])
    more = " ..." if dataset["skipped"] > len(dataset["first_skipped"]) else ""
    return (f"{dataset['path']}: skipped {dataset['skipped']} of {dataset['records']} records as unusable "
            f"({dataset['usable']} usable): {first}{more}")


def skipped_records(dataset: dict | None) -> list[str]:
    """Says once, on the log, how many records the run's dataset file had skipped, and
    returns the limit run.json records for them (none where nothing was skipped)."""
    line = skipped_line(dataset)
    if line is None:
        return []
    log.warning("%s", line)
    return [f"{dataset['skipped']} of {dataset['records']} records of the dataset were skipped as unusable "
            "(workload.dataset.first_skipped says why); the requests were drawn from the others"]


def read_file(path: Path, field_name: str) -> tuple[str, str]:
    """(text, sha256 of the file's bytes as stored) of a dataset file, gunzipped where it
    is gzip; ValueError naming the field and file where it is missing or unreadable."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{field_name}={path}: no such file") from None
    except OSError as exc:
        raise ValueError(f"{field_name}={path}: cannot read it: {exc.strerror or exc}") from None
    data = raw
    if raw[:2] == GZIP_MAGIC:
        try:
            data = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise ValueError(f"{path}: a gzip file that cannot be decompressed ({exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}{' after gunzip' if data is not raw else ''})") \
            from None
    return text, hashlib.sha256(raw).hexdigest()


def _named_jsonl(path: Path) -> bool:
    name = path.name[: -len(".gz")] if path.name.endswith(".gz") else path.name
    return name.endswith(".jsonl")


def jsonl_records(text: str) -> Iterator[Record]:
    """Each non-blank line of a JSONL text as a record (one that is not JSON carries why)."""
    index = 0
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield Record(index, n, json.loads(line))
        except json.JSONDecodeError as exc:
            yield Record(index, n, error=f"not valid JSON ({describe_json_error(exc)})")
        index += 1


def read_records(path: Path, text: str, what: str) -> list[Record]:
    """The records of a dataset text: the items of a JSON list, or the lines of a JSONL
    file. `what` names the list in the refusal of another JSON value ("conversations").
    ValueError naming the file where the text is neither."""
    if _named_jsonl(path):
        return list(jsonl_records(text))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        # More than one value ("Extra data" after the first line): a JSONL file named .json.
        if exc.msg == "Extra data" and exc.lineno > 1:
            return list(jsonl_records(text))
        raise ValueError(f"{path}: not valid JSON ({describe_json_error(exc)})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of {what} (or JSONL, one per line), got "
                         f"{type(data).__name__}")
    return [Record(i, None, value) for i, value in enumerate(data)]
