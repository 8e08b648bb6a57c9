"""The plain torch references of decode: what every decode kernel (remnant.kernels.decode's
triton, sm90, flashmla) is tested against, in float64 by default.

`decode_native_reference` and `decode_packed_reference` attend token by token: each
token's valid records are gathered from their pages (remnant.kv.paged.gather) and attended
with the window and the sink through remnant.kv.attention's per-token attention. They run
on any device and never dispatch; torch only, no kernel imported. A keep list may be given
as a tensor or as a KeptColumns table built once.
"""

from __future__ import annotations

import torch

from remnant.kv.attention import SOFTMAX_SCALE, attend_native, attend_packed
from remnant.kv.layout import KeptColumns, PageLayout, keep_tensor
from remnant.kv.paged import gather


def _valid(row: torch.Tensor) -> torch.Tensor:
    return row[row >= 0]


def _per_token(q, c4, c4_layout, c4_locs, window, window_layout, window_locs, attend) -> torch.Tensor:
    """Reference decode token by token: gather each token's valid records, then `attend`."""
    out = []
    for b in range(q.shape[0]):
        c4_rows = gather(c4, c4_layout, _valid(c4_locs[b]))
        win_rows = gather(window, window_layout, _valid(window_locs[b]))
        out.append(attend(q[b], win_rows, c4_rows))
    return torch.stack(out)


def decode_native_reference(
    q: torch.Tensor,
    c4: torch.Tensor,
    c4_layout: PageLayout,
    c4_locs: torch.Tensor,
    window: torch.Tensor,
    window_layout: PageLayout,
    window_locs: torch.Tensor,
    sink: torch.Tensor,
    scale: float = SOFTMAX_SCALE,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Sparse decode over native C4 records in pages, for a batch of B decode tokens.

    q: [B, H, 512] (RoPE applied); c4_locs: int [B, K] selected records' locations
    (-1 = padding); window_locs: int [B, W] window tokens' locations in the window pool
    (-1 = padding); sink: [H]. Returns `dtype` [B, H, 512].
    """
    return _per_token(q, c4, c4_layout, c4_locs, window, window_layout, window_locs,
                      lambda qb, win, rows: attend_native(qb, win, rows, torch.arange(rows.shape[0]), sink, scale,
                                                          dtype))


def decode_packed_reference(
    q: torch.Tensor,
    c4: torch.Tensor,
    c4_layout: PageLayout,
    c4_locs: torch.Tensor,
    keep: "torch.Tensor | KeptColumns",
    window: torch.Tensor,
    window_layout: PageLayout,
    window_locs: torch.Tensor,
    sink: torch.Tensor,
    scale: float = SOFTMAX_SCALE,
    dtype: torch.dtype = torch.float64,
    window_columns: str = "natural",
) -> torch.Tensor:
    """Sparse decode directly over packed C4 records in pages (the kernel mode).

    As decode_native_reference, with c4 holding packed records (R + 72 bytes) and keep
    int64 [N] the layer's kept NoPE indices. window_columns: the window records' form,
    "natural" (native records), "kept_first" (quantize_kept_first's, as kernel mode
    keeps its rings) or "packed" (R + 72-byte records packed with `keep`, as the C4
    records are: they add nothing to the dropped columns).
    """
    check_window_columns(window_columns)
    kept = keep_tensor(keep)
    window_order = KeptColumns.of(keep, torch.device("cpu")).order if window_columns == "kept_first" else None
    return _per_token(q, c4, c4_layout, c4_locs, window, window_layout, window_locs,
                      lambda qb, win, rows: attend_packed(qb, win, rows, kept, torch.arange(rows.shape[0]), sink,
                                                          scale, dtype, window_order,
                                                          window_packed=window_columns == "packed"))


WINDOW_COLUMNS = ("natural", "kept_first", "packed")


def check_window_columns(window_columns: str) -> None:
    if window_columns not in WINDOW_COLUMNS:
        raise ValueError(f"window_columns={window_columns!r} is not allowed; allowed: "
                         f"{', '.join(map(repr, WINDOW_COLUMNS))}")
