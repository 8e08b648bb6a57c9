"""The packed C4 pool against the real sglang 0.5.18, built on CPU at small size."""

import pytest
import torch

from remnant.kv.codec import quantize
from remnant.kv.packing import pack, unpack
from remnant.kv.layout import keep_tensor
from remnant.kv.paged import gather
from tests.sglang.env import needs_sglang, probe

pytestmark = needs_sglang

PAGE = 256  # SGLang's DeepSeek-V4 page (tokens); the C4 pool's page is PAGE // 4 records


def test_sglang_builds_the_packed_c4_pool_with_the_plugin():
    got = probe("pool", REMNANT_MODE="kernel")
    pages = (1024 + 64 + 1) // 64
    assert got["c4_class"] == "PackedC4Pool" and got["c4_page_size"] == 64
    assert got["c4_record_bytes"] == [328] * 3
    assert got["c4_buffers"] == [[pages, 21120]] * 3  # 64 x 328 bytes padded to a multiple of 320
    assert got["c128_class"] == "DeepSeekV4SingleKVPool"  # window and C128 pools unchanged
    assert got["mapping"] == [[0, 0], [0, 1], [4, 0], [128, 0], [4, 1], [128, 1], [4, 2]]
    native = probe("pool", REMNANT_MODE="native")
    assert native["c4_class"] == "DeepSeekV4SingleKVPool" and native["c4_buffers"] == [[pages, 37440]] * 3
    assert native["swa_buffers"] == got["swa_buffers"] and native["c128_buffers"] == got["c128_buffers"]


@pytest.fixture
def pool():
    from remnant.sglang.pool import PackedC4Pool

    keeps = [torch.arange(192), torch.arange(0, 448, 3)[:128]]
    return PackedC4Pool(500, PAGE // 4, torch.float8_e4m3fn, 448, 64, 2, "cpu", False,
                        retentions=[256, 192], keeps=keeps, mode="triton")


def test_pool_answers_the_backends_calls(pool):
    from sglang.kernels.ops.attention.dsv4.index_buf_accessor import NopeFp8RopeBf16Pack

    x = torch.randn(30, 512, generator=torch.Generator().manual_seed(0))
    locs = torch.arange(1, 31)
    rec = quantize(x)
    # Fused path (the compressor): bf16 latents in, packed records out.
    pool.set_key_buffer_fused(0, locs, x.to(torch.bfloat16))
    assert torch.equal(gather(pool.get_key_buffer(0).view(torch.uint8), pool.layouts[0], locs), pack(rec, keep_tensor(pool.keeps[0])))
    # SGLang's quantized pack (set_key_buffer), SGLang's own NopeFp8RopeBf16Pack.
    sg_pack = NopeFp8RopeBf16Pack(k_nope_fp8=rec[:, :448].view(torch.float8_e4m3fn),
                                  k_rope_bf16=rec[:, 448:576].view(torch.bfloat16),
                                  scale_k_nope_ue8m0=rec[:, 576:583])
    pool.set_key_buffer(1, locs, sg_pack)
    assert torch.equal(gather(pool.get_key_buffer(1).view(torch.uint8), pool.layouts[1], locs), pack(rec, keep_tensor(pool.keeps[1])))
    # Byte counts: R + 72 per record, in SGLang's split pages.
    assert [b.shape[1] for b in pool.kv_buffer] == [21120, 16896]  # 64 x (R + 72), padded to R + 64
    assert pool.record_bytes() == 328 + 264 and pool.get_bytes_per_token() == 296
    assert pool.bytes_per_page_padded is None  # per-layer profile: no single page size


def test_staged_native_pages_answer_get_key_buffer_then_go_away(pool):
    from remnant.sglang.buffers import native_layout, num_pages, stage_selected

    x = torch.randn(10, 512, generator=torch.Generator().manual_seed(1))
    pool.set_key_buffer_fused(1, torch.arange(1, 11), x)
    indices = torch.full((2, 64), -1, dtype=torch.int32)
    indices[0, :3] = torch.tensor([1, 5, 10])
    scratch = torch.zeros(num_pages(128, 64), native_layout(64).page_stride, dtype=torch.uint8)
    remapped = stage_selected(pool.kv_buffer[1], pool.layouts[1], pool.keeps[1], indices, scratch, 64)
    with pool.staged(1, scratch):
        buf = pool.get_key_buffer(1)
        # The stock pool's dtype (an FP8 view of the bytes), as SGLang's backend expects.
        assert buf.dtype == pool.dtype and buf.data_ptr() == scratch.data_ptr()
        buf = buf.view(torch.uint8)
        # DeepseekV4AttnBackend.forward's view of the C4 cache (k_cache_total_dim 584).
        view = buf[:, : 64 * pool.kv_cache_total_dim].view(buf.shape[0], 64, 1, pool.kv_cache_total_dim)
        assert view.shape == (buf.shape[0], 64, 1, 584)
        got = gather(buf, native_layout(64), remapped[0, :3].long())
        keep = keep_tensor(pool.keeps[1])
        assert torch.equal(got, unpack(pack(quantize(x), keep), keep)[[0, 4, 9]])
    assert pool.get_key_buffer(1).data_ptr() == pool.kv_buffer[1].data_ptr()


def test_hooks_find_the_pool_by_its_buffer(pool):
    from remnant.sglang.pool import pool_of

    assert pool_of(pool.kv_buffer[1].view(torch.uint8)) == (pool, 1)
    assert pool_of(torch.zeros(3, dtype=torch.uint8)) is None


def test_pool_refuses_mismatched_layers():
    from remnant.sglang.pool import PackedC4Pool

    with pytest.raises(ValueError, match="PackedC4Pool has 2 CSA layers but 1 retentions and 1 keeps"):
        PackedC4Pool(100, 64, torch.float8_e4m3fn, 448, 64, 2, "cpu", False, retentions=[256],
                     keeps=[torch.arange(192)], mode="kernel")
    with pytest.raises(ValueError, match="keeps\\[0\\] has 64 indices; retention 192 keeps R - 64 = 128"):
        PackedC4Pool(100, 64, torch.float8_e4m3fn, 448, 64, 1, "cpu", False, retentions=[192],
                     keeps=[torch.arange(64)], mode="triton")
