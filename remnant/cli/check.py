"""remnant-check: validate record files (run, collection, kernel benchmark) by their schema.

Usage: remnant-check PATH... [--quiet]

A file given by name must be a Remnant record. A directory is searched recursively for
*.json files whose top-level "schema" starts with "remnant/"; other JSON (Hydra's, a
tool's) is skipped and counted. Hidden files and directories are not searched. A run
directory (one holding requests.jsonl, server.log, server.port or .hydra/) without a
run.json is a run that was killed before it could record itself: it fails the check.

Exit status: 0 all checked files are valid; 1 some file failed or a run directory has no
run.json; 2 a path does not exist or nothing was checked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from remnant.records.schema import PREFIX, RecordError, read_json, validate
from remnant.run_dir import HYDRA_DIR, REQUESTS_JSONL, SERVER_LOG, SERVER_PORT


def _is_record(doc: object) -> bool:
    schema = doc.get("schema") if isinstance(doc, dict) else None
    return isinstance(schema, str) and schema.startswith(PREFIX)


#: Files a run leaves in its directory before it writes run.json.
RUN_MARKERS = (REQUESTS_JSONL, SERVER_LOG, SERVER_PORT, HYDRA_DIR)


def unrecorded_runs(directory: Path) -> list[Path]:
    """Run directories under `directory` (itself included) that hold what a run leaves
    while it runs but no run.json: runs killed outright. Hidden directories are skipped."""
    found = []
    for d in [directory, *sorted(p for p in directory.rglob("*") if p.is_dir())]:
        if d != directory and any(part.startswith(".") for part in d.relative_to(directory).parts):
            continue
        if not (d / "run.json").exists() and any((d / m).exists() for m in RUN_MARKERS):
            found.append(d)
    return found


def _walk(directory: Path) -> list[Path]:
    """*.json files under `directory`, sorted, leaving out hidden files and directories."""
    return sorted(p for p in directory.rglob("*.json")
                  if p.is_file() and not any(part.startswith(".")
                                             for part in p.relative_to(directory).parts))


def _check(path: Path, doc: object, quiet: bool) -> bool:
    """Validate one parsed document and print its line; True when it is valid."""
    try:
        validate(doc, source=str(path))
    except RecordError as e:
        print(f"FAIL {e}")
        return False
    if not quiet:
        print(f"ok   {path}  ({doc['schema']} v{doc['schema_version']})")
    return True


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="remnant-check",
        description="Validate Remnant record JSON files against their versioned schemas.",
        epilog="Exit status: 0 all valid, 1 a file failed or a run directory has no run.json "
               "(a killed run), 2 a path is missing or nothing was checked.")
    parser.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                        help="a record file, or a directory searched for *.json records")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only failures")
    args = parser.parse_args(argv)

    checked = failed = unrecorded = 0
    missing: list[Path] = []
    seen: set[Path] = set()
    for root in args.paths:
        if not root.exists():
            print(f"remnant-check: {root}: no such file or directory", file=sys.stderr)
            missing.append(root)
            continue
        explicit = not root.is_dir()
        skipped = 0
        for path in ([root] if explicit else _walk(root)):
            key = path.resolve()
            if key in seen:
                continue
            seen.add(key)
            try:
                doc = read_json(path)
            except RecordError as e:
                # A file that is not even JSON may well be a broken record: report it.
                print(f"FAIL {e}")
                checked += 1
                failed += 1
                continue
            if not explicit and not _is_record(doc):
                skipped += 1
                continue
            checked += 1
            failed += not _check(path, doc, args.quiet)
        if skipped and not args.quiet:
            print(f"skipped {skipped} JSON file(s) under {root} without a "
                  f"\"schema\": \"{PREFIX}...\" key")
        if not explicit:
            for run_dir in unrecorded_runs(root):
                key = run_dir.resolve()
                if key in seen:
                    continue
                seen.add(key)
                present = ", ".join(m for m in RUN_MARKERS if (run_dir / m).exists())
                print(f"FAIL {run_dir}: run directory without run.json (it holds {present}): "
                      "the run was killed before it could record itself")
                unrecorded += 1

    if missing:
        return 2
    if checked == 0 and not unrecorded:
        print("remnant-check: no Remnant records found in " + ", ".join(map(str, args.paths)),
              file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"{checked - failed} of {checked} record(s) valid")
        if unrecorded:
            print(f"{unrecorded} run director{'y' if unrecorded == 1 else 'ies'} without run.json")
    return 1 if failed or unrecorded else 0


if __name__ == "__main__":
    sys.exit(main())
