"""Reference decode attention: the three paths agree, as docs/architecture.md's modes require."""

from __future__ import annotations

import math

import pytest
import torch

from remnant.kv import RETENTION_VALUES, dequantize, pack, quantize, unpack
from remnant.kv.attention import attend_native, attend_packed, attend_reconstructed


def _case(heads=64, window=128, records=700, topk=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, 512, generator=g) * 2
    win = quantize(torch.randn(window, 512, generator=g))
    c4 = quantize(torch.randn(records, 512, generator=g) * torch.exp(torch.randn(1, 512, generator=g)))
    idx = torch.randperm(records, generator=g)[:topk]
    sink = torch.randn(heads, generator=g)
    return q, win, c4, idx, sink, g


def _keep(retention, g):
    return torch.sort(torch.randperm(448, generator=g)[: retention - 64]).values


def _naive(q, win, c4, idx, sink):
    """Float64 by the definition: one softmax over [sink, window, selected], V = K."""
    keys = torch.cat([dequantize(win), dequantize(c4[idx[idx >= 0]])]).double()
    out = torch.zeros(q.shape[0], 512, dtype=torch.float64)
    for h in range(q.shape[0]):
        logits = keys @ q[h].double() / math.sqrt(512)
        w = torch.exp(logits - logits.max())
        denom = w.sum() + math.exp(float(sink[h]) - float(logits.max()))
        out[h] = (w[:, None] * keys).sum(0) / denom
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_all_coordinates_kept_equals_native_exactly(dtype):
    q, win, c4, idx, sink, _ = _case()
    keep = torch.arange(448)
    native = attend_native(q, win, c4, idx, sink, dtype=dtype)
    packed = pack(c4, keep)
    assert torch.equal(attend_reconstructed(q, win, packed, keep, idx, sink, dtype=dtype), native)
    assert torch.equal(attend_packed(q, win, packed, keep, idx, sink, dtype=dtype), native)
    assert native.dtype == dtype and native.shape == (64, 512)
    # A window packed with that keep list too.
    packed_win = pack(win, keep)
    assert torch.equal(attend_reconstructed(q, packed_win, packed, keep, idx, sink, dtype=dtype, window_packed=True),
                       native)
    assert torch.equal(attend_packed(q, packed_win, packed, keep, idx, sink, dtype=dtype, window_packed=True), native)


