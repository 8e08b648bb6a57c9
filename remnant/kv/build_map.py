"""Build a retention map from calibration captures with a training-free policy.

Usage:
    python -m remnant.kv.build_map (--captures FILE | --synthetic) --policy POLICY
        (--retention R | --per-layer R1,R2,...) [--seed N] --out map.json

--synthetic uses synthetic_captures() with its default parameters (a first try, no
model needed); --seed is the seed of the random policy. Prints the path written.
Errors are one line, `build_map: error: ...`, naming the file or flag; exit status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

from remnant.kv.captures import _Parser, load_captures, synthetic_captures
from remnant.kv.policies import POLICIES, build_map
from remnant.kv.retention import profile_values


def _int_list(text: str) -> list[int]:
    values = []
    for i, part in enumerate(text.split(",")):
        try:
            values.append(int(part.strip()))
        except ValueError:
            raise ValueError(f"--per-layer value {i} is {part!r}, not an integer") from None
    return values


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns 0 or exits 2 with one error line (see module docstring)."""
    parser = _Parser(prog="build_map", description="Build a retention map (remnant/retention-map v1).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--captures", type=Path, metavar="FILE", help="capture file (safetensors)")
    source.add_argument("--synthetic", action="store_true",
                        help="synthetic captures with default parameters")
    parser.add_argument("--policy", required=True, choices=POLICIES)
    profile = parser.add_mutually_exclusive_group(required=True)
    profile.add_argument("--retention", type=int, metavar="R", help="uniform retention, 64..448 step 64")
    profile.add_argument("--per-layer", metavar="R1,R2,...",
                         help="one retention per CSA layer, in layer order")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random policy (default 0)")
    parser.add_argument("--out", type=Path, required=True, metavar="FILE", help="retention map JSON to write")
    args = parser.parse_args(argv)

    try:
        per_layer = None if args.per_layer is None else _int_list(args.per_layer)
        captures = synthetic_captures() if args.synthetic else load_captures(args.captures)
        values = profile_values(args.retention, per_layer, len(captures.layers))
        path = build_map(captures, args.policy, values, seed=args.seed).save(args.out)
    except (ValueError, OSError) as e:
        parser.error(str(e).replace("\n", " "))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
