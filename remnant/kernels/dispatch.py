"""store, reconstruct and decode over paged pools, each run where its tensors are: the
kernels of remnant.kernels on CUDA tensors, the plain torch references of remnant.kv.paged
elsewhere (CPU tests, the engine's reference path, SGLang's CPU tests).

The one place that chooses between a reference and a kernel: serving code (the engine, the
SGLang plugin) calls these; tests call a kernel and its `*_reference` side by side. The
kernel modules load on first CUDA use only (Triton's interpreter must be chosen before
triton is imported; FlashMLA is optional).
"""

from __future__ import annotations

import torch

from remnant.kv.attention import SOFTMAX_SCALE
from remnant.kv.layout import KeptColumns, PageLayout
from remnant.kv.paged import (check_reconstruct_outputs, check_window_columns, decode_native_reference,
                              decode_packed_reference, reconstruct_reference, store_kept_first_reference,
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


def decode_native(q: torch.Tensor, c4: torch.Tensor, c4_layout: PageLayout, c4_locs: torch.Tensor,
                  window: torch.Tensor, window_layout: PageLayout, window_locs: torch.Tensor, sink: torch.Tensor,
                  scale: float = SOFTMAX_SCALE, dtype: torch.dtype = torch.float64,
                  kernel: str = "auto") -> torch.Tensor:
    """Sparse decode over native C4 records (decode_native_reference's arguments); returns
    [B, H, 512], `dtype` from the reference, q's dtype from a kernel.

    kernel (CUDA tensors): "flashmla" (FlashMLA's V4 decode, the stock attention SGLang
    runs), "triton" (remnant.kernels.decode) or "auto": FlashMLA where it runs
    (remnant.kernels.flashmla.choose_native: its package, an SM90/SM100 GPU, 64 or 128
    heads, SGLang's split pages), Triton elsewhere.
    """
    if _on_cuda(q, c4, window):
        from remnant.kernels.flashmla import choose_native

        if choose_native(kernel, q.device, q.shape[1], (c4_layout, window_layout))[0] == "flashmla":
            from remnant.kernels.flashmla import decode as flashmla_decode

            return flashmla_decode(q, c4, c4_layout, c4_locs, window, window_layout, window_locs, sink, scale)
        from remnant.kernels.decode import decode

        return decode(q, c4, c4_layout, c4_locs, window, window_layout, window_locs, sink, None, scale)
    return decode_native_reference(q, c4, c4_layout, c4_locs, window, window_layout, window_locs, sink, scale, dtype)


def decode_packed(q: torch.Tensor, c4: torch.Tensor, c4_layout: PageLayout, c4_locs: torch.Tensor,
                  keep: "torch.Tensor | KeptColumns", window: torch.Tensor, window_layout: PageLayout,
                  window_locs: torch.Tensor, sink: torch.Tensor, scale: float = SOFTMAX_SCALE,
                  dtype: torch.dtype = torch.float64, window_columns: str = "natural") -> torch.Tensor:
    """Sparse decode directly over packed C4 records (the kernel mode;
    decode_packed_reference's arguments). remnant.kernels.decode.decode on CUDA, planned
    there (plan_decode), else decode_packed_reference."""
    check_window_columns(window_columns)
    if _on_cuda(q, c4, window):
        from remnant.kernels.decode import decode

        return decode(q, c4, c4_layout, c4_locs, window, window_layout, window_locs, sink, keep, scale,
                      window_columns=window_columns)
    return decode_packed_reference(q, c4, c4_layout, c4_locs, keep, window, window_layout, window_locs, sink, scale,
                                   dtype, window_columns)
