"""remnant.kv.paged: the kept-first code order of native records (to_kept_first, from_kept_first)."""

from __future__ import annotations

import torch

from remnant.kv.paged import KeptColumns, from_kept_first, to_kept_first
from tests.kernels.inputs import prmt


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


def test_word_plan_rebuilds_every_native_code_word_from_two_packed_words():
    # N = 64 with: native word 0 holding only byte 3 (a negative mask), a run across a packed
    # word boundary starting at slot 3 (first % 4 == 3), and the last slot N - 1 in word 111.
    keep = sorted({3, 8, 9, 10, 11, 12, 13, 14} | set(range(100, 155)) | {447})
    assert len(keep) == 64
    gen = torch.Generator().manual_seed(6)
    for kept in (torch.tensor(keep), torch.arange(0, 448, 7)[:64], torch.arange(384, 448), torch.empty(0, dtype=torch.long)):
        cols = KeptColumns.of(kept, torch.device("cpu"))
        codes = torch.randint(1, 256, (cols.n_kept + 128,), dtype=torch.uint8, generator=gen)  # codes, then RoPE
        words = codes.view(torch.int32).tolist()
        native = torch.zeros(448, dtype=torch.uint8)
        native[kept] = codes[: cols.n_kept]
        want = native.view(torch.int32).tolist()
        first, selector, mask = (cols.word_plan[i].tolist() for i in range(3))
        for w in range(112):
            if mask[w] == 0:
                assert want[w] == 0
                continue
            assert first[w] + 1 <= cols.n_kept // 4  # the second word read is at most the RoPE's first
            assert all((selector[w] >> (4 * k)) & 0xF < 8 for k in range(4))  # no sign-replicating nibble
            pair = (words[first[w]] & 0xFFFFFFFF) | ((words[first[w] + 1] & 0xFFFFFFFF) << 32)
            got = prmt(pair, selector[w]) & (mask[w] & 0xFFFFFFFF)
            assert got == want[w] & 0xFFFFFFFF, f"native word {w}"
