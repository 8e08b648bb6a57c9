#!/usr/bin/env bash
# One device call: GPU tests (kernels, FlashMLA, SGLang buffers, the engine's CUDA path),
# then remnant-kernels' sweep (BENCH_ARGS, e.g. --sweep decode, and --ncu for Nsight Compute summaries
# whose .ncu-rep files land in $OUT/kernel-bench-ncu/) against FlashMLA. Run from the repository root on
# the device machine:
#   .whl/ (git-ignored through .git/info/exclude, passed in the call's carry list) holds
#   jsonschema and its dependencies for the device's Python 3.12, made here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     -d .whl jsonschema jsonschema-specifications referencing rpds-py attrs sgl-flash-mla==1.0.0
#   (the device image may already have attrs);
#   the device's copy of the tree has no .git, or the session start's (runs' sources then name that
#   commit, dirty), so pass the commit for the JSON's provenance:
#   REMNANT_GIT_COMMIT=<hash> GPU_TESTS="tests/kernels tests/sglang/test_buffers.py
#   tests/engine/test_decode_path.py" bash runners/device/kernels_h200.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, triton, flash_mla; print('torch', torch.__version__, 'triton', triton.__version__, 'flash_mla', flash_mla.__version__)"
python3 -m pytest ${GPU_TESTS:-tests/kernels tests/sglang/test_buffers.py tests/engine/test_decode_path.py} -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/pytest-gpu.txt" | tail -15
python3 -m remnant.cli.kernels --out "$OUT/kernel-bench.json" --plot none ${BENCH_ARGS:-} 2>"$OUT/bench-progress.txt" | tee "$OUT/bench-table.txt"
tail -5 "$OUT/bench-progress.txt"
