"""store and reconstruct over paged pools, each run where its tensors are: the kernels of
remnant.kernels on CUDA tensors, the plain torch references of remnant.kv.paged elsewhere
(CPU tests, the engine's reference path, SGLang's CPU tests).

The one place that chooses between a copy kernel and its reference: serving code (the
engine, the SGLang plugin) calls these; tests call a kernel and its `*_reference` side by
side. The kernel modules load on first CUDA use only (Triton's interpreter must be chosen
before triton is imported). Decode has its own entry point, remnant.kernels.decode.decode.
"""

from __future__ import annotations

import torch

from remnant.kv.layout import KeptColumns, PageLayout
from remnant.kv.paged import (check_reconstruct_outputs, reconstruct_reference, store_kept_first_reference,
                              store_reference)


def _on_cuda(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda for t in tensors)


def store(x: torch.Tensor, pages: torch.Tensor, layout: PageLayout, locs: torch.Tensor,
          keep: "torch.Tensor | KeptColumns | None" = None) -> None:
    """Quantize latents x float [n, 512] and write them at `locs` [n]: native records (keep
    None) or packed ones of R = N + 64 (keep int64 [N]). remnant.kernels.store.store on
    CUDA, else store_reference."""
    if _on_cuda(x, pages):
        from remnant.kernels.store import store as store_kernel

        return store_kernel(x, pages, layout, locs, keep)
    store_reference(x, pages, layout, locs, keep)


def store_kept_first(x: torch.Tensor, pages: torch.Tensor, layout: PageLayout, locs: torch.Tensor,
                     keep: "torch.Tensor | KeptColumns") -> None:
    """Quantize latents x float [n, 512] into kept-first window records at `locs` [n]
    (remnant.kv.paged.quantize_kept_first). remnant.kernels.store.store_kept_first on CUDA,
    else store_kept_first_reference."""
    if _on_cuda(x, pages):
        from remnant.kernels.store import store_kept_first as store_kernel

        return store_kernel(x, pages, layout, locs, keep)
    store_kept_first_reference(x, pages, layout, locs, keep)


def reconstruct(pages: torch.Tensor, layout: PageLayout, locs: torch.Tensor, keep: "torch.Tensor | KeptColumns",
                out: torch.Tensor | None = None, out_layout: PageLayout | None = None,
                out_locs: torch.Tensor | None = None) -> torch.Tensor:
    """Packed records at `locs` [k] -> native records: uint8 [k, 584], or written into the
    native pages `out` at `out_locs` (see reconstruct_reference).
    remnant.kernels.reconstruct.reconstruct on CUDA, else reconstruct_reference."""
    check_reconstruct_outputs(out, out_layout, out_locs)
    if _on_cuda(pages):
        from remnant.kernels.reconstruct import reconstruct as reconstruct_kernel

        return reconstruct_kernel(pages, layout, locs, keep, out, out_layout, out_locs)
    return reconstruct_reference(pages, layout, locs, keep, out, out_layout, out_locs)
