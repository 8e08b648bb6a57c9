"""The SM90 Gluon packed decode (remnant.kernels.decode.sm90) against the float64 reference
and the Triton kernel it stands beside.

Gluon has no CPU interpreter: the kernel runs only on an sm_90 GPU (tests marked `gpu`).
Its reference is the Triton decode's folded call (q, out and the window in kept-first
order), which tests/kernels/decode/test_triton.py runs under the interpreter in CI, and
remnant.kernels.decode.reference's float64 decode; here the CPU checks what runs before a
launch.
"""

from __future__ import annotations

import pytest
import torch

from remnant.kernels.decode import DecodeConfig, decode, plan_decode, sm90
from remnant.kernels.decode.reference import decode_packed_reference
from remnant.kv.layout import KeptColumns, PageLayout
from tests.kernels.decode.test_triton import MAGNITUDES, SOFT, TOLERANCE, set_magnitude, set_pad_bytes
from tests.kernels.inputs import DEVICE, filled_pool, keep_map

WHY_NOT = sm90.unavailable_reason(DEVICE, sm90.KEPT, sm90.HEADS)
needs_sm90 = pytest.mark.skipif(WHY_NOT is not None, reason=f"the SM90 packed decode cannot run here: {WHY_NOT}")


def test_splits_fill_the_gpu_once_and_stop_at_six_past_eight_tokens():
    assert [sm90.splits_per_token(b, 132) for b in (1, 4, 7, 8, 16, 32, 64, 128, 512)] == [16, 16, 16, 6, 6, 4, 2, 1, 1]


def test_off_an_sm90_gpu_it_says_why():
    assert sm90.unavailable_reason(torch.device("cpu")) == "needs a CUDA GPU"
    with pytest.raises(ValueError, match="the SM90 packed decode needs a CUDA GPU"):
        sm90.decode(torch.zeros(1, 64, 512, dtype=torch.bfloat16), None, None, None, None, None, None, None,
                    KeptColumns.of(keep_map(256, torch.Generator().manual_seed(0)), torch.device("cpu")), splits=1)


def test_the_plan_chooses_triton_off_the_gpu_and_refuses_sm90_where_it_cannot_run():
    cpu = torch.device("cpu")
    folded = dict(columns="kept_first", window_columns="kept_first", n_kept=192, q_dtype=torch.bfloat16)
    assert plan_decode(64, 64, 128, 512, True, cpu, **folded).kernel == "triton"
    with pytest.raises(ValueError, match="decode kernel='sm90' cannot run this call: needs a CUDA GPU"):
        plan_decode(64, 64, 128, 512, True, cpu, config=DecodeConfig(kernel="sm90"), **folded)
    with pytest.raises(ValueError, match="cannot run this call: it runs the folded call only"):
        plan_decode(64, 64, 128, 512, True, cpu, config=DecodeConfig(kernel="sm90"), n_kept=192)
    with pytest.raises(ValueError, match="cannot run this call: it reads bf16 q, got torch.float32"):
        plan_decode(64, 64, 128, 512, True, cpu, config=DecodeConfig(kernel="sm90"),
                    **dict(folded, q_dtype=torch.float32))


@needs_sm90
@pytest.mark.gpu
def test_the_plan_takes_sm90_for_the_folded_call_unless_told_triton_or_tuned():
    folded = dict(columns="kept_first", window_columns="kept_first", n_kept=192, q_dtype=torch.bfloat16)
    plan = plan_decode(16, 64, 128, 512, True, DEVICE, **folded)
    assert (plan.kernel, plan.splits, plan.join, plan.split_plan) == ("sm90", 6, "kernel", "by_cost")
    assert plan_decode(256, 64, 128, 512, True, DEVICE, **folded).splits == 1
    for config in (DecodeConfig(kernel="triton"), DecodeConfig(block_n=32), DecodeConfig(h_block=16, num_warps=4)):
        assert plan_decode(16, 64, 128, 512, True, DEVICE, config=config, **folded).kernel == "triton"
    assert plan_decode(16, 64, 128, 512, True, DEVICE, n_kept=192, q_dtype=torch.bfloat16).kernel == "triton"
    assert plan_decode(16, 64, 128, 512, True, DEVICE, **dict(folded, n_kept=128)).kernel == "triton"


