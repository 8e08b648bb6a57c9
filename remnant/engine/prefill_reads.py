"""What a prefill's attention reads: the count behind the engine bench's prefill-read rows
(`python -m remnant.cli.engine_bench --prefill-profile`).

A prefill token attends as a decode token does (remnant.engine.prefill_step): to its window,
and on CSA layers to the C4 records the indexer picked for it, on HCA layers to every
visible C128 record. Per layer and chunk, for each of those parts:

- pairs: the (token, record) pairs attended. Native's FlashMLA and kernel mode's packed
  kernels gather this many records (tokens of a chunk that share a record read it again,
  from L2 where it is still there);
- distinct: the records among them, each once. Triton mode rebuilds this many into native
  scratch records before attending (remnant.engine.decode_step._rebuilt, distinct=True),
  for each part whose records are packed: the C4 records always, the window and C128
  records where retention packs them.

Counting reads the sizes back to the host (torch.unique), so the bench counts on a pass of
its own, not on the timed one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: The parts a prefill's attention reads, as the bench's rows name them.
PARTS = ("window", "c4", "c128")


@dataclass
class PrefillReads:
    """Counts summed over every layer and chunk of the prefill steps that ran while this
    was the model's `prefill_reads`."""

    steps: int = 0  # prefill steps counted (the bench's: one chunk each)
    pairs: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))
    distinct: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))

    def count(self, part: str, locs: torch.Tensor) -> None:
        """One layer's reads of `part`: locs int [T, K], the locations its T tokens read
        (-1: none)."""
        if part not in PARTS:
            raise ValueError(f"part {part!r} is not allowed; allowed: {', '.join(PARTS)}")
        read = locs[locs >= 0]
        self.pairs[part] += int(read.numel())
        self.distinct[part] += int(torch.unique(read).numel())

    def as_record(self) -> dict:
        """{part: {"pairs": int, "distinct": int}} for the bench's row."""
        return {part: {"pairs": self.pairs[part], "distinct": self.distinct[part]} for part in PARTS}
