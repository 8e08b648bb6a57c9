"""`remnant-capture`: remnant-run with capture=on (calibration captures, docs/capture.md)."""

from __future__ import annotations

import sys

from remnant.cli import run


def help_text() -> str:
    """`remnant-capture --help`."""
    return """usage: remnant-capture [GROUP=OPTION ...] [FIELD=VALUE ...]

Record calibration captures: remnant-run with capture=on. A native server (host=embedded,
or host=local: a container of the serving image, SGLang or the embedded engine) serves the
workload; each CSA layer hands its first capture.tokens decode queries (after RoPE) and
first capture.records C4 latents (before FP8) to a recorder, which writes
capture.safetensors into the run directory (remnant-capture/1 from SGLang; /2 from the
embedded engine, which also records the parts beyond C4 records: docs/capture.md): at
once when every layer has both, else when the workload ends (the run asks for it before
it stops the server).
run.json records the file's fingerprint; every map built from it, and every run that
serves with that map, carries it on.

  remnant-capture workload=smoke                          # embedded engine, CPU, seconds
  BENCH_DATASET_PATH=sharegpt.json remnant-capture workload=sharegpt
  remnant-capture workload=longswe capture.tokens=512
  BENCH_DATASET_PATH=sharegpt.json remnant-capture host=local model=dsv4_flash_0731 \\
      host.gpus=0,1,2,3 workload=sharegpt
  python -m remnant.cli.build_map --captures outputs/.../capture.safetensors \\
      --policy attention --retention 256 --out map.json
  remnant-run mode=kernel retention.map_path=map.json

Fields: capture.tokens (256), capture.records (4096), capture.source (default: the
workload's name; evaluate policies on a source they were not calibrated on).
host=external and host=modal are refused: Remnant cannot hand those servers capture
settings or bring their file back.
Everything else is remnant-run's (remnant-run --help); the capture needs mode=native.
"""


def main() -> None:
    """Entry point of `remnant-capture`: remnant-run with capture=on."""
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(help_text())
        return
    if not any(a.startswith(("capture=", "+capture=", "++capture=")) for a in sys.argv[1:]):
        sys.argv.insert(1, "capture=on")
    run.main()
