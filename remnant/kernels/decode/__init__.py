"""Sparse decode attention of one CSA layer (H query heads against the selected C4 records,
the sliding window and the attention sink, V = K) over native or packed records: one entry
point, `decode`, and the kernels it runs.

- `plan`: every choice of a call: `choose` (which kernel serves it, and why: a
  KernelChoice) and `plan_decode` (how one of Remnant's kernels runs it: a DecodePlan);
- `triton`: the Triton kernel, which reads every record form on every GPU and in Triton's
  interpreter (the CPU-tested reference of the others, and the fallback);
- `sm90`: the folded packed call (R = 256; q, out and the window in kept-first order, or a
  window packed with the keep list) in Gluon for sm_90;
- `flashmla`: FlashMLA's V4 decode (PyPI sgl-flash-mla, optional, CUDA only) over native
  records: the stock attention SGLang runs, and the baseline of every decode figure;
- `reference`: the plain torch references every kernel is tested against (float64).

`decode` checks a call, chooses its kernel (config.kernel, else the first of
plan.PREFERENCE that takes it), plans it (Remnant's kernels: plan.PLANNED) and runs it
where its tensors are: compiled on CUDA, under Triton's interpreter on the CPU. Each
kernel is the module of its name with a `run` of one signature, loaded on first use
(Gluon and FlashMLA only where they may run), so a new kernel is its module, its rule in
`plan` and its test. Serving code that may hold CPU tensors outside the interpreter (the
SGLang plugin) calls the reference there itself.
"""

from __future__ import annotations

import importlib

import torch

from remnant.kernels.decode.plan import (KERNELS, PLANNED, DecodeConfig, DecodePlan, KernelChoice, choose,
                                         plan_decode, plan_for, served_limits)
from remnant.kv.attention import SOFTMAX_SCALE
from remnant.kv.formats import HEAD_DIM, NATIVE_RECORD_BYTES
from remnant.kv.layout import KeptColumns, PageLayout

__all__ = ["KERNELS", "DecodeConfig", "DecodePlan", "KernelChoice", "choose", "decode", "plan_decode",
           "served_limits"]


