"""Every choice of a decode call, made once: which kernel serves it (choose, a KernelChoice
that says why) and, for Remnant's kernels, how it runs (plan_decode, a frozen DecodePlan).

A decode call is its data (q, the records and their layouts, the selected locations, the
sink, the kept columns, the softmax scale, q's column order and the window's form) and
how to run it: which kernel, its launch settings, how many programs share a token's
records (splits), whether the window gets a program of its own, the partials' dtype, how
the splits share the records and how they are joined. `DecodeConfig` holds the second
kind, each field None where the plan is to choose; `choose` names the kernel and
`plan_decode` resolves the rest for one call shape into a `DecodePlan`, which
`remnant.kernels.decode.decode` runs and the benchmark records (and sweeps, through
DecodeConfig). No choice here changes what decode computes beyond float rounding.

A kernel is chosen by a rule of its own (_why_not: why it cannot take a call) and its
place in PREFERENCE; the engine names what its decode steps run with `choose`, the
benchmark what it times, and a run's record says what served it (served_limits).

The measurements behind each default (which config, which split plan, which partials'
dtype, which join) are in benchmarks/kernels/NOTES.md, "Choices in the code": the
docstrings here say what each choice is and why, not how fast it ran.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
import triton

from remnant.kernels.common import interpreted
from remnant.kernels.decode.reference import WINDOW_COLUMNS

#: The decode kernels, as DecodeConfig.kernel names them: "triton" (remnant.kernels.decode.
#: triton, which reads every record form on every GPU and in the interpreter), "sm90"
#: (remnant.kernels.decode.sm90, the Gluon folded packed call at R = 256 on sm_90) and
#: "flashmla" (remnant.kernels.decode.flashmla, FlashMLA's V4 decode of native records on
#: SM90/SM100: the stock attention SGLang runs, and the baseline of every decode figure).
KERNELS = ("triton", "sm90", "flashmla")
#: Per record form (packed or not), the kernels that read it, fastest first: a call that asks
#: for none runs the first that can take it. Triton's takes every call, so it closes each list.
PREFERENCE = {False: ("flashmla", "triton"), True: ("sm90", "triton")}
#: The kernels whose launch plan_decode makes (FlashMLA schedules its own).
PLANNED = ("triton", "sm90")
# DecodeConfig fields that only the Triton kernel reads: a config that sets any of them
# asks for that kernel's program, so choose takes another only where none is set.
TRITON_ONLY = ("block_n", "num_stages", "scores_transposed", "window_block_n", "window_scores_transposed",
               "window_apart", "partials", "split_plan", "join")
COLUMN_ORDERS = ("natural", "kept_first")
MAX_SPLITS = 16
PARTIALS = ("float32", "float16")
SPLIT_PLANS = ("even", "by_cost")
JOINS = ("kernel", "exchange")
# How many C4 steps one window step costs when splits are cut by cost (split_plan
# "by_cost"). Packed: its window step (32 tokens, four column sets) against its C4 step (64
# records), the fastest weight measured at 8 splits. Native: both loops step over 32
# native records the same way. A packed window (window_columns="packed") is read by the C4
# loop itself, at as many records per step by default: its step is a C4 step.
PACKED_WINDOW_STEP_COST = 2
NATIVE_WINDOW_STEP_COST = 1
PACKED_RECORDS_WINDOW_STEP_COST = 1
# The fewest splits at which decode cuts the folded call's by cost unless told, and the
# split counts at which it cuts the native kernel's so (split_plan_for).
BY_COST_FROM_SPLITS = 8
NATIVE_BY_COST_SPLITS = (2,)
# The fastest loop settings per kernel in the tuning of an H200 (remnant-kernels,
# benchmarks/kernels/h200-2026-12-01-r6.json; NOTES.md, fifth round), at 64 heads per
# program on 8 warps. Packed window records in natural order are read by column index, a
# pointer per byte, whose registers make 16 records per step their best (more spill).
DEFAULT_CONFIGS = {
    "native": dict(block_n=32, num_stages=3, scores_transposed=True, window_block_n=32, window_scores_transposed=True),
    "packed": dict(block_n=64, num_stages=3, scores_transposed=False, window_block_n=16, window_scores_transposed=True),
    "packed, kept-first window": dict(block_n=64, num_stages=3, scores_transposed=False, window_block_n=32,
                                      window_scores_transposed=False),
    # The window in a program of its own (window_apart): the native kernel's window loop,
    # the packed kernel's C4 loop.
    "packed, window apart": dict(block_n=64, num_stages=3, scores_transposed=False, window_block_n=32,
                                 window_scores_transposed=True),
    # A packed window (window_columns="packed") runs the C4 loop over the window records:
    # the C4 loop's settings for both (not tuned apart), so that a window step is a C4 step
    # (PACKED_RECORDS_WINDOW_STEP_COST).
    "packed, packed window": dict(block_n=64, num_stages=3, scores_transposed=False, window_block_n=64,
                                  window_scores_transposed=False),
}
LOOP_SETTINGS = tuple(DEFAULT_CONFIGS["native"])


def _allowed(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; allowed: {', '.join(map(repr, allowed))}")


@dataclass(frozen=True)
class DecodeConfig:
    """How to run decode, each field None (or its default) where plan_decode chooses: what
    the benchmark sweeps and tests pin. Callers that serve pass none, or only what their
    geometry needs (the tiny engine model's 16-head blocks).

    kernel: one of KERNELS (None: choose's, the first of PREFERENCE that takes the call).
    h_block, num_warps: query heads per program and its warps (64 on 8: V4's heads).
    block_n, window_block_n: records per step of the C4 loop and of the window loop;
    scores_transposed, window_scores_transposed: each loop's scores as (K q^T)^T (the
    records the product's M side) or q K^T; num_stages: Triton's software-pipeline depth.
    None: DEFAULT_CONFIGS of the call's kernel form.
    splits: programs per (token, head block), each over a share of the records, joined by
    their log-sum-exp (None: auto_splits); window_apart: window_apart_for; partials ("float32",
    "float16"): partials_for; split_plan ("even", "by_cost"): split_plan_for; join
    ("kernel", "exchange"): join_for.
    """

    kernel: str | None = None
    h_block: int = 64
    num_warps: int = 8
    block_n: int | None = None
    num_stages: int | None = None
    scores_transposed: bool | None = None
    window_block_n: int | None = None
    window_scores_transposed: bool | None = None
    splits: int | None = None
    window_apart: bool | None = None
    partials: str | None = None
    split_plan: str | None = None
    join: str | None = None

    def __post_init__(self):
        for name, allowed in (("kernel", KERNELS), ("partials", PARTIALS), ("split_plan", SPLIT_PLANS),
                              ("join", JOINS)):
            _allowed(name, getattr(self, name), (None, *allowed))


@dataclass(frozen=True)
class DecodePlan:
    """One decode call's choices, all resolved (plan_decode), with the call form they were
    made for (packed records, q/out column order, the window records' form). decode runs a
    plan as it is, whatever the batch: a plan made once per shape serves every call of that
    shape (and the benchmark's checks run the timed call's plan on a smaller batch)."""

    kernel: str
    packed: bool
    columns: str
    window_columns: str
    h_block: int
    num_warps: int
    block_n: int
    num_stages: int
    scores_transposed: bool
    window_block_n: int
    window_scores_transposed: bool
    splits: int
    window_apart: bool
    partials: str | None
    split_plan: str | None
    join: str | None

    @property
    def permute(self) -> bool:
        """q and out are permuted between natural and kept-first order around the kernel."""
        return self.packed and self.columns == "natural"

    @property
    def window_kept_first(self) -> bool:
        return self.packed and self.window_columns == "kept_first"

    @property
    def window_packed(self) -> bool:
        """The window records are packed with the C4 records' keep list (read as C4 records)."""
        return self.packed and self.window_columns == "packed"

    def loops(self) -> dict:
        """The loop settings (DEFAULT_CONFIGS' keys) as a dict."""
        return {name: getattr(self, name) for name in LOOP_SETTINGS}

    def config(self) -> DecodeConfig:
        """A DecodeConfig that pins every choice of this plan."""
        fields = asdict(self)
        return DecodeConfig(**{name: fields[name] for name in DecodeConfig.__dataclass_fields__})


class KernelChoice(NamedTuple):
    """The kernel that serves a decode call (one of KERNELS), and why not the first of its
    record form's PREFERENCE: FlashMLA's for native records, the SM90 kernel for packed ones
    (None where that one serves). A pair, as the engine reports it."""

    kernel: str
    reason: str | None = None


def choose(device: torch.device, heads: int, packed: bool, *, n_kept: int | None = None,
           columns: str = "natural", window_columns: str = "natural", q_dtype: torch.dtype | None = None,
           layouts: tuple | None = None, config: DecodeConfig | None = None, kernels: tuple = KERNELS,
           field: str | None = None) -> KernelChoice:
    """Which kernel serves a decode call of `heads` query heads over packed (a keep list of
    n_kept columns) or native records on `device`, q and out in `columns` order, the window
    records of form `window_columns` (WINDOW_COLUMNS: native records in natural or
    kept-first order, or records packed with the keep list), q of `q_dtype` and the C4 and
    window PageLayouts `layouts` (each checked where given), and why.

    config.kernel where it names one (a ValueError where that kernel cannot take the call
    or the config sets the Triton kernel's own launch choices); else the first kernel of
    PREFERENCE[packed] among `kernels` that can take the call (_why_not) and that the
    config leaves free (_pinned: settings only the Triton kernel reads keep the call
    there). field: the setting that asked for the kernel, named in its errors and reasons
    (the engine's native_decode); None: the config's kernel."""
    config = config or DecodeConfig()
    _allowed("columns", columns, COLUMN_ORDERS)
    _allowed("window_columns", window_columns, WINDOW_COLUMNS)
    if window_columns != "natural" and not packed:
        raise ValueError(f"window_columns={window_columns!r} needs packed C4 records (a keep list): the native kernel "
                         "reads native window records in natural order")
    call = (device, heads, packed, n_kept, columns, window_columns, q_dtype, layouts)
    pinned = _pinned(config)
    asked = config.kernel
    if asked == "triton":
        named = "Remnant's Triton kernel" if packed else "Remnant's Triton native kernel"
        return KernelChoice("triton", f"{named} was asked for ({field or 'kernel'}=triton)")
    if asked is not None:
        why = (_why_not(asked, *call) if asked in kernels else
               f"it is not among the kernels planned here ({', '.join(kernels)}; FlashMLA schedules its own launch)")
        if why is not None:
            raise ValueError(f"{field}={asked} cannot run: {why}" if field else
                             f"decode kernel={asked!r} cannot run this call: {why}")
        if pinned:
            raise ValueError(f"decode kernel={asked!r} has a fixed program; these settings are the Triton kernel's: "
                             f"{', '.join(pinned)}")
        return KernelChoice(asked)
    reason = None
    for kernel in (k for k in PREFERENCE[packed] if k in kernels):
        why = _why_not(kernel, *call)
        if why is None and kernel != "triton" and pinned:
            why = f"the launch settings of a {heads}-head model ({config}) are the Triton kernel's"
        elif why is not None and kernel == "sm90":
            why = f"the SM90 Gluon kernel cannot take it: {why}"
        if why is None:
            return KernelChoice(kernel, reason)
        reason = reason or why
    raise AssertionError(f"no decode kernel of {kernels} takes this call: {reason}")  # Triton's takes every call


def _why_not(kernel: str, device: torch.device, heads: int, packed: bool, n_kept: int | None, columns: str,
             window_columns: str, q_dtype: torch.dtype | None, layouts: tuple | None) -> str | None:
    """Why `kernel` cannot take this call (choose's arguments), None where it can: each
    kernel's rule. Each kernel module is imported only where its rule needs it (Gluon and
    FlashMLA only where they may run)."""
    if kernel == "triton":
        return None
    if kernel == "sm90":
        if not (packed and columns == "kept_first" and window_columns in ("kept_first", "packed")):
            return ("it runs the folded call only (packed records, q and out in kept-first order, the window "
                    "kept-first or packed)")
        if q_dtype is not None and q_dtype != torch.bfloat16:
            return f"it reads bf16 q, got {q_dtype}"
        from remnant.kernels.decode import sm90

        why = sm90.unavailable_reason(device, n_kept, heads)
        if why is None and layouts is not None:
            why = sm90.layout_problem(*layouts, window_packed=window_columns == "packed")
        return why
    if kernel == "flashmla":
        if packed:
            return "FlashMLA's V4 decode reads native records, not packed ones"
        if (columns, window_columns) != ("natural", "natural"):
            return "FlashMLA reads q, out and the window in natural column order"
        from remnant.kernels.decode import flashmla

        return (next(filter(None, (flashmla.layout_reason(layout) for layout in layouts or ())), None)
                or flashmla.unavailable_reason(device, heads))
    raise ValueError(f"kernel={kernel!r} is not allowed; allowed: {', '.join(map(repr, KERNELS))}")


def _pinned(config: DecodeConfig) -> list[str]:
    """The Triton kernel's own choices that `config` sets (TRITON_ONLY, h_block, num_warps)."""
    names = [name for name in TRITON_ONLY if getattr(config, name) is not None]
    return names + [name for name, default in (("h_block", 64), ("num_warps", 8)) if getattr(config, name) != default]


#: What a run on a GPU says about the kernel that decoded each record form, where it was not
#: FlashMLA's (native records, as SGLang serves them) or, for packed records, always: the
#: benchmarks measure the two packed kernels apart (benchmarks/kernels/NOTES.md).
_SERVED = {
    (False, "triton"): "decode over native records (native and triton modes, window-only and HCA layers) ran on "
                       "Remnant's Triton native kernel, not FlashMLA's V4 decode that SGLang runs: {reason}",
    (True, "sm90"): "kernel mode's decode over packed records ran on the SM90 Gluon kernel "
                    "(remnant.kernels.decode.sm90)",
    (True, "triton"): "kernel mode's decode over packed records ran on Remnant's Triton kernel, not the SM90 Gluon "
                      "kernel: {reason}",
}


def served_limits(packed: bool, served: dict | None) -> list[str]:
    """The caveats of a run whose server decoded its packed (or native) records with the
    kernel it reported (served: the engine's KernelChoice as /server_info gives it,
    {"kernel", "reason"}); none where FlashMLA served native records or nothing ran."""
    served = served or {}
    text = _SERVED.get((packed, served.get("kernel")))
    return [] if text is None else [text.format(reason=served.get("reason"))]


def plan_decode(batch: int, heads: int, window: int, topk: int, packed: bool, device: torch.device, *,
                columns: str = "natural", window_columns: str = "natural",
                config: DecodeConfig | None = None, n_kept: int | None = None,
                q_dtype: torch.dtype | None = None, layouts: tuple | None = None) -> DecodePlan:
    """The plan of a call to one of Remnant's kernels (PLANNED) of `batch` tokens, `heads`
    query heads, `window` window locations and `topk` C4 locations per token, over packed
    (a keep list) or native C4 records on `device`, q and out in `columns` order and the
    window records of form `window_columns` (see remnant.kernels.decode.decode). config:
    the choices made by the caller (None: all chosen here). n_kept, q_dtype, layouts (the C4
    and window PageLayouts): what decides whether the SM90 kernel can take the call (choose)."""
    kernel = choose(device, heads, packed, n_kept=n_kept, columns=columns, window_columns=window_columns,
                    q_dtype=q_dtype, layouts=layouts, config=config, kernels=PLANNED).kernel
    return plan_for(kernel, batch, heads, window, topk, packed, device, columns=columns, window_columns=window_columns,
                    config=config)


def plan_for(kernel: str, batch: int, heads: int, window: int, topk: int, packed: bool, device: torch.device, *,
             columns: str = "natural", window_columns: str = "natural",
             config: DecodeConfig | None = None) -> DecodePlan:
    """plan_decode's plan for a kernel already chosen (choose: one of PLANNED) for this call."""
    config = config or DecodeConfig()
    if kernel == "sm90":
        return _sm90_plan(batch, packed, columns, window_columns, device, config)
    programs = batch * triton.cdiv(heads, config.h_block)
    window_apart = window_apart_for(config.window_apart, packed, columns, window_columns, window, config.splits,
                                    programs, device)
    window_kept_first = packed and window_columns == "kept_first"
    window_packed = packed and window_columns == "packed"
    form = ("native" if not packed else "packed, kept-first window" if window_kept_first
            else "packed, packed window" if window_packed else "packed, window apart" if window_apart else "packed")
    given = {name: getattr(config, name) for name in LOOP_SETTINGS}
    loops = {name: DEFAULT_CONFIGS[form][name] if value is None else value for name, value in given.items()}
    splits = split_count(config.splits, programs, window, topk, loops["block_n"], loops["window_block_n"], device,
                         window_apart)
    return DecodePlan(
        kernel=config.kernel or "triton", packed=packed, columns=columns, window_columns=window_columns,
        h_block=config.h_block, num_warps=config.num_warps, **loops, splits=splits, window_apart=window_apart,
        partials=partials_for(config.partials, splits),
        split_plan=split_plan_for(config.split_plan, splits, packed, window_kept_first or window_packed, window_apart),
        join=join_for(config.join, splits, packed and columns == "natural", window_apart, device))


def _sm90_plan(batch: int, packed: bool, columns: str, window_columns: str, device: torch.device,
               config: DecodeConfig) -> DecodePlan:
    """The SM90 kernel's plan: its splits (sm90.splits_per_token unless given); its fixed
    program in the launch fields (64 heads on 8 warps, steps of 64 records, two stages)."""
    from remnant.kernels.decode import sm90

    splits = config.splits
    if splits is None:
        splits = sm90.splits_per_token(batch, torch.cuda.get_device_properties(device).multi_processor_count)
    if not 1 <= splits <= sm90.MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {sm90.MAX_SPLITS}] for the SM90 kernel, got {splits}")
    split = splits > 1
    return DecodePlan(
        kernel="sm90", packed=packed, columns=columns, window_columns=window_columns, h_block=sm90.HEADS,
        num_warps=sm90.NUM_WARPS, block_n=sm90.STEP, num_stages=sm90.STAGES,
        scores_transposed=False, window_block_n=sm90.STEP, window_scores_transposed=False, splits=splits,
        window_apart=False, partials="float32" if split else None, split_plan="by_cost" if split else None,
        join="kernel" if split else None)


def splits_for(programs: int, multiprocessors: int) -> int:
    """Splits per program so that `programs` (tokens x head blocks) fill `multiprocessors`
    once: one 64-head program per SM is the most that fits (255 registers, 144 KB of
    shared memory), so a batch below the SM count leaves SMs idle without splits, and
    above it more splits would only queue (benchmarks/kernels/NOTES.md)."""
    return max(1, min(MAX_SPLITS, multiprocessors // max(programs, 1)))


def auto_splits(programs: int, device: torch.device) -> int:
    """splits_for this device's multiprocessors; 1 off the GPU."""
    if device.type != "cuda":
        return 1
    return splits_for(programs, torch.cuda.get_device_properties(device).multi_processor_count)


def split_count(splits: int | None, programs: int, window: int, topk: int, block_n: int, window_block_n: int,
                device: torch.device, window_apart: bool = False) -> int:
    """The splits decode runs: `splits` (None: auto_splits), at most one per step of the
    longer loop (a split without a step of its own would only add a partial).

    window_apart (window_apart_for): the window takes a program of its own, split 0, and the
    rest share the C4 records, at most one per C4 step; None then chooses one more than
    auto_splits."""
    if splits is None:
        splits = min(MAX_SPLITS, auto_splits(programs, device) + (1 if window_apart else 0))
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    if window_apart and splits < 2:
        raise ValueError(f"splits must be >= 2 with window_apart (the window's program and one for the C4 records), "
                         f"got {splits}")
    c4_steps = max(-(-topk // block_n), 1)
    if window_apart:
        return 1 + min(splits - 1, c4_steps)
    return min(splits, max(-(-window // window_block_n), c4_steps))


def window_apart_for(window_apart: bool | None, packed: bool, columns: str, window_columns: str, window: int,
                     splits: int | None, programs: int, device: torch.device) -> bool:
    """Whether decode gives the window a program of its own (split 0 runs the native
    program over the window, the other splits the packed program over the C4 records).

    Only packed C4 records with q, out and the window in natural order (as SGLang calls
    the kernel) can: there the fused program reads each window code by column index into
    its kept-first sets, which cost it as much as its C4 records. None chooses it where the
    window is not empty, splits is None and auto_splits gives the fused program one split
    (more programs than half the multiprocessors, where it measured faster; split in two,
    the fused program was faster); given splits keep the fused program."""
    natural = packed and columns == "natural" and window_columns == "natural"
    if window_apart is None:
        return natural and window > 0 and splits is None and auto_splits(programs, device) == 1
    if window_apart and not natural:
        raise ValueError("window_apart needs packed C4 records with q, out and the window in natural order (a keep "
                         f"list, columns='natural', window_columns='natural'), got "
                         f"{'packed' if packed else 'native'} records, columns={columns!r}, "
                         f"window_columns={window_columns!r}")
    return window_apart


def partials_for(partials: str | None, splits: int) -> str | None:
    """The split partials' dtype: None for one split (no partials); else as given or, where
    None, float16 (each row scaled by a power of two: decode's _row_scale) for two splits
    and float32 for more. Half the bytes paid at two splits; at 8 and 16 each split's row
    maxima cost more than the bytes they save."""
    if splits == 1:
        return None
    if partials is not None:
        return partials
    return "float16" if splits <= 2 else "float32"


def split_plan_for(split_plan: str | None, splits: int, packed: bool, window_words: bool,
                   window_apart: bool) -> str | None:
    """How a token's splits share the window and the C4 records: None for one split;
    "even", each split a like share of each (with the window apart: of the C4 records); or
    "by_cost", each split a contiguous range of the window's steps then the C4 records',
    cut at equal cost (decode's _split_step), so that most splits run one loop. None
    chooses "by_cost" for the packed program with a window read as runs of words
    (window_words: kept-first or packed window records) at BY_COST_FROM_SPLITS splits or
    more (measured with a kept-first window; at 2 and 4 the even plan was faster; a packed
    window, whose steps are C4 steps, is not measured apart), and for the native kernel at
    NATIVE_BY_COST_SPLITS (at 4 and 16 it was slower, at 8 even)."""
    if splits == 1:
        return None
    if split_plan is None:
        if not packed:
            return "by_cost" if splits in NATIVE_BY_COST_SPLITS else "even"
        return "by_cost" if window_words and not window_apart and splits >= BY_COST_FROM_SPLITS else "even"
    if split_plan == "by_cost" and window_apart:
        raise ValueError("split_plan='by_cost' cannot take the window apart: its program is split 0 by construction; "
                         "pass window_apart=False or split_plan='even'")
    return split_plan


def join_for(join: str | None, splits: int, permute: bool, window_apart: bool, device: torch.device) -> str | None:
    """How a token's splits are joined: None for one split; "kernel", the splits' partials
    written to global memory and joined by decode's _combine_kernel; or "exchange", a
    token's two splits launched as one cluster of two CTAs that write their partials as for
    the kernel, pass a cluster barrier and each join half of the output columns from L2.
    None chooses "exchange" wherever it can run: two splits, the output in the kernel's own
    column order (no permutation back to natural order, no window apart: their join reads
    the partials by index), compiled for an NVIDIA GPU with clusters (sm_90 and later;
    inline PTX; the interpreter runs programs one at a time), by a Triton whose launcher
    takes clusters from the packed metadata that launch_in_pairs sets (3.6 and later)."""
    if splits == 1:
        return None
    why = None
    if splits != 2:
        why = f"{splits} splits (it pairs two)"
    elif permute:
        why = "columns='natural' over packed records (the join kernel permutes the output back)"
    elif window_apart:
        why = "the window apart (the join kernel reads its partials in two orders)"
    elif device.type != "cuda" or interpreted():
        why = "no compiled CUDA launch (Triton's interpreter runs programs one at a time)"
    elif torch.version.hip is not None:
        why = "a ROCm GPU (the cluster barrier is PTX)"
    elif torch.cuda.get_device_capability(device) < (9, 0):
        why = "a GPU before sm_90 (no thread block clusters)"
    elif tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 6):
        why = f"Triton {triton.__version__} (launch_in_pairs needs 3.6 or later)"
    if join is None:
        return "kernel" if why else "exchange"
    if join == "exchange" and why:
        raise ValueError(f"join='exchange' cannot run with {why}; pass join='kernel' or leave it None")
    return join


def window_step_cost(packed: bool, window_columns: str = "natural") -> int:
    """How many C4 steps one window step weighs when splits are cut by cost (split_plan
    "by_cost"; decode's _split_step): PACKED_ or NATIVE_WINDOW_STEP_COST, and
    PACKED_RECORDS_WINDOW_STEP_COST for a packed window (window_columns="packed")."""
    if not packed:
        return NATIVE_WINDOW_STEP_COST
    return PACKED_RECORDS_WINDOW_STEP_COST if window_columns == "packed" else PACKED_WINDOW_STEP_COST
