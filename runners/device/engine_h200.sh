#!/usr/bin/env bash
# One device call for the embedded engine on one H200, in stages, each under its own time
# limit so that a stage that hangs or fails leaves the others' results:
#   tests   pytest -m gpu over the engine (graph replay, kernel per mode, capacity, compiled
#           step ops) and the kernels it calls (MoE and its routing, indexer, top-k, the
#           compressor update, norm + RoPE, RMS norm, the FP8 row quantizer)
#   timings runners/device/moe_topk_timings.py (the MoE launch grid, top-k against torch.topk;
#           TIMINGS: its tables, e.g. moe_tiles)
#   bench   python -m remnant.cli.engine_bench (decode step per mode beside its roofline, prefill)
#   serve   remnant-run over the three modes at model=dsv4_flash_h200 (RUN_ARGS: workload)
#   decode  runners/device/packed_window_timings.py (kernel mode's decode over a packed_csa window
#           on the SM90 and Triton kernels beside FlashMLA; DECODE_BATCHES, default all five)
#   ncu     Nsight Compute over the routed-expert kernels and the indexer's scores
#           (runners/device/step_ncu.py; NCU_PARTS, default "moe:32 moe:128 indexer:32 indexer:128"):
#           speed of light, occupancy, warp stalls, to $OUT/ncu-step.txt
# Run from the repository root on the device machine with .whl/ in the call's carry list
# (runners/device/setup_h200.sh says how to make it). The device's copy has no .git, so pass
# the commit for the records' provenance:
#   REMNANT_GIT_COMMIT=<hash> STAGES="tests bench serve" bash runners/device/engine_h200.sh
# Stage variables: TESTS_S TIMINGS_S BENCH_S DECODE_S SERVE_S NCU_S (limits, s), TIMINGS, NCU_PARTS, GPU_TESTS, PYTEST_ARGS (e.g. -n 4:
# the tests share the GPU), BENCH_ARGS, MODES, RUN_ARGS; the bench writes kernel logs to $OUT/kernels.tgz.
set -u
source runners/device/setup_h200.sh || exit 1

for stage in ${STAGES:-tests bench serve}; do
  t0=$(date +%s)
  case $stage in
  tests)
    # SIGINT at the limit: pytest then reports the failures so far (a SIGTERM or SIGKILL
    # leaves only its progress dots, as on 2026-12-05). -v: each result's line names its
    # test, which survives where xdist's summary does not (an interrupted run on 2026-12-06).
    timeout -s INT -k 20 ${TESTS_S:-300} python3 -m pytest ${GPU_TESTS:-tests/engine tests/kernels/test_moe.py \
        tests/kernels/test_indexer.py tests/kernels/test_top_k.py tests/kernels/test_compress.py \
        tests/kernels/test_rope.py tests/kernels/test_norm.py tests/kernels/test_route.py \
        tests/kernels/test_fp8_rows.py} -v -m gpu \
        -p no:cacheprovider --timeout 120 --tb=short -rfE ${PYTEST_ARGS:-} > "$OUT/pytest-gpu.txt" 2>&1
    grep -E " (FAILED|ERROR) |^(FAILED|ERROR)|^E  " "$OUT/pytest-gpu.txt" | head -40
    grep -E "^=+ .* in [0-9.]+s" "$OUT/pytest-gpu.txt" | tail -1 ;;  # pytest's last line
  timings)
    timeout ${TIMINGS_S:-180} python3 runners/device/moe_topk_timings.py ${TIMINGS:-} 2>&1 | tee "$OUT/timings.txt" | tail -20 ;;
  bench)
    timeout ${BENCH_S:-240} python3 -m remnant.cli.engine_bench --model dsv4_flash_h200 --out "$OUT/engine-bench.json" \
        --kernel-logs "$OUT/kernels" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/engine-bench.log" | tail -40
    # One archive: the device tool brings back few files (one kernel log of five on 2026-12-06).
    [ -d "$OUT/kernels" ] && tar -czf "$OUT/kernels.tgz" -C "$OUT" kernels && rm -rf "$OUT/kernels" ;;
  decode)
    timeout ${DECODE_S:-150} python3 runners/device/packed_window_timings.py ${DECODE_BATCHES:-} \
        > "$OUT/packed-window-timings.md" 2> "$OUT/packed-window-rows.jsonl"
    echo "packed_window_timings exit status $?"
    cat "$OUT/packed-window-timings.md"; grep -v '^{' "$OUT/packed-window-rows.jsonl" | tail -5 ;;
  ncu)
    # --clock-control none: the device's README asks that the clocks be left alone.
    timeout ${NCU_S:-300} ncu --clock-control none -k regex:'_gate_up|_down|_row_scores' --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats python3 runners/device/step_ncu.py ${NCU_PARTS:-moe:32 moe:128 indexer:32 indexer:128} \
        > "$OUT/ncu-step.txt" 2>&1
    echo "ncu exit status $? (124: the stage's limit; ncu prints its report only at exit)"
    # Each kernel's header line (name, grid, "Context N, Stream N") before its numbers.
    grep -E "==ERROR==|^(moe|indexer):|Context [0-9]+, Stream|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per" \
        "$OUT/ncu-step.txt" | head -120 ;;
  serve)
    # Native records through FlashMLA's V4 decode as SGLang runs them: native_decode=flashmla
    # fails a run where it cannot run rather than fall back.
    timeout ${SERVE_S:-240} python3 -m remnant.cli -m mode=${MODES:-native,triton,kernel} model=dsv4_flash_h200 \
        host.device=cuda host.threads=16 host.kv_budget_mib=${KV_MIB:-24576} host.startup_timeout_s=400 \
        host.native_decode=flashmla host.chunked_prefill_size=8192 ${RUN_ARGS:-workload=smoke} \
        hydra.sweep.dir="$OUT/multirun" 2>&1 | tee "$OUT/remnant-run.log" | grep -v "^\s*$" | tail -30
    for run in "$OUT"/multirun/*/run.json; do
      [ -e "$run" ] && { python3 -m remnant.cli.check "$run" || echo "check failed: $run"; }
    done
    # The device tool brings back few files: every cell's directory in one archive.
    [ -d "$OUT/multirun" ] && tar -czf "$OUT/multirun.tgz" -C "$OUT" multirun && rm -rf "$OUT/multirun" ;;
  esac
  echo "== stage $stage: $(( $(date +%s) - t0 )) s"
done
