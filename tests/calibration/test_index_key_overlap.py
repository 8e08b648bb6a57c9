"""remnant.calibration.fidelity_metrics' indexer measures: top_k_overlap, indexer_scores,
index_key_overlap and the synthetic heavy-tailed indexer inputs."""

from __future__ import annotations

import pytest
import torch

from remnant.calibration.fidelity_metrics import (hadamard, index_key_overlap, indexer_scores,
                                                  synthetic_indexer_inputs, top_k_overlap)
from remnant.engine.pools import SplitPages
from remnant.kernels.indexer import index_scores_reference
from remnant.kv.index_keys import IndexKeyFormat


def test_top_k_overlap_counts_the_shared_selection():
    a = torch.tensor([[9.0, 8, 7, 6, 5, 4, 3, 2], [1, 2, 3, 4, 5, 6, 7, 8]])
    b = torch.tensor([[9.0, 8, 1, 1, 5, 4, 1, 1], [8, 7, 6, 5, 4, 3, 2, 1]])
    # Row 0: top-4 {0, 1, 2, 3} against {0, 1, 4, 5}: half. Row 1: reversed, disjoint.
    assert torch.equal(top_k_overlap(a, b, 4), torch.tensor([0.5, 0.0], dtype=torch.float64))
    assert torch.equal(top_k_overlap(a, a, 3), torch.ones(2, dtype=torch.float64))
    assert torch.equal(top_k_overlap(a, b, 100), torch.ones(2, dtype=torch.float64))     # k clamps to n
    # Only the selection counts, not the values; leading dims are kept.
    assert top_k_overlap(a[0], a[0] * 2 + 1, 5).item() == 1.0
    assert top_k_overlap(a.expand(3, 2, 8), b.expand(3, 2, 8), 4).shape == (3, 2)


def test_top_k_overlap_names_bad_arguments():
    with pytest.raises(ValueError, match=r"scores_a and scores_b must have one shape \[..., n\]"):
        top_k_overlap(torch.zeros(2, 5), torch.zeros(2, 6), 3)
    with pytest.raises(ValueError, match="k=0 must be at least 1"):
        top_k_overlap(torch.zeros(5), torch.zeros(5), 0)


@pytest.mark.parametrize("key_format", ["fp8", "mxfp4"])
def test_indexer_scores_are_the_kernels_reference(key_format):
    # The plain scores over dequantized keys are index_scores_reference's over the same
    # keys in pages (the ground truth the Triton kernel is tested against).
    g = torch.Generator().manual_seed(0)
    fmt = IndexKeyFormat(key_format)
    q, w, keys = synthetic_indexer_inputs(1, tokens=3, keys=40, heads=8)
    pool = SplitPages(3, 16, fmt.bytes_per_key, fmt.tail_bytes)
    locs = torch.randperm(48, generator=g)[:40]
    pool.layout.write(pool.buf, locs, fmt.quantize(keys))
    want = index_scores_reference(q, w, pool.buf, pool.layout, locs, torch.full((3,), 40), key_format=key_format)
    got = indexer_scores(q, w, fmt.dequantize(fmt.quantize(keys)))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.float(), want)


def test_index_key_overlap_reports_each_pair():
    q, w, keys = synthetic_indexer_inputs(2, tokens=5, keys=300, heads=4)
    got = index_key_overlap(q, w, keys, top_k=64, chunk=2)
    assert set(got) == {"mxfp4_vs_fp8", "fp8_vs_exact", "mxfp4_vs_exact", "tokens", "keys", "top_k", "formats"}
    assert (got["tokens"], got["keys"], got["top_k"], got["formats"]) == (5, 300, 64, ["fp8", "mxfp4"])
    for pair in ("mxfp4_vs_fp8", "fp8_vs_exact", "mxfp4_vs_exact"):
        d = got[pair]
        assert 0.0 <= d["min"] <= d["p5"] <= d["p50"] <= 1.0 and d["min"] <= d["mean"] <= 1.0
    # FP8 keeps more of the exact selection than MXFP4 (8 bits a coordinate against 4).
    assert got["fp8_vs_exact"]["mean"] > got["mxfp4_vs_exact"]["mean"] > 0.5
    # The same format on both sides selects the same keys; so does k = n.
    assert index_key_overlap(q, w, keys, 64, ("fp8", "fp8"))["fp8_vs_fp8"]["min"] == 1.0
    assert index_key_overlap(q, w, keys, 1000)["mxfp4_vs_fp8"]["min"] == 1.0
    with pytest.raises(ValueError, match=r"q must be \[T, H, d\], w \[T, H\] and keys \[n, d\]"):
        index_key_overlap(q, w[:, :2], keys)
    with pytest.raises(ValueError, match="index key format='int4' is unknown"):
        index_key_overlap(q, w, keys, 64, ("fp8", "int4"))


def test_synthetic_inputs_are_seeded_and_rotation_keeps_scores():
    q, w, keys = synthetic_indexer_inputs(3, tokens=4, keys=50, heads=2, rotate=False)
    q2, w2, keys2 = synthetic_indexer_inputs(3, tokens=4, keys=50, heads=2, rotate=False)
    assert torch.equal(q, q2) and torch.equal(w, w2) and torch.equal(keys, keys2)
    assert q.shape == (4, 2, 128) and w.shape == (4, 2) and keys.shape == (50, 128) and keys.dtype == torch.float32
    rq, rw, rkeys = synthetic_indexer_inputs(3, tokens=4, keys=50, heads=2, rotate=True)
    torch.testing.assert_close(indexer_scores(rq, rw, rkeys), indexer_scores(q, w, keys), rtol=1e-5, atol=1e-4)
    h = hadamard(128)
    torch.testing.assert_close(h @ h.T, torch.eye(128, dtype=torch.float64))
    assert torch.equal(h.abs(), torch.full((128, 128), 1 / 128**0.5, dtype=torch.float64))
    with pytest.raises(ValueError, match="d=96 must be a power of two"):
        hadamard(96)
