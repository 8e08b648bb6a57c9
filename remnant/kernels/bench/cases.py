"""What remnant-kernels times: the decode and FlashMLA cases, the tuning's configs, and the
bytes and FLOPs each call must move and issue (the rows' roofline)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch


HEADS = 64


H_BLOCK = 64  # heads per decode program in every tuned config: all 64 of a token


WINDOW = 128


TOPK = 512


KERNEL_R = 256


DECODE_BATCHES = [1, 16, 32, 64, 128, 256, 512]


def store_variants(retention: int) -> list[str]:
    from remnant.kernels.store import PERMUTES

    # Native records need no permutation: one row, labelled by the kernel's contiguous store.
    return ["registers"] if retention == 512 else list(PERMUTES)


@dataclass
class DecodeCase:
    variant: str  # "native" or "packed"
    retention: int
    batch: int
    topk: int
    window: int
    columns: str = "natural"  # packed: q and out in the model's order, or "kept_first" (decode's columns)
    window_columns: str = "natural"  # packed: the window records' form, native, kept-first or packed (decode's)
    splits: int | None = None  # programs per token and head block (decode's splits); None: auto_splits
    window_apart: bool | None = None  # packed, all orders natural: the window in a program of its own (decode's)
    split_plan: str | None = None  # how splits share the records (decode's split_plan); None: split_plan_for
    join: str | None = None  # how splits join (decode's join); None: join_for
    kernel: str = "triton"  # the decode kernel (remnant.kernels.decode.KERNELS): "sm90", the folded packed call only

    def plan(self, launch: dict):
        """decode's plan for this case at the launch settings `launch` (h_block, num_warps
        and the loop settings: a tuned config) on this GPU: remnant.kernels.decode.plan_decode,
        as decode itself makes it."""
        from remnant.kernels.decode import DecodeConfig, plan_decode

        config = DecodeConfig(kernel=self.kernel, **launch, splits=self.splits, window_apart=self.window_apart,
                              split_plan=self.split_plan, join=self.join)
        return plan_decode(self.batch, HEADS, self.window, self.topk, self.variant == "packed", torch.device("cuda"),
                           columns=self.columns, window_columns=self.window_columns, config=config,
                           n_kept=self.retention - 64, q_dtype=torch.bfloat16)


def decode_bytes_flops(case: DecodeCase, window_apart: bool = False) -> tuple[int, float]:
    rb = 584 if case.variant == "native" else case.retention + 72
    # A packed window (window_columns="packed") holds records of the C4 records' format;
    # every other window form is native records.
    window_rb = rb if case.window_columns == "packed" else 584
    io = 2 * case.batch * HEADS * 512 * 2  # q read, out written (bf16)
    nbytes = case.batch * (case.topk * (rb + 4) + case.window * (window_rb + 4)) + io
    # Multiply-adds the kernel issues per (head, record), padding included (x 2 FLOPs):
    # native: 512 + 64 columns for the score and for P.V. Packed C4 records: the kept
    # column blocks (remnant.kernels.decode.triton.kept_column_blocks), plus RoPE, for both.
    # Window tokens of packed calls: kept blocks, dropped columns padded to a power of two,
    # plus RoPE, for both; with the window apart (the native program reads it), as native;
    # packed window records (read by the C4 loop), as C4 records.
    if case.variant == "native":
        c4_macs = win_macs = 2 * (512 + 64)
    else:
        from remnant.kernels.decode.triton import kept_column_blocks

        def padded(n: int) -> int:
            return max(16, 2 ** math.ceil(math.log2(max(n, 1))))

        kept = case.retention - 64
        kept_macs = sum(kept_column_blocks(kept, padded(kept)))
        c4_macs = 2 * (kept_macs + 64)
        if case.window_columns == "packed":
            win_macs = c4_macs
        else:
            win_macs = 2 * (512 + 64) if window_apart else 2 * (kept_macs + padded(448 - kept) + 64)
    flops = 2 * case.batch * HEADS * (case.topk * c4_macs + case.window * win_macs)
    return nbytes, float(flops)


# FlashMLA's rows: the stock decode over native records ("flashmla"), and triton mode's
# decode as the SGLang plugin runs it ("reconstruct+flashmla": stage_selected reconstructs
# each token's selected packed records into native pages, then FlashMLA reads those).
FLASHMLA_KERNELS = ("flashmla", "reconstruct+flashmla")


STAGE_PER_PAGE = 64  # the plugin stages into SGLang's C4 pages (page size 256)


@dataclass
class FlashMLACase:
    kernel: str  # one of FLASHMLA_KERNELS
    batch: int
    topk: int
    window: int
    retention: int = 512  # reconstruct+flashmla: the packed records' R

    def native_case(self) -> DecodeCase:
        return DecodeCase("native", 512, self.batch, self.topk, self.window)


def flashmla_bytes_flops(case: FlashMLACase) -> tuple[int, float]:
    """FlashMLA's call as the native decode's; the staging adds per selected record its
    packed read, its native write and its location."""
    nbytes, flops = decode_bytes_flops(case.native_case())
    if case.kernel == "reconstruct+flashmla":
        nbytes += case.batch * case.topk * (case.retention + 72 + 584 + 4)
    return nbytes, flops


# The SM90 Gluon kernel's fixed program, as a decode row's config: 64 heads on 8 warps,
# steps of 64 records, two stages of copies (remnant.kernels.decode.sm90).
SM90_CONFIG = {"h_block": 64, "block_n": 64, "num_warps": 8, "num_stages": 2}


def other_split_plan(plan: str | None) -> str | None:
    """The split plan decode did not choose (None for one split, which has no plan)."""
    return {"even": "by_cost", "by_cost": "even"}.get(plan)


def decode_cases(quick: bool, multiprocessors: int | None = None, sm90: bool = False) -> list[DecodeCase]:
    """The decode rows' cases; multiprocessors (default: this GPU's) sets the split counts
    of the rows that time the other split plan at auto_splits' count; sm90: the SM90 Gluon
    kernel's folded call beside the Triton one at every batch and window."""
    from remnant.kernels.decode.plan import split_plan_for, splits_for

    if multiprocessors is None:
        multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
    batches = [16, 64, 128] if quick else DECODE_BATCHES
    cases = []
    for batch in batches:
        for window in (WINDOW, 0):
            # Native (the cross-check), packed as the SGLang plugin calls it (natural orders),
            # and as the engine does (the order folded into the projections; with a window,
            # window records written in kept-first order).
            cases.append(DecodeCase("native", 512, batch, TOPK, window))
            cases.append(DecodeCase("packed", KERNEL_R, batch, TOPK, window))
            cases.append(DecodeCase("packed", KERNEL_R, batch, TOPK, window, "kept_first",
                                    "kept_first" if window else "natural"))
            if sm90:  # the same folded call on the SM90 kernel
                cases.append(DecodeCase("packed", KERNEL_R, batch, TOPK, window, "kept_first", "kept_first",
                                        kernel="sm90"))
            # The folded call over a window packed as the C4 records (the engine's packed_csa),
            # on the Triton kernel and the SM90 one; without a window it is the folded row above.
            if window:
                cases.append(DecodeCase("packed", KERNEL_R, batch, TOPK, window, "kept_first", "packed"))
                if sm90:
                    cases.append(DecodeCase("packed", KERNEL_R, batch, TOPK, window, "kept_first", "packed",
                                            kernel="sm90"))
            if batch >= 64 and window:  # each of the two orders alone
                cases.append(DecodeCase("packed", KERNEL_R, batch, TOPK, window, "kept_first"))
                if batch in (64, 128):
                    cases.append(DecodeCase("packed", KERNEL_R, batch, TOPK, window, "natural", "kept_first"))
    for topk in ([128, 2048] if not quick else [2048]):
        cases.append(DecodeCase("native", 512, 128, topk, WINDOW))
        cases.append(DecodeCase("packed", KERNEL_R, 128, topk, WINDOW))
    for retention in ([128, 384] if not quick else [128]):
        cases.append(DecodeCase("packed", retention, 128, TOPK, WINDOW))
    # The same calls without C4 records (top-k 0) at the same splits: q, out, the window
    # and the join, which native and packed calls share and which at batch 64 are most of
    # the packed call (benchmarks/kernels/NOTES.md, eighth round); targets() names them.
    for batch in ([64, 128] if not quick else [64]):
        cases.append(DecodeCase("native", 512, batch, 0, WINDOW))
        cases.append(DecodeCase("packed", KERNEL_R, batch, 0, WINDOW, "kept_first", "kept_first"))
        cases.append(DecodeCase("packed", KERNEL_R, batch, 0, WINDOW, "kept_first", "packed"))
    # Splits against auto_splits' choice (which the rows above use): each kernel at fixed
    # split counts, at batches below, at and above the multiprocessor count.
    for batch in ([16, 64, 128] if not quick else [64]):
        for splits in (1, 2, 4):
            cases.append(DecodeCase("native", 512, batch, TOPK, WINDOW, splits=splits))
            cases.append(DecodeCase("packed", KERNEL_R, batch, TOPK, WINDOW, "kept_first", "kept_first", splits=splits))
    # The other split plan at auto_splits' counts (8 at batch 16, 2 at 64 on an H200), for
    # native and the folded call: the one decode does not choose there. targets() names
    # the native one beside the ratio it would change.
    for batch in ([16, 64] if not quick else [64]):
        auto = splits_for(batch * math.ceil(HEADS / H_BLOCK), multiprocessors)
        if auto == 1:  # one split: no plan to compare
            continue
        for case in (DecodeCase("native", 512, batch, TOPK, WINDOW, splits=auto),
                     DecodeCase("packed", KERNEL_R, batch, TOPK, WINDOW, "kept_first", "kept_first", splits=auto)):
            chosen = split_plan_for(None, auto, case.variant == "packed", case.window_columns == "kept_first", False)
            cases.append(replace(case, split_plan=other_split_plan(chosen)))
            if auto == 2:  # and the join decode does not choose at two splits: the kernel, not the exchange
                cases.append(replace(case, join="kernel"))
    return cases


