"""The packed pool's buffers and steps on CPU (the torch references the plugin runs there)."""

import pytest
import torch

from remnant.kv.attention import SOFTMAX_SCALE
from remnant.kv.codec import quantize
from remnant.kv.formats import page_bytes
from remnant.kv.packing import pack, unpack
from remnant.kernels.dispatch import store
from remnant.kv.layout import KeptColumns
from remnant.kernels.decode.reference import decode_native_reference
from remnant.kv.paged import gather, store_reference
from remnant.sglang.buffers import (
    decode_c4_packed,
    make_packed_buffers,
    mask_by_length,
    native_layout,
    native_records,
    num_pages,
    reconstruct_rows,
    stage_selected,
    store_native,
)

PER_PAGE = 64  # SGLang's C4 page at page_size 256


def keep_of(r: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(448, generator=g)[: r - 64].sort().values


def latents(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 512, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("retentions", [[256, 256], [64, 448, 192]])
def test_buffers_count_packed_bytes(retentions):
    size = 1000
    buffers, layouts = make_packed_buffers(size, PER_PAGE, retentions)
    pages = num_pages(size, PER_PAGE)
    assert pages == (size + PER_PAGE + 1) // PER_PAGE  # DeepSeekV4SingleKVPool's page count
    for buf, layout, r in zip(buffers, layouts, retentions):
        assert layout.record_bytes == r + 72 and layout.per_page == PER_PAGE
        assert buf.dtype == torch.uint8 and tuple(buf.shape) == (pages, page_bytes(PER_PAGE, r))
        assert int(buf.count_nonzero()) == 0
    native = native_layout(PER_PAGE)
    # SGLang's native C4 page: 64 x 584 bytes padded to a multiple of 576.
    assert native.page_stride == -(-PER_PAGE * 584 // 576) * 576 == 37440
    assert buffers[0].numel() < pages * native.page_stride


def test_fused_and_unfused_writes_store_the_same_packed_records():
    keep = keep_of(256)
    (buf_a, buf_b), (layout, _) = make_packed_buffers(300, PER_PAGE, [256, 256])
    x = latents(40)
    locs = torch.randperm(300)[:40] + 1
    store(x, buf_a, layout, locs, keep)
    rec = quantize(x)  # what SGLang's quantizer writes natively
    fields = dict(k_nope_fp8=rec[:, :448].view(torch.float8_e4m3fn), k_rope_bf16=rec[:, 448:576].view(torch.bfloat16),
                  scale_ue8m0=rec[:, 576:583])
    assert torch.equal(native_records(**fields), rec)
    store_native(native_records(**fields), buf_b, layout, locs, keep)
    assert torch.equal(buf_a, buf_b)
    assert torch.equal(gather(buf_a, layout, locs), pack(rec, keep))


def test_triton_stage_reconstructs_each_selection_into_native_pages():
    keep = keep_of(192)
    (buf,), (layout,) = make_packed_buffers(500, PER_PAGE, [192])
    locs = torch.arange(1, 201)
    x = latents(200)
    store(x, buf, layout, locs, keep)
    indices = torch.full((3, 128), -1, dtype=torch.int32)  # FlashMLA pads to a multiple of 64
    indices[0, :5] = torch.tensor([1, 7, 7, 200, 33])
    indices[2, :2] = torch.tensor([150, 2])
    scratch = torch.full((num_pages(3 * 128, PER_PAGE), native_layout(PER_PAGE).page_stride), 0xAB, dtype=torch.uint8)
    remapped = stage_selected(buf, layout, keep, indices, scratch, PER_PAGE)
    assert remapped.dtype == indices.dtype and remapped.shape == indices.shape
    assert torch.equal(remapped < 0, indices < 0)
    want = unpack(pack(quantize(x), keep), keep)  # native records, dropped coordinates zero
    got = gather(scratch, native_layout(PER_PAGE), remapped[remapped >= 0].long())
    assert torch.equal(got, want[indices[indices >= 0].long() - 1])
    # The view DeepseekV4AttnBackend.forward takes of the C4 cache works on the scratch.
    view = scratch[:, : PER_PAGE * 584].view(scratch.shape[0], PER_PAGE, 1, 584)
    assert view.shape[1:] == (PER_PAGE, 1, 584)


def test_sparse_prefill_rows_and_too_small_scratch():
    keep = keep_of(256)
    (buf,), (layout,) = make_packed_buffers(200, PER_PAGE, [256])
    locs = torch.tensor([5, 9, 100, 3])
    x = latents(4)
    store(x, buf, layout, locs, keep)
    pages, ids = reconstruct_rows(buf, layout, keep, locs.to(torch.int32), PER_PAGE)
    assert ids.dtype == torch.int32 and ids.tolist() == [0, 1, 2, 3]
    assert torch.equal(gather(pages, native_layout(PER_PAGE), ids.long()), unpack(pack(quantize(x), keep), keep))
    with pytest.raises(ValueError, match="scratch holds 64 records; 2 x 64 = 128 are needed"):
        stage_selected(buf, layout, keep, torch.zeros(2, 64, dtype=torch.int32), pages[:1], PER_PAGE)


def test_kernel_decode_equals_native_decode_of_reconstructed_records():
    keep = keep_of(256)
    (buf,), (layout,) = make_packed_buffers(400, PER_PAGE, [256])
    c4_locs = torch.arange(1, 101)
    x = latents(100)
    store(x, buf, layout, c4_locs, keep)
    swa_layout = native_layout(128)
    swa = torch.zeros(4, swa_layout.page_stride, dtype=torch.uint8)
    win = latents(130, seed=5)
    store(win, swa, swa_layout, torch.arange(130))
    q = torch.randn(2, 8, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    sink = torch.randn(8)
    c4_idx = torch.full((2, 64), 7, dtype=torch.int32)
    c4_idx[0, :10] = torch.arange(1, 11)
    c4_idx[1, :64] = torch.arange(30, 94)
    c4_len = torch.tensor([10, 64])  # entries past the length are not read
    swa_idx = torch.arange(128, dtype=torch.int32).repeat(2, 1)
    swa_len = torch.tensor([5, 128])
    out = decode_c4_packed(q, buf, layout, keep, c4_idx, c4_len, swa, 128, swa_idx, swa_len, sink, SOFTMAX_SCALE)
    assert out.dtype == q.dtype and out.shape == (2, 8, 512)
    # As the plugin calls it: the pool's column table, and the window as SGLang hands it
    # out (an FP8 view of the uint8 pool).
    fp8_window = swa.view(torch.float8_e4m3fn)
    again = decode_c4_packed(q, buf, layout, KeptColumns.of(keep, buf.device), c4_idx, c4_len, fp8_window, 128,
                             swa_idx, swa_len, sink, SOFTMAX_SCALE)
    assert torch.equal(again, out)
    native = torch.zeros(num_pages(400, PER_PAGE), native_layout(PER_PAGE).page_stride, dtype=torch.uint8)
    from remnant.kv.paged import reconstruct_reference, write

    write(native, native_layout(PER_PAGE), c4_locs, reconstruct_reference(buf, layout, c4_locs, keep))
    want = decode_native_reference(q, native, native_layout(PER_PAGE), mask_by_length(c4_idx, c4_len), swa,
                                   swa_layout, mask_by_length(swa_idx, swa_len), sink)
    torch.testing.assert_close(out.double(), want.to(q.dtype).double())


def test_store_native_with_a_column_table_packs_as_pack_does():
    keep = keep_of(192, seed=2)
    (a, b), (layout, _) = make_packed_buffers(300, PER_PAGE, [192, 192])
    rec = quantize(latents(30, seed=4))
    locs = torch.randperm(300)[:30]
    store_native(rec, a, layout, locs, keep)
    store_native(rec, b, layout, locs, KeptColumns.of(keep, b.device))
    assert torch.equal(a, b)
    assert torch.equal(gather(a, layout, locs), pack(rec, keep))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_hooks_steps_run_inside_cuda_graph_capture():
    """SGLang captures decode in CUDA graphs: store, stage and decode, called as the hooks
    call them (column table, FP8-viewed window), must not read anything back to the host."""
    dev = torch.device("cuda")
    keep = keep_of(256)
    cols = KeptColumns.of(keep, dev)
    (buf,), (layout,) = make_packed_buffers(4096, PER_PAGE, [256], device=dev)
    x = latents(64).to(dev).to(torch.bfloat16)
    locs = torch.arange(1, 65, device=dev)
    rec = quantize(latents(64, seed=2)).to(dev)
    locs_native = torch.arange(100, 164, device=dev)
    swa_layout = native_layout(128)
    swa = torch.zeros(2, swa_layout.page_stride, dtype=torch.uint8, device=dev)
    store_reference(latents(256, seed=5).to(dev), swa, swa_layout, torch.arange(256, device=dev))
    q = torch.randn(4, 64, 512, device=dev).to(torch.bfloat16)
    c4_idx = torch.randint(1, 65, (4, 64), device=dev, dtype=torch.int32)
    swa_idx = torch.arange(128, device=dev, dtype=torch.int32).repeat(4, 1)
    lengths = torch.full((4,), 64, device=dev, dtype=torch.int32)
    sink = torch.randn(64, device=dev)
    scratch = torch.zeros(4, native_layout(PER_PAGE).page_stride, dtype=torch.uint8, device=dev)
    out = torch.empty_like(q)

    def steps():
        store(x, buf, layout, locs, cols)
        store_native(rec, buf, layout, locs_native, cols)
        stage_selected(buf, layout, cols, c4_idx, scratch, PER_PAGE)
        out.copy_(decode_c4_packed(q, buf, layout, cols, c4_idx, lengths, swa.view(torch.float8_e4m3fn), 128,
                                   swa_idx, None, sink, SOFTMAX_SCALE))

    steps()  # compiles the kernels
    torch.cuda.synchronize()
    _assert_graph_replays_the_eager_steps(steps, out)
    assert torch.equal(gather(buf, layout, locs_native), pack(rec.cpu(), keep).to(dev))


def test_packed_window_decode_equals_native_decode_of_reconstructed_records():
    """retention.window_records=packed_csa: a CSA layer's window records packed with its C4
    keep list (window_layout), read by kernel mode's decode as C4 records are; equal to the
    stock decode over the rebuilt native records (dropped coordinates zero), and triton
    mode's staging of the selected window records gives exactly those records."""
    from remnant.kv.paged import reconstruct_reference, write
    from remnant.sglang.buffers import window_layout

    keep = keep_of(256, seed=4)
    (c4,), (c4_layout,) = make_packed_buffers(400, PER_PAGE, [256])
    c4_locs = torch.arange(1, 101)
    store(latents(100), c4, c4_layout, c4_locs, keep)
    win_layout = window_layout(128, keep)
    assert win_layout.record_bytes == 328 and win_layout.per_page == 128
    win = torch.zeros(num_pages(300, 128), win_layout.page_stride, dtype=torch.uint8)
    win_locs = torch.arange(1, 201)
    store(latents(200, seed=6), win, win_layout, win_locs, keep)
    q = torch.randn(3, 8, 512, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    sink = torch.randn(8)
    c4_idx = torch.randint(1, 101, (3, 64), generator=torch.Generator().manual_seed(8), dtype=torch.int32)
    swa_idx = torch.randint(1, 201, (3, 128), generator=torch.Generator().manual_seed(9), dtype=torch.int32)
    c4_len, swa_len = torch.tensor([64, 7, 30]), torch.tensor([128, 1, 77])
    out = decode_c4_packed(q, c4, c4_layout, KeptColumns.of(keep, c4.device), c4_idx, c4_len,
                           win.view(torch.float8_e4m3fn), 128, swa_idx, swa_len, sink, SOFTMAX_SCALE,
                           window_columns="packed")
    native_c4 = torch.zeros(num_pages(400, PER_PAGE), native_layout(PER_PAGE).page_stride, dtype=torch.uint8)
    write(native_c4, native_layout(PER_PAGE), c4_locs, reconstruct_reference(c4, c4_layout, c4_locs, keep))
    native_win = torch.zeros(num_pages(300, 128), native_layout(128).page_stride, dtype=torch.uint8)
    write(native_win, native_layout(128), win_locs, reconstruct_reference(win, win_layout, win_locs, keep))
    want = decode_native_reference(q, native_c4, native_layout(PER_PAGE), mask_by_length(c4_idx, c4_len), native_win,
                                   native_layout(128), mask_by_length(swa_idx, swa_len), sink)
    torch.testing.assert_close(out.double(), want.to(q.dtype).double(), rtol=2**-8, atol=1e-6)
    # Triton mode: each (token, slot) of the window rebuilt into native scratch pages.
    scratch = torch.full((num_pages(3 * 128, 128), native_layout(128).page_stride), 0xAB, dtype=torch.uint8)
    remapped = stage_selected(win, win_layout, keep, swa_idx, scratch, 128)
    assert torch.equal(gather(scratch, native_layout(128), remapped.reshape(-1).long()),
                       gather(native_win, native_layout(128), swa_idx.reshape(-1).long()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_packed_window_steps_on_the_gpu_equal_the_references_inside_cuda_graph_capture():
    """The packed-window steps as the hooks call them on CUDA (the Triton store, reconstruct
    and packed-window decode), against the CPU references, then replayed from a CUDA graph
    (SGLang captures decode): the same records, the same output."""
    from remnant.sglang.buffers import window_layout

    dev = torch.device("cuda")
    keep = keep_of(256, seed=4)
    cols = KeptColumns.of(keep, dev)
    (c4,), (c4_layout,) = make_packed_buffers(4096, PER_PAGE, [256], device=dev)
    store(latents(512).to(dev), c4, c4_layout, torch.arange(1, 513, device=dev), cols)
    win_layout = window_layout(128, cols)
    win = torch.zeros(num_pages(1024, 128), win_layout.page_stride, dtype=torch.uint8, device=dev)
    win_x = latents(300, seed=6).to(torch.bfloat16)
    win_locs = torch.arange(1, 301)
    store(win_x.to(dev), win, win_layout, win_locs.to(dev), cols)
    assert torch.equal(gather(win.cpu(), win_layout, win_locs), pack(quantize(win_x.float()), keep))
    step_x, step_locs = latents(4, seed=10).to(dev).to(torch.bfloat16), torch.arange(301, 305, device=dev)
    q = torch.randn(4, 64, 512, device=dev).to(torch.bfloat16)
    sink = torch.randn(64, device=dev)
    c4_idx = torch.randint(1, 513, (4, 64), device=dev, dtype=torch.int32)
    swa_idx = torch.randint(1, 305, (4, 128), device=dev, dtype=torch.int32)
    swa_idx[:, 0] = step_locs.to(torch.int32)
    lengths = torch.tensor([64, 3, 50, 128], device=dev, dtype=torch.int32)
    scratch = torch.zeros(num_pages(4 * 128, 128), native_layout(128).page_stride, dtype=torch.uint8, device=dev)
    out = torch.empty_like(q)
    remapped = torch.empty_like(swa_idx)

    def steps():
        store(step_x, win, win_layout, step_locs, cols)
        remapped.copy_(stage_selected(win, win_layout, cols, swa_idx, scratch, 128))
        out.copy_(decode_c4_packed(q, c4, c4_layout, cols, c4_idx, lengths, win.view(torch.float8_e4m3fn), 128,
                                   swa_idx, lengths, sink, SOFTMAX_SCALE, window_columns="packed"))

    steps()  # compiles the kernels
    torch.cuda.synchronize()
    want = decode_c4_packed(q.cpu(), c4.cpu(), c4_layout, keep, c4_idx.cpu(), lengths.cpu(), win.cpu(), 128,
                            swa_idx.cpu(), lengths.cpu(), sink.cpu(), SOFTMAX_SCALE, window_columns="packed")
    err = ((out.cpu().double() - want.double()).norm() / want.double().norm()).item()
    assert err < 1e-2, f"relative error {err:.2e} against the float64 reference"  # bf16 kernel arithmetic
    staged = gather(scratch.cpu(), native_layout(128), remapped.cpu().reshape(-1).long())
    assert torch.equal(staged, unpack(gather(win.cpu(), win_layout, swa_idx.cpu().reshape(-1).long()), keep))
    _assert_graph_replays_the_eager_steps(steps, out)


def _assert_graph_replays_the_eager_steps(steps, out: torch.Tensor) -> None:
    """`steps` (run eagerly already: `out` holds its result) captured in a CUDA graph and
    replayed over a zeroed `out` gives the same result."""
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steps()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
