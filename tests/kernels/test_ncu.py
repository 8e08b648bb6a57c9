"""remnant.kernels.bench.ncu: ncu's raw CSV read into the record's summaries, the summaries
in the kernel-bench record and its table, and the CLI's refusals; on a GPU with ncu, one
case profiled for real."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from remnant.kernels.bench.ncu import METRICS, STALL_MARK, STALL_PREFIX, parse_raw_csv, profile_case
from tests.kernels.inputs import ON_GPU

SCHEMAS = Path(__file__).parents[2] / "schemas" / "kernel-bench" / "examples"


def _stall(reason: str, suffix: str = ".ratio") -> str:
    return f"{STALL_PREFIX}{reason}{STALL_MARK}{suffix}"


def _raw_csv(duration_unit: str = "usecond") -> str:
    """`ncu --csv --page raw` as it prints it: notes, a header, units, a row per kernel,
    every field quoted, thousands separated."""
    head = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
            "Grid Size", "Device", "CC", *METRICS.values(), _stall("barrier"), _stall("long_scoreboard"),
            _stall("math_pipe_throttle"), _stall("wait", ""), _stall("selected"), "sm__cycles_elapsed.avg"]
    units = ["", "", "", "", "", "", "", "", "", "", "", duration_unit, "%", "%", "%", "%", "register/thread",
             "", "", "", "", "", "cycle"]
    rows = [
        ["0", "4242", "python3", "127.0.0.1", "void flash_fwd_splitkv_mla_fp8_sparse_kernel<64>(Params)", "1", "7",
         "(384, 1, 1)", "(132, 1, 1)", "0", "9.0", "1,234.5", "61.25", "70.5", "35.2", "24.8", "168", "1.2", "3.1",
         "0.4", "0.6", "1", "2,600,000"],
        ["1", "4242", "python3", "127.0.0.1", "flash_fwd_mla_combine_kernel", "1", "7", "(128, 1, 1)",
         "(64, 1, 1)", "0", "9.0", "4.25", "12", "n/a", "8", "40.1", "64", "0", "0.2", "", "0.1", "1", "9,000"],
    ]
    quoted = ["==PROF== Connected to process 4242", "==PROF== Disconnected from process 4242"]
    quoted += [",".join(f'"{c}"' for c in r) for r in (head, units, *rows)]
    return "\n".join(quoted) + "\n"


def test_raw_csv_becomes_one_summary_per_kernel():
    fast, combine = parse_raw_csv(_raw_csv())
    assert fast["kernel"] == "void flash_fwd_splitkv_mla_fp8_sparse_kernel<64>(Params)"
    assert fast["duration_us"] == 1234.5 and fast["dram_throughput_pct"] == 61.25
    assert fast["memory_throughput_pct"] == 70.5 and fast["sm_throughput_pct"] == 35.2
    assert fast["achieved_occupancy_pct"] == 24.8
    assert fast["registers_per_thread"] == 168
    # The three largest stalls, largest first; the fourth and the unrelated metric left out.
    assert fast["stalls"] == [{"reason": "long_scoreboard", "warps_per_issue": 3.1},
                              {"reason": "barrier", "warps_per_issue": 1.2},
                              {"reason": "wait", "warps_per_issue": 0.6}]
    assert combine["memory_throughput_pct"] is None  # "n/a"
    assert [s["reason"] for s in combine["stalls"]] == ["long_scoreboard", "wait", "barrier"]  # "" skipped
    # "selected" (the issuing warp, 1 per issue) is no stall: never in the top three.
    ns, _ = parse_raw_csv(_raw_csv("nsecond"))
    assert ns["duration_us"] == pytest.approx(1.2345)
    # Later ncu releases print the short names.
    assert parse_raw_csv(_raw_csv("ns"))[0]["duration_us"] == pytest.approx(1.2345)
    assert parse_raw_csv(_raw_csv("ms"))[0]["duration_us"] == pytest.approx(1234500.0)
    unknown, _ = parse_raw_csv(_raw_csv("furlong"))
    assert unknown["duration_us"] is None  # a unit it does not know is not guessed


def test_output_without_a_header_is_refused():
    with pytest.raises(ValueError, match="no ncu CSV header"):
        parse_raw_csv("==PROF== Connected to process 1\n==ERROR== The application returned an error code (1).\n")


def test_summaries_fit_the_record_and_its_table():
    from remnant.kernels.bench.report import table
    from remnant.records.schema import validate

    doc = json.loads((SCHEMAS / "valid" / "v14-ncu-summaries.json").read_text())
    doc["ncu"]["cases"][0]["kernels"] = parse_raw_csv(_raw_csv())
    validate(doc)
    text = table(doc)
    assert "ncu flashmla B=64   1234.5 us dram 61% sm 35% occupancy 25% regs 168 stalls: long_scoreboard 3.1" in text
    assert "ncu sm90     B=64   failed: ncu profile exited 1: ==ERROR== example" in text


def test_cli_refuses_ncu_with_from(tmp_path):
    from remnant.cli.kernels import main

    assert main(["--from", str(SCHEMAS / "valid" / "v14-ncu-summaries.json"), "--ncu"]) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU or shutil.which("ncu") is None, reason="needs a CUDA GPU and Nsight Compute's ncu")
@pytest.mark.parametrize("case", ["flashmla", "sm90", "triton"])
def test_one_case_profiled_on_gpu(case, tmp_path):
    entry = profile_case(case, 64, tmp_path)
    assert entry["report"]["bytes"] > 0 and (tmp_path / entry["report"]["path"]).exists()
    main = entry["kernels"][0]
    assert main["duration_us"] > 1 and main["registers_per_thread"] > 0 and main["stalls"]
    assert 0 < main["achieved_occupancy_pct"] <= 100


def test_a_failing_step_names_itself_its_status_and_ncu_errors(tmp_path):
    # A stand-in for ncu (a real process): prints ncu's error lines and exits 0 or 1, or
    # hangs past the timeout; profile_case says which step failed and why, first.
    from remnant.kernels.bench.ncu import COUNTER_PERMISSION, profile

    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\n"
                    "case \"$*\" in *--version*) echo 'NVIDIA (R) Nsight Compute Command Line Profiler'; "
                    "echo 'Version 2025.3.1.0'; exit 0;; esac\n"
                    f"echo '==ERROR== {COUNTER_PERMISSION}: the user does not have permission'\n"
                    "exit ${FAKE_STATUS:-0}\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match=f"^ncu profile exited 0: ==ERROR== {COUNTER_PERMISSION}"):
        profile_case("flashmla", 64, tmp_path / "r", ncu=str(fake))
    # Every case after a counter-permission error is recorded as not run, with the reason.
    seen = []
    doc = profile(tmp_path / "r", progress=lambda _: None, ncu=str(fake),
                  on_case=lambda so_far: seen.append(len(so_far["cases"])))
    assert doc["version"] == "Version 2025.3.1.0" and len(doc["cases"]) == 6 and seen == [1, 2, 3, 4, 5, 6]
    assert COUNTER_PERMISSION in doc["cases"][0]["error"]
    assert all(c["error"].startswith("not run: the GPU's performance counters") for c in doc["cases"][1:])
    slow = tmp_path / "slow"
    slow.write_text("#!/bin/sh\nsleep 30\n")
    slow.chmod(0o755)
    with pytest.raises(RuntimeError, match="ncu profile: no answer in 1 s; killed"):
        profile_case("flashmla", 64, tmp_path / "r", ncu=str(slow), timeout_s=1)
