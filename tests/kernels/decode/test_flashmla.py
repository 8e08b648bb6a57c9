"""FlashMLA's V4 decode (remnant.kernels.decode.flashmla) on Remnant-written records, against
the float64 reference of remnant.kernels.decode.reference.

The choice of kernel, the views and the indices are checked on the CPU; FlashMLA itself runs
only on an SM90/SM100 GPU with sgl-flash-mla installed (`pip install --no-deps
sgl-flash-mla==1.0.0`): those tests are marked `gpu` and skip, saying why, elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from remnant.kernels.bench.inputs import poison_next_allocation
from remnant.kernels.decode import DecodeConfig, KernelChoice, choose, decode, flashmla
from remnant.kernels.decode.reference import decode_native_reference, decode_packed_reference
from remnant.kernels.dispatch import store
from remnant.kv.attention import SOFTMAX_SCALE
from remnant.kv.layout import KeptColumns, PageLayout
from tests.kernels.decode.test_triton import MAGNITUDES, SOFT, TOLERANCE, set_magnitude, set_pad_bytes
from tests.kernels.inputs import DEVICE, ON_GPU, filled_pool, keep_map, latents

WHY_NOT = flashmla.unavailable_reason(DEVICE, 64)
needs_flashmla = pytest.mark.skipif(WHY_NOT is not None, reason=f"FlashMLA cannot run here: {WHY_NOT}")


def test_indices_are_int32_padded_to_64_with_minus_one():
    locs = torch.tensor([[3, -1, 7], [0, 1, 2]])
    got = flashmla.indices(locs)
    assert got.dtype == torch.int32 and tuple(got.shape) == (2, 1, 64)
    assert got[:, 0, :3].tolist() == [[3, -1, 7], [0, 1, 2]]
    assert bool((got[:, :, 3:] == -1).all())
    assert tuple(flashmla.indices(torch.zeros(1, 128, dtype=torch.long)).shape) == (1, 1, 128)


def test_kv_view_carries_sglang_pages_page_stride():
    layout = PageLayout.sglang(64)
    pages = torch.zeros(3, layout.page_stride, dtype=torch.uint8)
    view = flashmla.kv_view(pages, layout, "c4")
    assert tuple(view.shape) == (3, 64, 1, 584) and view.stride() == (37440, 584, 584, 1)
    assert view.data_ptr() == pages.data_ptr()


@pytest.mark.parametrize(("layout", "message"), [
    (PageLayout.rows(584), "page stride a multiple of 576 bytes.*not a page stride of 584"),
    (PageLayout.sglang(64, 256), "reads native 584-byte records, not 328-byte ones"),
])
def test_kv_view_refuses_what_flashmla_cannot_read(layout, message):
    pages = torch.zeros(2, layout.page_stride, dtype=torch.uint8)
    with pytest.raises(ValueError, match=message):
        flashmla.kv_view(pages, layout, "c4")


@pytest.mark.skipif(ON_GPU, reason="checks the CPU's answer")
def test_on_the_cpu_the_triton_kernel_serves_and_says_why():
    assert choose(torch.device("cpu"), 64, False) == KernelChoice(
        "triton", "FlashMLA runs on CUDA GPUs, not on device=cpu")
    with pytest.raises(ValueError, match="native_decode=flashmla cannot run: FlashMLA runs on CUDA GPUs"):
        choose(torch.device("cpu"), 64, False, config=DecodeConfig(kernel="flashmla"), field="native_decode")


def test_choose_names_the_reason_for_native_records():
    assert choose(DEVICE, 64, False, config=DecodeConfig(kernel="triton")).kernel == "triton"
    kernel, why = choose(DEVICE, 64, False, layouts=(PageLayout.rows(584),))
    assert kernel == "triton" and "split pages" in why
    with pytest.raises(ValueError, match="kernel='fast' is not allowed; allowed: None, 'triton', 'sm90', 'flashmla'"):
        DecodeConfig(kernel="fast")


def _pools(topk: int, window: int, gen, per_page: int = 64, window_per_page: int = 64, keep=None):
    c4_layout = PageLayout.sglang(per_page, 512 if keep is None else keep.numel() + 64)
    win_layout = PageLayout.sglang(window_per_page)
    c4 = filled_pool(c4_layout, -(-4 * max(topk, 1) // per_page) + 1, keep, gen)
    win = filled_pool(win_layout, -(-2 * max(window, 1) // window_per_page) + 1, None, gen)
    return c4, c4_layout, win, win_layout


def _locs(batch: int, count: int, capacity: int, gen, pad_row: int) -> torch.Tensor:
    locs = torch.stack([torch.randperm(capacity, generator=gen)[:count] for _ in range(batch)])
    if count > 3 and batch > pad_row:
        locs[pad_row, -3:] = -1  # the indexer pads short selections with -1
    return locs.to(DEVICE)


def check_flashmla(batch, heads, topk, window, seed, q_scale=2.0, sink_shift=0.0, scale_byte=None, per_page=64,
                   window_per_page=64, pad_byte=0) -> float:
    gen = torch.Generator().manual_seed(seed)
    c4, c4_layout, win, win_layout = _pools(topk, window, gen, per_page, window_per_page)
    set_pad_bytes(c4, c4_layout, pad_byte)
    set_pad_bytes(win, win_layout, pad_byte)
    if scale_byte is not None:
        set_magnitude(c4, c4_layout, scale_byte)
        set_magnitude(win, win_layout, scale_byte)
    c4_locs = _locs(batch, topk, c4_layout.capacity(c4), gen, 0)
    win_locs = _locs(batch, window, win_layout.capacity(win), gen, 1)
    q = (torch.randn(batch, heads, 512, generator=gen) * q_scale).to(torch.bfloat16).to(DEVICE)
    sink = (torch.randn(heads, generator=gen) + sink_shift).to(DEVICE)
    want = decode_native_reference(q, c4, c4_layout, c4_locs, win, win_layout, win_locs, sink)
    poison_next_allocation(q)  # FlashMLA allocates its own output: that block reads NaN where unwritten
    out = flashmla.decode(q, c4, c4_layout, c4_locs, win, win_layout, win_locs, sink, SOFTMAX_SCALE)
    assert out.dtype == q.dtype and tuple(out.shape) == tuple(q.shape)
    assert not out.isnan().any(), "an output element was not written (or is NaN)"
    errors = (out.double() - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)
    assert float(errors.max()) < TOLERANCE, f"relative error per token {errors.tolist()}"
    return float(errors.max())


@pytest.mark.gpu
@needs_flashmla
@pytest.mark.parametrize("batch", [1, 9, 64, 130])
@pytest.mark.parametrize(("topk", "window"), [(512, 128), (512, 0), (100, 7), (0, 128), (2048, 128)])
def test_flashmla_matches_float64_reference(batch, topk, window):
    check_flashmla(batch, 64, topk, window, seed=batch + topk + window)


# Remnant's kernels are tested up to scale byte 150 (MAGNITUDES: codes times 2^23, values to
# 3.8e9); FlashMLA's output is NaN there (H200, sgl-flash-mla 1.0.0, 2026-12-03), a limit of
# the stock kernel far past DeepSeek-V4's normed latents. Its ends here: 2^13 and 2^-37.
FLASHMLA_MAGNITUDES = [140, *MAGNITUDES[1:]]


@pytest.mark.gpu
@needs_flashmla
@pytest.mark.parametrize("scale_byte", FLASHMLA_MAGNITUDES)
def test_flashmla_at_the_ends_of_the_fp8_scale_range(scale_byte):
    check_flashmla(9, 64, 512, 128, seed=7, scale_byte=scale_byte, pad_byte=0xA5)


@pytest.mark.gpu
@needs_flashmla
@pytest.mark.parametrize("heads", [64, 128])
def test_flashmla_with_a_soft_softmax_and_a_heavy_sink(heads):
    check_flashmla(5, heads, 512, 128, seed=heads, **SOFT)


@pytest.mark.gpu
@needs_flashmla
def test_flashmla_reads_the_engines_pools():
    # The embedded engine's layouts: C4 pages of 64 (page size 256), C128 pages of 2 and the
    # SWA pool's blocks of 128 (one page each), through remnant.engine.pools.
    from remnant.engine.pools import SplitPages, SwaPool

    gen = torch.Generator().manual_seed(3)
    swa = SwaPool(retentions=[512, 512], blocks=3, window=128, device=DEVICE)
    c4 = SplitPages(pages=12, per_page=64, record_bytes=584, device=DEVICE)
    c128 = SplitPages(pages=40, per_page=2, record_bytes=584, row_bytes=576, device=DEVICE)
    slots = torch.arange(3 * 128, device=DEVICE)
    store(latents(3 * 128, gen).to(DEVICE), swa.pages(1), swa.layouts[1], slots)
    store(latents(12 * 64, gen).to(DEVICE), c4.buf, c4.layout, torch.arange(12 * 64, device=DEVICE))
    store(latents(80, gen).to(DEVICE), c128.buf, c128.layout, torch.arange(80, device=DEVICE))
    batch = 3
    q = torch.randn(batch, 64, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    sink = torch.randn(64, generator=gen).to(DEVICE)
    win_locs = torch.stack([b * 128 + torch.arange(128) for b in range(batch)]).to(DEVICE)
    win_locs[2, :100] = -1  # a ring not yet full
    for records, k in ((c4, 512), (c128, 37)):
        locs = _locs(batch, k, records.layout.capacity(records.buf), gen, 0)
        want = decode_native_reference(q, records.buf, records.layout, locs, swa.pages(1), swa.layouts[1], win_locs,
                                       sink)
        got = flashmla.decode(q, records.buf, records.layout, locs, swa.pages(1), swa.layouts[1], win_locs, sink,
                              SOFTMAX_SCALE)
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < TOLERANCE, f"{records.layout}: relative error {err:.2e}"


@pytest.mark.gpu
@needs_flashmla
def test_flashmla_reads_what_triton_mode_stages_in_the_sglang_plugin():
    # The plugin's triton mode: each query's selected packed records reconstructed into
    # native pages (stage_selected), SGLang's window pool in pages of 128, FlashMLA over
    # both: the packed decode's reference (dropped coordinates zero) within bf16 rounding.
    from remnant.sglang.buffers import make_packed_buffers, native_layout, stage_selected

    gen = torch.Generator().manual_seed(4)
    keep = keep_map(256, gen)
    cols = KeptColumns.of(keep, DEVICE)
    (buf,), (layout,) = make_packed_buffers(4096, 64, [256], device=DEVICE)
    store(latents(4096, gen).to(DEVICE), buf, layout, torch.arange(4096, device=DEVICE), cols)
    swa_layout = native_layout(128)
    swa = torch.zeros(4, swa_layout.page_stride, dtype=torch.uint8, device=DEVICE)
    store(latents(512, gen).to(DEVICE), swa, swa_layout, torch.arange(512, device=DEVICE))
    batch, k = 6, 512
    c4_idx = _locs(batch, k, 4096, gen, 0).to(torch.int32)
    swa_idx = torch.stack([(b % 4) * 128 + torch.arange(128) for b in range(batch)]).to(DEVICE).to(torch.int32)
    scratch = torch.zeros(-(-batch * k // 64), native_layout(64).page_stride, dtype=torch.uint8, device=DEVICE)
    staged = stage_selected(buf, layout, cols, c4_idx, scratch, 64)
    q = torch.randn(batch, 64, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    sink = torch.randn(64, generator=gen).to(DEVICE)
    got = flashmla.decode(q, scratch, native_layout(64), staged, swa, swa_layout, swa_idx, sink, SOFTMAX_SCALE)
    want = decode_packed_reference(q, buf, layout, c4_idx, keep, swa, swa_layout, swa_idx, sink)
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < TOLERANCE, f"relative error {err:.2e}"


@pytest.mark.gpu
@needs_flashmla
def test_flashmla_replays_in_a_cuda_graph_and_repeats():
    gen = torch.Generator().manual_seed(9)
    c4, c4_layout, win, win_layout = _pools(512, 128, gen)
    batch = 16
    c4_locs = _locs(batch, 512, c4_layout.capacity(c4), gen, 0)
    win_locs = _locs(batch, 128, win_layout.capacity(win), gen, 1)
    q = torch.randn(batch, 64, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    sink = torch.randn(64, generator=gen).to(DEVICE)
    out = torch.empty_like(q)
    eager = flashmla.decode(q, c4, c4_layout, c4_locs, win, win_layout, win_locs, sink, SOFTMAX_SCALE)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # into a given `out`, as the engine's callers may pass one
        flashmla.decode(q, c4, c4_layout, c4_locs, win, win_layout, win_locs, sink, SOFTMAX_SCALE, out=out)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    q.copy_(torch.randn(batch, 64, 512, generator=gen).to(torch.bfloat16))  # new inputs, same graph
    graph.replay()
    want = decode_native_reference(q, c4, c4_layout, c4_locs, win, win_layout, win_locs, sink)
    assert ((out.double() - want).norm() / want.norm()).item() < TOLERANCE


@pytest.mark.gpu
@needs_flashmla
def test_decode_takes_flashmla_for_native_records_where_it_runs(monkeypatch):
    # remnant.kernels.decode.decode sends native records to FlashMLA on SGLang's pages (no
    # kernel asked) and to the Triton kernel where asked for it.
    gen = torch.Generator().manual_seed(11)
    calls = []
    real = flashmla.decode
    monkeypatch.setattr(flashmla, "decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    c4, c4_layout, win, win_layout = _pools(64, 16, gen)
    c4_locs, win_locs = _locs(2, 64, c4_layout.capacity(c4), gen, 0), _locs(2, 16, win_layout.capacity(win), gen, 1)
    q = torch.randn(2, 64, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    sink = torch.randn(64, generator=gen).to(DEVICE)
    want = decode_native_reference(q, c4, c4_layout, c4_locs, win, win_layout, win_locs, sink)
    for kernel, expected in ((None, 1), ("triton", 1), ("flashmla", 2)):
        got = decode(q, c4, c4_layout, c4_locs, win, win_layout, win_locs, sink, config=DecodeConfig(kernel=kernel))
        assert len(calls) == expected, kernel
        assert ((got.double() - want).norm() / want.norm()).item() < TOLERANCE


def test_schedules_a_graph_captured_are_never_dropped():
    # Eager calls of many shapes (prefill chunks' token counts) must not drop the schedule a
    # captured graph replays: its tensors' addresses are baked into the graph.
    made = []
    cache = flashmla.ScheduleCache(2, lambda: made.append(object()) or made[-1])
    graph_schedule = cache.get(("decode", 1))
    assert cache.get(("decode", 1), pin=True) is graph_schedule  # the capture after the warm-up
    for tokens in range(100):
        cache.get(("prefill", tokens))
    assert cache.get(("decode", 1)) is graph_schedule and len(made) == 101
    assert set(cache.items) == {("decode", 1), ("prefill", 98), ("prefill", 99)}  # 2 unpinned: the newest
    cache.get(("prefill", 0))  # dropped long ago: made again
    assert len(made) == 102
