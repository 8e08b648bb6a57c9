"""The elementwise chains compiled (remnant.engine.step_ops) against the plain functions:
traced whole on the CPU (backend aot_eager: no graph break, one graph for every batch
size), and through TorchInductor on a GPU (marked `gpu`). The ops that are Triton kernels
of their own (norm_rope, the top-k, the routing) run under Triton's interpreter here."""

from __future__ import annotations

import pytest
import torch

from remnant.engine.step_ops import PLAIN_OPS, compiled_ops
from remnant.kv.formats import NOPE_DIM

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _calls(rows: int, device: str, dtype: torch.dtype, seed: int = 0):
    """(name, args) of each op at `rows` tokens, as the model calls them."""
    g = torch.Generator().manual_seed(seed + rows)

    def r(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(device, dt)

    pos = torch.randint(0, 40_000, (rows,), generator=g).to(device)
    scores = torch.relu(torch.randn(rows, 700, generator=g)).to(device)  # relu: many exact ties at 0
    scores[:, -50:] = float("-inf")
    return [
        ("rms_norm", (r(rows, 1024), r(1024), 1e-6)),
        ("rms_norm", (r(rows, 8, 512), torch.ones(512, device=device, dtype=dtype), 1e-6)),
        ("norm_rope", (r(rows, 8, 512), torch.ones(512, device=device, dtype=dtype), 1e-6, pos, 10000.0)),
        ("norm_rope", (r(rows, 512), r(512), 1e-6, pos, 10000.0)),
        ("compress_latents", (r(rows, 4, 512, dt=torch.float32), r(rows, 4, 512, dt=torch.float32), r(4, 512),
                              r(512), pos // 4, 4, 1e-6, 160000.0)),
        ("quantize_index_keys", (r(rows, 128, dt=torch.float32),)),
        ("quantize_index_keys_mxfp4", (r(rows, 128, dt=torch.float32) * 3,)),
        ("index_top_k", (scores, 512)),
        ("moe_route", (r(rows, 256), r(256, 32, dt=torch.float32), 6, 2.5)),  # the router held in float32
        ("moe_align", (torch.randint(0, 32, (rows, 6), generator=g).to(device), 32, 16)),
        ("silu_mul", (r(rows, 2 * 96),)),
    ]


def _plain(name):
    from remnant.engine.moe import route_tokens
    from remnant.kernels.moe import align

    return {"moe_route": route_tokens, "moe_align": align}.get(name) or getattr(PLAIN_OPS, name)


def _assert_same(name, got, want):
    if name == "moe_align":
        assert (got.block_m, got.num_pairs) == (want.block_m, want.num_pairs)
        assert torch.equal(got.rows, want.rows) and torch.equal(got.block_expert, want.block_expert)
    elif name == "moe_route":
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
    elif name == "index_top_k":  # the same choice (remnant.kernels.top_k gives it in another order)
        order = got[1].sort(-1)
        assert torch.equal(order.values, want[1].sort(-1).values)
        assert torch.equal(got[0].gather(-1, order.indices), want[0].gather(-1, want[1].sort(-1).indices))
    elif name in ("quantize_index_keys", "quantize_index_keys_mxfp4"):  # codes: exact
        assert torch.equal(got, want), name
    elif name in ("compress_latents", "norm_rope"):
        # RoPE's angles reach 4e4 rad (positions up to 40,000, as at 160k context), whose
        # float32 ulp is 4e-3: Inductor (compress_latents) forms the inverse frequencies and
        # angles in another order, and one rounding apart in an angle moves cos and sin by up
        # to angle * 2^-23 (8.4e-4 measured on an H100, 2026-12-06; norm_rope through
        # Inductor, bf16 out: 9.8e-3 at one of 524,288 values, a bf16 step of a rotated value
        # near 0.13). norm_rope is now remnant.kernels.rope's, with torch's angles.
        # The NoPE columns match to rounding; a wrong rotation is off by O(1).
        bf16 = got.dtype == torch.bfloat16
        torch.testing.assert_close(got[..., :NOPE_DIM], want[..., :NOPE_DIM], rtol=2e-2 if bf16 else 1e-5,
                                   atol=4e-3 if bf16 else 1e-5)
        bound = 2 * 40_000 * 2.0**-23 * float(want[..., NOPE_DIM:].abs().max()) + (4e-3 if bf16 else 0.0)
        torch.testing.assert_close(got[..., NOPE_DIM:], want[..., NOPE_DIM:], rtol=2e-2 if bf16 else 0, atol=bound)
    else:
        # bf16: the compiled op rounds once where the plain one rounds each intermediate, so
        # a value cancelling towards 0 may differ by one bf16 step of its operands (~1e-3 at
        # magnitude 0.1-1: rope measured 1.1e-3 on an H100, 2026-12-05)
        bf16 = got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=2e-2 if bf16 else 1e-5, atol=4e-3 if bf16 else 1e-5,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_every_op_traces_whole_and_one_graph_serves_every_batch():
    ops = compiled_ops("aot_eager")
    for rows in (2, 3):  # the first two sizes: compile, then mark the token dimension dynamic
        for name, args in _calls(rows, "cpu", torch.float32):
            _assert_same(name, getattr(ops, name)(*args), _plain(name)(*args))
    # Later batch sizes reuse the graphs: a recompile would be an error here.
    with torch._dynamo.config.patch(error_on_recompile=True):
        for rows in (5, 17):
            for name, args in _calls(rows, "cpu", torch.float32):
                _assert_same(name, getattr(ops, name)(*args), _plain(name)(*args))


@needs_gpu
@pytest.mark.gpu
def test_inductor_ops_are_the_plain_ops_on_the_gpu():
    ops = compiled_ops()
    for rows in (1, 2, 24, 128):
        for name, args in _calls(rows, "cuda", torch.bfloat16):
            _assert_same(name, getattr(ops, name)(*args), _plain(name)(*args))


@pytest.mark.slow
@pytest.mark.parametrize("decode_path", ["batched", "kernels"])
def test_compiled_ops_at_their_call_sites_in_prefill_and_decode(decode_path):
    """A routed-MoE model's batched prefill and decode steps with the compiled ops (traced
    on the CPU: what the call sites pass, views and strides included, must trace whole)
    give the plain ops' logits; with attention in torch, and through remnant.kernels as on
    a GPU (the indexer kernel on the raw head weights, its choice as int32 locations)."""
    import dataclasses

    from remnant.config import ModelConfig
    from remnant.engine.model import Model, ModelArgs
    from remnant.engine.pools import new_sequence, scratch_pools

    args = dataclasses.replace(ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig())), intermediate_size=0,
                               n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                               n_shared_experts=1, expert_dtype="float32")
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (300, 37)]
    logits = {}
    for name, ops in (("plain", PLAIN_OPS), ("compiled", compiled_ops("aot_eager"))):
        model = Model(args, decode_path=decode_path)
        model.ops = ops
        pools = scratch_pools(model, 320, sequences=2)
        seqs = [new_sequence(pools, 320) for _ in prompts]
        rows = []
        with torch.inference_mode():
            rows.append(model.forward(seqs, prompts, pools))
            for _ in range(5):  # the same tokens for both: teacher forcing by the prompts' heads
                rows.append(model.forward(seqs, [[p[len(rows)]] for p in prompts], pools))
        logits[name] = torch.cat(rows)
    # index_top_k's order differs (remnant.kernels.top_k), so attention sums in another
    # order, and route_triton's logits sum in another order than the CPU matmul's, so the
    # routing weights differ in their last bits. That alone moves these logits (up to 3.3)
    # by 2.3e-4: weights times (1 + 2^-23) in the plain ops did as much (2026-12-06, this
    # test's model), through FP8 codes of cached records that round the other way. A wrong
    # expert or a dropped record moves them by O(0.1). Through remnant.kernels the decode
    # kernel also sums the chosen records in the top-k's order, not the sorted one: 8.3e-4
    # measured (21 of 3,096 logits above 5e-4; this CPU, 2026-12-06). The Triton RMS norm
    # sums its squares in another order than torch: on an AVX2 machine (AMD EPYC,
    # 2026-12-06) that flipped one FP8 code of the record completed at position 303, and
    # the one row reading it (step 5 of the long prompt) moved by 0.021, every other row by
    # under 8e-4. One row is allowed that much; a wrong expert or a dropped record moves
    # every row after it.
    bound = 5e-4 if decode_path == "batched" else 2e-3
    rows = (logits["compiled"] - logits["plain"]).abs().amax(1).sort().values
    assert rows[-1] < 0.05 and rows[-2] < bound, rows.tolist()
