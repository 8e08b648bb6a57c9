"""An argparse parser whose usage errors are one line: the calibration commands' (captures,
build_map, learned, fidelity)."""

from __future__ import annotations

import argparse
import sys


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exits 2."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)
