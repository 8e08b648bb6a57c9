"""remnant.kernels.moe: the fused routed-expert kernels and the batched torch path against
routed_experts_reference (float64, one token and expert at a time)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import triton
import triton.language as tl

from remnant.kernels.moe import (ALIGN_KERNEL_MAX_EXPERTS, ALIGN_KERNEL_MAX_PAIRS, EXPERT_DTYPES, MoEConfig, align,
                                 align_triton, default_config, dequantize_experts, k_major, max_blocks,
                                 quantize_experts, routed_experts, routed_experts_reference, routed_experts_torch,
                                 routed_experts_triton, torch_block_m)
from tests.kernels.inputs import DEVICE, ON_GPU

HIDDEN, INTER, E, K = 128, 64, 5, 2


def _experts(gen: torch.Generator, e: int, hidden: int, inter: int, dtype: str):
    """(w_gate_up, w_down, gate_up_scale, down_scale) on DEVICE in `dtype`, fresh random."""
    gu = torch.randn(e, hidden, 2 * inter, generator=gen) / hidden**0.5
    dn = torch.randn(e, inter, hidden, generator=gen) / inter**0.5
    if dtype == "float8_e4m3fn":
        (gu, gu_s), (dn, dn_s) = quantize_experts(gu), quantize_experts(dn)
        return gu.to(DEVICE), dn.to(DEVICE), gu_s.to(DEVICE), dn_s.to(DEVICE)
    return gu.to(DEVICE, EXPERT_DTYPES[dtype]), dn.to(DEVICE, EXPERT_DTYPES[dtype]), None, None


def _routing(gen: torch.Generator, t: int, e: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts per token, uniform; weights in (0.1, 1)."""
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    return ids.long().to(DEVICE), (0.1 + 0.9 * torch.rand(t, k, generator=gen)).to(DEVICE)


def _tolerance(dtype: torch.dtype) -> dict:
    # float32: summation order only. bf16: x, h and the output each rounded to 8 bits.
    return dict(rtol=0, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def _check(x, ids, weights, experts, impl: str = "triton", config: MoEConfig | None = None, adds=()) -> None:
    """impl's output against the reference (plus `adds`), with the triton buffers poisoned
    (NaN)."""
    ref = routed_experts_reference(x, ids, weights, *experts) + sum(a.double() for a in adds)
    if impl == "triton":
        n = ids.numel()
        h = torch.full((n, experts[1].shape[1]), float("nan"), dtype=x.dtype, device=x.device)
        pairs = torch.full(((config.down_split_k if config else 1) * n, x.shape[1]), float("nan"), device=x.device)
        got = routed_experts_triton(x, ids, weights, *experts, check_ids=True, h=h, pairs=pairs, config=config,
                                    adds=adds)
    else:
        got = routed_experts_torch(x, ids, weights, *experts, adds=adds)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.isfinite(got).all(), "an unwritten (poisoned) element reached the output"
    scale = ref.abs().max().clamp_min(1.0)
    torch.testing.assert_close(got.double() / scale, ref / scale, **_tolerance(x.dtype))


@triton.jit
def _widen(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n, other=0.0).to(tl.float32), mask=offs < n)


