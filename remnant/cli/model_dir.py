"""Write the embedded engine's model directory (remnant.engine.model_dir).

    python -m remnant.cli.model_dir --out models/tiny            # the tiny preset
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from remnant.engine.model_dir import write_model_dir


def main(argv: list[str] | None = None) -> int:
    import dataclasses

    from remnant.config import ModelConfig

    p = argparse.ArgumentParser(description="Write the embedded engine's model directory.")
    p.add_argument("--out", required=True, type=Path, help="directory to write")
    p.add_argument("--seed", type=int, default=0, help="weight seed")
    args = p.parse_args(argv)
    model = dataclasses.asdict(ModelConfig(seed=args.seed))
    try:
        print(write_model_dir(model, args.out))
    except OSError as exc:
        print(f"model_dir: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
