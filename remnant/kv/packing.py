"""Pack native records into R + 72-byte records and back (docs/kv.md).

Pack copies codes: kept NoPE coordinates keep their native FP8 codes and tile scales, so
pack is lossless for them and deterministic. Unpack (the triton mode's reconstruct) puts
FP8 zero in every dropped coordinate: bit-exact against the native record with those
coordinates zeroed.
"""

from __future__ import annotations

import torch

from remnant.kv.formats import (
    NATIVE_DATA_BYTES,
    NATIVE_RECORD_BYTES,
    NOPE_DIM,
    RETENTION_VALUES,
    ROPE_BYTES,
    SCALE_BYTES,
)

_ALLOWED_N = tuple(r - 64 for r in RETENTION_VALUES) + (NOPE_DIM,)


def check_keep(keep: torch.Tensor, name: str = "keep") -> None:
    """Validate kept NoPE indices: int64 [N], strictly increasing, in [0, 448), N = R - 64."""
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.int64 or keep.ndim != 1:
        got = f"{keep.dtype} {tuple(keep.shape)}" if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise ValueError(f"{name} must be an int64 tensor [N] of kept NoPE indices, got {got}")
    n = keep.numel()
    if n not in _ALLOWED_N:
        raise ValueError(
            f"{name} has {n} indices; N = R - 64 must be one of {', '.join(map(str, _ALLOWED_N))}"
        )
    if n and (keep.min() < 0 or keep.max() >= NOPE_DIM):
        raise ValueError(f"{name} has indices outside [0, {NOPE_DIM}): min {int(keep.min())}, max {int(keep.max())}")
    if n > 1:
        step = keep[1:] - keep[:-1]
        if (step == 0).any():
            raise ValueError(f"{name} repeats index {int(keep[1:][step == 0][0])}")
        if (step < 0).any():
            raise ValueError(f"{name} is not sorted ascending (at position {int((step < 0).nonzero()[0]) + 1})")


def _check_records(rec: torch.Tensor, width: int, name: str) -> None:
    if not isinstance(rec, torch.Tensor) or rec.dtype != torch.uint8 or rec.ndim != 2 or rec.shape[1] != width:
        got = f"{rec.dtype} {tuple(rec.shape)}" if isinstance(rec, torch.Tensor) else type(rec).__name__
        raise ValueError(f"{name} must be uint8 [n, {width}], got {got}")


def pack(rec: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Native records -> packed records.

    rec: uint8 [n, 584]; keep: int64 [N] sorted kept NoPE indices (N = R - 64).
    Returns uint8 [n, N + 136] (= R + 72): kept codes, RoPE bytes, scales + pad.
    """
    _check_records(rec, NATIVE_RECORD_BYTES, "rec")
    check_keep(keep)
    keep = keep.to(rec.device)
    return torch.cat([rec[:, keep], rec[:, NOPE_DIM:]], dim=1)


def unpack(packed: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Packed records -> native records with FP8 zero (code 0) in dropped NoPE coordinates.

    packed: uint8 [n, N + 136]; keep: int64 [N]. Returns uint8 [n, 584].
    """
    check_keep(keep)
    n_keep = keep.numel()
    _check_records(packed, n_keep + ROPE_BYTES + SCALE_BYTES, "packed")
    keep = keep.to(packed.device)
    out = torch.zeros(packed.shape[0], NATIVE_RECORD_BYTES, dtype=torch.uint8, device=packed.device)
    out[:, keep] = packed[:, :n_keep]
    out[:, NOPE_DIM:] = packed[:, n_keep:]
    return out


def to_pages(rec: torch.Tensor, page_size: int) -> torch.Tensor:
    """Records (native [n, 584] or packed [n, R + 72]) -> SGLang's split page layout.

    Returns uint8 [ceil(n / page_size), page_bytes]: per page, every record's data part
    (all but its last 8 bytes) back to back, then every record's 8 scale+pad bytes,
    then zero padding to a whole number of data rows. Slots past n are zero.
    """
    if rec.dtype != torch.uint8 or rec.ndim != 2 or rec.shape[1] <= SCALE_BYTES:
        raise ValueError(f"rec must be uint8 [n, record_bytes], got {rec.dtype} {tuple(rec.shape)}")
    from remnant.kv.formats import page_bytes

    n, width = rec.shape
    data = width - SCALE_BYTES
    pages = -(-n // page_size)
    padded = torch.zeros(pages * page_size, width, dtype=torch.uint8, device=rec.device)
    padded[:n] = rec
    padded = padded.view(pages, page_size, width)
    out = torch.zeros(pages, page_bytes(page_size, _retention_of(data)), dtype=torch.uint8, device=rec.device)
    out[:, : page_size * data] = padded[:, :, :data].reshape(pages, -1)
    out[:, page_size * data : page_size * width] = padded[:, :, data:].reshape(pages, -1)
    return out


def from_pages(pages: torch.Tensor, page_size: int, record_bytes: int, n: int | None = None) -> torch.Tensor:
    """Inverse of to_pages: uint8 [pages, page_bytes] -> records uint8 [n, record_bytes]."""
    data = record_bytes - SCALE_BYTES
    count = pages.shape[0]
    body = pages[:, : page_size * data].reshape(count, page_size, data)
    scales = pages[:, page_size * data : page_size * record_bytes].reshape(count, page_size, SCALE_BYTES)
    rec = torch.cat([body, scales], dim=2).reshape(count * page_size, record_bytes)
    return rec if n is None else rec[:n]


def _retention_of(data_bytes: int) -> int:
    retention = data_bytes - ROPE_BYTES + 64
    if data_bytes == NATIVE_DATA_BYTES:
        return 512
    return retention
