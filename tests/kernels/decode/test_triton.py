"""The Triton decode kernel (remnant.kernels.decode.triton), run through the package's entry point,
against the float64 references of remnant.kernels.decode.reference."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from remnant.kernels.decode import DecodeConfig, DecodePlan, decode, plan_decode
from remnant.kernels.decode.plan import window_step_cost
from remnant.kernels.decode.reference import decode_native_reference, decode_packed_reference
from remnant.kernels.decode.triton import _split_step, kept_column_blocks, permute_columns
from remnant.kv.layout import KeptColumns, PageLayout
from tests.kernels.inputs import DEVICE, ON_GPU, filled_pool, keep_map

# bf16 operands and a bf16 output: errors of a few 1e-3 (METHOD: 1e-3..1e-2).
TOLERANCE = 1e-2


def set_pad_bytes(pool: torch.Tensor, layout: PageLayout, value: int) -> None:
    """Byte 7 of every record's tail (after the 7 scales) set to `value`: SGLang's quantizer
    need not write it, so the kernels must not read it as a scale or a zero."""
    tails = pool[:, layout.per_page * layout.data_bytes:][:, : layout.per_page * 8]
    tails.unflatten(1, (layout.per_page, 8))[:, :, 7] = value


def set_magnitude(pool: torch.Tensor, layout: PageLayout, scale_byte: int | tuple[int, ...]) -> None:
    """Every record's 7 UE8M0 scale bytes set to `scale_byte` (one for all tiles, or one per
    tile) and its bf16 RoPE multiplied by 2^(first scale byte - 127): its values that far
    from the FP8 codes' range."""
    bytes_ = (scale_byte,) * 7 if isinstance(scale_byte, int) else scale_byte
    tails = pool[:, layout.per_page * layout.data_bytes:][:, : layout.per_page * 8]
    tails.unflatten(1, (layout.per_page, 8))[:, :, :7] = torch.tensor(bytes_, dtype=torch.uint8, device=pool.device)
    body = pool[:, : layout.per_page * layout.data_bytes].unflatten(1, (layout.per_page, layout.data_bytes))
    rope = body[:, :, layout.data_bytes - 128:].view(torch.bfloat16)
    rope.mul_(2.0 ** (bytes_[0] - 127))


