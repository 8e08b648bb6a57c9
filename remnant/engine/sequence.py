"""Per-sequence attention state of the embedded engine (v0: contiguous, not yet paged).

For each layer: the last `window_size` K=V latents (as read back from their FP8 records),
the compressor's pending tokens of the current incomplete block, and the compressed
records (native 584-byte C4 or C128 records) with, on CSA layers, their indexer keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from remnant.kv import HEAD_DIM, NATIVE_RECORD_BYTES


@dataclass
class LayerState:
    ratio: int
    window: torch.Tensor  # float32 [<= window_size, 512]
    window_pos: torch.Tensor  # int64 [<= window_size]
    pending_c: torch.Tensor  # float32 [< ratio, 512] compressor content of the open block
    pending_g: torch.Tensor  # float32 [< ratio, 512] compressor gate logits
    pending_ik: torch.Tensor  # float32 [< ratio, index_head_dim] indexer key parts (CSA)
    records: torch.Tensor  # uint8 [n, record_bytes] C4 (584 or R + 72) or C128 (584) records
    index_keys: torch.Tensor  # float32 [n, index_head_dim] (CSA only)

    @classmethod
    def empty(cls, ratio: int, index_head_dim: int, record_bytes: int = NATIVE_RECORD_BYTES) -> "LayerState":
        f = torch.float32
        return cls(
            ratio=ratio,
            window=torch.empty(0, HEAD_DIM, dtype=f),
            window_pos=torch.empty(0, dtype=torch.long),
            pending_c=torch.empty(0, HEAD_DIM, dtype=f),
            pending_g=torch.empty(0, HEAD_DIM, dtype=f),
            pending_ik=torch.empty(0, index_head_dim, dtype=f),
            records=torch.empty(0, record_bytes, dtype=torch.uint8),
            index_keys=torch.empty(0, index_head_dim, dtype=f),
        )


@dataclass
class SequenceState:
    """Everything the model keeps for one sequence; `length` tokens have been processed."""

    layers: list[LayerState]
    length: int = 0
    token_ids: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, compress_ratios: list[int], index_head_dim: int,
              record_bytes: list[int] | None = None) -> "SequenceState":
        """record_bytes: stored bytes per compressed record of each layer (native if None)."""
        widths = record_bytes or [NATIVE_RECORD_BYTES] * len(compress_ratios)
        return cls(layers=[LayerState.empty(r, index_head_dim, w or NATIVE_RECORD_BYTES)
                           for r, w in zip(compress_ratios, widths)])

    def record_bytes(self) -> int:
        """Bytes held in compressed records (C4 + C128) for this sequence."""
        return sum(layer.records.numel() for layer in self.layers)