def test_the_kernel_reads_split_pages_only():
    assert sm90.layout_problem(PageLayout.sglang(64, 256), PageLayout.sglang(64)) is None
    assert sm90.layout_problem(PageLayout.sglang(64, 256), PageLayout.sglang(128)) is None
    assert sm90.layout_problem(PageLayout.rows(328), PageLayout.sglang(64)).startswith(
        "reads c4 records with 320-byte data parts on 16-byte aligned split pages, got 1 per page of stride 328")
    assert "window records with 576-byte" in sm90.layout_problem(PageLayout.sglang(64, 256), PageLayout.rows(584))
    assert "c4 records" in sm90.layout_problem(PageLayout.sglang(64, 128), PageLayout.sglang(64))


@needs_sm90
@pytest.mark.gpu
def test_rows_and_tuned_configs_stay_on_triton_and_sm90_refuses_triton_settings():
    folded = dict(columns="kept_first", window_columns="kept_first", n_kept=192, q_dtype=torch.bfloat16)
    rows = (PageLayout.rows(328), PageLayout.rows(584))
    assert plan_decode(16, 64, 128, 512, True, DEVICE, layouts=rows, **folded).kernel == "triton"
    with pytest.raises(ValueError, match="kernel='sm90' cannot run this call: reads c4 records"):
        plan_decode(16, 64, 128, 512, True, DEVICE, layouts=rows, config=DecodeConfig(kernel="sm90"), **folded)
    with pytest.raises(ValueError, match="kernel='sm90' has a fixed program; these settings are the Triton "
                                         "kernel's: block_n, h_block"):
        plan_decode(16, 64, 128, 512, True, DEVICE, config=DecodeConfig(kernel="sm90", block_n=32, h_block=16),
                    **folded)
    # decode itself on row layouts, the folded call with no config: Triton's program, right.
    gen = torch.Generator().manual_seed(8)
    keep = keep_map(256, gen)
    c4_layout, win_layout = rows
    c4 = filled_pool(c4_layout, 4 * 512 + 1, keep, gen)
    win = filled_pool(win_layout, 2 * 128 + 1, keep, gen, kept_first=True)
    c4_locs = torch.stack([torch.randperm(4 * 512, generator=gen)[:512] for _ in range(3)]).to(DEVICE)
    win_locs = torch.stack([torch.randperm(2 * 128, generator=gen)[:128] for _ in range(3)]).to(DEVICE)
    q = torch.randn(3, 64, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    sink = torch.randn(64, generator=gen).to(DEVICE)
    cols = KeptColumns.of(keep, DEVICE)
    got = decode(q[:, :, cols.order], c4, c4_layout, c4_locs, win, win_layout, win_locs, sink, cols,
                 columns="kept_first", window_columns="kept_first")
    out = torch.empty_like(got)
    out[:, :, cols.order] = got
    want = decode_packed_reference(q, c4, c4_layout, c4_locs, keep, win, win_layout, win_locs, sink,
                                   window_columns="kept_first")
    assert _relative(out, want) < TOLERANCE


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("window_packed", [False, True])
def test_decode_runs_the_folded_call_on_sm90_by_itself(window_packed):
    # The folded call with a kept-first window and with a packed one.
    x = _inputs(9, 64, 512, 128, seed=5 + window_packed, window_packed=window_packed)
    order = x["cols"].order
    compiled: list = []
    got = decode(x["q"][:, :, order], x["c4"], x["c4_layout"], x["c4_locs"], x["window"], x["window_layout"],
                 x["window_locs"], x["sink"], x["cols"], columns="kept_first", window_columns=x["window_columns"],
                 compiled=compiled)
    assert compiled and "packed_sm90" in compiled[-1].name
    out = torch.empty_like(got)
    out[:, :, order] = got
    assert _relative(out, _reference(x)) < TOLERANCE


@needs_sm90
@pytest.mark.gpu
def test_refuses_other_retentions_and_more_heads():
    keep128 = KeptColumns.of(keep_map(128, torch.Generator().manual_seed(0)), DEVICE)
    q = torch.zeros(1, 64, 512, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="written for R = 256 \\(192 kept NoPE columns\\), got 64"):
        sm90.decode(q, None, None, None, None, None, None, None, keep128, splits=1)
    keep = KeptColumns.of(keep_map(256, torch.Generator().manual_seed(0)), DEVICE)
    with pytest.raises(ValueError, match="at most 64 heads per call, got 65"):
        sm90.decode(torch.zeros(1, 65, 512, dtype=torch.bfloat16, device=DEVICE), None, None, None, None, None,
                    None, None, keep, splits=1)


def _inputs(batch, heads, topk, window, seed, q_scale=2.0, sink_shift=0.0, scale_byte=None, pad_byte=0,
            window_packed=False):
    """window_packed: the window holds records packed with the C4 records' keep list, in
    their layout (window_columns="packed"); else kept-first native window records."""
    gen = torch.Generator().manual_seed(seed)
    keep = keep_map(256, gen)
    cols = KeptColumns.of(keep, DEVICE)
    c4_layout = PageLayout.sglang(64, 256)
    win_layout = c4_layout if window_packed else PageLayout.sglang(64)
    c4 = filled_pool(c4_layout, -(-4 * max(topk, 1) // 64) + 1, keep, gen)
    win = filled_pool(win_layout, -(-2 * max(window, 1) // 64) + 1, keep, gen, kept_first=not window_packed)
    set_pad_bytes(c4, c4_layout, pad_byte)
    set_pad_bytes(win, win_layout, pad_byte)
    if scale_byte is not None:
        set_magnitude(c4, c4_layout, scale_byte)
        set_magnitude(win, win_layout, scale_byte)
    c4_locs = torch.stack([torch.randperm(c4_layout.capacity(c4), generator=gen)[:topk] for _ in range(batch)])
    win_locs = torch.stack([torch.randperm(win_layout.capacity(win), generator=gen)[:window] for _ in range(batch)])
    if topk > 3:
        c4_locs[0, -3:] = -1  # the indexer pads short selections with -1
    if window > 2 and batch > 1:
        win_locs[1, :2] = -1  # a window ring not yet full
    q = (torch.randn(batch, heads, 512, generator=gen) * q_scale).to(torch.bfloat16).to(DEVICE)
    sink = (torch.randn(heads, generator=gen) + sink_shift).to(DEVICE)
    return dict(q=q, c4=c4, c4_layout=c4_layout, c4_locs=c4_locs.to(DEVICE), window=win, window_layout=win_layout,
                window_locs=win_locs.to(DEVICE), sink=sink, keep=keep, cols=cols,
                window_columns="packed" if window_packed else "kept_first")


def _sm90(x, splits=None, q=None):
    """(splits None: the plan's choice for this batch.)"""
    """The kernel on x's inputs; q and out in the model's order (permuted around the call)."""
    order = x["cols"].order
    q = x["q"] if q is None else q
    got = torch.full_like(q, float("nan"))
    if splits is None:
        splits = sm90.splits_per_token(q.shape[0], torch.cuda.get_device_properties(DEVICE).multi_processor_count)
    sm90.decode(q[:, :, order].contiguous(), x["c4"], x["c4_layout"], x["c4_locs"], x["window"], x["window_layout"],
                x["window_locs"], x["sink"], x["cols"], out=got, splits=splits,
                window_packed=x["window_columns"] == "packed")
    out = torch.full_like(q, float("nan"))
    out[:, :, order] = got
    return out


def _triton(x):
    order = x["cols"].order
    got = torch.empty_like(x["q"])
    decode(x["q"][:, :, order], x["c4"], x["c4_layout"], x["c4_locs"], x["window"], x["window_layout"],
           x["window_locs"], x["sink"], x["cols"], out=got, columns="kept_first", window_columns=x["window_columns"],
           config=DecodeConfig(kernel="triton"))
    out = torch.empty_like(got)
    out[:, :, order] = got
    return out


def _reference(x):
    return decode_packed_reference(x["q"], x["c4"], x["c4_layout"], x["c4_locs"], x["keep"], x["window"],
                                   x["window_layout"], x["window_locs"], x["sink"], window_columns=x["window_columns"])


def _relative(a, b):
    return ((a.double() - b.double()).flatten(1).norm(dim=1) / b.double().flatten(1).norm(dim=1)).max().item()


def check(batch, heads, topk, window, seed, splits=None, per_tile=False, **kw) -> float:
    x = _inputs(batch, heads, topk, window, seed, **kw)
    out = _sm90(x, splits)
    assert not out.isnan().any(), "an output element was not written (or is NaN)"
    want = _reference(x)
    err = _relative(out, want)
    assert err < TOLERANCE, f"relative error {err:.2e} against the float64 reference"
    triton_err = _relative(_triton(x), want)
    assert err < max(2 * triton_err, 2e-3), f"{err:.2e}, the Triton kernel's {triton_err:.2e}"
    if per_tile:  # natural columns: tiles 0-6 of the NoPE part, then RoPE, each on its own
        diff, ref = (out.double() - want).unflatten(2, (8, 64)), want.unflatten(2, (8, 64))
        tiles = (diff.square().sum(dim=(0, 1, 3)) / ref.square().sum(dim=(0, 1, 3))).sqrt().tolist()
        assert max(tiles) < TOLERANCE, f"relative error per tile {[f'{e:.1e}' for e in tiles]}"
    return err


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 9, 64, 130, 512])
@pytest.mark.parametrize(("topk", "window"), [(512, 128), (512, 0), (100, 7), (0, 128), (2048, 128)])
def test_matches_the_float64_reference_and_the_triton_kernel(batch, topk, window):
    check(batch, 64, topk, window, seed=batch + topk + window)


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 9, 130])
@pytest.mark.parametrize(("topk", "window", "splits"), [(512, 128, None), (100, 7, None), (0, 128, None),
                                                        (512, 128, 3), (64, 256, 16)])
def test_a_packed_window_matches_the_reference_and_the_triton_kernel(batch, topk, window, splits):
    # The window's records packed with the C4 records' keep list, read by the C4 loop: the
    # output's dropped columns are 0 in the reference; splits cut window steps at one C4
    # step's cost (16 splits of 5 steps: top-k 64 is 1 step, the window 4; most splits
    # hold no record and join with weight 0).
    check(batch, 64, topk, window, seed=batch + topk + window + 1, splits=splits, window_packed=True)


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 16])
def test_every_split_count_joins_to_the_same_answer(splits):
    # 16 splits of 10 steps: some splits hold no record and join with weight 0.
    check(3, 64, 512, 128, seed=splits, splits=splits)


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("heads", [1, 20, 64])
def test_fewer_heads_are_masked(heads):
    check(5, heads, 300, 40, seed=heads)


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("scale_byte", MAGNITUDES)
def test_at_the_ends_of_the_fp8_scale_range(scale_byte):
    check(9, 64, 512, 128, seed=7, scale_byte=scale_byte, per_tile=True, pad_byte=0xA5, **SOFT)


@needs_sm90
@pytest.mark.gpu
def test_with_a_soft_softmax_and_a_heavy_sink():
    check(17, 64, 512, 128, seed=3, **SOFT)


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_replays_in_a_cuda_graph_and_repeats(splits):
    x = _inputs(16, 64, 512, 128, seed=11)
    order = x["cols"].order
    q = x["q"][:, :, order].contiguous()
    out = torch.empty_like(q)

    def call():
        sm90.decode(q, x["c4"], x["c4_layout"], x["c4_locs"], x["window"], x["window_layout"], x["window_locs"],
                    x["sink"], x["cols"], out=out, splits=splits)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    first = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first), "a replay differs from the first launch"
    # New inputs in the same buffers: the graph reads them.
    x["q"] = (torch.randn_like(x["q"].float()) * 2).to(torch.bfloat16)
    q.copy_(x["q"][:, :, order])
    graph.replay()
    torch.cuda.synchronize()
    got = torch.empty_like(out)
    got[:, :, order] = out
    assert _relative(got, _reference(x)) < TOLERANCE
