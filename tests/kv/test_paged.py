"""remnant.kv.paged: the kept-first code order of native records (to_kept_first, from_kept_first)."""

from __future__ import annotations

import torch

from remnant.kv.paged import KeptColumns, from_kept_first, to_kept_first


def test_kept_first_order_round_trips_and_moves_only_codes():
    gen = torch.Generator().manual_seed(4)
    keep = torch.randperm(448, generator=gen)[:192].sort().values
    cols = KeptColumns.of(keep, torch.device("cpu"))
    records = torch.randint(0, 256, (5, 584), dtype=torch.uint8, generator=gen)
    permuted = to_kept_first(records, cols)
    assert torch.equal(permuted[:, :192], records[:, keep])  # kept codes first, in map order
    dropped = torch.ones(448, dtype=torch.bool)
    dropped[keep] = False
    assert torch.equal(permuted[:, 192:448], records[:, :448][:, dropped])
    assert torch.equal(permuted[:, 448:], records[:, 448:])
    assert torch.equal(from_kept_first(permuted, cols), records)


def test_rewritten_pages_are_a_copy_with_every_record_transformed():
    from remnant.kv.paged import PageLayout, gather, rewritten

    gen = torch.Generator().manual_seed(5)
    keep = torch.randperm(448, generator=gen)[:192].sort().values
    cols = KeptColumns.of(keep, torch.device("cpu"))
    layout = PageLayout.sglang(16)
    pages = torch.randint(0, 256, (3, layout.page_stride), dtype=torch.uint8, generator=gen)
    before = pages.clone()
    out = rewritten(pages, layout, lambda records: to_kept_first(records, cols))
    every = torch.arange(layout.capacity(pages))
    assert torch.equal(gather(out, layout, every), to_kept_first(gather(pages, layout, every), cols))
    assert torch.equal(pages, before)