def test_fp8_codes_widen_exactly_in_triton():
    """The kernels widen FP8 codes in Triton; every finite code must give torch's value
    (checked because Triton's interpreter casts float32 -> FP8 wrongly: triton issue 8322;
    its FP8 -> float32 differs only on the two NaN codes, which quantize_experts never makes)."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = (codes & 0x7F) != 0x7F
    f8 = codes[finite].view(torch.float8_e4m3fn).to(DEVICE)
    out = torch.empty(f8.shape, device=DEVICE)
    _widen[(1,)](f8, out, f8.numel(), BLOCK=256)
    assert torch.equal(out, f8.float())


def test_quantize_experts_per_output_column():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3, 40, 24, generator=gen) * torch.exp(torch.randn(3, 1, 24, generator=gen))
    codes, scale = quantize_experts(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (3, 24) and scale.dtype == torch.float32
    assert torch.equal(codes.float().abs().amax(1), torch.full((3, 24), 448.0))  # each column's amax is 448
    back = dequantize_experts(codes, scale, torch.float32)
    assert ((back - w).abs() <= w.abs().amax(1, keepdim=True) / 16).all()  # e4m3: 3 mantissa bits
    with pytest.raises(ValueError, match=r"quantize_experts expects float \[E, K, N\] weights, got torch.float32 \(3, 40\)"):
        quantize_experts(w[:, :, 0])


def _expected_blocks(ids: torch.Tensor, e: int, block_m: int) -> list[tuple[int, list[int]]]:
    """(expert, pairs) per non-padding block, built with plain Python."""
    flat = ids.flatten().tolist()
    out = []
    for expert in range(e):
        pairs = [p for p, x in enumerate(flat) if x == expert]
        out += [(expert, pairs[i : i + block_m]) for i in range(0, len(pairs), block_m)]
    return out


@pytest.mark.parametrize("t,e,k,block_m", [(1, 5, 2, 16), (7, 5, 2, 16), (20, 3, 2, 16), (33, 8, 3, 4), (0, 4, 2, 16)])
def test_align_blocks_each_hold_one_experts_pairs(t, e, k, block_m):
    gen = torch.Generator().manual_seed(t)
    ids, _ = _routing(gen, t, e, k)
    al = align(ids, e, block_m)
    n = t * k
    assert al.rows.shape == (max_blocks(n, e, block_m) * block_m,) and al.rows.dtype == torch.int32
    rows, experts = al.rows.view(-1, block_m).cpu(), al.block_expert.cpu()
    want = _expected_blocks(ids.cpu(), e, block_m)
    assert [int(x) for x in experts[: len(want)]] == [x for x, _ in want]
    assert (experts[len(want) :] == -1).all()
    for b, (_, pairs) in enumerate(want):
        assert rows[b].tolist() == pairs + [n] * (block_m - len(pairs))
    assert (rows[len(want) :] == n).all()


@pytest.mark.parametrize("t,e,k,block_m", [(1, 32, 6, 16), (5, 32, 6, 16), (128, 32, 6, 64), (170, 32, 6, 16),
                                             (7, 5, 2, 16), (33, 8, 3, 4), (1, 1, 1, 16),
                                             (4, 256, 8, 16)])
def test_align_kernel_is_align(t, e, k, block_m):
    # The one-launch align of decode batches: the same rows and block experts as `align`,
    # with routes spread over the experts and piled on a few (long blocks, idle experts).
    # Its outputs start poisoned: each of E programs writes its own rows and blocks, so one
    # left unwritten would show.
    gen = torch.Generator().manual_seed(t * e)
    for ids in (_routing(gen, t, e, k)[0], torch.randint(0, min(e, 2), (t, k), generator=gen).to(DEVICE)):
        want = align(ids, e, block_m)
        out = (torch.full_like(want.rows, -7), torch.full_like(want.block_expert, -7))
        got = align_triton(ids, e, block_m, fallback=_no_fallback, out=out)
        assert (got.block_m, got.num_pairs) == (want.block_m, want.num_pairs)
        assert torch.equal(got.rows, want.rows) and torch.equal(got.block_expert, want.block_expert), (t, e, k)


def _no_fallback(*args):
    raise AssertionError(f"align_triton fell back at {args[1:]}")


def test_align_kernel_hands_large_batches_and_expert_counts_to_its_fallback():
    for pairs, experts in ((ALIGN_KERNEL_MAX_PAIRS + 1, 4), (8, ALIGN_KERNEL_MAX_EXPERTS + 1)):
        ids = torch.zeros(pairs, 1, dtype=torch.long, device=DEVICE)
        calls = []
        got = align_triton(ids, experts, 16, fallback=lambda *a: calls.append(a) or align(*a))
        assert len(calls) == 1 and torch.equal(got.rows, align(ids, experts, 16).rows)


def test_align_kernel_refuses_outputs_of_other_sizes():
    ids = torch.zeros(3, 2, dtype=torch.long, device=DEVICE)
    want = align(ids, 4, 16)
    with pytest.raises(ValueError, match="out must be int32"):
        align_triton(ids, 4, 16, out=(want.rows[:-1], want.block_expert))


def test_max_blocks_is_the_worst_case_and_attained():
    # All but one expert with one pair, the rest on one expert: min(n, E) + (n - min(n, E)) // BM.
    for n, e, bm in [(6, 32, 16), (768, 32, 16), (14, 5, 16), (40, 3, 16), (100, 7, 8)]:
        m = min(n, e)
        counts = [1] * (m - 1) + [n - (m - 1)]
        assert sum(-(-c // bm) for c in counts) == max_blocks(n, e, bm) == m + (n - m) // bm
    # And no routing exceeds it (exhaustive over a small case: 3 tokens x k=2 of E=4, BM=2).
    for combo in itertools.product(list(itertools.combinations(range(4), 2)), repeat=3):
        counts = [sum(x == ex for pair in combo for x in pair) for ex in range(4)]
        assert sum(-(-c // 2) for c in counts) <= max_blocks(6, 4, 2)


@pytest.mark.parametrize("expert_dtype", list(EXPERT_DTYPES))
@pytest.mark.parametrize("t,x_dtype", [(1, torch.float32), (3, torch.bfloat16), (7, torch.float32),
                                       (7, torch.bfloat16)])
def test_kernel_matches_reference(t, x_dtype, expert_dtype):
    gen = torch.Generator().manual_seed(100 * t + len(expert_dtype))
    experts = _experts(gen, E, HIDDEN, INTER, expert_dtype)
    x = torch.randn(t, HIDDEN, generator=gen).to(DEVICE, x_dtype)
    ids, weights = _routing(gen, t, E, K)
    _check(x, ids, weights, experts)


@pytest.mark.parametrize("splits", [(2, 1), (1, 2), (4, 2)])
@pytest.mark.parametrize("t,x_dtype", [(1, torch.bfloat16), (9, torch.float32)])
def test_split_sums_match_reference(t, x_dtype, splits):
    # The batch-1 launch: gate/up and down sums split over programs (float32 partial sums
    # added in the next kernel); with 9 tokens blocks hold several real rows.
    gen = torch.Generator().manual_seed(7 * t + splits[0])
    experts = _experts(gen, E, HIDDEN, INTER, "float8_e4m3fn")
    x = torch.randn(t, HIDDEN, generator=gen).to(DEVICE, x_dtype)
    ids, weights = _routing(gen, t, E, K)
    config = MoEConfig(block_m=16, block_n=32, block_k=32, num_warps=1, num_stages=1, split_k=splits[0],
                       down_split_k=splits[1])
    _check(x, ids, weights, experts, config=config)


@pytest.mark.parametrize("splits", [(1, 1), (4, 2)])
@pytest.mark.parametrize("t,x_dtype,expert_dtype", [(1, torch.bfloat16, "float8_e4m3fn"),
                                                    (1, torch.float32, "bfloat16"),
                                                    (4, torch.bfloat16, "float8_e4m3fn"),
                                                    (4, torch.float32, "float32")])
def test_per_pair_gemv_matches_reference(t, x_dtype, expert_dtype, splits):
    # One program per pair, no alignment: with 4 tokens of top-2 over 5 experts, pairs
    # share experts (each reads its expert itself); hidden 128 and I 64 over 32-column
    # tiles leave several tiles a pair.
    gen = torch.Generator().manual_seed(31 * t + splits[0])
    experts = _experts(gen, E, HIDDEN, INTER, expert_dtype)
    x = torch.randn(t, HIDDEN, generator=gen).to(DEVICE, x_dtype)
    ids, weights = _routing(gen, t, E, K)
    config = MoEConfig(per_pair=True, block_m=1, block_n=32, block_k=16, num_warps=1, num_stages=1,
                       split_k=splits[0], down_split_k=splits[1])
    _check(x, ids, weights, experts, config=config)


@pytest.mark.parametrize("per_pair", [False, True])
def test_down_kernel_takes_its_own_tile(per_pair):
    # The down kernel's tile, warps and stages apart from gate/up's: 64 columns and 16
    # summed rows where gate/up's tile is 32 x 32, both sums split in two, so the down
    # kernel's split of I and its read of gate/up's split sums run at a tile gate/up does
    # not use.
    gen = torch.Generator().manual_seed(41 + per_pair)
    experts = _experts(gen, E, HIDDEN, INTER, "float8_e4m3fn")
    x = torch.randn(9, HIDDEN, generator=gen).to(DEVICE, torch.bfloat16)
    ids, weights = _routing(gen, 9, E, K)
    config = MoEConfig(per_pair=per_pair, block_m=1 if per_pair else 16, block_n=32, block_k=32, num_warps=1,
                       num_stages=1, split_k=2, down_split_k=2, down_block_n=64, down_block_k=16, down_num_warps=2,
                       down_num_stages=2)
    assert config.down_launch() == dict(BLOCK_N=64, BLOCK_K=16, num_warps=2, num_stages=2)
    _check(x, ids, weights, experts, config=config)


def _f16_case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    experts = _experts(gen, E, HIDDEN, INTER, "float8_e4m3fn")
    x = torch.randn(9, HIDDEN, generator=gen).to(DEVICE, torch.bfloat16)
    ids, weights = _routing(gen, 9, E, K)
    configs = {f16: MoEConfig(block_m=16, block_n=32, block_k=32, num_warps=1, num_stages=1, f16_operands=f16)
               for f16 in (True, False)}
    return x, ids, weights, experts, configs


@pytest.mark.parametrize("f16", [True, False])
def test_f16_operands_either_way_match_reference(f16):
    # FP8 experts with bf16 x: the aligned kernels' operands in float16 (x and h rounded to
    # it) or in bf16; both within the reference's bound.
    x, ids, weights, experts, configs = _f16_case(47)
    _check(x, ids, weights, experts, config=configs[f16])


def test_f16_operands_give_the_bf16_output_in_float16_range():
    # Values in float16's normal range are exact in it: the same products, the same sums,
    # the same output bit for bit (as measured on an H200 at 8 and 32 tokens).
    x, ids, weights, experts, configs = _f16_case(53)
    out = {f16: routed_experts_triton(x, ids, weights, *experts, config=cfg) for f16, cfg in configs.items()}
    assert torch.equal(out[True], out[False])


def test_f16_operands_overflow_past_65504_and_nothing_else_does():
    # The price of float16 operands (MoEConfig's docstring): an x element of 70000 is inf
    # in float16. bf16 operands, float32 x and bf16 experts keep it finite.
    x, ids, weights, experts, configs = _f16_case(59)
    x[0, 0] = 70000.0
    assert not routed_experts_triton(x, ids, weights, *experts, config=configs[True]).isfinite().all()
    assert routed_experts_triton(x, ids, weights, *experts, config=configs[False]).isfinite().all()
    assert routed_experts_triton(x.float(), ids, weights, *experts, config=configs[True]).isfinite().all()
    gen = torch.Generator().manual_seed(59)
    bf16_experts = _experts(gen, E, HIDDEN, INTER, "bfloat16")
    assert routed_experts_triton(x, ids, weights, *bf16_experts, config=configs[True]).isfinite().all()


@pytest.mark.parametrize("t,x_dtype,block_m,fp8_x,fp8_h", [(9, torch.bfloat16, 16, True, True),
                                                             (7, torch.float32, 16, True, True),
                                                             (20, torch.bfloat16, 32, True, True),
                                                             (20, torch.bfloat16, 32, True, False),
                                                             (9, torch.float32, 16, False, True)])
def test_fp8_activations_match_their_reference(t, x_dtype, block_m, fp8_x, fp8_h):
    # FP8 operands on both sides of either kernel: the kernels against the reference that
    # quantizes x's or h's rows the same way, within the bf16 path's bound; and the FP8
    # sums stay near the unquantized reference, by about the weights' own quantization error.
    gen = torch.Generator().manual_seed(61 + t)
    experts = _experts(gen, E, HIDDEN, INTER, "float8_e4m3fn")
    x = torch.randn(t, HIDDEN, generator=gen).to(DEVICE, x_dtype)
    ids, weights = _routing(gen, t, E, K)
    config = MoEConfig(block_m=block_m, block_n=32, block_k=32, num_warps=1, num_stages=1, fp8_x=fp8_x, fp8_h=fp8_h)
    n = ids.numel()
    h = torch.full((n, INTER), float("nan"), dtype=x.dtype, device=x.device)
    got = routed_experts_triton(x, ids, weights, *experts, config=config, check_ids=True, h=h)
    ref = routed_experts_reference(x, ids, weights, *experts, fp8_x=fp8_x, fp8_h=fp8_h)
    scale = ref.abs().max()
    torch.testing.assert_close(got.double() / scale, ref / scale, **_tolerance(x_dtype))
    plain = routed_experts_reference(x, ids, weights, *experts)
    err = ((ref - plain).norm() / plain.norm()).item()
    assert 1e-3 < err < 0.08  # moved by FP8's rounding of x or h, and not by more
    if fp8_x != fp8_h:  # the reference quantizes only what the config names
        both = routed_experts_reference(x, ids, weights, *experts, fp8_x=True, fp8_h=True)
        assert not torch.equal(ref, both)


@pytest.mark.parametrize("field", ["fp8_x", "fp8_h"])
def test_fp8_activations_take_only_the_aligned_unsplit_fp8_kernels(field):
    gen = torch.Generator().manual_seed(67)
    x = torch.randn(3, HIDDEN, generator=gen).to(DEVICE, torch.bfloat16)
    ids, weights = _routing(gen, 3, E, K)
    fp8, bf16 = _experts(gen, E, HIDDEN, INTER, "float8_e4m3fn"), _experts(gen, E, HIDDEN, INTER, "bfloat16")
    on = {field: True}
    for experts, config in ((fp8, MoEConfig(**on, per_pair=True, block_m=1)),
                            (fp8, MoEConfig(**on, split_k=2, block_k=32)),
                            (bf16, MoEConfig(**on))):
        with pytest.raises(ValueError, match=f"config.{field}=True is not allowed with per_pair="):
            routed_experts_triton(x, ids, weights, *experts, config=config)


@pytest.mark.parametrize("config", [MoEConfig(block_m=16, block_n=32, block_k=32, num_warps=1, num_stages=1),
                                    MoEConfig(per_pair=True, block_m=1, block_n=32, block_k=16, num_warps=1,
                                              num_stages=1, split_k=2, down_split_k=2),
                                    MoEConfig(block_m=16, block_n=32, block_k=32, num_warps=1, num_stages=1,
                                              fp8_x=True, fp8_h=True)])
def test_k_major_experts_give_the_same_output(config):
    # The kernels read weights through their strides: K-contiguous experts (k_major, as
    # vLLM's and SGLang's layout) give the N-contiguous ones' output bit for bit.
    gen = torch.Generator().manual_seed(71)
    gu, dn, gu_s, dn_s = _experts(gen, E, HIDDEN, INTER, "float8_e4m3fn")
    x = torch.randn(9, HIDDEN, generator=gen).to(DEVICE, torch.bfloat16)
    ids, weights = _routing(gen, 9, E, K)
    kgu, kdn = k_major(gu), k_major(dn)
    assert kgu.shape == gu.shape and kgu.stride(1) == 1 and torch.equal(kgu.float(), gu.float())
    want = routed_experts_triton(x, ids, weights, gu, dn, gu_s, dn_s, config=config)
    assert torch.equal(routed_experts_triton(x, ids, weights, kgu, kdn, gu_s, dn_s, config=config), want)
    # Any layout: every stride is the kernels' argument (here N strided by 2).
    spaced = torch.stack([gu, gu], dim=3).flatten(2)[:, :, ::2]
    assert spaced.stride(2) == 2 and torch.equal(spaced.float(), gu.float())
    assert torch.equal(routed_experts_triton(x, ids, weights, spaced, dn, gu_s, dn_s, config=config), want)


def test_default_config_rows_per_block_follow_pairs_per_expert():
    # Blocks sized to the pairs an expert gets on average (16 rows to 8 pairs, 32 to 32, 64
    # to 256, then 128); float16 operands took nothing off the 64-row tiles (H200): they and
    # the 128-row tiles keep x's range.
    configs = {t: default_config(t * 6, 32, True, 4096, 2048) for t in (32, 128, 256, 1365, 1366, 8192)}
    assert {t: c.block_m for t, c in configs.items()} == {32: 16, 128: 32, 256: 64, 1365: 64, 1366: 128, 8192: 128}
    # A prefill chunk's 128-row blocks in 4 stages (H100: 8.4 against 10.3 ms at 8,192 tokens).
    assert configs[8192].num_stages == 4 and configs[1365].num_stages == 3
    assert configs[32].f16_operands and configs[128].f16_operands and not configs[256].f16_operands
    # 128-column tiles at 32 rows (H100: gate/up 196 against 267 us with 64), down in 4
    # stages; FP8 activations nowhere (1% of a call for 3.8% of output error).
    assert configs[128].block_n == 128 and configs[128].num_stages == 3
    assert configs[128].down_launch() == dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)
    assert not any(c.fp8_x or c.fp8_h or c.f16_operands for t, c in configs.items() if t >= 256)
    assert not any(c.fp8_x or c.fp8_h for c in configs.values())


def test_down_split_must_divide_by_the_down_tile():
    # down_split_k is checked against the down kernel's own block_k, not gate/up's.
    gen = torch.Generator().manual_seed(43)
    experts = _experts(gen, E, HIDDEN, INTER, "float8_e4m3fn")
    x = torch.randn(2, HIDDEN, generator=gen).to(DEVICE, torch.bfloat16)
    ids, weights = _routing(gen, 2, E, K)
    config = MoEConfig(block_k=16, down_block_k=64, down_split_k=2)
    with pytest.raises(ValueError, match="down_split_k=2 must split 64 into whole tiles of 64"):
        routed_experts_triton(x, ids, weights, *experts, config=config)


_OUT_OF_RANGE = """
import torch
from remnant.kernels.moe import MoEConfig, quantize_experts, routed_experts_reference, routed_experts_triton
g = torch.Generator().manual_seed(0)
(gu, gs), (dn, ds) = quantize_experts(torch.randn(5, 128, 128, generator=g) / 11), quantize_experts(
    torch.randn(5, 64, 128, generator=g) / 8)
