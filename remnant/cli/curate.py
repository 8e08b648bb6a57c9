"""Curate a sweep into a collection under benchmarks/ and index it.

    python -m remnant.cli.curate multirun/modes --name smoke-three-modes-cpu \\
        --description "Three modes on the embedded engine, CPU" --benchmarks benchmarks
    python -m remnant.cli.curate --index-only --benchmarks benchmarks

Copies every run.json of the sweep (with its requests.jsonl) into
benchmarks/<name>/runs/<cell>/, writes benchmarks/<name>/collection.json (schema
remnant/collection: what ran, provenance, the runs' limits, members with sha256, the
report table) and rebuilds benchmarks/index.json over every curated file
(remnant.report.curate).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from remnant.report.curate import curate, write_index


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m remnant.cli.curate", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", type=Path, nargs="?", help="a sweep or run directory")
    p.add_argument("--name", help="collection name (lowercase, digits, . _ -); required to curate")
    p.add_argument("--description", help="what the collection holds; required to curate")
    p.add_argument("--benchmarks", type=Path, default=Path("benchmarks"))
    p.add_argument("--index-only", action="store_true", help="only rebuild benchmarks/index.json")
    a = p.parse_args(argv)
    if not a.index_only:
        missing = [flag for flag, value in (("the sweep directory", a.sweep), ("--name", a.name),
                                            ("--description", a.description)) if value is None]
        if missing:
            p.error(f"to curate, give {', '.join(missing)} (or --index-only)")
    try:
        path = write_index(a.benchmarks) if a.index_only else curate(a.sweep, a.name, a.description, a.benchmarks)
    except (ValueError, OSError) as exc:
        print(f"curate: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
