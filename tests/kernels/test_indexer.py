"""remnant.kernels.indexer: the indexer's scores over FP8 and MXFP4 keys in their pages
against the float64 reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from remnant.engine.ops import index_top_k
from remnant.kernels.top_k import top_k_reference
from remnant.kv.index_keys import IndexKeyFormat, quantize_index_keys
from remnant.engine.pools import SplitPages
from remnant.kernels.indexer import (SHARED_TILE, ScoresConfig, default_scores_config, index_scores,
                                     index_scores_reference, index_scores_shared, keys_at)
from tests.kernels.inputs import DEVICE, ON_GPU


def _pool(gen: torch.Generator, pages: int, per_page: int, key_format: str = "fp8") -> SplitPages:
    """An indexer pool (the engine's layout) whose every slot holds a fresh quantized key.
    MXFP4 keys get a scale per 32 coordinates over 4 decades, so the kernel must pick each
    coordinate's own exponent."""
    fmt = IndexKeyFormat(key_format)
    pool = SplitPages(pages, per_page, fmt.bytes_per_key, fmt.tail_bytes, device=DEVICE)
    keys = torch.randn(pages * per_page, 128, generator=gen) * torch.exp(torch.randn(pages * per_page, 1, generator=gen))
    if key_format == "mxfp4":
        keys = keys * torch.exp(2 * torch.randn(pages * per_page, 4, 1, generator=gen)).repeat_interleave(32, 1)[..., 0]
    stored = quantize_index_keys(keys) if key_format == "fp8" else fmt.quantize(keys)
    pool.layout.write(pool.buf, torch.arange(pages * per_page, device=DEVICE), stored.to(DEVICE))
    return pool


@pytest.mark.parametrize("key_format", ["fp8", "mxfp4"])
@pytest.mark.parametrize(("heads", "dtype", "n"), [(8, torch.float32, 100), (64, torch.float32, 64),
                                                    (64, torch.bfloat16, 130)])
def test_scores_are_the_reference(heads, dtype, n, key_format):
    gen = torch.Generator().manual_seed(heads + n)
    B, per_page = 3, 16
    pool = _pool(gen, 12, per_page, key_format)
    locs = torch.randint(0, 12 * per_page, (B, n), generator=gen)
    locs[1, ::7] = -1                                    # padding columns
    counts = torch.tensor([n, n // 2, 0])
    q = torch.randn(B, heads, 128, generator=gen).to(DEVICE, dtype)
    w = torch.randn(B, heads, generator=gen).to(DEVICE)
    locs, counts = locs.to(DEVICE), counts.to(DEVICE)
    got = index_scores(q, w, pool.buf, pool.layout, locs, counts, key_format=key_format)
    want = index_scores_reference(q, w, pool.buf, pool.layout, locs, counts, key_format=key_format)
    _same_scores(got, want)
    assert torch.isneginf(got[2]).all() and torch.isneginf(got[1, n // 2:]).all() and torch.isneginf(got[1, ::7]).all()


@pytest.mark.parametrize("key_format", ["fp8", "mxfp4"])
@pytest.mark.parametrize("config", [ScoresConfig(block_n=16, blocks=3), ScoresConfig(block_n=32, blocks=4, num_stages=3),
                                    ScoresConfig(block_n=64, blocks=2, f16_operands=True), ScoresConfig(),
                                    ScoresConfig(block_n=32, blocks=3, keys_on_m=False)], ids=str)
def test_every_launch_config_scores_as_the_reference(config, key_format):
    # Several key blocks a program, the last one ragged (130 keys), rows whose visible keys
    # end inside a block, at a block's edge, at 0 and at n: the keys past a row's count are
    # not read, and still score -inf. float16 operands: bf16 q is exact in float16 here.
    gen = torch.Generator().manual_seed(config.block_n + config.blocks)
    B, n, per_page = 5, 130, 16
    pool = _pool(gen, 12, per_page, key_format)
    locs = torch.randint(0, 12 * per_page, (B, n), generator=gen)
    locs[0, 3::11] = -1
    counts = torch.tensor([n, 37, 0, 2 * config.block_n, 1])
    q = torch.randn(B, 64, 128, generator=gen).to(DEVICE, torch.bfloat16)
    w = torch.randn(B, 64, generator=gen).to(DEVICE)
    locs, counts = locs.to(DEVICE), counts.to(DEVICE)
    # Past each row's count, locations far outside the pool: a read there would fault.
    far = locs.masked_fill(torch.arange(n, device=DEVICE)[None, :] >= counts[:, None], 10**7)
    got = index_scores(q, w, pool.buf, pool.layout, far, counts, key_format=key_format, config=config)
    _same_scores(got, index_scores_reference(q, w, pool.buf, pool.layout, locs, counts, key_format=key_format))


@pytest.mark.parametrize("config", [ScoresConfig(fp8_q=True), ScoresConfig(block_n=32, blocks=3, fp8_q=True),
                                    ScoresConfig(fp8_q=True, keys_on_m=False)], ids=str)
def test_fp8_queries_score_as_their_reference_and_keep_the_top_k(config):
    # FP8 queries (a scale per head) against FP8 keys: the reference of the rounded queries,
    # rows ending inside a block and at 0, padding; heads past H (none here: 64) and a head
    # of zeros get no NaN. Against the bf16 queries' scores: FP8's rounding of q moves a
    # score by ~1-2% and keeps most of the top-k.
    gen = torch.Generator().manual_seed(config.block_n)
    B, n, per_page = 4, 200, 16
    pool = _pool(gen, 16, per_page)
    locs = torch.randint(0, 16 * per_page, (B, n), generator=gen)
    locs[0, 5::13] = -1
    counts = torch.tensor([n, 77, 0, n])
    q = torch.randn(B, 64, 128, generator=gen).to(torch.bfloat16)
    q[3, 7] = 0.0
    w = torch.randn(B, 64, generator=gen)
    q, w, locs, counts = q.to(DEVICE), w.to(DEVICE), locs.to(DEVICE), counts.to(DEVICE)
    got = index_scores(q, w, pool.buf, pool.layout, locs, counts, config=config)
    _same_fp8_query_scores(got, index_scores_reference(q, w, pool.buf, pool.layout, locs, counts, fp8_q=True))
    exact = index_scores_reference(q, w, pool.buf, pool.layout, locs, counts)
    seen = torch.isfinite(exact)
    assert torch.equal(torch.isfinite(got), seen)
    error = (got - exact)[seen].abs().max() / exact[seen].abs().max()
    assert 1e-4 < error < 0.05, error  # rounded (not the bf16 path), and not by much
    for row in (0, 3):
        top = lambda s: set(torch.topk(s[row], 32).indices.tolist())  # noqa: E731
        assert len(top(got) & top(exact)) >= 28


def test_fp8_queries_need_fp8_keys_without_float16_operands():
    gen = torch.Generator().manual_seed(1)
    pool = _pool(gen, 2, 16, "mxfp4")
    q, w = torch.zeros(1, 64, 128, device=DEVICE), torch.zeros(1, 64, device=DEVICE)
    locs, counts = torch.zeros(1, 8, dtype=torch.long, device=DEVICE), torch.ones(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="fp8_q takes FP8 keys without f16_operands, got key_format='mxfp4'"):
        index_scores(q, w, pool.buf, pool.layout, locs, counts, key_format="mxfp4", config=ScoresConfig(fp8_q=True))
    fp8 = _pool(gen, 2, 16)
    with pytest.raises(ValueError, match="f16_operands=True"):
        index_scores(q, w, fp8.buf, fp8.layout, locs, counts, config=ScoresConfig(fp8_q=True, f16_operands=True))


def test_raw_head_weights_with_a_scale_are_the_scaled_weights():
    # The decode step hands the projection's bf16 column slice and 1 / sqrt(heads), as
    # Model.index_queries would scale them in float32 first: the same scores, bit for bit.
    gen = torch.Generator().manual_seed(5)
    pool = _pool(gen, 8, 16, "fp8")
    locs = torch.randint(0, 128, (3, 70), generator=gen).to(DEVICE)
    counts = torch.tensor([70, 30, 5]).to(DEVICE)
    q = torch.randn(3, 8, 128, generator=gen).to(DEVICE, torch.bfloat16)
    projection = torch.randn(3, 40, generator=gen).to(DEVICE, torch.bfloat16)
    raw = projection[:, 16:24]                                # a row-strided view, as Projections.iw
    got = index_scores(q, raw, pool.buf, pool.layout, locs, counts, w_scale=8**-0.5)
    want = index_scores(q, raw.float() * 8**-0.5, pool.buf, pool.layout, locs, counts)
    assert torch.equal(got, want)


@pytest.mark.parametrize("key_format", ["fp8", "mxfp4"])
@pytest.mark.parametrize(("tokens", "block_t", "dtype", "keys_on_m"),
                         [(1, 16, torch.float32, None), (37, 16, torch.float32, None), (20, 4, torch.bfloat16, False),
                          (20, 4, torch.bfloat16, True)])
def test_shared_scores_are_the_reference(tokens, block_t, dtype, keys_on_m, key_format):
    # A prefill's tokens of one sequence against its keys: token t sees the first counts[t].
    gen = torch.Generator().manual_seed(tokens)
    pool = _pool(gen, 10, 16, key_format)
    n = 90
    locs = torch.randperm(160, generator=gen)[:n].to(DEVICE)
    counts = torch.randint(0, n + 1, (tokens,), generator=gen).to(DEVICE)
    q = torch.randn(tokens, 64, 128, generator=gen).to(DEVICE, dtype)
    w = torch.randn(tokens, 64, generator=gen).to(DEVICE)
    got = index_scores_shared(q, w, pool.buf, pool.layout, locs, counts, block_t=block_t, key_format=key_format,
                              keys_on_m=keys_on_m)
    want = index_scores_reference(q, w, pool.buf, pool.layout, locs, counts, key_format=key_format)
    _same_scores(got, want)
    # The same as each token scoring its own copy of the locations, in blocks of as many keys.
    torch.testing.assert_close(got, index_scores(q, w, pool.buf, pool.layout, locs.expand(tokens, n), counts,
                                                 key_format=key_format,
                                                 config=ScoresConfig(**SHARED_TILE[key_format]) if keys_on_m is None
                                                 else ScoresConfig(block_n=SHARED_TILE[key_format]["block_n"],
                                                                   keys_on_m=keys_on_m)))


def test_shared_fp8_queries_score_as_their_reference():
    # A prefill's tokens with FP8 queries: each token's queries rounded per head (a head of
    # zeros included), as the decode form's; -inf past each token's count.
    gen = torch.Generator().manual_seed(11)
    pool = _pool(gen, 10, 16)
    n, tokens = 90, 21
    locs = torch.randperm(160, generator=gen)[:n].to(DEVICE)
    counts = torch.randint(0, n + 1, (tokens,), generator=gen).to(DEVICE)
    q = torch.randn(tokens, 64, 128, generator=gen).to(torch.bfloat16)
    q[4, 9] = 0.0
    q, w = q.to(DEVICE), torch.randn(tokens, 64, generator=gen).to(DEVICE)
    got = index_scores_shared(q, w, pool.buf, pool.layout, locs, counts, block_t=8, fp8_q=True)
    _same_fp8_query_scores(got, index_scores_reference(q, w, pool.buf, pool.layout, locs, counts, fp8_q=True))
    # The decode form's FP8 queries over each token's copy of the locations: the same scores.
    rows = index_scores(q, w, pool.buf, pool.layout, locs.expand(tokens, n), counts,
                        config=ScoresConfig(block_n=128, fp8_q=True))
    torch.testing.assert_close(got, rows)
    with pytest.raises(ValueError, match="fp8_q takes FP8 keys without f16_operands, got key_format='mxfp4'"):
        mx = _pool(gen, 2, 16, "mxfp4")
        index_scores_shared(q, w, mx.buf, mx.layout, torch.arange(20, device=DEVICE), counts.clamp(max=20),
                            key_format="mxfp4", fp8_q=True)


def _same_scores(got: torch.Tensor, want: torch.Tensor) -> None:
    """-inf exactly where the reference has it; elsewhere float32 accumulation of exact
    products (codes are exact in q's dtype): summation order only."""
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    seen = ~torch.isneginf(want)
    assert torch.isfinite(got[seen]).all()
    if seen.any():
        torch.testing.assert_close(got[seen], want[seen], rtol=1e-5, atol=1e-4 * want[seen].abs().max().item())


def _same_fp8_query_scores(got: torch.Tensor, want: torch.Tensor) -> None:
    """_same_scores for FP8 queries. On a GPU, looser: Hopper's FP8 MMAs add their products
    with fewer bits than float32 (DeepGEMM promotes every 128 of K for it; K is 128 here)."""
    if not ON_GPU:
        return _same_scores(got, want)
    seen = ~torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), ~seen)
    torch.testing.assert_close(got[seen], want[seen], rtol=1e-3, atol=1e-3 * want[seen].abs().max().item())


@pytest.mark.parametrize("key_format", ["fp8", "mxfp4"])
def test_scores_read_the_keys_where_the_layout_puts_them(key_format):
    # One key at a time: a score with one head and weight 1 is relu(q . key), the key as
    # keys_at dequantizes it from its page.
    gen = torch.Generator().manual_seed(5)
    pool = _pool(gen, 4, 8, key_format)
    locs = torch.tensor([[0, 7, 8, 31]], device=DEVICE)
    q = torch.randn(1, 1, 128, generator=gen).to(DEVICE)
    got = index_scores(q, torch.ones(1, 1, device=DEVICE), pool.buf, pool.layout, locs, torch.tensor([4], device=DEVICE),
                       key_format=key_format)
    keys = keys_at(pool.buf, pool.layout, locs, key_format)[0]
    torch.testing.assert_close(got[0], torch.relu(keys @ q[0, 0]), rtol=1e-5, atol=1e-5)


def test_mxfp4_scores_take_each_coordinate_from_its_nibble_and_exponent():
    # One coordinate at a time: q = e_c picks coordinate c of each key, so the scores are
    # relu(key[c]) for every c: a swapped nibble or a neighbour's exponent shows here.
    gen = torch.Generator().manual_seed(6)
    pool = _pool(gen, 3, 4, "mxfp4")
    locs = torch.tensor([[1, 6, 11]], device=DEVICE).expand(128, 3).contiguous()
    eye = torch.eye(128, device=DEVICE)
    keys = keys_at(pool.buf, pool.layout, locs[0], "mxfp4")                      # [3, 128]
    for sign in (1.0, -1.0):
        got = index_scores(sign * eye[:, None, :], torch.ones(128, 1, device=DEVICE), pool.buf, pool.layout, locs,
                           torch.full((128,), 3, device=DEVICE), key_format="mxfp4")
        assert torch.equal(got, torch.relu(sign * keys.T))


def test_bad_arguments_name_the_argument():
    pool = SplitPages(2, 4, 132, 4, device=DEVICE)
    q, w = torch.zeros(1, 2, 128, device=DEVICE), torch.zeros(1, 2, device=DEVICE)
    locs, counts = torch.zeros(1, 3, dtype=torch.long, device=DEVICE), torch.ones(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="q must be"):
        index_scores(q[..., :64], w, pool.buf, pool.layout, locs, counts)
    with pytest.raises(ValueError, match="w must be"):
        index_scores(q, w[:, :1], pool.buf, pool.layout, locs, counts)
    with pytest.raises(ValueError, match="counts must be"):
        index_scores(q, w, pool.buf, pool.layout, locs, counts.float())
    with pytest.raises(ValueError, match=r"locs must be int \[n\]"):
        index_scores_shared(q, w, pool.buf, pool.layout, locs, counts)
    native = SplitPages(2, 4, 584, device=DEVICE)
    with pytest.raises(ValueError, match="128 code bytes"):
        index_scores(q, w, native.buf, native.layout, locs, counts)
    # FP8 pages read as MXFP4 and the other way round: the layout does not match the format.
    with pytest.raises(ValueError, match="mxfp4 keys hold 64 code bytes and 4 scale bytes"):
        index_scores(q, w, pool.buf, pool.layout, locs, counts, key_format="mxfp4")
    mx = SplitPages(2, 4, 68, 4, device=DEVICE)
    with pytest.raises(ValueError, match="fp8 keys hold 128 code bytes"):
        index_scores_shared(q, w, mx.buf, mx.layout, locs[0], counts)
    with pytest.raises(ValueError, match="index key format='fp4' is unknown; allowed: fp8, mxfp4"):
        index_scores(q, w, mx.buf, mx.layout, locs, counts, key_format="fp4")


@pytest.mark.skipif(not ON_GPU, reason="compiled on the GPU; the interpreter runs the same function above")
@pytest.mark.gpu
@pytest.mark.parametrize("key_format", ["fp8", "mxfp4"])
def test_scores_at_v4_flash_shapes_on_gpu(key_format):
    gen = torch.Generator().manual_seed(0)
    pool = _pool(gen, 130, 64, key_format)
    B, n = 32, 8192
    locs = torch.randperm(130 * 64, generator=gen)[:n].repeat(B, 1).to(DEVICE)
    counts = torch.randint(1, n + 1, (B,), generator=gen).to(DEVICE)
    q = torch.randn(B, 64, 128, generator=gen).to(DEVICE, torch.bfloat16)
    w = torch.randn(B, 64, generator=gen).to(DEVICE)
    want = index_scores_reference(q, w, pool.buf, pool.layout, locs, counts, key_format=key_format)
    # The default config, the same with keys_on_m flipped (FP8 keys: the former default;
    # MXFP4: keys on M, not the default), and several blocks of 64 keys a program with
    # float16 operands. The top-k below takes the default's scores.
    default = default_scores_config(key_format)
    for config in (dataclasses.replace(default, keys_on_m=not default.keys_on_m),
                   ScoresConfig(block_n=64, blocks=16, num_warps=8, f16_operands=True), default):
        got = index_scores(q, w, pool.buf, pool.layout, locs, counts, key_format=key_format, config=config)
        _same_scores(got, want)
    if key_format == "fp8":  # FP8 queries: the FP8 MMAs against their own reference
        fp8 = index_scores(q, w, pool.buf, pool.layout, locs, counts, config=ScoresConfig(fp8_q=True))
        _same_fp8_query_scores(fp8, index_scores_reference(q, w, pool.buf, pool.layout, locs, counts, fp8_q=True))
    shared = index_scores_shared(q, w, pool.buf, pool.layout, locs[0], counts, key_format=key_format)
    _same_scores(shared, index_scores_reference(q, w, pool.buf, pool.layout, locs[0], counts, key_format=key_format))
    if key_format == "fp8":
        shared = index_scores_shared(q, w, pool.buf, pool.layout, locs[0], counts, fp8_q=True)
        _same_fp8_query_scores(shared, index_scores_reference(q, w, pool.buf, pool.layout, locs[0], counts, fp8_q=True))
    # The selection from them on the GPU: the stable sort's, ties and -inf included.
    for k in (1, 512, n):
        assert torch.equal(index_top_k(got, k)[1], top_k_reference(got, k)[1])
