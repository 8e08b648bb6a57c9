"""remnant.kernels.top_k: the radix-select top-k against a stable sort's first k (the same
set of indices, ties to the lower index; values at those indices)."""

from __future__ import annotations

import pytest
import torch

from remnant.engine.ops import index_top_locations
from remnant.kernels.top_k import top_k, top_k_locations, top_k_reference
from tests.kernels.inputs import DEVICE


def _rows(n: int, gen: torch.Generator) -> torch.Tensor:
    """Rows that make selection hard: distinct scores, many exact zeros (relu), ties
    everywhere, all -inf, -0.0 beside 0.0 and -inf, huge negatives."""
    rows = [torch.randn(n, generator=gen),
            torch.relu(torch.randn(n, generator=gen)) * (torch.rand(n, generator=gen) < 0.3),
            torch.randint(-3, 3, (n,), generator=gen).float(),
            torch.full((n,), float("-inf"))]
    mixed = torch.randn(n, generator=gen)
    mixed[::3] = float("-inf")
    mixed[1::5] = -0.0
    mixed[2::5] = 0.0
    return torch.stack(rows + [mixed, -mixed.abs() * 1e30])


def _check(scores: torch.Tensor, k: int) -> None:
    got_v, got_i = top_k(scores.to(DEVICE), k)
    _, want_i = top_k_reference(scores, k)
    got_i = got_i.cpu()
    assert torch.equal(got_i.sort(-1).values, want_i.sort(-1).values), k
    assert torch.equal(got_v.cpu(), scores.gather(1, got_i)), k


@pytest.mark.parametrize("n", [1, 37, 600, 2049, 4500])
def test_top_k_chooses_a_stable_sorts_first_k(n):
    scores = _rows(n, torch.Generator().manual_seed(n))
    for k in sorted({0, 1, min(n, 5), min(n, 512), n}):
        _check(scores, k)


def test_chosen_keys_come_above_the_kth_then_its_ties_by_index():
    scores = torch.tensor([[1.0, 3.0, 2.0, 2.0, 5.0, 2.0, 0.0]])
    values, indices = top_k(scores.to(DEVICE), 4)
    assert indices.cpu().tolist() == [[1, 4, 2, 3]] and values.cpu().tolist() == [[3.0, 5.0, 2.0, 2.0]]


@pytest.mark.parametrize(("rows", "n"), [(1, 3000), (2, 1000)])
def test_parts_write_in_the_one_program_order(rows, n):
    # A row split in parts (plan_parts: 12 and 4 here) gives the order of one program per
    # row: every key above the k-th by index, then the lowest-index ties.
    from remnant.kernels.top_k import plan_parts

    assert plan_parts(rows, n)[0] > 1
    gen = torch.Generator().manual_seed(n)
    scores = torch.randint(-4, 4, (rows, n), generator=gen).float()  # ties across parts
    for k in (1, 512):
        _, indices = top_k(scores.to(DEVICE), k)
        for row, got in zip(scores, indices.cpu()):
            t = float(top_k_reference(row[None], k)[0][0, -1])  # the k-th largest
            above = (row > t).nonzero().flatten()
            ties = (row == t).nonzero().flatten()[: k - above.numel()]
            assert got.tolist() == torch.cat([above, ties]).tolist(), k


@pytest.mark.parametrize("locs_dtype", [torch.int64, torch.int32])
def test_top_k_locations_are_the_plain_choices_locations(locs_dtype):
    # The decode step's form: each chosen index's location, -1 for a chosen -inf score
    # (fewer visible records than k), int32; top_k's order, so compared as sorted rows.
    scores = _rows(2100, torch.Generator().manual_seed(3))
    locs = torch.randperm(50_000, generator=torch.Generator().manual_seed(4))[: scores.numel()].view(scores.shape)
    for k in (1, 512, 2100):
        got = top_k_locations(scores.to(DEVICE), k, locs.to(DEVICE, locs_dtype))
        want = index_top_locations(scores, k, locs)
        assert got.dtype == torch.int32 and got.shape == want.shape
        assert torch.equal(got.cpu().sort(-1).values, want.sort(-1).values), k
    assert (got.cpu()[3] == -1).all()  # the all -inf row: nothing to read


def test_top_k_refuses_what_it_cannot_select():
    with pytest.raises(ValueError, match="float32 scores"):
        top_k(torch.zeros(2, 8, dtype=torch.float64, device=DEVICE), 2)
    with pytest.raises(ValueError, match="k=9"):
        top_k(torch.zeros(2, 8, device=DEVICE), 9)
    with pytest.raises(ValueError, match="locs must be"):
        top_k_locations(torch.zeros(2, 8, device=DEVICE), 2, torch.zeros(2, 7, dtype=torch.long, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("rows", "n"), [(1, 8192), (128, 8192), (24, 32768)])
def test_top_k_at_the_engines_sizes_on_the_gpu(rows, n):
    gen = torch.Generator().manual_seed(rows + n)
    scores = torch.relu(torch.randn(rows, n, generator=gen))  # relu: a quarter of the row ties at 0
    scores[:, n // 3:] = float("-inf")  # records not yet visible
    locs = torch.randperm(4 * rows * n, generator=gen)[: rows * n].view(rows, n)
    for k in (512, n // 3 + 7):  # the second takes every visible record and some -inf ties
        _check(scores, k)
        got = top_k_locations(scores.to(DEVICE), k, locs.to(DEVICE, torch.int32)).cpu()
        assert torch.equal(got.sort(-1).values, index_top_locations(scores, k, locs).sort(-1).values)


@pytest.mark.parametrize(("rows", "n"), [(1, 3000), (3, 1000), (6, 600)])
def test_counts_give_the_whole_rows_choice_unread(rows, n):
    # Rows padded with -inf past their counts (a decode step's page-table bucket): with the
    # counts the passes read only below them, and the choice, its order and values are the
    # whole row's; every count from none to all, k above and below it, ties at the
    # threshold, and -inf inside the count too.
    from remnant.kernels.top_k import plan_parts

    gen = torch.Generator().manual_seed(rows * n)
    scores = torch.randint(-3, 3, (rows, n), generator=gen).float()
    scores[:, 5::7] = float("-inf")
    counts = torch.tensor([0, n, 1, n // 2 + 3, 511, n - 1][:rows])
    for b, c in enumerate(counts.tolist()):
        scores[b, c:] = float("-inf")
    locs = torch.randperm(10 * rows * n, generator=gen)[: rows * n].view(rows, n)
    assert plan_parts(rows, n)[0] > 1  # parts wholly past a count read nothing
    for k in (1, 7, 512, n):
        want_v, want_i = top_k(scores.to(DEVICE), k)
        got_v, got_i = top_k(scores.to(DEVICE), k, counts.to(DEVICE))
        assert torch.equal(got_i, want_i) and torch.equal(got_v, want_v), k
        want_l = top_k_locations(scores.to(DEVICE), k, locs.to(DEVICE))
        assert torch.equal(top_k_locations(scores.to(DEVICE), k, locs.to(DEVICE), counts.to(DEVICE, torch.int32)),
                           want_l), k
    with pytest.raises(ValueError, match=r"counts must be int32 or int64 \[3\]"):
        top_k(torch.zeros(3, 8, device=DEVICE), 2, torch.zeros(2, dtype=torch.long, device=DEVICE))
