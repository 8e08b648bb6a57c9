"""Fresh random inputs for kernel tests: latents, keep maps, pools, and the device to use.

On a machine with CUDA the kernels compile for the GPU; without it they run under
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), at small sizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from remnant.kv.layout import PageLayout
from remnant.kv.paged import store_kept_first_reference, store_reference

POISON = 0xAB
ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def latents(n: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 [n, 512] with row scales over 6 decades and a few heavy-tailed coordinates."""
    x = torch.randn(n, 512, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen) * 2.0)
    spikes = torch.rand(n, 512, generator=gen) < 0.01
    x = torch.where(spikes, x * 30, x)
    return x.to(torch.bfloat16)


def keep_map(retention: int, gen: torch.Generator) -> torch.Tensor | None:
    if retention == 512:
        return None
    return torch.randperm(448, generator=gen)[: retention - 64].sort().values


def poisoned_pages(layout: PageLayout, pages: int) -> torch.Tensor:
    return torch.full((pages, layout.page_stride), POISON, dtype=torch.uint8, device=DEVICE)


def filled_pool(layout: PageLayout, pages: int, keep, gen: torch.Generator, kept_first: bool = False) -> torch.Tensor:
    """A pool whose every slot holds a real record (written by the reference store): with
    kept_first, a kept-first window record of `keep`'s order (store_kept_first)."""
    pool = poisoned_pages(layout, pages)
    n = layout.capacity(pool)
    x, locs = latents(n, gen).to(DEVICE), torch.arange(n, device=DEVICE)
    if kept_first:
        store_kept_first_reference(x, pool, layout, locs, keep)
    else:
        store_reference(x, pool, layout, locs, keep)
    return pool


@triton.jit
def _cast_fp8(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    v = tl.load(src + offs, mask=ok, other=0.0)
    tl.store(dst + offs, tl.clamp(v, -448.0, 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=ok)


def triton_fp8_codes(values: torch.Tensor) -> torch.Tensor:
    """FP8 codes of float32 values as Triton's own cast makes them here.

    Under the interpreter this is Triton 3.9's cast, which rounds some values near powers
    of two wrongly (triton-lang/triton issue 8322); tests accept a kernel code that differs
    from torch's only where it equals this.
    """
    flat = values.float().contiguous().view(-1)
    out = torch.empty(flat.shape, dtype=torch.uint8, device=flat.device)
    _cast_fp8[(triton.cdiv(flat.numel(), 1024),)](flat, out, flat.numel(), BLOCK=1024)
    return out.view(values.shape)


def prmt(pair: int, selector: int) -> int:
    """PTX prmt.b32 on the 8 bytes `pair`: nibble k picks result byte k; bit 3 of a nibble
    gives that byte's sign (0x00 or 0xFF) instead."""
    out = 0
    for k in range(4):
        nibble = (selector >> (4 * k)) & 0xF
        byte = (pair >> (8 * (nibble & 7))) & 0xFF
        out |= ((0xFF if byte & 0x80 else 0) if nibble & 8 else byte) << (8 * k)
    return out
