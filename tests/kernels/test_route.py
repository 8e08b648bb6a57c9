"""remnant.kernels.route against remnant.engine.moe.route_tokens (the torch ops it fuses)."""

from __future__ import annotations

import pytest
import torch

from remnant.engine.moe import route_tokens
from remnant.kernels.route import route_triton
from tests.kernels.inputs import DEVICE


def _inputs(t: int, hidden: int, e: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).to(DEVICE, dtype)
    router = (torch.randn(hidden, e, generator=g) / hidden**0.5).to(DEVICE)
    return x, router


@pytest.mark.parametrize("t,hidden,e,k", [(1, 256, 32, 6), (3, 128, 5, 2), (17, 192, 32, 6), (40, 64, 64, 8),
                                          (2, 256, 256, 8)])
def test_route_is_route_tokens(t, hidden, e, k):
    x, router = _inputs(t, hidden, e, seed=t + e)
    ids, weights = route_triton(x, router, k, 2.5)
    want_ids, want_weights = route_tokens(x, router, k, 2.5)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights)
    torch.testing.assert_close(weights.sum(-1), torch.full((t,), 2.5, device=DEVICE))


def test_saturated_logits_keep_their_order():
    # Logits past ~17 all have sigmoid 1.0 in float32; the experts still come in logit order.
    x, router = _inputs(2, 128, 16, seed=3, dtype=torch.float32)
    router *= 40
    ids, weights = route_triton(x, router, 4, 1.0)
    logits = x @ router
    assert torch.equal(ids, torch.topk(logits, 4).indices)
    assert torch.equal(ids, route_tokens(x, router, 4, 1.0)[0])


def test_equal_logits_take_the_lowest_expert():
    x = torch.ones(1, 64, device=DEVICE)
    router = torch.zeros(64, 8, device=DEVICE)
    router[:, 5] = 1.0
    ids, weights = route_triton(x, router, 3, 3.0)
    assert ids.tolist() == [[5, 0, 1]]
    torch.testing.assert_close(weights.sum(), torch.tensor(3.0, device=DEVICE))


def test_non_finite_rows_still_pick_k_distinct_experts():
    # The per-pair MoE kernels index expert weights by these ids: a NaN row must not yield
    # an id past E (nor a repeated one). Rows of +inf and -inf logits too.
    x, router = _inputs(4, 64, 8, seed=1, dtype=torch.float32)
    x[1] = float("nan")
    x[2, 0] = float("inf")
    router[0, :] = torch.linspace(-1, 1, 8)
    ids, weights = route_triton(x, router, 3, 1.0)
    assert ((ids >= 0) & (ids < 8)).all()
    assert all(len(set(row)) == 3 for row in ids.tolist())
    assert torch.equal(ids[[0, 3]], route_tokens(x[[0, 3]], router, 3, 1.0)[0])


def test_shapes_it_cannot_take_go_to_the_fallback_or_name_the_field():
    x, router = _inputs(2, 96, 8, seed=0)  # hidden 96: not whole steps of 64
    with pytest.raises(ValueError, match="hidden a multiple of 64"):
        route_triton(x, router, 2, 1.0)
    assert torch.equal(route_triton(x, router, 2, 1.0, fallback=route_tokens)[0], route_tokens(x, router, 2, 1.0)[0])
    x, router = _inputs(2, 64, 8, seed=0)
    with pytest.raises(ValueError, match="k=9 experts per token"):
        route_triton(x, router, 9, 1.0)
    ids, weights = route_triton(x[:0], router, 2, 1.0)
    assert ids.shape == (0, 2) and weights.shape == (0, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the compiled kernels")
@pytest.mark.parametrize("t", [1, 32, 128])
def test_route_at_v4_flash_size_on_gpu(t):
    """hidden 4096, top-6 of 32 (V4-Flash's router in the engine's model), compiled, then
    replayed in a CUDA graph on new tokens."""
    x, router = _inputs(t, 4096, 32, seed=t)
    x, router = x.cuda(), router.cuda()
    ids, weights = route_triton(x, router, 6, 2.5)
    want_ids, want_weights = route_tokens(x, router, 6, 2.5)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = route_triton(x, router, 6, 2.5)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], route_tokens(x, router, 6, 2.5)[0])
