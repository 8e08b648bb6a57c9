"""remnant.kernels.decode.plan: which kernel serves a call (choose) and how Remnant's kernels
run it (plan_decode and its resolvers), checked without a GPU. Each kernel's own rule is
also checked where its tests run it (test_sm90, test_flashmla)."""

from __future__ import annotations

import pytest
import torch

from remnant.kernels.decode import DecodeConfig, KernelChoice, choose, decode, flashmla, plan_decode, sm90
from remnant.kernels.decode.plan import (DEFAULT_CONFIGS, join_for, partials_for, split_count, split_plan_for,
                                         splits_for, window_apart_for, window_step_cost)
from remnant.kv.layout import PageLayout

CPU = torch.device("cpu")
FOLDED = dict(n_kept=192, columns="kept_first", window_columns="kept_first", q_dtype=torch.bfloat16)


@pytest.fixture
def sm90_runs(monkeypatch):
    """The SM90 kernel's device rule stood in for (an sm_90 GPU), so that choose's rules
    around it are checked here; the kernel itself runs in test_sm90 only."""
    monkeypatch.setattr(sm90, "unavailable_reason", lambda device, n_kept=None, heads=None: None)


@pytest.fixture
def flashmla_runs(monkeypatch):
    """FlashMLA's device rule stood in for (its package on an SM90 GPU)."""
    monkeypatch.setattr(flashmla, "unavailable_reason", lambda device, heads: None)


def test_choose_takes_the_first_kernel_of_each_record_forms_preference_that_takes_the_call():
    assert choose(CPU, 64, False) == ("triton", "FlashMLA runs on CUDA GPUs, not on device=cpu")
    kernel, why = choose(CPU, 64, True, **FOLDED)
    assert kernel == "triton" and why.startswith("the SM90 Gluon kernel cannot take it: ")
    assert choose(CPU, 64, True, n_kept=192) == KernelChoice(
        "triton", "the SM90 Gluon kernel cannot take it: it runs the folded call only (packed records, q and out "
                  "in kept-first order, the window kept-first or packed)")
    assert choose(CPU, 64, True, **dict(FOLDED, q_dtype=torch.float32)).reason.endswith(
        "it reads bf16 q, got torch.float32")


def test_choose_takes_sm90_for_the_folded_call_unless_the_config_is_the_triton_kernels(sm90_runs):
    assert choose(CPU, 64, True, **FOLDED) == ("sm90", None)
    config = DecodeConfig(block_n=32)
    assert choose(CPU, 64, True, **FOLDED, config=config) == (
        "triton", f"the launch settings of a 64-head model ({config}) are the Triton kernel's")
    assert choose(CPU, 64, True, **FOLDED, config=DecodeConfig(kernel="triton")) == (
        "triton", "Remnant's Triton kernel was asked for (kernel=triton)")
    rows = (PageLayout.rows(328), PageLayout.rows(584))
    assert choose(CPU, 64, True, **FOLDED, layouts=rows).reason.startswith(
        "the SM90 Gluon kernel cannot take it: reads c4 records with 320-byte data parts")
    with pytest.raises(ValueError, match="decode kernel='sm90' has a fixed program; these settings are the Triton "
                                         "kernel's: block_n"):
        choose(CPU, 64, True, **FOLDED, config=DecodeConfig(kernel="sm90", block_n=32))


