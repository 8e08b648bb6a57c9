"""A decode step's positions in one ratio's records and compressor state, in one launch.

The plain function (remnant.engine.ops.ratio_slots, the reference this is tested against
in tests/kernels/test_slots.py) is some thirty torch operations a ratio, each its own
kernel of a microsecond or two inside the step's CUDA graph: about 60 of a V4-Flash step's
first 170 us at batch 1 (H100, 802cbae's kernel log, benchmarks/engine-h100-fused/). Here
one program per row and tile of record slots writes the same tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ratio_slots_kernel(pos_ptr, table_ptr, stride_t, slot_ptr,
                        locs_ptr, visible_ptr, visible_locs_ptr,
                        counts_ptr, state_row_ptr, block_rows_ptr, index_ptr, write_ptr, complete_ptr,
                        N, pad_page,
                        PER: tl.constexpr, RATIO: tl.constexpr, RING: tl.constexpr, BLOCK: tl.constexpr,
                        RATIO_BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    pos = tl.load(pos_ptr + b)
    count = tl.minimum((pos + 1) // RATIO, N)
    j = tile * BLOCK + tl.arange(0, BLOCK)
    inside = j < N
    page = tl.load(table_ptr + b * stride_t + j // PER, mask=inside, other=0)
    loc = page * PER + j % PER
    visible = j < count
    row = b * N + j
    tl.store(locs_ptr + row, loc.to(tl.int32), mask=inside)
    tl.store(visible_ptr + row, visible.to(tl.int1), mask=inside)
    tl.store(visible_locs_ptr + row, tl.where(visible, loc, -1).to(tl.int32), mask=inside)
    if tile == 0:  # the row's own block: one program writes it
        slot = tl.load(slot_ptr + b)
        index = pos // RATIO
        complete = pos % RATIO == RATIO - 1
        own_page = tl.load(table_ptr + b * stride_t + index // PER)
        tl.store(counts_ptr + b, count.to(tl.int32))
        tl.store(state_row_ptr + b, slot * RING + pos % RATIO)
        r = tl.arange(0, RATIO_BLOCK)
        tl.store(block_rows_ptr + b * RATIO + r, slot * RING + r, mask=r < RATIO)
        tl.store(index_ptr + b, index)
        tl.store(write_ptr + b, tl.where(complete, own_page * PER + index % PER, pad_page * PER).to(tl.int32))
        tl.store(complete_ptr + b, complete.to(tl.int1))


def ratio_slots(pos: torch.Tensor, page_table: torch.Tensor, slot: torch.Tensor, page_size: int, ratio: int,
                ring: int, pad_page: int) -> tuple[torch.Tensor, ...]:
    """remnant.engine.ops.ratio_slots in one launch (its docstring says what each output
    is). pos and slot int64 [B], page_table int64 [B, P] with unit column stride, as
    remnant.engine.decode_step.DecodeBatch holds them. Graph-safe (no host sync), so the
    kernel cannot check what the plain function's indexing would refuse: each position
    must be >= 0 (Triton's // and % truncate toward zero) and inside its row's pages
    (pos < P * page_size; its block's page is read unchecked)."""
    for name, t in (("pos", pos), ("page_table", page_table), ("slot", slot)):
        if t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {t.dtype}")
    if not pos.shape[0] == slot.shape[0] == page_table.shape[0]:
        raise ValueError(f"pos, slot and page_table must have one row per sequence, got {pos.shape[0]}, "
                         f"{slot.shape[0]} and {page_table.shape[0]}")
    if page_table.stride(1) != 1 or pos.stride(0) != 1 or slot.stride(0) != 1:
        raise ValueError("pos, slot and page_table's rows must have unit stride")
    B, P = page_table.shape
    per = page_size // ratio
    N = P * per
    dev = pos.device
    i32, i64 = torch.int32, torch.int64
    locs, visible_locs = torch.empty(B, N, dtype=i32, device=dev), torch.empty(B, N, dtype=i32, device=dev)
    visible = torch.empty(B, N, dtype=torch.bool, device=dev)
    counts, write_locs = torch.empty(B, dtype=i32, device=dev), torch.empty(B, dtype=i32, device=dev)
    state_row, index = torch.empty(B, dtype=i64, device=dev), torch.empty(B, dtype=i64, device=dev)
    block_rows = torch.empty(B, ratio, dtype=i64, device=dev)
    complete = torch.empty(B, dtype=torch.bool, device=dev)
    if B:
        block = min(1024, triton.next_power_of_2(max(N, 1)))
        _ratio_slots_kernel[(B, max(1, triton.cdiv(N, block)))](
            pos, page_table, page_table.stride(0), slot, locs, visible, visible_locs,
            counts, state_row, block_rows, index, write_locs, complete, N, pad_page,
            PER=per, RATIO=ratio, RING=ring, BLOCK=block, RATIO_BLOCK=triton.next_power_of_2(ratio), num_warps=4)
    return locs, visible, visible_locs, counts, state_row, block_rows, index, write_locs, complete