x = torch.randn(2, 128, generator=g).bfloat16()
ids, w = torch.tensor([[0, 1], [2, 1_000_000]]), torch.rand(2, 2, generator=g)
config = MoEConfig(per_pair=True, block_m=1, block_n=32, block_k=16, num_warps=1, num_stages=1)
pairs = torch.full((4, 128), float("nan"))
got = routed_experts_triton(x, ids, w, gu, dn, gs, ds, config=config, pairs=pairs).double()
# Token 1 keeps its real pair (expert 2); the other adds nothing.
ref = torch.cat([routed_experts_reference(x[:1], ids[:1], w[:1], gu, dn, gs, ds),
                 routed_experts_reference(x[1:], ids[1:, :1], w[1:, :1], gu, dn, gs, ds)])
print(float((got - ref).abs().max() / ref.abs().max()))
"""


def test_per_pair_reads_nothing_for_an_expert_id_out_of_range():
    # A garbage row (a NaN hidden state, a padded graph row) must not take the server down:
    # the per-pair kernels index expert weights by the id, where the aligned kernels only
    # compare it. Without the range check the interpreter segfaults (so: a subprocess).
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}  # CPU tensors, whatever GPU the machine has
    p = subprocess.run([sys.executable, "-c", _OUT_OF_RANGE], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, f"rc={p.returncode}: {p.stderr[-2000:]}"
    assert float(p.stdout.strip().splitlines()[-1]) < 2e-2  # NaN: an unwritten pair row was summed


@pytest.mark.parametrize("t,hidden,inter,e", [(1, HIDDEN, INTER, E), (1, 512, 256, E), (1, 384, 128, E),
                                              (2, 192, 128, E), (3, 512, 256, E)])
def test_gpu_defaults_fit_any_expert_shape(t, hidden, inter, e):
    # Up to a pair per expert, the per-pair GEMV, whose splits cut hidden and I into whole
    # 64-row tiles, fewer where they do not divide (hidden 128 and 384: 2, 192: none; I 64:
    # none); 6 pairs over 5 experts take the aligned kernels. Run here under the interpreter.
    config = default_config(t * K, e, True, hidden, inter)
    assert config.per_pair == (t * K <= e)
    if config.per_pair:
        assert (config.split_k, config.down_split_k) == {(128, 64): (2, 1), (512, 256): (4, 2), (384, 128): (2, 2),
                                                         (192, 128): (1, 2)}[hidden, inter]
    gen = torch.Generator().manual_seed(hidden)
    experts = _experts(gen, e, hidden, inter, "float8_e4m3fn")
    x = torch.randn(t, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    ids, weights = _routing(gen, t, e, K)
    _check(x, ids, weights, experts, config=config)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("config", [None, MoEConfig(per_pair=True, block_m=1, block_n=32, block_k=32, num_warps=1,
                                                    num_stages=1, split_k=2, down_split_k=2)])
def test_adds_join_the_sums_before_the_one_rounding(impl, config):
    # The shared expert's output and the residual, added where the pairs are summed. Each
    # addend is a tenth or more of the largest output, so a missing one fails the bound.
    gen = torch.Generator().manual_seed(5)
    experts = _experts(gen, E, HIDDEN, INTER, "float8_e4m3fn")
    x = torch.randn(3, HIDDEN, generator=gen).to(DEVICE, torch.bfloat16)
    ids, weights = _routing(gen, 3, E, K)
    adds = ((10 * torch.randn(3, HIDDEN, generator=gen)).to(DEVICE, torch.bfloat16),
            (30 * torch.randn(3, HIDDEN, generator=gen)).to(DEVICE, torch.bfloat16))
    if impl == "torch" and config is not None:
        pytest.skip("the torch path has no configs")
    _check(x, ids, weights, experts, impl=impl, config=config, adds=adds)
    with pytest.raises(ValueError, match=r"adds\[1\] must be float \(3, 128\)"):
        routed_experts(x, ids, weights, *experts, impl=impl, adds=(adds[0], adds[1][:2]))


def test_splits_must_cut_whole_tiles():
    gen = torch.Generator().manual_seed(0)
    experts = _experts(gen, E, HIDDEN, INTER, "bfloat16")
    x = torch.randn(1, HIDDEN, generator=gen).to(DEVICE, torch.bfloat16)
    ids, weights = _routing(gen, 1, E, K)
    with pytest.raises(ValueError, match="split_k=3 must split 128"):
        routed_experts_triton(x, ids, weights, *experts, config=MoEConfig(block_k=32, split_k=3))


@pytest.mark.parametrize("expert_dtype", list(EXPERT_DTYPES))
def test_kernel_with_idle_experts_and_one_expert_taking_every_token(expert_dtype):
    """Experts 0, 2 and 4 get no token, 3 and 1 get all 20 (two blocks each of 16 rows),
    and sizes off the tiles (hidden 80, I 48) leave partial column tiles. The idle experts'
    weights and scales are NaN: a read of them into any product would reach the output."""
    gen = torch.Generator().manual_seed(7)
    hidden, inter, t = 80, 48, 20
    experts = _experts(gen, E, hidden, inter, expert_dtype)
    idle = torch.tensor([0, 2, 4], device=DEVICE)
    for w in experts:
        if w is not None:
            w.view(torch.uint8)[idle] = 0x7F if w.dtype == torch.float8_e4m3fn else 0xFF  # NaN bytes
    assert all(w[idle].float().isnan().all() for w in experts if w is not None)
    x = torch.randn(t, hidden, generator=gen).to(DEVICE)
    ids = torch.tensor([[3, 1]] * t, device=DEVICE)
    weights = torch.rand(t, K, generator=gen).to(DEVICE)
    ref = routed_experts_reference(x, ids, weights, *experts)
    h = torch.full((t * K, inter), float("nan"), device=DEVICE)
    pairs = torch.full((t * K, hidden), float("nan"), device=DEVICE)
    got = routed_experts_triton(x, ids, weights, *experts, check_ids=True, h=h, pairs=pairs)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(routed_experts_torch(x, ids, weights, *experts).double(), ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("expert_dtype", list(EXPERT_DTYPES))
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_reference(x_dtype, expert_dtype):
    gen = torch.Generator().manual_seed(3)
    experts = _experts(gen, E, HIDDEN, INTER, expert_dtype)
    for t in (1, 7):  # several blocks per expert: test_kernel_with_idle_experts_...
        x = torch.randn(t, HIDDEN, generator=gen).to(DEVICE, x_dtype)
        ids, weights = _routing(gen, t, E, K)
        _check(x, ids, weights, experts, impl="torch")


def test_torch_block_m_bounds_the_gathered_experts():
    assert torch_block_m(6, 32) == 16 and torch_block_m(768, 32) == 32 and torch_block_m(8192, 4) == 2048
    for n, e in [(6, 32), (768, 32), (8192, 4), (100_000, 7)]:
        assert max_blocks(n, e, torch_block_m(n, e)) <= 2 * e


def test_no_tokens():
    gen = torch.Generator().manual_seed(0)
    experts = _experts(gen, E, HIDDEN, INTER, "float32")
    x = torch.zeros(0, HIDDEN, device=DEVICE)
    ids, weights = torch.zeros(0, K, dtype=torch.long, device=DEVICE), torch.zeros(0, K, device=DEVICE)
    for impl in ("triton", "torch"):
        assert routed_experts(x, ids, weights, *experts, impl=impl).shape == (0, HIDDEN)


def test_dispatch_takes_the_kernel_here():
    """On CUDA tensors or under the interpreter (this suite without a GPU), "auto" is the
    kernel; "torch" forces the batched torch path."""
    gen = torch.Generator().manual_seed(5)
    experts = _experts(gen, E, HIDDEN, INTER, "float8_e4m3fn")
    x = torch.randn(3, HIDDEN, generator=gen).to(DEVICE)
    ids, weights = _routing(gen, 3, E, K)
    assert torch.equal(routed_experts(x, ids, weights, *experts), routed_experts_triton(x, ids, weights, *experts))
    assert torch.equal(routed_experts(x, ids, weights, *experts, impl="torch"),
                       routed_experts_torch(x, ids, weights, *experts))


def test_errors_name_the_field_and_what_is_allowed():
    gen = torch.Generator().manual_seed(0)
    gu, dn, gu_s, dn_s = _experts(gen, E, HIDDEN, INTER, "float8_e4m3fn")
    x = torch.randn(2, HIDDEN, device=DEVICE)
    ids, w = torch.tensor([[0, 1], [2, 3]], device=DEVICE), torch.ones(2, 2, device=DEVICE)
    with pytest.raises(ValueError, match="impl='cuda' is not allowed; allowed: 'auto', 'triton', 'torch'"):
        routed_experts(x, ids, w, gu, dn, gu_s, dn_s, impl="cuda")
    with pytest.raises(ValueError, match=r"gate_up_scale must be float32 \(5, 128\) with float8_e4m3fn experts"):
        routed_experts(x, ids, w, gu, dn)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, E=5\), got \[0, 5\]"):
        routed_experts(x, torch.tensor([[0, 1], [2, 5]], device=DEVICE), w, gu, dn, gu_s, dn_s, check_ids=True)
    with pytest.raises(ValueError, match="w_gate_up dtype=float16 is not allowed; allowed: bfloat16, float8_e4m3fn"):
        routed_experts(x, ids, w, gu.half(), dn.half())
    with pytest.raises(ValueError, match=r"w_down must be \[E=5, I=64, hidden=128\], got \(5, 128, 64\)"):
        routed_experts(x, ids, w, gu, dn.transpose(1, 2), gu_s, dn_s)
    with pytest.raises(ValueError, match="topk_ids has k=6 experts per token; allowed: 1..E=5"):
        routed_experts(x, torch.zeros(2, 6, dtype=torch.long, device=DEVICE), torch.ones(2, 6, device=DEVICE),
                       gu, dn, gu_s, dn_s)
    with pytest.raises(ValueError, match=r"x must be \[T, hidden\] of bfloat16, float32, got torch.float16"):
        routed_experts(x.half(), ids, w, gu, dn, gu_s, dn_s)
    with pytest.raises(ValueError, match=r"h must be contiguous float32 \(4, 64\)"):
        routed_experts_triton(x, ids, w, gu, dn, gu_s, dn_s, h=torch.empty(4, 65, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU: the compiled kernels at V4-Flash's expert shape")
@pytest.mark.parametrize("expert_dtype", ["float8_e4m3fn", "bfloat16"])
@pytest.mark.parametrize("t", [1, 32, 128])
def test_kernel_at_v4_flash_size_on_gpu(t, expert_dtype):
    """hidden 4096, I 2048, top-6 of 32 experts, bf16 activations, compiled, against the
    float64 reference; then captured in a CUDA graph and replayed on new tokens and routes."""
    hidden, inter, e, k = 4096, 2048, 32, 6
    gen = torch.Generator().manual_seed(t)
    experts = _experts(gen, e, hidden, inter, expert_dtype)
    x = torch.randn(t, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    ids, weights = _routing(gen, t, e, k)
    ref = routed_experts_reference(x, ids, weights, *experts)
    got = routed_experts(x, ids, weights, *experts, check_ids=True)
    scale = ref.abs().max()
    torch.testing.assert_close(got.double() / scale, ref / scale, rtol=0, atol=1e-2)

    static_x, static_ids, static_w = x.clone(), ids.clone(), weights.clone()
    routed_experts(static_x, static_ids, static_w, *experts)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed_experts(static_x, static_ids, static_w, *experts)
    x2 = torch.randn(t, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    ids2, w2 = _routing(gen, t, e, k)
    ids2[0] = torch.arange(k, device=DEVICE)  # expert 0 hit, whatever the draw
    static_x.copy_(x2), static_ids.copy_(ids2), static_w.copy_(w2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, routed_experts(x2, ids2, w2, *experts))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU: the compiled FP8 MMAs at V4-Flash's expert shape")
@pytest.mark.parametrize("fp8_h", [False, True])
@pytest.mark.parametrize("layout", ["N", "K"])
@pytest.mark.parametrize("t", [8, 32, 128])
def test_fp8_activations_at_v4_flash_size_on_gpu(t, layout, fp8_h):
    """FP8 experts and activations (tl.dot on FP8 codes, compiled; x's rows, and h's with
    fp8_h) in both expert layouts at default_config's tile, against the reference that
    quantizes the same rows."""
    hidden, inter, e, k = 4096, 2048, 32, 6
    gen = torch.Generator().manual_seed(t)
    gu, dn, gu_s, dn_s = _experts(gen, e, hidden, inter, "float8_e4m3fn")
    if layout == "K":
        gu, dn = k_major(gu), k_major(dn)
    x = torch.randn(t, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    ids, weights = _routing(gen, t, e, k)
    config = dataclasses.replace(default_config(t * k, e, True, hidden, inter), fp8_x=True, fp8_h=fp8_h)
    ref = routed_experts_reference(x, ids, weights, gu, dn, gu_s, dn_s, fp8_x=True, fp8_h=fp8_h)
    got = routed_experts_triton(x, ids, weights, gu, dn, gu_s, dn_s, config=config, check_ids=True)
    scale = ref.abs().max()
    torch.testing.assert_close(got.double() / scale, ref / scale, rtol=0, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU: the compiled kernels at a prefill chunk's size")
def test_prefill_tile_at_v4_flash_size_on_gpu():
    """2,048 tokens take 128-row blocks: a sample of rows against the float64 reference
    (one token at a time, too slow for all), every row against the 64-row tile's output."""
    hidden, inter, e, k, t = 4096, 2048, 32, 6, 2048
    config = default_config(t * k, e, True, hidden, inter)
    assert config.block_m == 128
    gen = torch.Generator().manual_seed(t)
    experts = _experts(gen, e, hidden, inter, "float8_e4m3fn")
    x = torch.randn(t, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    ids, weights = _routing(gen, t, e, k)
    got = routed_experts_triton(x, ids, weights, *experts, config=config, check_ids=True)
    rows = torch.arange(0, t, 97, device=DEVICE)
    ref = routed_experts_reference(x[rows], ids[rows], weights[rows], *experts)
    scale = ref.abs().max()
    torch.testing.assert_close(got[rows].double() / scale, ref / scale, rtol=0, atol=1e-2)
    rows64 = dataclasses.replace(config, block_m=64, num_stages=3)
    torch.testing.assert_close(got, routed_experts_triton(x, ids, weights, *experts, config=rows64), rtol=0,
                               atol=1e-2 * float(scale))
