"""Train a learned coordinate scorer (remnant.calibration.learned) on capture files.

    python -m remnant.cli.learned train --captures A.safetensors [B.safetensors ...]
        --out scorer.json [--steps N] [--seed S] [--init attention|magnitude|zero]
    python -m remnant.cli.learned train --synthetic --out scorer.json

Prints the scorer's path. Errors are one line, `learned: error: ...`, naming the file or
flag; exit status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

from remnant.calibration.captures import load_captures, synthetic_captures
from remnant.calibration.learned import INITS, Hyperparameters, train
from remnant.cli.parser import OneLineParser


def main(argv: list[str] | None = None) -> int:
    """Console entry point (see the module docstring); prints the scorer path."""
    parser = OneLineParser(prog="learned", description="Train a learned coordinate scorer (remnant/learned-scorer v1).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a scorer on capture files")
    p.prog = "learned"
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--captures", type=Path, nargs="+", metavar="FILE", help="training capture files")
    src.add_argument("--synthetic", action="store_true", help="synthetic captures with default parameters")
    d = Hyperparameters()
    p.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps per layer (default {d.steps})")
    p.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    p.add_argument("--init", choices=INITS, default=d.init, help=f"starting score (default {d.init})")
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="scorer JSON to write")
    args = parser.parse_args(argv)
    try:
        hp = Hyperparameters(steps=args.steps, init=args.init)
        hp.check()
        if args.synthetic:
            named = [("--synthetic", synthetic_captures())]
        else:
            named = [(str(path), load_captures(path)) for path in args.captures]
        path = train(named, hp, seed=args.seed).save(args.out)
    except (ValueError, OSError) as e:
        p.error(str(e).replace("\n", " "))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
