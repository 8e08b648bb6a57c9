"""Pool sizing follows SGLang's DeepSeek-V4 configurator; packing buys capacity as predicted."""

from __future__ import annotations

import pytest

from remnant.engine.capacity import PoolGeometry, pool_bytes, request_capacity, size_pools

V4_FLASH_RATIOS = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)]  # 43 layers: 21 CSA, 20 HCA


def _geometry(record_bytes: int, **kw) -> PoolGeometry:
    return PoolGeometry(V4_FLASH_RATIOS, [record_bytes] * 21, **kw)


def test_v4_flash_bytes_per_token_by_hand():
    per = _geometry(584).bytes_per_full_token()
    # SGLang's _get_bytes_per_full_token, term by term (swa_ratio 0.1, window 128, ring 8, fp32 state).
    assert per == pytest.approx({
        "swa": 0.1 * 584 * 43,
        "c4": 584 / 4 * 21,
        "c128": 584 / 128 * 20,
        "c4_indexer": 132 / 4 * 21,
        "c4_state": 0.1 * (8 / 128) * (2 * 2 * 512 * 4) * 21,
        "c4_indexer_state": 0.1 * (8 / 128) * (2 * 2 * 128 * 4) * 21,
    })
    assert sum(per.values()) == pytest.approx(7705.45)
    assert sum(_geometry(328).bytes_per_full_token().values()) == pytest.approx(6361.45)


def test_capacity_ratio_is_the_research_figure():
    budget = 60 << 30
    native, packed = size_pools(_geometry(584), budget), size_pools(_geometry(328), budget)
    assert packed.full_tokens / native.full_tokens == pytest.approx(7705.45 / 6361.45, rel=1e-4)
    assert round(7705.45 / 6361.45, 4) == 1.2113  # the original system's measured 1.2113x
    # The C4 pool alone: 584 / 328 times the records per byte.
    c4_native = pool_bytes(_geometry(584), native)["c4"] / native.c4_records
    c4_packed = pool_bytes(_geometry(328), packed)["c4"] / packed.c4_records
    assert c4_native / c4_packed == pytest.approx(584 / 328)


def test_sizes_are_page_aligned_and_within_budget():
    g = _geometry(328, max_running_requests=48)
    s = size_pools(g, 10 << 30)
    assert s.full_tokens % 256 == 0 and s.swa_tokens % 256 == 0
    assert s.c4_records == s.full_tokens // 4 and s.c128_records == s.full_tokens // 128
    assert s.c4_state_slots == s.swa_tokens // 128 * 8
    assert sum(pool_bytes(g, s).values()) <= 10 << 30
    # The fixed C128 state: rows = ceil((49 * 128 + 129) / 128) * 128, 2 x 512 fp32 each, 20 layers.
    assert s.fixed_bytes["c128_state"] == 6528 * 4096 * 20


def test_request_capacity_bounds():
    g = _geometry(584)
    s = size_pools(g, 60 << 30)
    long = request_capacity(g, s, 128 * 1024)
    assert long["bound_by"] == "full_tokens" and long["requests"] == s.full_tokens // (128 * 1024)
    short = request_capacity(g, s, 1000)
    assert short["bound_by"] in ("swa_tokens", "request_slots")


@pytest.mark.parametrize(("kw", "message"), [
    ({"page_size": 100}, "page_size=100 must be a multiple of 128"),
    ({"swa_ratio": 0.0}, r"swa_ratio=0.0 must be in \(0, 1\]"),
    ({"index_head_dim": 64}, "index_head_dim=64 must be a multiple of 128"),
])
def test_bad_geometry(kw, message):
    with pytest.raises(ValueError, match=message):
        _geometry(584, **kw)
    with pytest.raises(ValueError, match="c4_record_bytes has 2 values; the model has 21 CSA layers"):
        PoolGeometry(V4_FLASH_RATIOS, [584, 584])