def test_choose_takes_flashmla_for_native_records_in_natural_order_only(flashmla_runs):
    assert choose(CPU, 64, False, layouts=(PageLayout.sglang(64), PageLayout.sglang(64))) == ("flashmla", None)
    assert choose(CPU, 64, False, columns="kept_first") == (
        "triton", "FlashMLA reads q, out and the window in natural column order")
    assert choose(CPU, 64, False, config=DecodeConfig(kernel="triton"), field="native_decode") == (
        "triton", "Remnant's Triton native kernel was asked for (native_decode=triton)")
    config = DecodeConfig(h_block=16, num_warps=4)
    assert choose(CPU, 64, False, config=config).reason.startswith("the launch settings of a 64-head model")
    with pytest.raises(ValueError, match="decode kernel='flashmla' cannot run this call: FlashMLA's V4 decode reads "
                                         "native records, not packed ones"):
        choose(CPU, 64, True, **FOLDED, config=DecodeConfig(kernel="flashmla"))
    # FlashMLA schedules its own launch: the plan is of Remnant's kernels only.
    assert plan_decode(3, 64, 128, 512, False, CPU).kernel == "triton"
    with pytest.raises(ValueError, match="not among the kernels planned here \\(triton, sm90; FlashMLA"):
        plan_decode(3, 64, 128, 512, False, CPU, config=DecodeConfig(kernel="flashmla"))


def test_a_packed_window_is_the_sm90_kernels_in_kept_first_order_and_never_flashmlas(sm90_runs, flashmla_runs):
    # Window records packed with the C4 records' keep list: the SM90 kernel reads them with
    # its C4 loop (q and out kept-first, on 16-byte aligned split pages of R + 72-byte
    # records), the Triton kernel in any order; FlashMLA reads native records only, and
    # native C4 records have no keep list to pack them with.
    packed_window = dict(FOLDED, window_columns="packed")
    assert choose(CPU, 64, True, **packed_window) == ("sm90", None)
    split = (PageLayout.sglang(64, 256), PageLayout.sglang(64, 256))
    assert choose(CPU, 64, True, **packed_window, layouts=split) == ("sm90", None)
    native_window = (PageLayout.sglang(64, 256), PageLayout.sglang(64))
    assert choose(CPU, 64, True, **packed_window, layouts=native_window).reason.startswith(
        "the SM90 Gluon kernel cannot take it: reads window records with 320-byte data parts")
    assert choose(CPU, 64, True, **dict(packed_window, columns="natural")).kernel == "triton"
    with pytest.raises(ValueError, match="decode kernel='flashmla' cannot run this call: FlashMLA's V4 decode reads "
                                         "native records, not packed ones"):
        choose(CPU, 64, True, **packed_window, config=DecodeConfig(kernel="flashmla"))
    with pytest.raises(ValueError, match="window_columns='packed' needs packed C4 records \\(a keep list\\)"):
        choose(CPU, 64, False, window_columns="packed")
    with pytest.raises(ValueError, match="window_columns='packed' needs packed C4 records"):
        plan_decode(3, 64, 128, 512, False, CPU, window_columns="packed")
    with pytest.raises(ValueError, match="window_columns='ring' is not allowed; allowed: 'natural', 'kept_first', "
                                         "'packed'"):
        choose(CPU, 64, True, window_columns="ring")


def test_a_packed_window_is_planned_as_more_c4_records():
    # The C4 loop's settings for both loops, no window apart (the window is read in
    # kept-first sets already), a window step weighing one C4 step, and the folded call's
    # split plans.
    plan = plan_decode(3, 64, 128, 512, True, CPU, window_columns="packed")
    assert (plan.window_apart, plan.window_packed, plan.window_kept_first) == (False, True, False)
    assert plan.loops() == DEFAULT_CONFIGS["packed, packed window"]
    assert plan.block_n == plan.window_block_n and plan.scores_transposed == plan.window_scores_transposed
    assert window_step_cost(True, "packed") == 1 and window_step_cost(True, "kept_first") == 2
    eight = plan_decode(3, 64, 128, 512, True, CPU, window_columns="packed", config=DecodeConfig(splits=8))
    two = plan_decode(3, 64, 128, 512, True, CPU, columns="kept_first", window_columns="packed",
                      config=DecodeConfig(splits=2))
    assert (eight.split_plan, two.split_plan) == ("by_cost", "even")
    assert not window_apart_for(None, True, "natural", "packed", 128, None, 9, CPU)
    with pytest.raises(ValueError, match="window_apart needs packed C4 records with q, out and the window in natural "
                                         "order .* window_columns='packed'"):
        plan_decode(3, 64, 128, 512, True, CPU, window_columns="packed", config=DecodeConfig(window_apart=True))


