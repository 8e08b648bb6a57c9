"""Packed records: sizes, bit-exact pack/unpack (property tests), SGLang's split pages."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from remnant.kv import NATIVE_RECORD_BYTES, RETENTION_VALUES, pack, packed_record_bytes, quantize, unpack
from remnant.kv.formats import page_bytes
from remnant.kv.packing import check_keep, from_pages, to_pages


def test_packed_record_bytes():
    assert {r: packed_record_bytes(r) for r in RETENTION_VALUES} == {r: r + 72 for r in RETENTION_VALUES}
    assert packed_record_bytes(256) == 328 and packed_record_bytes(512) == NATIVE_RECORD_BYTES == 584
    for bad in (0, 63, 100, 576, -64):
        with pytest.raises(ValueError, match=f"retention={bad} is not allowed"):
            packed_record_bytes(bad)


@st.composite
def records_and_keep(draw):
    n = draw(st.integers(0, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    retention = draw(st.sampled_from([*RETENTION_VALUES, 512]))
    g = torch.Generator().manual_seed(seed)
    rec = torch.randint(0, 256, (n, NATIVE_RECORD_BYTES), dtype=torch.uint8, generator=g)
    keep = torch.sort(torch.randperm(448, generator=g)[: retention - 64]).values
    return rec, keep, retention


@settings(max_examples=150, deadline=None)
@given(records_and_keep())
def test_unpack_pack_is_native_with_dropped_codes_zeroed(case):
    rec, keep, retention = case
    packed = pack(rec, keep)
    assert packed.shape == (rec.shape[0], packed_record_bytes(retention))
    assert torch.equal(packed[:, : keep.numel()], rec[:, keep])  # kept codes, in map order
    expected = rec.clone()
    dropped = torch.ones(448, dtype=torch.bool)
    dropped[keep] = False
    expected[:, :448][:, dropped] = 0
    back = unpack(packed, keep)
    assert torch.equal(back, expected)
    assert torch.equal(back[:, 448:], rec[:, 448:])  # RoPE, scales and pad unchanged
    assert torch.equal(pack(back, keep), packed)  # deterministic, idempotent


def test_pack_real_records_keeps_values():
    from remnant.kv import dequantize

    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    rec = quantize(x)
    keep = torch.arange(0, 448, 2)[:192]
    y = dequantize(unpack(pack(rec, keep), keep))
    ref = dequantize(rec)
    assert torch.equal(y[:, keep], ref[:, keep]) and torch.equal(y[:, 448:], ref[:, 448:])
    dropped = torch.ones(448, dtype=torch.bool)
    dropped[keep] = False
    assert (y[:, :448][:, dropped] == 0).all()


@pytest.mark.parametrize(("keep", "message"), [
    (torch.tensor([3, 1] + list(range(4, 66))), "not sorted ascending"),
    (torch.tensor([1, 1] + list(range(3, 65))), "repeats index 1"),
    (torch.arange(385, 449), r"outside \[0, 448\)"),
    (torch.arange(-1, 63), r"outside \[0, 448\)"),
    (torch.arange(10), "has 10 indices; N = R - 64 must be one of"),
    (torch.arange(64, dtype=torch.int32), "must be an int64 tensor"),
    (torch.arange(128).view(2, 64), "must be an int64 tensor"),
])
def test_bad_keep(keep, message):
    with pytest.raises(ValueError, match=message):
        check_keep(keep)
    with pytest.raises(ValueError, match=message):
        pack(torch.zeros(1, 584, dtype=torch.uint8), keep)


@pytest.mark.parametrize(("rec", "message"), [
    (torch.zeros(2, 583, dtype=torch.uint8), r"rec must be uint8 \[n, 584\], got torch.uint8 \(2, 583\)"),
    (torch.zeros(2, 584, dtype=torch.int8), r"rec must be uint8 \[n, 584\]"),
    (torch.zeros(584, dtype=torch.uint8), r"rec must be uint8 \[n, 584\]"),
])
def test_bad_records(rec, message):
    with pytest.raises(ValueError, match=message):
        pack(rec, torch.arange(192))


def test_unpack_checks_width():
    with pytest.raises(ValueError, match=r"packed must be uint8 \[n, 328\]"):
        unpack(torch.zeros(1, 329, dtype=torch.uint8), torch.arange(192))


def test_native_page_bytes_as_sglang():
    # SGLang: ceil(page_size * 584 / 576) * 576 bytes per page of the C4 pool.
    for page_size in (1, 16, 64, 72):
        assert page_bytes(page_size) == -(-page_size * 584 // 576) * 576
    assert page_bytes(64) == 37440  # 64 C4 records (page_size 256 tokens / 4)


@pytest.mark.parametrize("retention", [*RETENTION_VALUES, 512])
@pytest.mark.parametrize("page_size", [1, 5, 64])
def test_split_pages_round_trip(retention, page_size):
    width = packed_record_bytes(retention)
    rec = torch.randint(1, 256, (2 * page_size + 3, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(retention))
    pages = to_pages(rec, page_size)
    data = width - 8
    assert pages.shape == (-(-rec.shape[0] // page_size), page_bytes(page_size, retention))
    assert pages.shape[1] % data == 0  # padded to whole data rows
    # Record j of page 0: its data at j*data, its scales at page_size*data + 8*j.
    j = page_size - 1
    assert torch.equal(pages[0, j * data : (j + 1) * data], rec[j, :data])
    assert torch.equal(pages[0, page_size * data + 8 * j : page_size * data + 8 * j + 8], rec[j, data:])
    assert (pages[:, page_size * width :] == 0).all()
    assert torch.equal(from_pages(pages, page_size, width, rec.shape[0]), rec)


def test_split_page_layout_matches_sglangs_writer():
    """Offsets as SGLang's _set_k_and_s_torch writes them (index_buf_accessor.py)."""
    page_size = 4
    rec = torch.randint(0, 256, (7, 584), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    pages = to_pages(rec, page_size).flatten()
    per_page = page_bytes(page_size)
    for loc in range(7):
        page, slot = divmod(loc, page_size)
        nope = page * per_page + slot * 576
        scale = page * per_page + page_size * 576 + slot * 8
        assert torch.equal(pages[nope : nope + 448], rec[loc, :448])
        assert torch.equal(pages[nope + 448 : nope + 576], rec[loc, 448:576])
        assert torch.equal(pages[scale : scale + 7], rec[loc, 576:583])
