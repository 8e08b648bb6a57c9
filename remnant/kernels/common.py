"""Checks shared by the kernels' Python wrappers (the column tables are remnant.kv.paged's
KeptColumns)."""

from __future__ import annotations

import torch


def check_locs(locs: torch.Tensor, name: str, capacity: int, check_range: bool) -> torch.Tensor:
    """Locations as contiguous int32 (Triton index math; -1 = padding where allowed).

    The range check reads the tensor back to the host (a device sync), so serving paths,
    whose locations come from the allocator, leave it off; tests turn it on.
    """
    if locs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {locs.dtype}")
    if capacity >= 2**31:
        raise ValueError(f"{name}: a pool of {capacity} records needs int64 locations; kernels index with int32")
    if check_range and locs.numel():
        lo, hi = int(locs.min()), int(locs.max())
        if hi >= capacity or lo < -1:
            raise ValueError(f"{name} must lie in [0, {capacity}) (or -1 for padding), got [{lo}, {hi}]")
    return locs.to(torch.int32).contiguous()