def test_decode_runs_flashmla_where_choose_takes_it_and_hands_it_out_as_given(flashmla_runs, monkeypatch):
    calls = []
    monkeypatch.setattr(flashmla, "decode", lambda *a, out=None: calls.append((a[3].dtype, out)) or a[0])
    layout = PageLayout.sglang(64)
    pages = torch.zeros(2, layout.page_stride, dtype=torch.uint8)
    q = torch.zeros(2, 64, 512)
    locs = torch.zeros(2, 3, dtype=torch.long)
    assert decode(q, pages, layout, locs, pages, layout, locs, torch.zeros(64)) is q
    assert calls == [(torch.int32, None)]  # checked locations, and no output of ours to copy into


def test_split_plan_is_by_cost_for_a_kept_first_window_at_eight_splits_or_more():
    assert [split_plan_for(None, s, True, True, False) for s in (1, 2, 7, 8, 16)] == [None, "even", "even", "by_cost",
                                                                                      "by_cost"]
    assert [split_plan_for(None, 8, True, kept, apart) for kept, apart in ((False, False), (False, True))] == ["even",
                                                                                                              "even"]
    assert split_plan_for("by_cost", 2, True, False, False) == "by_cost"
    assert split_plan_for("even", 8, True, True, False) == "even"
    assert split_plan_for("by_cost", 1, True, True, False) is None  # one split: nothing to plan
    with pytest.raises(ValueError, match="split_plan='by_cost' cannot take the window apart"):
        split_plan_for("by_cost", 3, True, False, True)


def test_split_plan_is_by_cost_for_the_native_kernel_at_two_splits_only():
    assert [split_plan_for(None, s, False, False, False) for s in (1, 2, 3, 4, 8, 16)] == [None, "by_cost", "even",
                                                                                             "even", "even", "even"]
    assert split_plan_for("even", 2, False, False, False) == "even"


def test_partials_are_float16_for_two_splits_or_fewer_unless_given():
    assert [partials_for(None, splits) for splits in (2, 3, 16)] == ["float16", "float32", "float32"]
    assert partials_for("float32", 2) == "float32" and partials_for("float16", 16) == "float16"
    assert partials_for(None, 1) is None and partials_for("float16", 1) is None  # one split: no partials


