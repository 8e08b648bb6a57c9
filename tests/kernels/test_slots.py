"""remnant.kernels.slots.ratio_slots against its plain reference (remnant.engine.ops), on
decode batches with padding rows, tokens that complete a block and tokens that do not, and
page tables of several pages; both ratios of V4 (C4 and C128) at the pools' page size."""

from __future__ import annotations

import pytest
import torch

from remnant.engine.capacity import C4_RING, C128_RING
from remnant.engine.ops import ratio_slots as ratio_slots_plain
from remnant.kernels.slots import ratio_slots
from tests.kernels.inputs import DEVICE

PAGE = 256
NAMES = ("locs", "visible", "visible_locs", "counts", "state_row", "block_rows", "index", "write_locs", "complete")


def _batch(positions: list[int], pages: int, pad_page: int, seed: int):
    """A decode batch as DecodeBatch holds it: each row's pages are distinct random pages
    (in the order a sequence would have been given them), padded with pad_page; padding
    rows (position 0, slot 0, all pages pad_page) where positions are None."""
    gen = torch.Generator().manual_seed(seed)
    B = len(positions)
    table = torch.full((B, pages), pad_page, dtype=torch.long)
    order = torch.randperm(pad_page, generator=gen)
    pos = torch.zeros(B, dtype=torch.long)
    slot = torch.zeros(B, dtype=torch.long)
    for i, p in enumerate(positions):
        if p is None:
            continue
        used = p // PAGE + 1
        table[i, :used] = order[i * pages: i * pages + used]
        pos[i], slot[i] = p, i + 1
    return pos.to(DEVICE), table.to(DEVICE), slot.to(DEVICE)


@pytest.mark.parametrize("ratio,ring", [(4, C4_RING), (128, C128_RING)])
def test_ratio_slots_are_the_plain_ones(ratio, ring):
    # Positions that end a block (ratio - 1 mod ratio), open one (0 mod ratio), sit on a
    # page boundary, and padding rows between real ones.
    positions = [ratio - 1, None, 2 * PAGE, 3 * PAGE - 1, 0, None, 5 * PAGE + 2 * ratio + 1, 4 * ratio - 1]
    pos, table, slot = _batch(positions, pages=7, pad_page=60, seed=ratio)
    got = ratio_slots(pos, table, slot, PAGE, ratio, ring, 60)
    want = ratio_slots_plain(pos, table, slot, PAGE, ratio, ring, 60)
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), name
    complete = got[NAMES.index("complete")].cpu().tolist()
    assert complete == [p is not None and p % ratio == ratio - 1 for p in positions]


def test_more_record_slots_than_one_tile():
    # 32 pages of C4 records: 2,048 slots a row, two programs a row.
    pos, table, slot = _batch([32 * PAGE - 1, 7 * PAGE + 3], pages=32, pad_page=100, seed=3)
    got = ratio_slots(pos, table, slot, PAGE, 4, C4_RING, 100)
    want = ratio_slots_plain(pos, table, slot, PAGE, 4, C4_RING, 100)
    assert got[0].shape == (2, 32 * PAGE // 4)
    for name, g, w in zip(NAMES, got, want):
        assert torch.equal(g, w), name


def test_ratio_slots_refuse_int32_positions():
    pos, table, slot = _batch([5], pages=1, pad_page=3, seed=0)
    with pytest.raises(ValueError, match="pos must be int64"):
        ratio_slots(pos.to(torch.int32), table, slot, PAGE, 4, C4_RING, 3)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("ratio,ring", [(4, C4_RING), (128, C128_RING)])
def test_ratio_slots_at_the_engines_shapes_on_the_gpu(ratio, ring):
    # A CUDA graph bucket of batch 128 at 32k context: 129 pages a row, a third padding rows.
    gen = torch.Generator().manual_seed(ratio)
    positions = [None if i % 3 == 2 else int(p) for i, p in enumerate(torch.randint(0, 129 * PAGE, (128,),
                                                                                    generator=gen))]
    pos, table, slot = _batch(positions, pages=129, pad_page=128 * 129, seed=ratio)
    got = ratio_slots(pos, table, slot, PAGE, ratio, ring, 128 * 129)
    want = ratio_slots_plain(pos, table, slot, PAGE, ratio, ring, 128 * 129)
    for name, g, w in zip(NAMES, got, want):
        assert torch.equal(g, w), name


def test_ratio_slots_refuse_rows_that_disagree():
    pos, table, slot = _batch([5, 9], pages=1, pad_page=3, seed=0)
    with pytest.raises(ValueError, match="one row per sequence"):
        ratio_slots(pos, table, slot[:1], PAGE, 4, C4_RING, 3)
