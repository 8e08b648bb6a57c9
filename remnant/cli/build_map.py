"""Build a retention map from calibration captures with a training-free policy, or from a
learned scorer (remnant.calibration.learned, an offline research extension).

Usage:
    python -m remnant.cli.build_map (--captures FILE | --synthetic) --policy POLICY
        (--retention R | --per-layer R1,R2,...) [--seed N] --out map.json
    python -m remnant.cli.build_map --policy learned --scorer scorer.json [--captures FILE]
        (--retention R | --per-layer R1,R2,...) --out map.json

--synthetic uses synthetic_captures() with its default parameters (a first try, no
model needed); --seed is the seed of the random policy. With --policy learned the map
comes from the scorer alone (remnant/retention-map v2): its policy params name the
scorer's sha256 and its training captures, its calibration the training captures;
--captures, if given, is only checked against the scorer (model_id and layers). Prints
the path written. Errors are one line, `build_map: error: ...`, naming the file or flag;
exit status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

from remnant.calibration.captures import load_captures, synthetic_captures
from remnant.calibration.policies import build_map
from remnant.calibration.retention import LEARNED, MAP_POLICIES, profile_values
from remnant.cli.parser import OneLineParser


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
    parser = OneLineParser(prog="build_map", description="Build a retention map (remnant/retention-map).")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--captures", type=Path, metavar="FILE", help="capture file (safetensors)")
    source.add_argument("--synthetic", action="store_true",
                        help="synthetic captures with default parameters")
    parser.add_argument("--policy", required=True, choices=MAP_POLICIES)
    parser.add_argument("--scorer", type=Path, metavar="FILE",
                        help="learned scorer JSON (remnant.cli.learned train); --policy learned only")
    profile = parser.add_mutually_exclusive_group(required=True)
    profile.add_argument("--retention", type=int, metavar="R", help="uniform retention, 64..448 step 64")
    profile.add_argument("--per-layer", metavar="R1,R2,...",
                         help="one retention per CSA layer, in layer order")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random policy (default 0)")
    parser.add_argument("--out", type=Path, required=True, metavar="FILE", help="retention map JSON to write")
    args = parser.parse_args(argv)
    learned = args.policy == LEARNED
    if learned and args.scorer is None:
        parser.error("--policy learned needs --scorer FILE (a scorer from python -m remnant.cli.learned train)")
    if not learned and args.scorer is not None:
        parser.error(f"--scorer is for --policy learned only; --policy {args.policy} reads --captures or --synthetic")
    if not learned and args.captures is None and not args.synthetic:
        parser.error(f"--policy {args.policy} needs --captures FILE or --synthetic")

    try:
        per_layer = None if args.per_layer is None else _int_list(args.per_layer)
        captures = None
        if args.synthetic:
            captures = synthetic_captures()
        elif args.captures is not None:
            captures = load_captures(args.captures)
        if learned:
            from remnant.calibration.learned import LearnedScorer, build_map as build_learned_map

            scorer = LearnedScorer.load(args.scorer)
            values = profile_values(args.retention, per_layer, len(scorer.csa_layers))
            rmap = build_learned_map(scorer, values, captures,
                                     "--synthetic" if args.synthetic else str(args.captures))
        else:
            values = profile_values(args.retention, per_layer, len(captures.layers))
            rmap = build_map(captures, args.policy, values, seed=args.seed)
        path = rmap.save(args.out)
    except (ValueError, OSError) as e:
        parser.error(str(e).replace("\n", " "))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
