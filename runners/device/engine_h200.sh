#!/usr/bin/env bash
# One device call: the embedded engine at DeepSeek-V4-Flash's attention geometry
# (model=dsv4_flash_attn: 43 layers, random weights, ~31 GB) on one GPU, served and driven
# by remnant-run in each mode, each run.json checked. Run from the repository root on the
# device machine, with .whl/ (kernels_h200.sh's wheels) and .whl-run/ (remnant-run's
# client side for the device's Python 3.12: httpx httpcore certifi pandas python-dateutil
# six pytz tzdata numpy tokenizers tqdm rich markdown-it-py mdurl pygments packaging
# safetensors, made with kernels_h200.sh's `pip download` line) in the call's carry list:
#   REMNANT_GIT_COMMIT=<hash> bash runners/device/engine_h200.sh
# Overrides for every run go in RUN_ARGS (default: the random workload).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# numpy only where the image has none: torch was built against the image's own.
skip=numpy
python3 -c "import numpy" 2>/dev/null || skip=none
wheels=$(ls .whl/*.whl .whl-run/*.whl | grep -v "/$skip-")
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels || exit 1
export PYTHONPATH=/tmp/site:$PWD
# An installed remnant maps conf/ and schemas/ to remnant.conf and remnant.schemas
# (pyproject's package-dir); this copy is imported in place, so link them there.
for d in conf schemas; do [ -e remnant/$d ] || ln -s ../$d remnant/$d; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import remnant.cli, remnant.engine.server, remnant.kernels.decode, httpx, pandas" || exit 1
# Native records through FlashMLA's V4 decode (sgl-flash-mla, in .whl/), as SGLang runs
# them: native_decode=flashmla fails the run where it cannot run rather than fall back.
timeout ${RUN_TIMEOUT_S:-540} python3 -m remnant.cli -m mode=native,triton,kernel model=dsv4_flash_attn host.device=cuda \
    host.threads=16 host.kv_budget_mib=4096 host.startup_timeout_s=400 host.native_decode=${NATIVE_DECODE:-flashmla} \
    ${RUN_ARGS:-workload=random} \
    hydra.sweep.dir="$OUT/multirun" 2> >(tee "$OUT/remnant-run.stderr" | grep -v "^\s*$" | tail -40 >&2)
for run in "$OUT"/multirun/*/run.json; do
    python3 -m remnant.records.check "$run" || echo "check failed: $run"
done
# The device tool brings back few files: every cell's directory in one archive, and the
# run records beside it.
tar -czf "$OUT/multirun.tgz" -C "$OUT" multirun
for run in "$OUT"/multirun/*/run.json; do cp "$run" "$OUT/$(basename "$(dirname "$run")").run.json"; done
rm -rf "$OUT/multirun"
