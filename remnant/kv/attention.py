"""Reference decode attention for one CSA layer of DeepSeek-V4 (docs/kv.md).

One decode token: H query heads (64 in V4-Flash) attend, through one softmax with a
per-head attention sink, to the sliding-window tokens (native records) and the top-k C4
records the indexer selected, with V = K (the same 512-vector). Three paths over record
rows for one token, the ground truth for every kernel (remnant.kernels.decode.reference
runs them token by token over pages: decode_native_reference, decode_packed_reference):

- `attend_native`: over native C4 records (stock storage, stock attention);
- `attend_reconstructed`: packed records unpacked to native (dropped codes = FP8 zero),
  then the native math (the triton mode);
- `attend_packed`: directly over packed records, reading only kept coordinates; dropped
  coordinates add nothing to scores and give zero output coordinates (the kernel mode).

The packed paths also take a packed window (window_packed): window records packed with
the C4 records' keep list, which then count as C4 records do (kept coordinates only), so
that the dropped output coordinates are exactly zero.

All three compute the window part and the C4 part of the scores and of the output
separately, with the same operations, so keeping all 448 NoPE coordinates makes
`attend_packed` equal `attend_native` exactly (a packed window too), and any retention
makes `attend_reconstructed` and `attend_packed` agree to float rounding.
"""

from __future__ import annotations

import math

import torch

from remnant.kv.codec import dequantize, dequantize_ordered
from remnant.kv.formats import (HEAD_DIM, NATIVE_RECORD_BYTES, NOPE_DIM, NUM_TILES, ROPE_BYTES, SCALE_BYTES, TILE,
                                UE8M0_BIAS)
from remnant.kv.packing import check_keep, unpack

SOFTMAX_SCALE = 1.0 / math.sqrt(HEAD_DIM)


def _check_inputs(q: torch.Tensor, window: torch.Tensor, sink: torch.Tensor,
                  window_keep: torch.Tensor | None = None) -> None:
    """window_keep: the keep list the window records are packed with (None: native records)."""
    if q.ndim != 2 or q.shape[1] != HEAD_DIM or not q.is_floating_point():
        raise ValueError(f"q must be float [heads, {HEAD_DIM}], got {q.dtype} {tuple(q.shape)}")
    width, form = ((NATIVE_RECORD_BYTES, "native") if window_keep is None else
                   (window_keep.numel() + ROPE_BYTES + SCALE_BYTES, "packed"))
    if window.dtype != torch.uint8 or window.ndim != 2 or window.shape[1] != width:
        raise ValueError(f"window must be uint8 [W, {width}] {form} records, got {window.dtype} {tuple(window.shape)}")
    if sink.shape != (q.shape[0],):
        raise ValueError(f"sink must be [heads] = [{q.shape[0]}], got {tuple(sink.shape)}")


def selected(indices: torch.Tensor, n_records: int) -> torch.Tensor:
    """Valid entries of a top-k index list (-1 pads, as SGLang's indexer pads); int64 [k']."""
    if indices.dtype not in (torch.int32, torch.int64) or indices.ndim != 1:
        raise ValueError(f"indices must be an int tensor [k], got {indices.dtype} {tuple(indices.shape)}")
    idx = indices[indices >= 0].long()
    if idx.numel() and int(idx.max()) >= n_records:
        raise ValueError(f"indices hold record {int(idx.max())} but the layer has {n_records} records")
    return idx