def test_native_equals_the_definition():
    q, win, c4, idx, sink, _ = _case(heads=8, records=300, topk=200, seed=1)
    torch.testing.assert_close(attend_native(q, win, c4, idx, sink), _naive(q, win, c4, idx, sink), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("retention", RETENTION_VALUES)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_triton_math_equals_kernel_math(retention, dtype, tol):
    q, win, c4, idx, sink, g = _case(seed=retention)
    keep = _keep(retention, g)
    packed = pack(c4, keep)
    a = attend_reconstructed(q, win, packed, keep, idx, sink, dtype=dtype)
    b = attend_packed(q, win, packed, keep, idx, sink, dtype=dtype)
    # Float rounding, relative to the output's scale (float32 sums of ~600 terms).
    atol = tol * float(a.abs().max())
    torch.testing.assert_close(b, a, rtol=0, atol=atol)
    # And both are the native definition over records with dropped coordinates zeroed.
    zeroed = unpack(packed, keep)
    torch.testing.assert_close(a.double(), _naive(q, win, zeroed, idx, sink), rtol=0, atol=atol)


@pytest.mark.parametrize("retention", [64, 192, 256, 448])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_a_packed_window_counts_as_c4_records(retention, dtype, tol):
    # Window records packed with the C4 records' keep list: the triton and kernel math agree
    # to float rounding, both are the definition over window and C4 records with their
    # dropped coordinates zeroed, and no dropped output coordinate gets anything.
    q, win, c4, idx, sink, g = _case(heads=16, records=300, topk=200, seed=retention + 9)
    keep = _keep(retention, g)
    packed_win, packed = pack(win, keep), pack(c4, keep)
    a = attend_reconstructed(q, packed_win, packed, keep, idx, sink, dtype=dtype, window_packed=True)
    b = attend_packed(q, packed_win, packed, keep, idx, sink, dtype=dtype, window_packed=True)
    atol = tol * float(a.abs().max())
    torch.testing.assert_close(b, a, rtol=0, atol=atol)
    torch.testing.assert_close(a.double(), _naive(q, unpack(packed_win, keep), unpack(packed, keep), idx, sink), rtol=0,
                               atol=atol)
    dropped = torch.ones(448, dtype=torch.bool)
    dropped[keep] = False
    assert (a[:, :448][:, dropped] == 0).all() and (b[:, :448][:, dropped] == 0).all()


def test_a_packed_window_is_checked_against_the_keep_list():
    q, win, c4, idx, sink, g = _case()
    keep = _keep(256, g)
    for attend in (attend_packed, attend_reconstructed):
        with pytest.raises(ValueError, match=r"window must be uint8 \[W, 328\] packed records, got torch.uint8 "
                                             r"\(128, 584\)"):
            attend(q, win, pack(c4, keep), keep, idx, sink, window_packed=True)
    with pytest.raises(ValueError, match="window_order is for native window records in another column order"):
        attend_packed(q, pack(win, keep), pack(c4, keep), keep, idx, sink, window_order=torch.arange(512),
                      window_packed=True)


def test_dropped_coordinates_of_c4_output_come_from_the_window_only():
    q, win, c4, idx, sink, g = _case(seed=5)
    keep = _keep(256, g)
    empty_window = win[:0]
    out = attend_packed(q, empty_window, pack(c4, keep), keep, idx, sink)
    dropped = torch.ones(448, dtype=torch.bool)
    dropped[keep] = False
    assert (out[:, :448][:, dropped] == 0).all()


def test_padding_and_empty_selection():
    q, win, c4, idx, sink, g = _case(seed=2)
    padded = torch.cat([idx[:100], torch.full((412,), -1)])
    torch.testing.assert_close(attend_native(q, win, c4, padded, sink), attend_native(q, win, c4, idx[:100], sink))
    none = torch.full((512,), -1)
    only_window = attend_native(q, win, c4, none, sink)
    keep = _keep(128, g)
    torch.testing.assert_close(attend_packed(q, win, pack(c4, keep), keep, none, sink), only_window)
    # No keys at all: the sink takes all the mass.
    assert torch.equal(attend_native(q, win[:0], c4, none, sink), torch.zeros(64, 512, dtype=torch.float64))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"q": torch.zeros(64, 511)}, r"q must be float \[heads, 512\]"),
    ({"q": torch.zeros(64, 512, dtype=torch.int32)}, r"q must be float"),
    ({"window": torch.zeros(4, 584)}, r"window must be uint8 \[W, 584\]"),
    ({"sink": torch.zeros(63)}, r"sink must be \[heads\] = \[64\]"),
    ({"indices": torch.tensor([0, 700])}, "indices hold record 700 but the layer has 700 records"),
    ({"indices": torch.zeros(2, 2, dtype=torch.long)}, r"indices must be an int tensor \[k\]"),
])
def test_bad_inputs_name_the_problem(kwargs, message):
    q, win, c4, idx, sink, _ = _case()
    args = {"q": q, "window": win, "c4": c4, "indices": idx, "sink": sink, **kwargs}
    with pytest.raises(ValueError, match=message):
        attend_native(**args)


def test_packed_path_rejects_bad_keep():
    q, win, c4, idx, sink, _ = _case()
    with pytest.raises(ValueError, match="not sorted ascending"):
        attend_packed(q, win, pack(c4, torch.arange(192)), torch.arange(192).flip(0), idx, sink)
