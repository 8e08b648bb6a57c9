"""Column tables and checks shared by the kernels' Python wrappers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from remnant.kv.formats import NOPE_DIM
from remnant.kv.packing import check_keep


def _padded(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """int32 values padded with zeros to a power of two of at least 16 (tl.dot's minimum)."""
    out = torch.zeros(max(triton.next_power_of_2(values.numel()), 16), dtype=torch.int32, device=device)
    out[: values.numel()] = values.to(device=device, dtype=torch.int32)
    return out


@dataclass(frozen=True)
class KeptColumns:
    """One layer's kept NoPE columns in the forms the kernels read, built once per layer.

    kept: int32 [NP] kept indices in map order, zero-padded; n_kept: N.
    dropped: int32 [DP] the other NoPE indices, zero-padded; n_dropped: 448 - N.
    slot_of: int32 [512] for native coordinate c < 448 its position in kept, else -1.
    packed: False when every NoPE coordinate is kept (native records).
    """

    kept: torch.Tensor
    n_kept: int
    dropped: torch.Tensor
    n_dropped: int
    slot_of: torch.Tensor

    @property
    def packed(self) -> bool:
        return self.n_kept < NOPE_DIM

    @property
    def record_bytes(self) -> int:
        return self.n_kept + 136

    @classmethod
    def of(cls, keep: "torch.Tensor | KeptColumns | None", device: torch.device) -> "KeptColumns":
        """From a keep tensor (int64 [N], sorted NoPE indices), or None for native records."""
        if isinstance(keep, KeptColumns):
            return keep
        if keep is None:
            keep = torch.arange(NOPE_DIM)
        else:
            check_keep(keep)
        keep = keep.cpu().long()
        mask = torch.ones(NOPE_DIM, dtype=torch.bool)
        mask[keep] = False
        dropped = mask.nonzero().flatten()
        slot_of = torch.full((512,), -1, dtype=torch.int32)
        slot_of[keep] = torch.arange(keep.numel(), dtype=torch.int32)
        return cls(_padded(keep, device), keep.numel(), _padded(dropped, device), dropped.numel(),
                   slot_of.to(device))


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
