"""Pieces shared by the kernels: location checks, record addresses in the split page
layout, and the byte permute (prmt) that store codes and scales are moved with (the
column tables are remnant.kv.layout's KeptColumns)."""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from remnant.kv.layout import PageLayout


def check_locs(locs: torch.Tensor, name: str, capacity: int, check_range: bool,
               allow_padding: bool = False) -> torch.Tensor:
    """Locations as contiguous int32 (Triton index math); -1 = padding where the kernel
    masks it (decode), refused elsewhere (store and reconstruct address every location).

    The range check reads the tensor back to the host (a device sync), so serving paths,
    whose locations come from the allocator, leave it off; tests turn it on.
    """
    if locs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {locs.dtype}")
    if capacity >= 2**31:
        raise ValueError(f"{name}: a pool of {capacity} records needs int64 locations; kernels index with int32")
    if check_range and locs.numel():
        lo, hi = int(locs.min()), int(locs.max())
        lowest = -1 if allow_padding else 0
        if hi >= capacity or lo < lowest:
            padding = " (or -1 for padding)" if allow_padding else ""
            raise ValueError(f"{name} must lie in [0, {capacity}){padding}, got [{lo}, {hi}]")
    return locs.to(torch.int32).contiguous()


def alignment(layout: PageLayout, name: str) -> int:
    """The largest power of two (<= 16) dividing every record's data offset in `layout`.

    The kernels move the 8 tail bytes as one int64 and codes as 4-byte words or wider, so
    a layout must keep records 8-byte aligned (SGLang's and the engine's do).
    """
    if layout.page_stride % 8 or layout.data_bytes % 8 or layout.tail_bytes != 8:
        raise ValueError(f"{name}: the kernels need 8-byte aligned records with an 8-byte tail, got page_stride="
                         f"{layout.page_stride}, data_bytes={layout.data_bytes}, tail_bytes={layout.tail_bytes}")
    return math.gcd(layout.page_stride, layout.data_bytes, 16)


@triton.jit
def record_addresses(base_ptr, loc, PER_PAGE: tl.constexpr, stride, DATA: tl.constexpr, ALIGN: tl.constexpr):
    """Data and tail (scales) byte pointers of records at flat locations `loc` (int32, >= 0).

    ALIGN (from `alignment`) tells the compiler where data parts start, so code and RoPE
    accesses can be vector loads and stores rather than byte ones (benchmarks/kernels/NOTES.md).
    """
    page = loc // PER_PAGE
    slot = loc % PER_PAGE
    page_off = page.to(tl.int64) * stride
    data_off = tl.multiple_of(page_off + slot * DATA, ALIGN)
    tail_off = tl.multiple_of(page_off + PER_PAGE * DATA + slot * 8, 8)
    return base_ptr + data_off, base_ptr + tail_off


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1): kernels then
    take their INTERPRETED paths (no inline assembly, float32 products)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def byte_permute(a, b, selector, INTERPRETED: tl.constexpr):
    """int32: byte k of the result is byte ((selector >> 4k) & 7) of the 8 bytes b:a (a's
    bytes 0-3, then b's), k = 0..3, element by element: PTX's prmt.b32 (one instruction).
    A nibble with bit 3 set gives the sign of that byte, 0x00 or 0xFF, as prmt does (the
    kernels' selectors do not use it). The interpreter has no inline assembly: it shifts
    an int64 instead (the same bytes)."""
    if INTERPRETED:
        pair = (b.to(tl.int64) << 32) | (a.to(tl.int64) & 0xFFFFFFFF)
        out = tl.zeros(pair.shape, dtype=tl.int64)
        for k in tl.static_range(4):
            nibble = ((selector >> (4 * k)) & 0xF).to(tl.int64)
            byte = (pair >> (8 * (nibble & 7))) & 0xFF
            byte = tl.where(nibble >= 8, tl.where(byte >= 0x80, 0xFF, 0), byte)
            out |= byte << (8 * k)
        return out.to(tl.uint32).to(tl.int32, bitcast=True)
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, selector],
                                     dtype=tl.int32, is_pure=True, pack=1)


def launch_in_pairs(kernel) -> None:
    """Makes a compiled Triton kernel (a JIT function's warmup's) launch its axis-0 programs
    as clusters of two CTAs, 2x and 2x + 1, each its own program (the grid's axis 0
    doubles), which the GPU schedules together (sm_90 and later). Triton 3.6 launches a
    kernel's clusters from its packed metadata (num_warps, num_ctas, shared), which says
    num_ctas = 1 for a kernel compiled for one CTA per program; asking for num_ctas at
    compile time instead would split each program's tensors across the cluster.
    Idempotent; later launches of the JIT function with the same specialization reuse this
    kernel object, and so its clusters."""
    if len(kernel.packed_metadata) != 3:
        raise RuntimeError(f"launch_in_pairs knows Triton's packed metadata as (num_warps, num_ctas, shared); this "
                           f"Triton ({triton.__version__}) packs {kernel.packed_metadata}")
    num_warps, num_ctas, shared = kernel.packed_metadata
    if num_ctas == 2:
        return
    if num_ctas != 1:
        raise ValueError(f"launch_in_pairs takes a kernel compiled for one CTA per program, got num_ctas={num_ctas}")
    # The launcher sizes global and profile scratch per program from metadata.num_ctas,
    # which stays 1: a kernel that used scratch would get half of it.
    scratch = {name: getattr(kernel.metadata, name, 0) or 0 for name in ("global_scratch_size", "profile_scratch_size")}
    if any(scratch.values()):
        raise ValueError(f"launch_in_pairs takes a kernel without global or profile scratch, got {scratch}")
    kernel.packed_metadata = (num_warps, 2, shared)


@triton.jit
def cast_nearest(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """x.to(dtype), rounding to nearest even as a GPU does. Triton's interpreter (3.9, on
    this project's CPU) truncates float32 to bf16 (half of all values off by one bf16 step)
    and casts float32 to FP8 e4m3 wrongly near powers of two (126.35 -> 64; triton issue
    8322), while it casts values already on the target's grid exactly; so there the
    rounding is done first, in float32. FP8 saturates at +-448 as the GPU's cast does."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    if INTERPRETED and dtype == tl.float8e4nv:
        x = _e4m3_grid(x.to(tl.float32))
    return x.to(dtype)


@triton.jit
def _e4m3_grid(x):
    """float32 x rounded to FP8 e4m3's nearest value, ties to even, saturated at +-448, on
    the magnitude with x's sign kept (a tiny negative becomes -0, as the GPU's cast gives):
    normal values (from 2^-6) keep 3 mantissa bits, smaller ones round to a multiple of
    2^-9 (e4m3's subnormal step; adding and taking away 1.5 * 2^23 rounds to an integer)."""
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    subnormal = ((a * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)
    r = tl.minimum(tl.where(a < 0.015625, subnormal, normal), 448.0).to(tl.int32, bitcast=True)
    return (r | (x.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)