def decode(
    q: torch.Tensor,
    c4: torch.Tensor,
    c4_layout: PageLayout,
    c4_locs: torch.Tensor,
    window: torch.Tensor,
    window_layout: PageLayout,
    window_locs: torch.Tensor,
    sink: torch.Tensor,
    keep: "torch.Tensor | KeptColumns | None" = None,
    scale: float = SOFTMAX_SCALE,
    *,
    columns: str = "natural",
    window_columns: str = "natural",
    out: torch.Tensor | None = None,
    config: DecodeConfig | DecodePlan | None = None,
    check_range: bool = False,
    compiled: list | None = None,
) -> torch.Tensor:
    """Sparse decode of B tokens; plain references: remnant.kernels.decode.reference's
    decode_native_reference and decode_packed_reference.

    Data. q: bf16/float [B, H, 512]; c4 and window: pages uint8 [P, page_stride] with their
    layouts; c4_locs int [B, K], window_locs int [B, W] (-1 = padding); sink float [H]; keep
    None for native C4 records, int64 [N] (or its KeptColumns) for packed ones; scale: the
    softmax scale. Returns out [B, H, 512] in q's dtype (or writes the given `out`, [B, H,
    512] with contiguous rows; its dtype may differ from q's). FlashMLA, given no `out`,
    returns its own output, as SGLang takes it (a copy would add a pass over it).

    columns (packed records): "natural", q and out in the model's column order, permuted
    to and from kept-first order around the kernel (permute_columns, one pass each); or
    "kept_first", q given and out returned in KeptColumns.order (kept columns in map
    order, dropped ones, RoPE), as when that permutation is folded into the projections
    that make q and read out, once at load time. Native records ignore it.

    window_columns (packed records): the window records' form, "natural" (native records,
    as the stock store writes them), "kept_first" (kept-first window records, written by
    remnant.kernels.store.store_kept_first: the latent quantized in KeptColumns.order, so
    that the kernel reads both column sets with word loads and finds each code's scale from
    its position) or "packed" (records packed with `keep`, R + 72 bytes, written as the C4
    records are by remnant.kernels.dispatch.store with the keep list: the window then
    counts as C4 records do, its output in the kept columns only, so the dropped columns of
    the output are 0; the window layout holds R + 72-byte records). Native records refuse
    both others. The SM90 kernel reads kept-first and packed windows with q and out in
    kept-first order; the Triton kernel reads every form.

    How to run it. config: a DecodeConfig (its kernel, else choose's, and its None fields
    chosen by plan_decode for this call) or a DecodePlan made by plan_decode (run as it is;
    its record form and column orders must be this call's); None: everything chosen here.
    check_range: check every location against its pool (reads them back to the host: tests).
    compiled: a list the compiled kernel is appended to (the benchmark records its
    registers and spills; FlashMLA's is not a Triton kernel and appends nothing).
    """
    from remnant.kernels.common import check_locs  # imports triton: the kernels load on first use

    if q.ndim != 3 or q.shape[2] != HEAD_DIM:
        raise ValueError(f"q must be [B, H, {HEAD_DIM}], got {tuple(q.shape)}")
    batch, heads, _ = q.shape
    cols = KeptColumns.of(keep, q.device)
    if isinstance(config, DecodePlan):
        plan, kernel = config, config.kernel
        made_for = (plan.packed, plan.columns, plan.window_columns)
        if made_for != (cols.packed, columns, window_columns):
            raise ValueError(f"this DecodePlan was made for (packed, columns, window_columns) = {made_for}, the call is "
                             f"{(cols.packed, columns, window_columns)}")
    else:
        kernel = choose(q.device, heads, cols.packed, columns=columns, window_columns=window_columns, config=config,
                        n_kept=cols.n_kept, q_dtype=q.dtype, layouts=(c4_layout, window_layout)).kernel
        plan = None if kernel not in PLANNED else plan_for(
            kernel, batch, heads, window_locs.shape[-1], c4_locs.shape[-1], cols.packed, q.device, columns=columns,
            window_columns=window_columns, config=config)
    if q.stride(2) != 1:
        q = q.contiguous()
    _check_layout(c4_layout, c4, cols.record_bytes, "c4")
    _check_layout(window_layout, window, cols.record_bytes if window_columns == "packed" else NATIVE_RECORD_BYTES,
                  "window")
    if c4_locs.ndim != 2 or c4_locs.shape[0] != batch or window_locs.ndim != 2 or window_locs.shape[0] != batch:
        raise ValueError(f"c4_locs and window_locs must be [B={batch}, *], got {tuple(c4_locs.shape)} and {tuple(window_locs.shape)}")
    if sink.shape != (heads,):
        raise ValueError(f"sink must be [H] = [{heads}], got {tuple(sink.shape)}")
    c4_locs = check_locs(c4_locs, "c4_locs", c4_layout.capacity(c4), check_range, allow_padding=True)
    window_locs = check_locs(window_locs, "window_locs", window_layout.capacity(window), check_range,
                             allow_padding=True)
    if out is not None and (out.shape != q.shape or out.stride(2) != 1):
        raise ValueError(f"out must be [B, H, {HEAD_DIM}] = {tuple(q.shape)} with contiguous rows, got "
                         f"{tuple(out.shape)} with strides {out.stride()}")
    # Each kernel is the module of its name, whose `run` takes the checked call and its plan.
    module = importlib.import_module(f"{__name__}.{kernel}")
    return module.run(plan, q, c4, c4_layout, c4_locs, window, window_layout, window_locs, sink, cols, scale, out,
                      compiled)


def _check_layout(layout: PageLayout, pages: torch.Tensor, width: int, name: str) -> None:
    layout.check(pages, name)
    if layout.record_bytes != width:
        raise ValueError(f"{name} layout holds {layout.record_bytes}-byte records, expected {width}")
