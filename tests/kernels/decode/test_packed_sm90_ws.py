"""The warp-specialized SM90 lab kernel (runners/device/packed_sm90_ws.py, outside the
package) against the float64 reference. The plan does not run it (benchmarks/kernels/
NOTES.md, twentieth round: slower than remnant.kernels.decode.sm90); these tests keep it
honest for the next attempt. On the GPU it also passes tests/kernels/decode/test_sm90.py
put in sm90's place."""

from __future__ import annotations

import pytest
import torch

from remnant.kernels.decode import sm90
from remnant.kv.layout import KeptColumns, PageLayout
from runners.device import packed_sm90_ws as ws
from tests.kernels.decode.test_sm90 import _inputs, _reference, _relative
from tests.kernels.decode.test_triton import TOLERANCE
from tests.kernels.inputs import DEVICE, keep_map

WHY_NOT = ws.unavailable_reason(DEVICE, ws.KEPT, ws.HEADS)
needs_sm90 = pytest.mark.skipif(WHY_NOT is not None, reason=f"the SM90 lab kernel cannot run here: {WHY_NOT}")


def test_it_keeps_packed_sm90s_contract_off_the_gpu():
    assert ws.unavailable_reason(torch.device("cpu")) == "needs a CUDA GPU"
    with pytest.raises(ValueError, match="the SM90 packed decode needs a CUDA GPU"):
        ws.decode(torch.zeros(1, 64, 512, dtype=torch.bfloat16), None, None, None, None, None, None, None,
                  KeptColumns.of(keep_map(256, torch.Generator().manual_seed(0)), torch.device("cpu")), splits=1)
    for layouts in ((PageLayout.sglang(64, 256), PageLayout.sglang(64)), (PageLayout.rows(328), PageLayout.sglang(64))):
        assert ws.layout_problem(*layouts) == sm90.layout_problem(*layouts)
    assert [ws.splits_per_token(b, 132) for b in (1, 8, 64, 512)] == [sm90.splits_per_token(b, 132)
                                                                       for b in (1, 8, 64, 512)]


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize(("batch", "heads", "topk", "window", "splits"),
                         [(1, 64, 512, 128, None), (3, 64, 512, 128, 16), (9, 64, 512, 0, 3), (64, 64, 512, 128, None),
                          (130, 64, 2048, 128, None), (5, 20, 300, 40, 2), (2, 64, 0, 128, 1), (2, 64, 100, 7, 1)])
def test_matches_the_float64_reference(batch, heads, topk, window, splits):
    x = _inputs(batch, heads, topk, window, seed=batch + topk + window)
    order = x["cols"].order
    if splits is None:
        splits = ws.splits_per_token(batch, torch.cuda.get_device_properties(DEVICE).multi_processor_count)
    got = torch.full_like(x["q"], float("nan"))
    ws.decode(x["q"][:, :, order].contiguous(), x["c4"], x["c4_layout"], x["c4_locs"], x["window"],
              x["window_layout"], x["window_locs"], x["sink"], x["cols"], out=got, splits=splits)
    out = torch.full_like(got, float("nan"))
    out[:, :, order] = got
    assert not out.isnan().any()
    assert _relative(out, _reference(x)) < TOLERANCE
