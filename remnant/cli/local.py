"""Containers of host=local runs (remnant.hosts.local): remove those a killed run left.

    python -m remnant.cli.local cleanup                  # containers of runs no longer alive
    python -m remnant.cli.local cleanup --run-id ID      # this run's containers, alive or not
    python -m remnant.cli.local cleanup --all            # every container remnant started
"""

from __future__ import annotations

import argparse
import sys

from remnant.hosts.base import HostError
from remnant.hosts.local import cleanup


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m remnant.cli.local",
                                description="Containers of host=local runs (label remnant.run_id).")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("cleanup", help="remove containers left by runs that were killed")
    c.add_argument("--run-id", help="remove this run's containers, alive or not")
    c.add_argument("--all", action="store_true", help="remove every container remnant started")
    args = p.parse_args(argv)
    try:
        removed = cleanup(args.run_id, args.all)
    except HostError as exc:
        print(f"remnant cleanup: error: {exc}", file=sys.stderr)
        return 2
    for name in removed:
        print(f"removed {name}")
    print(f"{len(removed)} container(s) removed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
