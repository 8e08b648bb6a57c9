"""python -m remnant.kernels.bench: remnant-kernels."""

import sys

from remnant.kernels.bench.cli import main

sys.exit(main())
