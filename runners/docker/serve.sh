#!/usr/bin/env bash
# Entry of Remnant's server image (runners/docker/Dockerfile): serve MODEL_PATH on
# 127.0.0.1:PORT with the mode and retention in REMNANT_* (the Dockerfile lists them);
# the container's command adds server arguments last. REMNANT_SERVER (the image's SERVER
# build arg) picks SGLang with Remnant's plugin or the embedded reference engine.
set -euo pipefail

die() { echo "remnant-container-serve: $*" >&2; exit 2; }

[ -n "${MODEL_PATH:-}" ] || die "MODEL_PATH is not set: the model directory inside the container"
[ -d "$MODEL_PATH" ] || die "MODEL_PATH=$MODEL_PATH is not a directory inside the container (mount it)"
port=${PORT:-30000}
mode=${REMNANT_MODE:-native}
case "$mode" in native|triton|kernel) ;; *) die "REMNANT_MODE=$mode is not a mode; allowed: native, triton, kernel" ;; esac

case "${REMNANT_SERVER:-}" in
sglang)
  # SGLang's own arguments; the plugin reads REMNANT_MODE, REMNANT_RETENTION,
  # REMNANT_RETENTION_MAP and REMNANT_RETENTION_POLICY from this environment, and in
  # capture mode REMNANT_CAPTURE* (remnant.cli.sglang_launch then adds --disable-cuda-graph
  # and takes the capture's model id from --model-path unless REMNANT_CAPTURE_MODEL_ID is set).
  args=(--model-path "$MODEL_PATH" --host 127.0.0.1 --port "$port" --tp-size "${REMNANT_TP_SIZE:-1}")
  [ -z "${MASTER_PORT:-}" ] || args+=(--nccl-port "$MASTER_PORT")
  echo "remnant-container-serve: run ${REMNANT_RUN_ID:-?}: python3 -m remnant.cli.sglang_launch ${args[*]} $*"
  exec python3 -m remnant.cli.sglang_launch "${args[@]}" "$@"
  ;;
embedded)
  args=(--model-dir "$MODEL_PATH" --host 127.0.0.1 --port "$port" --mode "$mode")
  if [ "$mode" != native ]; then
    retention=${REMNANT_RETENTION:-256}
    case "$retention" in
      *,*) args+=(--retention-per-layer "$retention") ;;
      *) args+=(--retention "$retention") ;;
    esac
    [ -z "${REMNANT_RETENTION_MAP:-}" ] || args+=(--retention-map "$REMNANT_RETENTION_MAP")
    args+=(--retention-policy "${REMNANT_RETENTION_POLICY:-attention}")
  fi
  if [ -n "${REMNANT_CAPTURE:-}" ]; then
    # Unset ones keep remnant-serve's defaults.
    args+=(--capture "$REMNANT_CAPTURE")
    [ -z "${REMNANT_CAPTURE_TOKENS:-}" ] || args+=(--capture-tokens "$REMNANT_CAPTURE_TOKENS")
    [ -z "${REMNANT_CAPTURE_RECORDS:-}" ] || args+=(--capture-records "$REMNANT_CAPTURE_RECORDS")
    [ -z "${REMNANT_CAPTURE_SOURCE:-}" ] || args+=(--capture-source "$REMNANT_CAPTURE_SOURCE")
    [ -z "${REMNANT_CAPTURE_MODEL_ID:-}" ] || args+=(--capture-model-id "$REMNANT_CAPTURE_MODEL_ID")
  fi
  echo "remnant-container-serve: run ${REMNANT_RUN_ID:-?}: remnant-serve ${args[*]} $*"
  exec python3 -m remnant.cli.serve "${args[@]}" "$@"
  ;;
*)
  die "REMNANT_SERVER=${REMNANT_SERVER:-} is not a server; allowed: sglang, embedded (the image's SERVER build arg)"
  ;;
esac
