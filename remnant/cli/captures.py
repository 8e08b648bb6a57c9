"""Write a calibration capture file (remnant.calibration.captures).

    python -m remnant.cli.captures --synthetic --out FILE [--seed N]

writes synthetic captures (synthetic_captures with default parameters but the seed) and
prints the path.
"""

from __future__ import annotations

import sys
from pathlib import Path

from remnant.calibration.captures import save_captures, synthetic_captures
from remnant.cli.parser import OneLineParser


def main(argv: list[str] | None = None) -> int:
    """`python -m remnant.cli.captures --synthetic --out FILE [--seed N]`; prints the path."""
    parser = OneLineParser(prog="captures", description="Write a calibration capture file.")
    parser.add_argument("--synthetic", action="store_true", required=True,
                        help="synthetic captures (synthetic_captures with default parameters)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument("--out", type=Path, required=True, help="capture file to write (.safetensors)")
    args = parser.parse_args(argv)
    try:
        path = save_captures(synthetic_captures(seed=args.seed), args.out)
    except (ValueError, OSError) as e:
        parser.error(f"--out {args.out}: {e}")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