def check_decode(batch, heads, topk, window, retention, seed, rows=False, kept_first=False, window_kept_first=False,
                 window_packed=False, window_padding=False, q_scale=2.0, sink_shift=0.0, pad_byte=0, scale_byte=None,
                 per_tile=False, window_apart=False, **config) -> float:
    """q_scale, sink_shift: the records' scales span 6 decades, so at q_scale 2 the softmax
    is nearly one-hot and the sink carries no mass; small q and a sink near log(records)
    give every term weight (the sink about a quarter of it at 0.02 and 3).
    kept_first: q and out in kept-first column order (columns="kept_first");
    window_kept_first: the window holds kept-first window records (store_kept_first: codes
    in that order, scale tiles of 64 kept-first positions; window_columns="kept_first");
    window_packed: the window holds records packed with the C4 records' keep list, in the C4
    records' layout (window_columns="packed"), and the output's dropped NoPE columns must
    be exactly 0; window_padding: the last token's window all padding (-1).
    rows: plain [n, record_bytes] tensors (8-byte aligned records, as the engine's window
    ring and triton-mode scratch) instead of SGLang's pages of 64 (16-byte aligned).
    pad_byte: the value of every record's pad byte (set_pad_bytes).
    scale_byte: every record's scale bytes (set_magnitude), None to keep the drawn ones.
    per_tile: also bound the error of each 64-column scale tile and of RoPE on its own, so
    that a tile far smaller than the others cannot hide in the whole output's norm.
    window_apart: decode's, False by default so that each test checks the same program on
    the CPU and the GPU (decode's own choice depends on the GPU's multiprocessors)."""
    gen = torch.Generator().manual_seed(seed)
    keep = keep_map(retention, gen)
    per_page = 1 if rows else 64
    c4_layout = PageLayout.rows(PageLayout.sglang(1, retention).record_bytes) if rows else PageLayout.sglang(64, retention)
    c4 = filled_pool(c4_layout, -(-4 * topk // per_page) + 1, keep, gen)
    win_layout = c4_layout if window_packed else PageLayout.rows(584) if rows else PageLayout.sglang(64)
    win = filled_pool(win_layout, -(-2 * max(window, 1) // per_page) + 1,
                      keep if window_kept_first or window_packed else None, gen, kept_first=window_kept_first)
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
        win_locs[1, :2] = -1
    if window_padding:
        win_locs[-1] = -1
    c4_locs, win_locs = c4_locs.to(DEVICE), win_locs.to(DEVICE)
    q = (torch.randn(batch, heads, 512, generator=gen) * q_scale).to(torch.bfloat16).to(DEVICE)
    sink = (torch.randn(heads, generator=gen) + sink_shift).to(DEVICE)

    args = (c4_locs, win, win_layout, win_locs, sink)
    orders = {"columns": config.pop("columns", "natural"), "window_columns": config.pop("window_columns", "natural")}
    window_form = "kept_first" if window_kept_first else "packed" if window_packed else "natural"
    if keep is None:
        want = decode_native_reference(q, c4, c4_layout, *args)
    else:
        want = decode_packed_reference(q, c4, c4_layout, c4_locs, keep, win, win_layout, win_locs, sink,
                                       window_columns=window_form)
    out = torch.full_like(q, float("nan"))
    if window_form != "natural":
        orders["window_columns"] = window_form
    config = DecodeConfig(window_apart=window_apart, **config)
    if kept_first:  # q in, out back in KeptColumns.order, as with the order folded into the weights
        order = KeptColumns.of(keep, q.device).order
        got = torch.full_like(q, float("nan"))
        decode(q[:, :, order], c4, c4_layout, c4_locs, win, win_layout, win_locs, sink, keep, out=got, check_range=True,
               **dict(orders, columns="kept_first"), config=config)
        out[:, :, order] = got
    else:
        decode(q, c4, c4_layout, c4_locs, win, win_layout, win_locs, sink, keep, out=out, check_range=True, **orders,
               config=config)
    assert not out.isnan().any(), "an output element was not written (or is NaN)"
    if window_packed:  # no record holds a dropped column
        dropped = torch.ones(448, dtype=torch.bool, device=out.device)
        dropped[keep.to(out.device)] = False
        assert (out[:, :, :448][:, :, dropped] == 0).all(), "a dropped output column is not 0"
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < TOLERANCE, f"relative error {err:.2e}"
    if per_tile:  # natural columns: tiles 0-6 of the NoPE part, then RoPE
        diff, ref = (out.double() - want).unflatten(2, (8, 64)), want.unflatten(2, (8, 64))
        tile_errors = (diff.square().sum(dim=(0, 1, 3)) / ref.square().sum(dim=(0, 1, 3))).sqrt().tolist()
        assert max(tile_errors) < TOLERANCE, f"relative error per tile {[f'{e:.1e}' for e in tile_errors]}"
    return err


SMALL = dict(h_block=16, block_n=16, num_warps=4)
SOFT = dict(q_scale=0.02, sink_shift=3.0)  # a softmax where the sink and every record carry mass


@pytest.mark.parametrize("retention", [512, 256])
@pytest.mark.parametrize("scores_transposed", [False, True])
def test_decode_ignores_the_pad_byte(retention, scores_transposed):
    check_decode(batch=3, heads=5, topk=37, window=11, retention=retention, seed=12, pad_byte=0xA5,
                 scores_transposed=scores_transposed, window_scores_transposed=scores_transposed, **SMALL)


@pytest.mark.slow
@pytest.mark.parametrize("scores_transposed", [False, True])
@pytest.mark.parametrize("retention", [256, 512, 128, 384, 64])
def test_decode_matches_float64_reference(retention, scores_transposed):
    check_decode(batch=3, heads=20, topk=37, window=13, retention=retention, seed=retention,
                 scores_transposed=scores_transposed, **SMALL)


@pytest.mark.parametrize("retention", [512, 256])
def test_decode_with_a_soft_softmax_and_a_heavy_sink(retention):
    check_decode(batch=3, heads=20, topk=37, window=13, retention=retention, seed=retention + 1, **SOFT, **SMALL)


@pytest.mark.parametrize("retention", [256, 128])
def test_decode_with_q_and_out_in_kept_first_order(retention):
    check_decode(batch=3, heads=20, topk=37, window=21, retention=retention, seed=retention + 2, kept_first=True, **SMALL)


@pytest.mark.parametrize("retention", [256, 64, 448])
@pytest.mark.parametrize("kept_first", [False, True])
def test_decode_over_a_window_written_in_kept_first_order(retention, kept_first):
    check_decode(batch=3, heads=20, topk=37, window=21, retention=retention, seed=retention + 3, kept_first=kept_first,
                 window_kept_first=True, **SMALL)


@pytest.mark.parametrize("scale_byte", [120, 130])
def test_decode_over_a_kept_first_window_whose_dropped_set_is_padded_past_448(scale_byte):
    # R = 128: 384 dropped columns padded to 512, so kept-first positions run to 575; those
    # past 448 must scale by the zero pad byte. A tile-8 selector makes prmt copy the sign
    # of scale byte 0, an infinite scale where that byte is >= 128 (0 x inf: NaN).
    check_decode(batch=2, heads=20, topk=9, window=21, retention=128, seed=30, kept_first=True,
                 window_kept_first=True, scale_byte=scale_byte, **SMALL)


# A packed window: the C4 records' format and keep list, read by the C4 loop over the
# window's range. R = 256 and 448 have a kept tail (N = 192: 128 + 64; 384: 256 + 128), R =
# 192 none (N = 128). Window 21 and top-k 37 at 16 per step are 2 and 3 steps: three splits
# by cost (a window step is a C4 step) cut at 0, 1, 3, 5, so split 1 runs a step of each
# loop; even, each split takes a share of both. The last token's window is all padding.
@pytest.mark.parametrize(("retention", "rows", "kept_first", "splits", "split_plan"), [
    (256, False, False, 1, None), (192, True, False, 1, None), (448, False, True, 1, None), (256, True, True, 1, None),
    (256, False, True, 3, "by_cost"), (192, False, False, 3, "even"), (448, True, False, 2, "by_cost"),
    (256, True, False, 2, "even")])
def test_decode_over_a_packed_window(retention, rows, kept_first, splits, split_plan):
    check_decode(batch=3, heads=20, topk=37, window=21, retention=retention, seed=retention + splits + 50, rows=rows,
                 kept_first=kept_first, window_packed=True, window_padding=True, splits=splits, split_plan=split_plan,
                 window_block_n=16, **SOFT, **SMALL)


@pytest.mark.parametrize("retention", [256, 192])
@pytest.mark.parametrize("transposed", [False, True])
def test_decode_over_a_packed_window_in_its_own_score_form(retention, transposed):
    # The window loop in the other score form than the C4 loop's (q loaded again for it),
    # at twice its records per step, with the plan's own splits.
    check_decode(batch=3, heads=20, topk=37, window=21, retention=retention, seed=retention + 60, window_packed=True,
                 scores_transposed=transposed, window_scores_transposed=not transposed, window_block_n=32, **SOFT,
                 **SMALL)


def test_decode_over_a_packed_window_with_float16_partials_far_from_float16s_range():
    # Two splits' float16 partials, each row scaled with no dropped accumulator in it.
    for scale_byte in MAGNITUDES:
        check_decode(batch=3, heads=20, topk=37, window=21, retention=256, seed=8, splits=2, partials="float16",
                     window_packed=True, scale_byte=scale_byte, window_block_n=16, **SOFT, **SMALL)


@pytest.mark.slow
@pytest.mark.parametrize(("retention", "splits", "kept_first", "window_kept_first"),
                         [(512, 2, False, False), (512, 3, False, False), (256, 3, False, False),
                          (256, 2, True, True), (128, 4, False, True), (384, 3, True, False)])
@pytest.mark.parametrize("partials", ["float32", "float16"])
def test_decode_split_across_programs_matches_reference(retention, splits, kept_first, window_kept_first, partials):
    # (decode's own plan: native's 2 splits are cut by cost, the rest even; the test below
    # pins native's 2 even.)
    # topk 37 and window 21 at 16 per step: 3 C4 steps and 2 window steps, so at 3 splits
    # and more (4 is capped to 3) one split gets C4 records only. 19 heads: the last head
    # block of decode (16 per program) and of the join (JOIN_LAUNCH's 2) are partly masked.
    check_decode(batch=3, heads=19, topk=37, window=21, retention=retention, seed=retention + splits, splits=splits,
                 kept_first=kept_first, window_kept_first=window_kept_first, window_block_n=16, partials=partials,
                 **SOFT, **SMALL)


def test_decode_of_native_records_split_evenly_in_two():
    check_decode(batch=3, heads=19, topk=37, window=21, retention=512, seed=70, splits=2, window_block_n=16,
                 split_plan="even", **SOFT, **SMALL)


# Splits cut by cost, at 16 records per step. Packed (a window step weighs two C4 steps):
# window 21 and top-k 37 (2 and 3 steps) give two splits all window, then all C4 records
# (cuts 0, 2, 5); three give one window step each, then the C4 records (0, 1, 2, 5); window
# 11 and top-k 90 (1 and 6 steps) give a first split of the window and two C4 steps, then
# 4 C4 steps (0, 3, 7); five splits there the window, then C4 steps 1, 1, 2, 2 (0, 1, 2, 3,
# 5, 7). Native (one C4 step): three splits of window 21 and top-k 37 cut at 0, 1, 3, 5
# (a split with a step of each loop), five of window 11 and top-k 90 at 0, 1, 2, 4, 5, 7.
# Every record must be read exactly once for the softmax to match.
@pytest.mark.slow
@pytest.mark.parametrize(("retention", "window", "topk", "splits", "kept_first", "window_kept_first"),
                         [(256, 21, 37, 2, True, True), (256, 21, 37, 3, False, True), (512, 21, 37, 3, False, False),
                          (128, 11, 90, 2, True, True), (384, 11, 90, 5, False, False), (512, 11, 90, 5, False, False),
                          (256, 0, 37, 3, True, True)])
@pytest.mark.parametrize("partials", ["float32", "float16"])
def test_decode_split_by_cost_matches_reference(retention, window, topk, splits, kept_first, window_kept_first,
                                                partials):
    check_decode(batch=3, heads=20, topk=topk, window=window, retention=retention, seed=retention + splits + window,
                 splits=splits, kept_first=kept_first, window_kept_first=window_kept_first, window_block_n=16,
                 partials=partials, split_plan="by_cost", **SOFT, **SMALL)


@triton.jit
def _cuts_kernel(out_ptr, S, win_steps, c4_steps, COST: tl.constexpr):
    s = tl.program_id(0)
    tl.store(out_ptr + s, _split_step(s, S, win_steps, c4_steps, COST))


def split_cuts(splits: int, win_steps: int, c4_steps: int, cost: int | None = None) -> list[int]:
    """The first step of each split cut by cost, and the end (the kernel's own _split_step;
    cost: a window step's in C4 steps, the packed kernel's unless given)."""
    out = torch.full((splits + 1,), -1, dtype=torch.int32, device=DEVICE)
    _cuts_kernel[(splits + 1,)](out, splits, win_steps, c4_steps, COST=window_step_cost(True) if cost is None else cost)
    return out.tolist()


def test_splits_by_cost_give_most_splits_one_loop():
    # V4's folded call: 4 window steps (32 tokens) and 8 C4 steps (64 packed records). At 8
    # splits, four of one window step, then four of two C4 steps: one loop each.
    assert split_cuts(8, 4, 8) == [0, 1, 2, 3, 4, 6, 8, 10, 12]
    # Two splits: the window, then the C4 records (which measured slower than "even" on
    # the H200, so split_plan_for keeps "even" there).
    assert split_cuts(2, 4, 8) == [0, 4, 12]
    # The cut inside the C4 records, and none at all: no window, or no C4 records.
    assert split_cuts(2, 1, 6) == [0, 3, 7]
    assert split_cuts(3, 0, 6) == [0, 2, 4, 6] and split_cuts(2, 3, 0) == [0, 2, 3]


def test_native_splits_by_cost_weigh_a_window_step_as_a_c4_step():
    # Native at V4's shape: 4 window steps and 16 C4 steps of 32 records each. Two splits
    # take 10 steps each (split 0 the window and 192 C4 records); at the packed weight (2)
    # split 0 would take the window and 4 C4 steps, split 1 the other 12 C4 steps.
    assert split_cuts(2, 4, 16, cost=window_step_cost(packed=False)) == [0, 10, 20]
    assert split_cuts(2, 4, 16, cost=window_step_cost(packed=True)) == [0, 8, 20]
    assert split_cuts(4, 4, 16, cost=window_step_cost(packed=False)) == [0, 5, 10, 15, 20]
    # The packed kernel's own shape (8 C4 steps of 64 records): the window, then the C4 records.
    assert split_cuts(2, 4, 8, cost=window_step_cost(packed=True)) == [0, 4, 12]


def test_decode_refuses_an_unknown_split_plan():
    with pytest.raises(ValueError, match=r"split_plan='balanced' is not allowed; allowed: None, 'even', 'by_cost'"):
        check_decode(batch=1, heads=16, topk=4, window=2, retention=256, seed=0, splits=2, split_plan="balanced")


# Every record's values (codes and RoPE) near 2^23 (float16 overflows above 65504), near
# 2^-37 (below its least subnormal, 2^-24), or with tile 0 and RoPE near 2^10 and tile 6
# near 2^-14, 2^-24 of the row's largest (float16 subnormal unless the row is scaled up).
MAGNITUDES = [150, 90, (137, 127, 127, 127, 127, 127, 113)]


@pytest.mark.parametrize("scale_byte", MAGNITUDES)
@pytest.mark.parametrize(("retention", "window_apart"), [(512, False), (256, False), (256, True)])
def test_decode_float16_partials_hold_values_beyond_float16s_range(scale_byte, retention, window_apart):
    # Each partial row is scaled so that its largest value lies just under float16's top.
    check_decode(batch=3, heads=20, topk=37, window=21, retention=retention, seed=7, splits=2,
                 window_apart=window_apart, partials="float16", scale_byte=scale_byte, per_tile=True,
                 window_block_n=16, **SOFT, **SMALL)


def test_decode_refuses_an_unknown_partials_dtype():
    with pytest.raises(ValueError, match=r"partials='bfloat16' is not allowed; allowed: None, 'float32', 'float16'"):
        check_decode(batch=1, heads=16, topk=4, window=2, retention=256, seed=0, splits=2, partials="bfloat16")


@pytest.mark.parametrize(("retention", "window_kept_first"), [(512, False), (256, True), (256, False)])
@pytest.mark.parametrize("transposed", [False, True])
def test_decode_with_its_own_window_loop_form(retention, window_kept_first, transposed):
    # The window loop in the other score form, with twice the C4 loop's records per step
    # (q loaded again for it).
    check_decode(batch=3, heads=20, topk=37, window=21, retention=retention, seed=retention + 11,
                 window_kept_first=window_kept_first, scores_transposed=transposed, window_scores_transposed=not transposed,
                 window_block_n=32, **SOFT, **SMALL)


def test_kept_columns_split_into_a_power_of_two_and_a_tail_only_where_it_saves_padding():
    # (N kept, padded table size) -> (block, tail): R = 256, 384, 448 get a tail.
    cases = {(0, 16): (16, 0), (64, 64): (64, 0), (128, 128): (128, 0), (192, 256): (128, 64), (256, 256): (256, 0),
             (320, 512): (256, 64), (384, 512): (256, 128), (448, 512): (512, 0)}
    assert {key: kept_column_blocks(*key) for key in cases} == cases


def test_decode_refuses_an_unknown_join():
    with pytest.raises(ValueError, match="join='program' is not allowed; allowed: None, 'kernel', 'exchange'"):
        check_decode(batch=2, heads=16, topk=16, window=8, retention=256, seed=1, splits=2, join="program", **SMALL)


@pytest.mark.parametrize(("retention", "splits"), [(256, None), (256, 2), (128, 3), (448, None), (64, 2), (384, None)])
@pytest.mark.parametrize(("scores_transposed", "window_scores_transposed"), [(False, True), (True, False)])
def test_decode_with_the_window_in_a_program_of_its_own(retention, splits, scores_transposed, window_scores_transposed):
    # Split 0 reads the window in natural order, the rest share the C4 records in
    # kept-first order (q through the kept columns); the join returns natural order.
    check_decode(batch=3, heads=20, topk=37, window=21, retention=retention, seed=retention + 21, splits=splits,
                 window_apart=True, window_block_n=16, scores_transposed=scores_transposed,
                 window_scores_transposed=window_scores_transposed, pad_byte=0xA5, **SOFT, **SMALL)


@pytest.mark.parametrize("window_apart", [False, True])
def test_decode_with_the_window_apart_or_not_and_no_window(window_apart):
    # No window: the window's program holds the sink only.
    check_decode(batch=2, heads=20, topk=37, window=0, retention=256, seed=31, window_apart=window_apart, **SOFT, **SMALL)


def test_decode_with_its_own_choice_of_the_window_program():
    # decode's own choice (window_apart=None): off the GPU auto_splits is 1, so the window
    # apart; on one, at batch 3, the fused program split across programs.
    check_decode(batch=3, heads=20, topk=37, window=21, retention=256, seed=41, window_apart=None, **SOFT, **SMALL)


@pytest.mark.parametrize(("retention", "kept_first"), [(512, False), (256, True)])
def test_decode_of_the_window_alone(retention, kept_first):
    # Top-k 0 (no C4 records, as remnant-kernels times the part the calls share), split in two.
    check_decode(batch=3, heads=20, topk=0, window=21, retention=retention, seed=retention + 21, splits=2,
                 kept_first=kept_first, window_kept_first=kept_first, window_block_n=16, **SMALL)


@pytest.mark.slow
def test_decode_runs_a_plan_as_given_and_refuses_one_made_for_another_call():
    # The plan of a call split in three runs unchanged on a batch of two: the same output
    # as the config it pins, to the bit.
    gen = torch.Generator().manual_seed(4)
    keep = keep_map(256, gen)
    c4_layout, win_layout = PageLayout.sglang(64, 256), PageLayout.sglang(64)
    c4, win = filled_pool(c4_layout, 2, keep, gen), filled_pool(win_layout, 1, None, gen)
    c4_locs = torch.stack([torch.randperm(128, generator=gen)[:37] for _ in range(2)]).to(DEVICE)
    win_locs = torch.stack([torch.randperm(64, generator=gen)[:21] for _ in range(2)]).to(DEVICE)
    q = torch.randn(2, 20, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    sink = torch.randn(20, generator=gen).to(DEVICE)
    plan = plan_decode(9, 20, 21, 37, True, torch.device(DEVICE),
                       config=DecodeConfig(splits=3, window_apart=False, **SMALL))
    assert isinstance(plan, DecodePlan) and plan.splits == 3
    args = (q, c4, c4_layout, c4_locs, win, win_layout, win_locs, sink, keep)
    assert torch.equal(decode(*args, config=plan), decode(*args, config=plan.config()))
    with pytest.raises(ValueError, match=r"made for \(packed, columns, window_columns\) = \(True, 'natural', "
                                         r"'natural'\), the call is \(True, 'kept_first', 'natural'\)"):
        decode(*args, columns="kept_first", config=plan)


def test_decode_refuses_zero_splits():
    with pytest.raises(ValueError, match="splits must be >= 1, got 0"):
        check_decode(batch=1, heads=16, topk=4, window=2, retention=256, seed=0, splits=0)


def test_permute_columns_is_an_exact_gather_of_each_row():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 2 * 13, 512, generator=gen).to(torch.bfloat16).to(DEVICE)[:, ::2]  # rows strided, 13 heads
    x[0, 0, 7] = float("nan")  # a copy: NaN stays in its own column
    index = torch.randperm(512, generator=gen).to(torch.int32).to(DEVICE)
    got = permute_columns(x, index)
    assert torch.equal(got.view(torch.int16), x[:, :, index.long()].view(torch.int16))
    into = torch.full((3, 13, 512), float("inf"), dtype=torch.bfloat16, device=DEVICE)
    permute_columns(x, index, out=into)
    assert torch.equal(into.view(torch.int16), got.view(torch.int16))


def test_decode_refuses_an_unknown_column_order():
    with pytest.raises(ValueError, match="columns='kept' is not allowed; allowed: 'natural', 'kept_first'"):
        check_decode(batch=1, heads=16, topk=4, window=2, retention=256, seed=0, columns="kept")
    with pytest.raises(ValueError, match="window_columns='permuted' is not allowed"):
        check_decode(batch=1, heads=16, topk=4, window=2, retention=256, seed=0, window_columns="permuted")


@pytest.mark.parametrize("window_columns", ["kept_first", "packed"])
def test_decode_refuses_a_window_of_the_keep_list_with_native_records(window_columns):
    with pytest.raises(ValueError, match=f"window_columns='{window_columns}' needs packed C4 records"):
        check_decode(batch=1, heads=16, topk=4, window=2, retention=512, seed=0, window_columns=window_columns)


def test_decode_refuses_an_out_of_other_shape():
    layout = PageLayout.sglang(64)
    pool = torch.zeros(1, layout.page_stride, dtype=torch.uint8, device=DEVICE)
    locs = torch.zeros(1, 1, dtype=torch.long, device=DEVICE)
    q = torch.zeros(1, 16, 512, device=DEVICE)
    for out in (torch.empty(1, 16, 256, device=DEVICE), torch.empty(1, 512, 16, device=DEVICE).transpose(1, 2)):
        with pytest.raises(ValueError, match=r"out must be \[B, H, 512\] = \(1, 16, 512\) with contiguous rows"):
            decode(q, pool, layout, locs, pool, layout, locs, torch.zeros(16, device=DEVICE), out=out)


@pytest.mark.parametrize("retention", [256, 512])
def test_decode_over_plain_record_rows(retention):
    check_decode(batch=2, heads=16, topk=21, window=9, retention=retention, seed=3, rows=True, **SMALL)


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_with_no_window_and_all_padding(splits):
    # Only the sink is left in the softmax: the output is zero, and still written (split:
    # the second split sees padding only, and must add nothing, not NaN).
    gen = torch.Generator().manual_seed(0)
    layout = PageLayout.sglang(64, 256)
    keep = keep_map(256, gen)
    c4 = filled_pool(layout, 1, keep, gen)
    win_layout = PageLayout.sglang(64)
    win = filled_pool(win_layout, 1, None, gen)
    q = torch.randn(2, 16, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    decode(q, c4, layout, torch.full((2, 40), -1, device=DEVICE), win, win_layout, torch.zeros(2, 0, dtype=torch.long, device=DEVICE),
           torch.zeros(16, device=DEVICE), keep, out=out, config=DecodeConfig(splits=splits, **SMALL))
    assert torch.equal(out, torch.zeros_like(out))


def test_decode_refuses_a_window_of_packed_records():
    layout = PageLayout.sglang(64, 256)
    pool = torch.zeros(1, layout.page_stride, dtype=torch.uint8, device=DEVICE)
    locs = torch.zeros(1, 1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="window layout holds 328-byte records, expected 584"):
        decode(torch.zeros(1, 16, 512, device=DEVICE), pool, layout, locs, pool, layout, locs,
               torch.zeros(16, device=DEVICE), torch.arange(192))
    # ... unless it says so, and then its records are the C4 records' width.
    native = PageLayout.sglang(64)
    native_pool = torch.zeros(1, native.page_stride, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="window layout holds 584-byte records, expected 328"):
        decode(torch.zeros(1, 16, 512, device=DEVICE), pool, layout, locs, native_pool, native, locs,
               torch.zeros(16, device=DEVICE), torch.arange(192), window_columns="packed")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("retention", [256, 512, 128])
@pytest.mark.parametrize("config", [dict(),  # DEFAULT_CONFIGS
                                    dict(h_block=64, block_n=64, num_warps=8, num_stages=1, scores_transposed=True),
                                    dict(h_block=16, block_n=32, num_warps=4),
                                    dict(h_block=64, block_n=32, num_warps=8, num_stages=1, scores_transposed=False),
                                    dict(h_block=64, block_n=64, num_warps=8, num_stages=1, scores_transposed=False,
                                         window_block_n=32, window_scores_transposed=True),
                                    dict(h_block=64, block_n=32, num_warps=8, num_stages=2, splits=1)])
def test_decode_on_gpu_at_v4_shape(retention, config):
    check_decode(batch=9, heads=64, topk=512, window=128, retention=retention, seed=7 + retention, **config)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(("retention", "kept_first"), [(256, True), (256, False), (192, True), (448, False)])
@pytest.mark.parametrize(("splits", "split_plan"), [(None, None), (2, None), (8, "by_cost"), (8, "even")])
def test_decode_on_gpu_over_a_packed_window(retention, kept_first, splits, split_plan):
    # At V4's shape with the plan's own loop settings (two splits with q and out in
    # kept-first order join by the exchange).
    check_decode(batch=9, heads=64, topk=512, window=128, retention=retention, seed=40 + retention,
                 kept_first=kept_first, window_packed=True, window_padding=True, splits=splits,
                 split_plan=split_plan, per_tile=True)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("retention", [256, 128, 448])
@pytest.mark.parametrize("splits", [None, 2])
def test_decode_on_gpu_with_the_window_apart(retention, splits):
    check_decode(batch=9, heads=64, topk=512, window=128, retention=retention, seed=12 + retention, splits=splits,
                 window_apart=True)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
# The exchange joins the output in the kernel's own column order only: natural columns over
# packed records are joined (and permuted back) by the join kernel (join_for refuses it).
@pytest.mark.parametrize(("retention", "kept_first", "join"), [
    (512, False, "kernel"), (512, False, "exchange"), (256, False, "kernel"), (256, True, "kernel"),
    (256, True, "exchange")])
@pytest.mark.parametrize("scale_byte", [None, *MAGNITUDES])
@pytest.mark.parametrize("partials", ["float16", "float32"])
def test_decode_on_gpu_split_in_two_with_each_partials_dtype(retention, kept_first, join, scale_byte, partials):
    # Two splits, as at batch 64 on an H200, with values in and far beyond float16's range.
    check_decode(batch=9, heads=64, topk=512, window=128, retention=retention, seed=21, splits=2, kept_first=kept_first,
                 window_kept_first=kept_first, scale_byte=scale_byte, per_tile=True, partials=partials, join=join)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(("retention", "kept_first"), [(512, False), (256, True), (128, True), (448, True)])
@pytest.mark.parametrize("scale_byte", [None, *MAGNITUDES])
@pytest.mark.parametrize(("split_plan", "heads", "config"), [("even", 64, {}), ("by_cost", 64, {}),
                                                             ("even", 41, dict(h_block=16, block_n=32, num_warps=4))])
def test_decode_on_gpu_joined_by_exchange_between_two_splits(retention, kept_first, scale_byte, split_plan, heads,
                                                             config):
    # The two splits of a token as one cluster, each joining half of the output columns from
    # both partials after the cluster barrier; 41 heads leave a head block part empty, whose
    # rows neither CTA stores.
    check_decode(batch=9, heads=heads, topk=512, window=128, retention=retention, seed=31, splits=2, join="exchange",
                 kept_first=kept_first, window_kept_first=kept_first, scale_byte=scale_byte, per_tile=True,
                 split_plan=split_plan, **config)
    if scale_byte is None:  # with a soft softmax, where both splits carry weight
        check_decode(batch=9, heads=heads, topk=512, window=128, retention=retention, seed=32, splits=2,
                     join="exchange", kept_first=kept_first, window_kept_first=kept_first, per_tile=True,
                     split_plan=split_plan, **SOFT, **config)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(("retention", "kept_first"), [(512, False), (256, True)])
def test_decode_on_gpu_joined_by_exchange_gives_the_join_kernels_output_every_launch(retention, kept_first):
    # A barrier that let one CTA read its sibling's partial before it was written would read
    # the last launch's (the allocator hands the same blocks back): each launch here has a
    # q of its own, so such a read gives another output than the join kernel's (an error of
    # order 1). Both joins run the same arithmetic (_join) on the same partials, so they
    # should agree to the bit; the bound leaves room for the two kernels' compiled forms
    # (multiply-adds fused or not). Batch 64 fills an H200's SMs.
    gen = torch.Generator().manual_seed(5)
    keep = keep_map(retention, gen)
    c4_layout, win_layout = PageLayout.sglang(64, retention), PageLayout.sglang(64)
    c4 = filled_pool(c4_layout, 40, keep, gen)
    win = filled_pool(win_layout, 8, keep if kept_first else None, gen, kept_first=kept_first)
    batch = 64
    c4_locs = torch.stack([torch.randperm(c4_layout.capacity(c4), generator=gen)[:512] for _ in range(batch)]).to(DEVICE)
    win_locs = torch.stack([torch.randperm(win_layout.capacity(win), generator=gen)[:128] for _ in range(batch)]).to(DEVICE)
    sink = torch.randn(64, generator=gen).to(DEVICE)
    orders = dict(columns="kept_first", window_columns="kept_first") if kept_first else {}
    for _ in range(20):
        q = (torch.randn(batch, 64, 512, generator=gen) * 0.02).to(torch.bfloat16).to(DEVICE)
        exchanged, joined = (decode(q, c4, c4_layout, c4_locs, win, win_layout, win_locs, sink, keep,
                                    config=DecodeConfig(splits=2, join=join), **orders) for join in ("exchange", "kernel"))
        assert not exchanged.isnan().any()
        assert ((exchanged.double() - joined.double()).norm() / joined.double().norm()).item() < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(("retention", "kept_first", "window_kept_first"), [(256, True, True), (256, False, False),
                                                                            (512, False, False)])
@pytest.mark.parametrize("splits", [2, 5, 8])
def test_decode_on_gpu_split_by_cost(retention, kept_first, window_kept_first, splits):
    # At V4's shape: 4 window steps and 8 (packed) or 16 (native) C4 steps.
    check_decode(batch=9, heads=64, topk=512, window=128, retention=retention, seed=23 + splits, splits=splits,
                 kept_first=kept_first, window_kept_first=window_kept_first, split_plan="by_cost", per_tile=True)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("partials", ["float16", "float32"])
def test_decode_on_gpu_of_one_token_in_sixteen_splits_with_each_partials_dtype(partials):
    check_decode(batch=1, heads=64, topk=512, window=128, retention=512, seed=22, splits=16,
                 scale_byte=MAGNITUDES[2], per_tile=True, partials=partials)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("retention", [512, 256])
def test_decode_on_gpu_of_one_token_split_across_the_multiprocessors(retention):
    # Batch 1: the most splits, and a launch whose batch argument Triton would make a constant.
    check_decode(batch=1, heads=64, topk=512, window=128, retention=retention, seed=10)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_decode_names_launch_settings_beyond_shared_memory():
    # 64 native records per step in the transposed form at 3 stages: about 250 KB.
    with pytest.raises(ValueError, match=r"decode launch settings .*'num_stages': 3.* lower num_stages or block_n"):
        check_decode(batch=2, heads=64, topk=128, window=0, retention=512, seed=1, block_n=64, num_stages=3,
                     scores_transposed=True, window_block_n=64, window_scores_transposed=True)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("retention", [256, 128])
@pytest.mark.parametrize(("kept_first", "window_kept_first"), [(True, False), (True, True), (False, True)])
def test_decode_on_gpu_in_kept_first_order(retention, kept_first, window_kept_first):
    check_decode(batch=9, heads=64, topk=512, window=128, retention=retention, seed=8 + retention,
                 kept_first=kept_first, window_kept_first=window_kept_first)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("retention", [512, 256])
@pytest.mark.parametrize("scores_transposed", [False, True])
def test_decode_on_gpu_ignores_the_pad_byte(retention, scores_transposed):
    # The byte permute (prmt) that picks each column's scale reads the pad as its zero byte.
    check_decode(batch=9, heads=64, topk=512, window=128, retention=retention, seed=9, pad_byte=0xA5,
                 scores_transposed=scores_transposed, window_scores_transposed=scores_transposed,
                 block_n=32, window_block_n=32)
