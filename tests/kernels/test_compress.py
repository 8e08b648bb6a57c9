"""remnant.kernels.compress: the compressors' decode update (two launches and one), against the
plain torch update (remnant.engine.ops.compress_decode, index_key_decode) that the CPU's
decode step runs: the same state rows, latents to their bf16 rounding, the same index-key
pages (FP8 codes exact but where Triton's interpreted cast is off: tests/kernels/inputs.py)."""

from __future__ import annotations

import pytest
import torch

from remnant.engine.capacity import C4_RING, C128_RING
from remnant.engine.ops import compress_decode as compress_decode_plain
from remnant.engine.ops import index_key_decode as index_key_decode_plain
from remnant.kernels.compress import compress_decode, index_key_decode
from remnant.kv.index_keys import BLOCK, index_key_codes
from remnant.kv.layout import PageLayout
from tests.kernels.inputs import DEVICE, triton_fp8_codes

SLOTS = 6
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _batch(ratio: int, rows: int, gen: torch.Generator, slots: int = SLOTS):
    """(state_row, block_rows, block_index) of `rows` tokens in distinct slots, each at a
    random place in its block (its own row among the block's), positions up to 1M tokens
    (RoPE angles of 1e6 rad)."""
    ring = C4_RING if ratio == 4 else C128_RING
    slot = torch.randperm(slots, generator=gen)[:rows]
    pos = torch.randint(0, 2**20, (rows,), generator=gen)
    pos[0] = ratio - 1  # a block completing at the sequence's start
    state_row = slot * ring + pos % ratio
    block_rows = slot[:, None] * ring + torch.arange(ratio)
    return state_row.to(DEVICE), block_rows.to(DEVICE), (pos // ratio).to(DEVICE), ring


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compress_decode_is_the_plain_update(ratio, state_dtype, dtype, rows=5):
    gen = torch.Generator().manual_seed(ratio)
    state_row, block_rows, index, ring = _batch(ratio, rows, gen, max(SLOTS, rows))
    # c and g as the step's projections hand them: column slices of one wider row.
    proj = (torch.randn(rows, 3 * 512, generator=gen) * 2).to(DEVICE, dtype)
    c, g = proj[:, 512:1024], proj[:, 1024:]
    bias = torch.randn(ratio, 512, generator=gen).to(DEVICE, dtype)
    norm = (1 + 0.1 * torch.randn(512, generator=gen)).to(DEVICE, dtype)
    state = (torch.randn(max(SLOTS, rows) * ring, 2, 1024, generator=gen) * 3).to(DEVICE, state_dtype)
    want_state = state.clone()
    args = (block_rows, bias, norm, index, ratio, 1e-6, 160000.0)
    every = torch.ones(rows, dtype=torch.bool, device=DEVICE)  # every token completes its block
    want = compress_decode_plain(c, g, want_state, state_row, *args, complete=every)
    exact = compress_decode(c, g, state.clone(), state_row, *args, out_dtype=torch.float32, complete=every)
    got = compress_decode(c, g, state, state_row, *args, complete=every)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 512)
    assert torch.equal(state, want_state)
    # float32: apart by summation order (an online softmax) and RoPE's cos and sin (of the
    # angle reduced to [-pi, pi] first): 7e-7 measured at magnitudes up to 3.5.
    torch.testing.assert_close(exact, want, rtol=1e-5, atol=1e-5)
    # bf16 out: that value rounded once to nearest, as the record store would round it
    # (equal but where the float32 values straddle a rounding boundary).
    assert ((got.float() - want).abs() <= want.abs() * 2.0**-8 + 1e-5).all()
    assert (got != want.to(torch.bfloat16)).float().mean() < 0.01


@pytest.mark.parametrize("ratio", [4, 128])
def test_only_completing_tokens_read_their_block(ratio, rows=6):
    # The step passes which tokens complete their block: the others get zeros (their
    # record goes to the padding page) without reading it, and write their state row all
    # the same. Their blocks' other rows hold NaN, so a read would show.
    gen = torch.Generator().manual_seed(ratio + rows)
    state_row, block_rows, index, ring = _batch(ratio, rows, gen, max(SLOTS, rows))
    c, g = (torch.randn(2, rows, 512, generator=gen) * 2).to(DEVICE, torch.bfloat16)
    bias = torch.randn(ratio, 512, generator=gen).to(DEVICE, torch.bfloat16)
    norm = (1 + 0.1 * torch.randn(512, generator=gen)).to(DEVICE, torch.bfloat16)
    state = (torch.randn(max(SLOTS, rows) * ring, 2, 512, generator=gen) * 3).to(DEVICE)
    complete = torch.arange(rows, device=DEVICE) % 3 == 0  # the first row's block completes (_batch)
    open_rows = block_rows[~complete]
    state[open_rows[open_rows != state_row[~complete, None]]] = float("nan")
    args = (block_rows, bias, norm, index, ratio, 1e-6, 160000.0)
    want_state = state.clone()
    want = compress_decode_plain(c, g, want_state, state_row, *args, complete=complete)
    every = compress_decode_plain(c, g, state.clone(), state_row, *args, complete=torch.ones_like(complete))
    got = compress_decode(c, g, state, state_row, *args, out_dtype=torch.float32, complete=complete)
    assert torch.equal(state.nan_to_num(7.0), want_state.nan_to_num(7.0))
    assert (want[~complete] == 0).all() and torch.equal(want[complete], every[complete])
    assert (got[~complete] == 0).all() and not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 24, 128])
