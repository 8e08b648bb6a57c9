"""remnant.kernels.decode.reference: the plain torch decodes every decode kernel is tested
against (the kernels' own tests compare them at size: test_triton, test_sm90, test_flashmla)."""

from __future__ import annotations

import pytest
import torch

from remnant.kernels.decode.reference import check_window_columns, decode_packed_reference
from remnant.kv.codec import quantize
from remnant.kv.layout import KeptColumns, PageLayout
from remnant.kv.packing import pack, unpack
from remnant.kv.paged import quantize_kept_first
from tests.kernels.inputs import latents

CPU = torch.device("cpu")


def test_reference_decode_reads_a_kept_first_window_in_natural_order():
    # The same latents as native and as kept-first window records: the reference decodes
    # of the two differ by FP8 rounding only, and reading the kept-first ones as native
    # records (a wrong window_columns) is far off.
    keep = torch.randperm(448, generator=torch.Generator().manual_seed(10))[:192].sort().values
    cols = KeptColumns.of(keep, CPU)
    gen = torch.Generator().manual_seed(11)
    layout = PageLayout.rows(584)
    win_x = latents(8, gen)
    native, kept_first = (torch.zeros(8, 584, dtype=torch.uint8) for _ in range(2))
    native[:] = quantize(win_x)
    kept_first[:] = quantize_kept_first(win_x, cols)
    c4_layout = PageLayout.rows(192 + 136)
    c4 = torch.zeros(4, 192 + 136, dtype=torch.uint8)
    q = torch.randn(2, 3, 512, generator=gen) * 0.05
    sink = torch.zeros(3)
    win_locs = torch.arange(8).repeat(2, 1)
    c4_locs = torch.full((2, 1), -1)
    want = decode_packed_reference(q, c4, c4_layout, c4_locs, keep, native, layout, win_locs, sink)
    got = decode_packed_reference(q, c4, c4_layout, c4_locs, keep, kept_first, layout, win_locs, sink,
                                  window_columns="kept_first")
    wrong = decode_packed_reference(q, c4, c4_layout, c4_locs, keep, kept_first, layout, win_locs, sink)
    assert (got - want).norm() < 0.05 * want.norm()
    assert (wrong - want).norm() > 0.3 * want.norm()


def test_reference_decode_reads_a_packed_window_as_native_records_with_dropped_codes_zero():
    # A window packed with the C4 records' keep list decodes as the same records unpacked
    # (dropped codes FP8 zero) in a native window, and its dropped output columns are 0.
    gen = torch.Generator().manual_seed(12)
    keep = torch.randperm(448, generator=gen)[:192].sort().values
    packed = pack(quantize(latents(8, gen)), keep)
    c4 = pack(quantize(latents(4, gen)), keep)
    c4_layout = PageLayout.rows(192 + 136)
    q = torch.randn(2, 3, 512, generator=gen) * 0.05
    sink = torch.zeros(3)
    win_locs = torch.tensor([[0, 3, 5, -1, 7], [1, 2, 4, 6, -1]])
    c4_locs = torch.tensor([[0, 2], [1, -1]])
    got = decode_packed_reference(q, c4, c4_layout, c4_locs, keep, packed, c4_layout, win_locs, sink,
                                  window_columns="packed")
    want = decode_packed_reference(q, c4, c4_layout, c4_locs, keep, unpack(packed, keep), PageLayout.rows(584),
                                   win_locs, sink)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12 * float(want.abs().max()))
    dropped = torch.ones(448, dtype=torch.bool)
    dropped[keep] = False
    assert (got[:, :, :448][:, :, dropped] == 0).all()


def test_window_columns_are_checked():
    for form in ("natural", "kept_first", "packed"):
        check_window_columns(form)
    with pytest.raises(ValueError, match="window_columns='kept' is not allowed; allowed: 'natural', 'kept_first', "
                                         "'packed'"):
        check_window_columns("kept")