def flashmla_cases(quick: bool) -> list[FlashMLACase]:
    """FlashMLA's rows at every batch and window the decode rows have at top-k 512, triton
    mode's beside them, and FlashMLA at the other top-k the decode rows time."""
    batches = [16, 64, 128] if quick else DECODE_BATCHES
    cases = [FlashMLACase(kernel, batch, TOPK, window, 512 if kernel == "flashmla" else KERNEL_R)
             for batch in batches for window in (WINDOW, 0) for kernel in FLASHMLA_KERNELS]
    cases += [FlashMLACase("flashmla", 128, topk, WINDOW) for topk in ([2048] if quick else [128, 2048])]
    return cases


# What is tuned, each for its own best config (equal care): native records, and packed
# records with the window in each code order (the window loop differs: by index or by
# words) or, in natural order, in a program of its own (decode's window_apart), or packed
# as the C4 records are (the C4 loop reads it).
TUNED = [("native", "natural", False), ("packed", "natural", False), ("packed", "natural", True),
         ("packed", "kept_first", False), ("packed", "packed", False)]


# Per tuned kind, the loop forms in the sweep: (C4 loop records per step, its scores
# transposed, window loop records per step, its scores transposed), each at 1-3 pipeline
# stages, 64 heads per program on 8 warps. The forms are the best three per kind of the
# fourth round's probes (the window apart: the sixth's; benchmarks/kernels/NOTES.md),
# which also measured and dropped: 16-warp programs (+35-60%), two 32-head programs per SM
# (+55-60%), and for native records 64 records per step with transposed scores (+35-90%:
# spills). A packed window's forms are not from a probe (none has run): the packed C4
# loop's forms, each taken by both loops (the window's is the C4 loop), so that a window
# step stays one C4 step (plan.PACKED_RECORDS_WINDOW_STEP_COST).
DECODE_FORMS = {
    ("native", "natural", False): [(32, True, 32, True), (64, False, 32, True), (16, True, 16, True)],
    ("packed", "natural", False): [(64, False, 16, True), (32, True, 16, True), (64, True, 16, True)],
    ("packed", "natural", True): [(64, False, 32, True), (64, False, 16, True), (32, False, 32, True)],
    ("packed", "kept_first", False): [(64, False, 32, False), (64, False, 16, True), (32, True, 32, True)],
    ("packed", "packed", False): [(64, False, 64, False), (32, True, 32, True), (64, True, 64, True)],
}