def test_compress_decode_at_the_engines_batches_on_the_gpu(rows):
    for ratio in (4, 128):
        for state_dtype in (torch.float32, torch.bfloat16):
            test_compress_decode_is_the_plain_update(ratio, state_dtype, torch.bfloat16, rows)
    for ratio in (4, 128):
        test_only_completing_tokens_read_their_block(ratio, rows)


def test_compress_decode_refuses_wrong_shapes_naming_them():
    z = torch.zeros(2, 512, device=DEVICE)
    state = torch.zeros(16, 2, 1024, device=DEVICE)
    rows, block = torch.zeros(2, dtype=torch.long, device=DEVICE), torch.zeros(2, 4, dtype=torch.long, device=DEVICE)
    ok = torch.ones(2, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="c and g must be"):
        compress_decode(z[:, :256], z[:, :256], state, rows, block, z[:4], z[0], rows, 4, 1e-6, 1e4, complete=ok)
    with pytest.raises(ValueError, match="gate_bias"):
        compress_decode(z, z, state, rows, block, z[:3], z[0], rows, 4, 1e-6, 1e4, complete=ok)
    with pytest.raises(ValueError, match="state must be"):
        compress_decode(z, z, state[:, :, :256], rows, block, torch.zeros(4, 512), z[0], rows, 4, 1e-6, 1e4,
                        complete=ok)


def _index_pages(per_page: int, pages: int, d: int) -> tuple[torch.Tensor, PageLayout]:
    """Pages padded past their keys, as the engine's pools pad them (to a multiple of a
    data row)."""
    scale_bytes = 4 * d // BLOCK
    layout = PageLayout(per_page, d + scale_bytes, per_page * (d + scale_bytes) + 3 * d, scale_bytes)
    return torch.full((pages, layout.page_stride), 0xAB, dtype=torch.uint8, device=DEVICE), layout


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [128, 256])
def test_index_key_decode_is_the_plain_update(state_dtype, d, rows=5):
    gen = torch.Generator().manual_seed(d)
    state_row, block_rows, index, ring = _batch(4, rows, gen, max(SLOTS, rows))
    proj = torch.randn(rows, 2 * d, generator=gen).to(DEVICE, torch.bfloat16)
    ik = proj[:, d:]
    state = torch.randn(max(SLOTS, rows) * ring, 2, 2 * d, generator=gen).to(DEVICE, state_dtype)
    pages, layout = _index_pages(16, 16, d)
    locs = torch.randperm(256, generator=gen)[:rows].to(DEVICE, torch.int32)
    want_state, want_pages = state.clone(), pages.clone()
    index_key_decode_plain(ik, want_state, state_row, block_rows, want_pages, layout, locs)
    index_key_decode(ik, state, state_row, block_rows, pages, layout, locs)
    assert torch.equal(state, want_state)
    got, want = layout.read(pages, locs.long()), layout.read(want_pages, locs.long())
    assert torch.equal(got[:, d:], want[:, d:])  # the float32 scales
    differ = got[:, :d] != want[:, :d]
    if differ.any():  # only where the interpreter's FP8 cast differs from torch's
        keys = want_state[block_rows, 0, :d].float().mean(1)
        _, scale = index_key_codes(keys)
        interpreted = triton_fp8_codes((keys.view(rows, -1, BLOCK) / scale[..., None]).view(rows, d))
        assert torch.equal(got[:, :d][differ], interpreted[differ])
    untouched = torch.ones(256, dtype=torch.bool)
    untouched[locs.long().cpu()] = False
    assert (layout.read(pages, torch.arange(256, device=DEVICE)[untouched.to(DEVICE)]) == 0xAB).all()


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 24, 128])
def test_index_key_decode_at_the_engines_batches_on_the_gpu(rows):
    for state_dtype in (torch.float32, torch.bfloat16):
        test_index_key_decode_is_the_plain_update(state_dtype, 128, rows)


def test_index_key_decode_refuses_a_layout_of_another_key_size():
    pages, layout = _index_pages(16, 2, 256)
    z = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="indexer pages must hold 128 code bytes"):
        index_key_decode(torch.zeros(2, 128, device=DEVICE), torch.zeros(16, 2, 256, device=DEVICE), z,
                         torch.zeros(2, 4, dtype=torch.long, device=DEVICE), pages, layout, z)
