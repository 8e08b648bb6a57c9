# Sourced by the device runners (engine_h200.sh, study_h200.sh) from the repository root on
# the device machine: installs the wheels in .whl/ (carried with the call), puts this copy
# on the path and checks the imports; OUT (default /tmp/out) is made.
# .whl/ holds wheels for the device's Python 3.12 of what its image lacks, made where pip
# works with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl sgl-flash-mla==1.0.0 hydra-core omegaconf orjson fastapi opentelemetry-api annotated-doc \
#     starlette pydantic pydantic-core typing-inspection annotated-types typing-extensions uvicorn \
#     jsonschema jsonschema-specifications referencing rpds-py docker
#   pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3   # an sdist only
# (the versions of the project's own environment).
# The records' provenance takes the commit whole (remnant.records.provenance); an abbreviated
# one is ignored there, and a stale .git beside this copy would be named instead.
if [ -n "${REMNANT_GIT_COMMIT:-}" ] && ! [[ $REMNANT_GIT_COMMIT =~ ^[0-9a-f]{40}$ ]]; then
  echo "REMNANT_GIT_COMMIT=$REMNANT_GIT_COMMIT is not allowed; allowed: the commit's 40 hex digits" >&2
  return 1
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# An installed remnant maps conf/ and schemas/ to remnant.conf and remnant.schemas
# (pyproject's package-dir); this copy is imported in place, so link them there.
for d in conf schemas; do [ -e remnant/$d ] || ln -s ../$d remnant/$d; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, triton, flash_mla; print('torch', torch.__version__, 'triton', triton.__version__)" || return 1
# remnant-serve's and remnant-run's imports (the wheels above complete them).
python3 -c "import remnant.engine.server, remnant.cli, httpx, pandas" || return 1