DECODE_STAGES = (1, 2, 3)


# The decode defaults (remnant.kernels.decode.plan.DEFAULT_CONFIGS) of each tuned kind.
DEFAULT_OF_KIND = {("native", "natural", False): "native", ("packed", "natural", False): "packed",
                   ("packed", "natural", True): "packed, window apart",
                   ("packed", "kept_first", False): "packed, kept-first window",
                   ("packed", "packed", False): "packed, packed window"}


def decode_configs(kind: tuple[str, str, bool], quick: bool, defaults: bool = False) -> list[dict]:
    """The configs tune_decode times for `kind`: every form at every depth, the first form
    at one stage (quick), or decode's own default (defaults: the tuning's winner)."""
    if defaults:
        from remnant.kernels.decode.plan import DEFAULT_CONFIGS

        return [dict(h_block=H_BLOCK, num_warps=8, **DEFAULT_CONFIGS[DEFAULT_OF_KIND[kind]])]
    forms = DECODE_FORMS[kind][:1] if quick else DECODE_FORMS[kind]
    return [dict(h_block=H_BLOCK, block_n=bn, num_warps=8, num_stages=stages, scores_transposed=t,
                 window_block_n=wbn, window_scores_transposed=wt)
            for bn, t, wbn, wt in forms for stages in ((1,) if quick else DECODE_STAGES)]


def planned_window_apart(case: DecodeCase) -> bool:
    """Whether decode runs the window of `case` in a program of its own (which the tuned
    kind and the FLOP count follow), at 64 heads per program."""
    return case.plan({"h_block": H_BLOCK}).window_apart


def tuned_kind(case: DecodeCase) -> tuple[str, str, bool]:
    return case.variant, case.window_columns if case.variant == "packed" else "natural", planned_window_apart(case)