def test_join_is_the_exchange_only_for_two_splits_in_the_kernels_own_order_on_a_gpu(monkeypatch):
    import remnant.kernels.decode.plan as plan_module

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert join_for(None, 1, False, False, cpu) is None  # one split: nothing to join
    # Off the GPU (and under the interpreter, which runs programs one at a time): the kernel.
    assert join_for(None, 2, False, False, cpu) == "kernel"
    with pytest.raises(ValueError, match="join='exchange' cannot run with no compiled CUDA launch"):
        join_for("exchange", 2, False, False, cpu)
    # A compiled launch on an sm_90 GPU (its capability and the interpreter's flag stood in
    # for, so that the choice itself is tested here).
    monkeypatch.setattr(plan_module, "interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert join_for(None, 2, False, False, cuda) == "exchange"
    assert join_for("kernel", 2, False, False, cuda) == "kernel"
    for splits, permute, apart, why in ((3, False, False, "3 splits"), (2, True, False, "columns='natural'"),
                                        (2, False, True, "the window apart")):
        with pytest.raises(ValueError, match=f"join='exchange' cannot run with {why}"):
            join_for("exchange", splits, permute, apart, cuda)
        assert join_for(None, splits, permute, apart, cuda) == "kernel"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert join_for(None, 2, False, False, cuda) == "kernel"
    with pytest.raises(ValueError, match="join='exchange' cannot run with a GPU before sm_90"):
        join_for("exchange", 2, False, False, cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(plan_module.triton, "__version__", "3.5.1")
    with pytest.raises(ValueError, match=r"join='exchange' cannot run with Triton 3.5.1 \(launch_in_pairs needs 3.6"):
        join_for("exchange", 2, False, False, cuda)


def test_split_count_fills_the_multiprocessors_once():
    assert [splits_for(programs, 132) for programs in (1, 9, 64, 66, 67, 128, 512)] == [16, 14, 2, 2, 1, 1, 1]
    # At most one split per step of the longer loop: 37 records at 16 per step are 3 steps.
    cpu = torch.device("cpu")
    assert [split_count(s, 1, 21, 37, 16, 32, cpu) for s in (None, 2, 3, 8)] == [1, 2, 3, 3]


def test_window_apart_is_chosen_for_natural_orders_with_a_window_and_a_full_batch():
    cpu = torch.device("cpu")  # auto_splits is 1 off the GPU: every batch counts as full
    assert window_apart_for(None, True, "natural", "natural", 128, None, 9, cpu)
    assert not window_apart_for(None, True, "natural", "natural", 0, None, 9, cpu)  # no window
    assert not window_apart_for(None, True, "natural", "natural", 128, 2, 9, cpu)  # splits given: fused
    assert not window_apart_for(None, True, "kept_first", "natural", 128, None, 9, cpu)
    assert not window_apart_for(None, False, "natural", "natural", 128, None, 9, cpu)  # native records
    assert window_apart_for(True, True, "natural", "natural", 0, 3, 9, cpu)
    with pytest.raises(ValueError, match="in natural order .*, got packed records, columns='natural', "
                                         "window_columns='kept_first'"):
        window_apart_for(True, True, "natural", "kept_first", 128, None, 9, cpu)
    # The window's program and at most one per C4 step (37 records at 16 per step: 3).
    assert [split_count(s, 1, 21, 37, 16, 32, cpu, window_apart=True) for s in (None, 2, 8)] == [2, 2, 4]
    with pytest.raises(ValueError, match=r"splits must be >= 2 with window_apart \(the window's program and one for"):
        split_count(1, 1, 21, 37, 16, 32, cpu, window_apart=True)


def test_plan_resolves_every_choice_as_the_resolvers_do():
    cpu = torch.device("cpu")
    # Off the GPU: one split (auto_splits), so natural orders over packed records take the
    # window apart, with its defaults and one more split than auto.
    plan = plan_decode(3, 64, 128, 512, True, cpu)
    assert (plan.kernel, plan.window_apart, plan.splits, plan.h_block, plan.num_warps) == ("triton", True, 2, 64, 8)
    assert plan.loops() == DEFAULT_CONFIGS["packed, window apart"] and plan.permute and not plan.window_kept_first
    assert (plan.partials, plan.split_plan, plan.join) == ("float16", "even", "kernel")
    folded = plan_decode(3, 64, 128, 512, True, cpu, columns="kept_first", window_columns="kept_first",
                         config=DecodeConfig(splits=8, block_n=32))
    assert (folded.window_apart, folded.splits, folded.block_n) == (False, 8, 32)
    assert (folded.partials, folded.split_plan, folded.join) == ("float32", "by_cost", "kernel")
    assert folded.window_block_n == DEFAULT_CONFIGS["packed, kept-first window"]["window_block_n"]
    native = plan_decode(1, 16, 21, 37, False, cpu, config=DecodeConfig(h_block=16, num_warps=4))
    assert (native.splits, native.partials, native.split_plan, native.join) == (1, None, None, None)
    assert native.loops() == DEFAULT_CONFIGS["native"]
    # A plan pins itself: planned again from its own config, at any batch, it is the same.
    assert plan_decode(40, 64, 128, 512, True, cpu, config=plan.config()) == plan
    with pytest.raises(ValueError, match="kernel='sm80' is not allowed; allowed: None, 'triton', 'sm90'"):
        DecodeConfig(kernel="sm80")
