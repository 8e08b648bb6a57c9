"""Kernel mode's decode over a window packed with the C4 records' keep list (retention.
window_records=packed_csa, the 1.6x KV combination) on the SM90 Gluon kernel, beside the same
call on the Triton kernel, the SM90 kernel over kept-first native windows, and FlashMLA V4
over native records, at the benchmark's shapes (64 heads, top-k 512, window 128). The rows
are remnant-kernels' own (remnant.kernels.bench: its inputs, checks, graphs of rotated input
sets and roofline); each packed call is checked against the float64 reference first. A
short device call where the full `remnant-kernels --sweep decode` does not fit:

    python3 runners/device/packed_window_timings.py [batch ...] > table.md 2> rows.jsonl
                                                                  (default 1 16 64 128 512)

The table goes to stdout, each call's benchmark row (registers, spills, roofline) to stderr
(remnant.kernels.bench.harness.progress_row): keep them apart, as a tail of the two mixed
lost the table's first rows on 2026-12-07.
"""

from __future__ import annotations

import sys

import torch

from remnant.kernels.bench.cases import KERNEL_R, TOPK, WINDOW, DecodeCase, FlashMLACase, decode_configs, tuned_kind
from remnant.kernels.bench.checks import check_decode
from remnant.kernels.bench.harness import measure_ceilings
from remnant.kernels.bench.inputs import DecodeInputs
from remnant.kernels.bench.sweep import bench_decode, bench_flashmla

REPS = 30


def main(batches: list[int]) -> None:
    print(torch.cuda.get_device_name(), flush=True)
    ceil = measure_ceilings(REPS)
    inputs = DecodeInputs(torch.Generator().manual_seed(0))
    forms = {"sm90, packed window": ("packed", "sm90"), "sm90, kept-first window": ("kept_first", "sm90"),
             "triton, packed window": ("packed", "triton")}
    print("| batch | FlashMLA V4 us | " + " | ".join(f"{name} us | x FlashMLA" for name in forms) + " |")
    print("|---|---|" + "---|---|" * len(forms))
    for batch in batches:
        flash = bench_flashmla(inputs, ceil, REPS, [FlashMLACase("flashmla", batch, TOPK, WINDOW)])[0]["time_us"]
        cells = []
        for window_columns, kernel in forms.values():
            case = DecodeCase("packed", KERNEL_R, batch, TOPK, WINDOW, "kept_first", window_columns, kernel=kernel)
            best = {} if kernel == "sm90" else {tuned_kind(case): decode_configs(tuned_kind(case), True, True)[0]}
            error = check_decode(inputs, case, case.plan({} if kernel == "sm90" else best[tuned_kind(case)]))
            if not error < 1e-2:
                raise RuntimeError(f"{case}: relative error {error:.2e} against the float64 reference")
            us = bench_decode(inputs, ceil, REPS, best, [case])[0]["time_us"]
            cells.append(f"{us:.1f} | {us / flash:.2f}")
        print(f"| {batch} | {flash:.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1:]] or [1, 16, 64, 128, 512])
