"""Shared by the decode-path tests: two window rings hold the same records; one model's
formats given to another."""

from __future__ import annotations

import torch

from remnant.kv.codec import dequantize
from remnant.kv.packing import unpack


def ring_keep(model, li: int) -> torch.Tensor | None:
    """The kept columns layer li's ring records are packed with (None: 584-byte records)."""
    fmt = model.layer_format(li)
    return fmt.keep if fmt.window_form == "packed" else None


def live_ring(pools, li: int) -> torch.Tensor:
    """Layer li's ring slots of the blocks the pools hand out, uint8 [blocks * window, bytes]:
    not the padding block, which a CUDA graph's padded rows write and an eager step does not."""
    return pools.swa[li][: pools.pad_block * pools.swa.layouts[li].per_page]


def assert_same_ring(got: torch.Tensor, want: torch.Tensor, keep: torch.Tensor | None = None) -> None:
    """Rings uint8 [slots, 584] (SwaPool[layer]; packed with `keep`, [slots, R + 72], which are
    compared unpacked) hold records in the same slots, with the same
    values up to one rounding step: a decode step computes its token's latent in a batch of
    other shapes than the reference's (BLAS blocks differ), so a bf16 RoPE value may move
    by one ulp and an FP8 code by one step (2^-3 relative, or 2^-9 of its tile's scale)."""
    assert torch.equal((got != 0).any(1), (want != 0).any(1)), "records in other slots"
    if keep is not None:
        got, want = unpack(got, keep), unpack(want, keep)
    a, b = dequantize(got), dequantize(want)
    scale = torch.maximum(a.abs(), b.abs()).amax(1, keepdim=True)
    assert bool(((a - b).abs() <= 2.0**-3 * torch.maximum(a.abs(), b.abs()) + 2.0**-9 * scale).all())


def copy_formats(model, reference) -> None:
    """`reference`'s formats (CSA and other layers', the same kept columns) on `model`."""
    model.set_c4_formats(reference.c4_formats)
    model.set_other_formats(reference.other_formats)
