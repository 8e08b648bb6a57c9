"""remnant.engine.moe: the MoE block (router, routed experts, shared expert) against its
float64 reference, its seeded weights, routing and byte accounting."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from remnant.engine.moe import EXPERT_DTYPES, MoE, MoEArgs, expected_distinct_experts

SHAPE = dict(hidden_size=96, moe_intermediate_size=48, n_routed_experts=5, num_experts_per_tok=2)


def _moe(seed: int = 0, **overrides) -> MoE:
    kwargs = {**SHAPE, "n_shared_experts": 1, "expert_dtype": "float32", **overrides}
    return MoE(**kwargs, generator=torch.Generator().manual_seed(seed))


def _x(t: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(t, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("impl", ["auto", "torch"])
@pytest.mark.parametrize("expert_dtype", EXPERT_DTYPES)
def test_forward_matches_reference_on_cpu_float32(expert_dtype, impl):
    """"auto" here is the Triton kernel under the interpreter; "torch" the batched path."""
    moe = _moe(expert_dtype=expert_dtype, routed_scaling_factor=1.5).to("cpu", torch.float32)
    for t in (1, 6):
        x = _x(t, seed=t)
        got, ref = moe.forward(x, impl=impl), moe.forward_reference(x)
        assert got.dtype == torch.float32 and ref.dtype == torch.float64 and got.shape == (t, SHAPE["hidden_size"])
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-5)


def test_forward_in_bfloat16_is_close_to_reference():
    moe = _moe(expert_dtype="float8_e4m3fn").to("cpu", torch.bfloat16)
    x = _x(5).to(torch.bfloat16)
    ref = moe.forward_reference(x)
    for impl in ("auto", "torch"):
        got = moe.forward(x, impl=impl)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double() / ref.abs().max(), ref / ref.abs().max(), rtol=0, atol=2e-2)


def test_seeded_weights_are_identical_across_constructions():
    names = ("router", "w_gate_up", "w_down", "shared_gate_up", "shared_down", "gate_up_scale", "down_scale")
    a, b = _moe(3, expert_dtype="float8_e4m3fn"), _moe(3, expert_dtype="float8_e4m3fn")
    assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in names[:5])
    a.to("cpu", torch.bfloat16), b.to("cpu", torch.bfloat16)
    for n in names:
        assert getattr(a, n).dtype == getattr(b, n).dtype
        assert torch.equal(getattr(a, n).view(torch.uint8), getattr(b, n).view(torch.uint8)), n
    assert a.w_gate_up.dtype == torch.float8_e4m3fn and a.gate_up_scale.dtype == torch.float32
    assert a.shared_down.dtype == torch.bfloat16 and a.router.dtype == torch.float32
    assert torch.equal(a.router, a.router.bfloat16().float())  # bf16 values, held widened
    assert not torch.equal(_moe(4).router, _moe(3).router)
    # Init scale 1/sqrt(fan_in): unit-variance rows in, unit-variance columns out.
    big = MoE(hidden_size=512, moe_intermediate_size=256, n_routed_experts=4, num_experts_per_tok=2,
              expert_dtype="float32", generator=torch.Generator().manual_seed(0))
    assert abs(big.w_gate_up.std().item() * 512**0.5 - 1) < 0.01
    assert abs(big.w_down.std().item() * 256**0.5 - 1) < 0.01


def test_to_quantizes_once_and_moves_after():
    moe = _moe(expert_dtype="float8_e4m3fn").to("cpu", torch.float32)
    codes, scale = moe.w_gate_up, moe.gate_up_scale
    moe.to("cpu", torch.bfloat16)
    assert torch.equal(moe.w_gate_up.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(moe.gate_up_scale, scale) and moe.router.dtype == torch.float32 and moe.dtype == torch.bfloat16


@pytest.mark.parametrize("factor", [1.0, 2.5])
def test_routing_takes_the_top_sigmoid_scores_and_weights_sum_to_the_factor(factor):
    moe = _moe(routed_scaling_factor=factor).to("cpu", torch.float32)
    x = _x(9)
    ids, weights = moe.route(x)
    assert ids.shape == weights.shape == (9, 2) and weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.full((9,), factor))
    scores = torch.sigmoid(x @ moe.router)
    assert torch.equal(ids, scores.topk(2, dim=-1).indices)
    torch.testing.assert_close(weights, scores.gather(1, ids) / scores.gather(1, ids).sum(-1, keepdim=True) * factor)


def test_shared_expert_is_added():
    """Shared weights are drawn last, so the same seed gives the same router and experts
    with and without them; the difference of the outputs is the shared SwiGLU."""
    with_shared = _moe(5, n_shared_experts=2).to("cpu", torch.float32)
    without = _moe(5, n_shared_experts=0).to("cpu", torch.float32)
    assert without.shared_gate_up is None and with_shared.shared_gate_up.shape == (96, 2 * 2 * 48)
    assert torch.equal(with_shared.w_down, without.w_down)
    x = _x(4)
    g, u = (x @ with_shared.shared_gate_up).chunk(2, dim=-1)
    shared = (F.silu(g) * u) @ with_shared.shared_down
    torch.testing.assert_close(with_shared.forward(x) - without.forward(x), shared, rtol=0, atol=1e-5)
    torch.testing.assert_close(with_shared.forward_reference(x) - without.forward_reference(x), shared.double(),
                               rtol=0, atol=1e-5)


def test_weight_bytes_hand_computed():
    # hidden 8, I 4, E 4, k 2, one shared expert; bf16 compute, FP8 experts.
    moe = MoE(hidden_size=8, moe_intermediate_size=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
              expert_dtype="float8_e4m3fn", generator=torch.Generator().manual_seed(0)).to("cpu", torch.bfloat16)
    router = 8 * 4 * 4                       # [8, 4] bf16 values held in float32
    shared = (8 * 8 + 4 * 8) * 2             # gate_up [8, 8] + down [4, 8], bf16
    expert = (8 * 8 + 4 * 8) * 1 + (8 + 8) * 4  # FP8 codes + float32 scales per column (2I + hidden)
    assert (router, shared, expert) == (128, 192, 160)
    assert moe.weight_bytes(0) == 320 and moe.weight_bytes(3) == 320 + 3 * 160 == 800
    bf16 = MoE(hidden_size=8, moe_intermediate_size=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=0,
               expert_dtype="bfloat16", generator=torch.Generator().manual_seed(0)).to("cpu", torch.bfloat16)
    assert bf16.weight_bytes(4) == 128 + 4 * 96 * 2
    with pytest.raises(ValueError, match="distinct_experts=5 is not allowed; allowed: 0..n_routed_experts=4"):
        moe.weight_bytes(5)


def test_expected_distinct_experts():
    assert expected_distinct_experts(0, 32, 6) == 0
    assert expected_distinct_experts(1, 32, 6) == pytest.approx(6)
    assert expected_distinct_experts(2, 32, 6) == pytest.approx(32 * (1 - (26 / 32) ** 2)) == pytest.approx(10.875)
    assert expected_distinct_experts(10_000, 32, 6) == pytest.approx(32)
    # Exact by enumeration: 3 tokens each choosing 2 of 4 experts uniformly.
    choices = list(itertools.combinations(range(4), 2))
    sizes = [len(set(itertools.chain(*c))) for c in itertools.product(choices, repeat=3)]
    assert expected_distinct_experts(3, 4, 2) == pytest.approx(sum(sizes) / len(sizes))
    with pytest.raises(ValueError, match="k=7 is not allowed; allowed: 1..experts=6"):
        expected_distinct_experts(1, 6, 7)


def test_errors_name_the_field_and_what_is_allowed():
    with pytest.raises(ValueError, match="expert_dtype='fp4' is not allowed; allowed: 'float8_e4m3fn', 'bfloat16', 'float32'"):
        _moe(expert_dtype="fp4")
    with pytest.raises(ValueError, match="num_experts_per_tok=6 is not allowed; allowed: 1..n_routed_experts=5"):
        _moe(num_experts_per_tok=6)
    with pytest.raises(ValueError, match="n_shared_experts=-1 is not allowed"):
        _moe(n_shared_experts=-1)
    with pytest.raises(ValueError, match="dtype=torch.float16 is not allowed; allowed: torch.bfloat16, torch.float32"):
        _moe().to("cpu", torch.float16)
    with pytest.raises(ValueError, match=r"x must be \[T, hidden_size=96\], got \(2, 95\)"):
        _moe().forward(torch.zeros(2, 95))
    assert MoE.from_args(MoEArgs(**SHAPE, expert_dtype="float32")).args.expert_dtype == "float32"
