"""A sequence's handles into the engine's KV pools (remnant.engine.pools).

The KV itself lives in the pools: compressed records and indexer keys in `pages` (one
full page per page_size tokens, possibly shared with the prefix cache), the sliding
window in SWA block `swa_block`, the compressor's open blocks in request slot `slot`.
`length` tokens have their KV written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Sequence:
    pages: list[int]
    swa_block: int
    slot: int
    length: int = 0
    token_ids: list[int] = field(default_factory=list)
    _page_tensor: torch.Tensor | None = field(default=None, repr=False)

    def page_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 [pages] page table on `device` (cached until pages or device change)."""
        t, want = self._page_tensor, torch.device(device)
        same_device = t is not None and t.device.type == want.type and want.index in (None, t.device.index)
        if not same_device or t.numel() != len(self.pages):
            self._page_tensor = torch.tensor(self.pages, dtype=torch.long, device=device)
        return self._page_tensor