def _combine(
    q: torch.Tensor,
    sink: torch.Tensor,
    window_keys: torch.Tensor,
    window_cols: torch.Tensor | None,
    c4_keys: torch.Tensor,
    c4_cols: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """softmax([sink | q.window | q.c4]) with V = K; the sink takes mass, gives no value.

    window_keys [W, D], c4_keys [k, D']: keys in the coordinates window_cols and c4_cols
    list (None: all 512 in order); each part's scores read q there and its output lands
    there, zero elsewhere.
    """
    s_win = (_columns(q, window_cols) @ window_keys.T) * scale
    s_c4 = (_columns(q, c4_cols) @ c4_keys.T) * scale
    logits = torch.cat([sink[:, None], s_win, s_c4], dim=1)
    p = torch.softmax(logits, dim=1)
    p_win, p_c4 = p[:, 1 : 1 + s_win.shape[1]], p[:, 1 + s_win.shape[1] :]
    return _scattered(p_win @ window_keys, window_cols) + _scattered(p_c4 @ c4_keys, c4_cols)


def _columns(q: torch.Tensor, cols: torch.Tensor | None) -> torch.Tensor:
    return q if cols is None else q[:, cols]


def _scattered(part: torch.Tensor, cols: torch.Tensor | None) -> torch.Tensor:
    """part [H, D] placed in coordinates cols of [H, 512] (None: part itself, D = 512)."""
    if cols is None:
        return part
    full = part.new_zeros(part.shape[0], HEAD_DIM)
    full[:, cols] = part
    return full


def attend_native(
    q: torch.Tensor,
    window: torch.Tensor,
    c4: torch.Tensor,
    indices: torch.Tensor,
    sink: torch.Tensor,
    scale: float = SOFTMAX_SCALE,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Attention over native C4 records.

    q: float [H, 512] (RoPE applied); window: uint8 [W, 584]; c4: uint8 [n, 584] the layer's
    C4 records; indices: int [k] selected records (-1 = padding); sink: [H] logits.
    Returns `dtype` [H, 512].
    """
    _check_inputs(q, window, sink)
    idx = selected(indices, c4.shape[0])
    keys = dequantize(c4[idx]).to(dtype)
    return _combine(q.to(dtype), sink.to(dtype), dequantize(window).to(dtype), None, keys, None, scale)


def attend_reconstructed(
    q: torch.Tensor,
    window: torch.Tensor,
    c4_packed: torch.Tensor,
    keep: torch.Tensor,
    indices: torch.Tensor,
    sink: torch.Tensor,
    scale: float = SOFTMAX_SCALE,
    dtype: torch.dtype = torch.float64,
    *,
    window_packed: bool = False,
) -> torch.Tensor:
    """The triton mode: unpack the selected packed records to native, then native math.

    c4_packed: uint8 [n, R + 72]; keep: int64 [R - 64] kept NoPE indices. window_packed:
    `window` is uint8 [W, R + 72], records packed with `keep` (unpacked to native too);
    else native records. Other arguments and the result as in attend_native.
    """
    if window_packed:
        check_keep(keep)
        _check_inputs(q, window, sink, keep)
        window = unpack(window, keep)
    idx = selected(indices, c4_packed.shape[0])
    native = unpack(c4_packed[idx], keep)
    return attend_native(q, window, native, torch.arange(idx.numel()), sink, scale, dtype)


def packed_keys(packed: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Decode packed records to their kept coordinates only.

    packed: uint8 [k, N + 136]; keep: int64 [N]. Returns float32 [k, N + 64]: the kept NoPE
    values (FP8 code x its tile's UE8M0 scale) then the 64 RoPE values.
    """
    check_keep(keep)
    n = keep.numel()
    codes = packed[:, :n].contiguous().view(torch.float8_e4m3fn).float()
    scales = packed[:, n + ROPE_BYTES : n + ROPE_BYTES + NUM_TILES].float() - UE8M0_BIAS
    tile = (keep // TILE).to(packed.device)
    nope = codes * torch.exp2(scales[:, tile])
    rope = packed[:, n : n + ROPE_BYTES].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=1)


def attend_packed(
    q: torch.Tensor,
    window: torch.Tensor,
    c4_packed: torch.Tensor,
    keep: torch.Tensor,
    indices: torch.Tensor,
    sink: torch.Tensor,
    scale: float = SOFTMAX_SCALE,
    dtype: torch.dtype = torch.float64,
    window_order: torch.Tensor | None = None,
    *,
    window_packed: bool = False,
) -> torch.Tensor:
    """The kernel mode: attention read directly from packed records.

    Scores of C4 records use only the kept coordinates (q restricted to keep + RoPE); their
    output lands in those coordinates and is zero in the dropped ones. Arguments and result
    as in attend_reconstructed. window_order: int [512], the natural column of each column
    of the window records when they were quantized in another order (kernel mode's
    kept-first rings: KeptColumns.order); None: native records. window_packed: `window`
    holds records packed with `keep`, read as the C4 records are (their output in the kept
    coordinates only: with no dropped coordinate left anywhere, those of the result are 0).
    """
    check_keep(keep)
    if window_packed and window_order is not None:
        raise ValueError("window_order is for native window records in another column order; a packed window has none")
    _check_inputs(q, window, sink, keep if window_packed else None)
    idx = selected(indices, c4_packed.shape[0])
    cols = torch.cat([keep, torch.arange(NOPE_DIM, HEAD_DIM)]).to(q.device)
    keys = packed_keys(c4_packed[idx], keep).to(dtype)
    if window_packed:
        window_keys, window_cols = packed_keys(window, keep), cols
    else:
        window_keys = dequantize(window) if window_order is None else dequantize_ordered(window, window_order)
        window_cols = None
    return _combine(q.to(dtype), sink.to(dtype), window_keys.to(dtype), window_cols, keys, cols, scale)
