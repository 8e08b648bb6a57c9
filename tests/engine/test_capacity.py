"""Pool sizing follows SGLang's DeepSeek-V4 configurator; packing buys capacity as predicted."""

from __future__ import annotations

import dataclasses
import pytest

from remnant.engine.capacity import (
    C4_CSA_SWA,
    C4_CSA_SWA_BF16,
    C4_CSA_SWA_MXFP4_BF16,
    C4_ONLY,
    C4_SWA,
    C4_SWA_C128,
    C4_SWA_C128_MXFP4,
    C4_SWA_C128_MXFP4_BF16,
    NATIVE,
    STANDARD_COMBINATIONS,
    Combination,
    PoolGeometry,
    combination_geometry,
    index_key_bytes,
    pool_bytes,
    request_capacity,
    size_pools,
)

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


# Capacity beyond C4: the stored size of every part, and the combinations.

PART_DEFAULTS = {"swa_record_bytes": 584, "c128_record_bytes": 584, "index_key_bytes": 132, "state_dtype_bytes": 4}


def test_default_parts_are_sglang_and_change_nothing():
    budget = 60 << 30
    implicit, explicit = _geometry(328), _geometry(328, **PART_DEFAULTS)
    assert implicit.indexer_key_bytes() == 132
    assert explicit.bytes_per_full_token() == implicit.bytes_per_full_token()
    assert explicit.c128_state_fixed_bytes() == implicit.c128_state_fixed_bytes()
    assert size_pools(explicit, budget) == size_pools(implicit, budget)
    # The research figure stays, byte for byte.
    native, packed = size_pools(_geometry(584), budget), size_pools(implicit, budget)
    assert round(sum(native.bytes_per_full_token.values()) / sum(packed.bytes_per_full_token.values()), 4) == 1.2113


@pytest.mark.parametrize(("part", "value", "changed"), [
    ("swa_record_bytes", 328, {"swa"}),
    ("c128_record_bytes", 328, {"c128"}),
    ("index_key_bytes", 68, {"c4_indexer"}),
    ("state_dtype_bytes", 2, {"c4_state", "c4_indexer_state", "c128_state"}),
])
def test_each_part_changes_only_its_own_component(part, value, changed):
    budget = 60 << 30
    before, after = _geometry(584), _geometry(584, **{part: value})
    per_before, per_after = before.bytes_per_full_token(), after.bytes_per_full_token()
    assert {k for k in per_before if per_after[k] != per_before[k]} == changed - {"c128_state"}
    for k in changed - {"c128_state"}:  # every part scales its component by its size
        assert per_after[k] / per_before[k] == pytest.approx(value / PART_DEFAULTS[part])
    # Per pool at the same sizes, the fixed C128 state included.
    sizes = size_pools(before, budget)
    sizes.fixed_bytes = {"c128_state": after.c128_state_fixed_bytes()}
    got, want = pool_bytes(after, sizes), pool_bytes(before, size_pools(before, budget))
    assert {k for k in want if got[k] != want[k]} == changed
    assert size_pools(after, budget).full_tokens > size_pools(before, budget).full_tokens


def test_index_key_and_record_sizes():
    assert index_key_bytes("fp8", 128) == 132   # SGLang's configurator: d + 4 d / 128
    assert index_key_bytes("mxfp4", 128) == 68  # SGLang's FP4 indexer pool: d // 2 + 4
    assert index_key_bytes("fp8", 256) == 264 and index_key_bytes("mxfp4", 256) == 136
    with pytest.raises(ValueError, match="index key format='nvfp4' is unknown; allowed: fp8, mxfp4"):
        index_key_bytes("nvfp4", 128)
    g = combination_geometry(_geometry(584), C4_SWA_C128_MXFP4_BF16)
    assert (g.swa_record_bytes, g.c4_record_bytes, g.c128_record_bytes) == (328, [328] * 21, 328)
    assert (g.indexer_key_bytes(), g.state_dtype_bytes) == (68, 2)
    # The geometry's own parts are replaced, not kept.
    assert combination_geometry(g, NATIVE) == _geometry(584, **PART_DEFAULTS)


# Bytes per full token at V4-Flash's shapes (21 CSA, 20 HCA, 43 layers; swa_ratio 0.1):
# what docs/kv.md's "Capacity beyond C4" table states.
LADDER = [
    (NATIVE, "native", 7705.45, 1.0),
    (C4_ONLY, "c4", 6361.45, 1.2113),
    (C4_SWA, "c4+swa", 5260.65, 1.4647),
    (C4_SWA_C128, "c4+swa+c128", 5220.65, 1.4760),
    (C4_SWA_C128_MXFP4, "c4+swa+c128+mxfp4_index", 4884.65, 1.5775),
    (C4_SWA_C128_MXFP4_BF16, "c4+swa+c128+mxfp4_index+bf16_state", 4212.65, 1.8291),
    # Served: the CSA layers' windows packed (21 of 43 layers' 0.1 x 584 -> 328).
    (C4_CSA_SWA, "c4+csa_swa", 5823.85, 1.3231),
    (C4_CSA_SWA_BF16, "c4+csa_swa+bf16_state", 5151.85, 1.4957),
    (C4_CSA_SWA_MXFP4_BF16, "c4+csa_swa+mxfp4_index+bf16_state", 4815.85, 1.6000),
]


@pytest.mark.parametrize("preset", ["dsv4_flash_0731", "dsv4_flash_attn"])
def test_combinations_at_v4_flash_shapes(preset):
    from remnant.engine.capacity_report import load_model_preset

    model = load_model_preset(preset)
    assert model["compress_ratios"] == V4_FLASH_RATIOS
    base = PoolGeometry(model["compress_ratios"], [584] * 21, window_size=model["window_size"],
                        index_head_dim=model["index_head_dim"])
    assert [c for c, *_ in LADDER] == list(STANDARD_COMBINATIONS)
    for combo, name, bpt, ratio in LADDER:
        per = combination_geometry(base, combo).bytes_per_full_token()
        assert combo.name == name
        assert sum(per.values()) == pytest.approx(bpt)
        assert round(7705.45 / sum(per.values()), 4) == ratio
    per = combination_geometry(base, C4_SWA_C128_MXFP4_BF16).bytes_per_full_token()
    assert per == pytest.approx({"swa": 0.1 * 328 * 43, "c4": 328 / 4 * 21, "c128": 328 / 128 * 20,
                                 "c4_indexer": 68 / 4 * 21, "c4_state": 537.6, "c4_indexer_state": 134.4})


def test_combinations_at_a_budget():
    """Tokens follow the per-token ratio, but for bf16 state, which also halves the fixed
    C128 state taken off the budget first (64 + 1 request slots: 8576 rows)."""
    budget = 60 << 30
    base = _geometry(584)
    native = size_pools(base, budget).full_tokens
    for combo, _, bpt, ratio in LADDER:
        s = size_pools(combination_geometry(base, combo), budget)
        if combo.state_dtype == "float32":
            assert s.full_tokens / native == pytest.approx(ratio, abs=2e-4)
            assert s.fixed_bytes["c128_state"] == 8576 * 4096 * 20
        else:
            assert s.fixed_bytes["c128_state"] == 8576 * 2048 * 20
            assert s.full_tokens / native > ratio


def test_combination_names_validation_and_served():
    assert Combination(packed=("c128", "c4")).packed == ("c4", "c128")
    assert Combination(packed=("c128", "c4")) == Combination(packed=("c4", "c128"))
    # The engine serves every combination that packs the C4 records (or nothing).
    assert all(c.served for c in STANDARD_COMBINATIONS)
    assert not Combination(packed=("swa",)).served and not Combination(packed=("c128",)).served
    # bf16 state and MXFP4 keys are served (host.compressor_state_dtype, host.index_key_format):
    # C4 with bf16 state 1.3543x, with MXFP4 keys too 1.4393x (docs/kv.md).
    for combination, name, ratio in ((Combination(packed=("c4",), state_dtype="bfloat16"), "c4+bf16_state", 1.3543),
                                     (Combination(packed=("c4",), state_dtype="bfloat16", index_keys="mxfp4"),
                                      "c4+mxfp4_index+bf16_state", 1.4393)):
        assert combination.served and combination.name == name
        geometry = combination_geometry(_geometry(584), combination)
        assert round(7705.45 / sum(geometry.bytes_per_full_token().values()), 4) == ratio
    assert Combination(packed=("swa",), retention=128).name == "swa"
    for kw, message in (({"packed": ("c4", "window")}, r"packed=\['c4', 'window'\] must name distinct parts of"),
                        ({"packed": ("c4", "c4")}, "must name distinct parts"),
                        ({"retention": 100}, "retention=100 is not allowed"),
                        ({"index_keys": "fp4"}, "index_keys='fp4' is not allowed; allowed: fp8, mxfp4"),
                        ({"state_dtype": "fp16"}, "state_dtype='fp16' is not allowed; allowed: float32, bfloat16"),
                        ({"packed": ("c4", "csa_swa", "swa")}, "names both csa_swa .* and swa"),
                        ({"packed": ("csa_swa",)}, "csa_swa packs the CSA layers' window records with their C4 maps")):
        with pytest.raises(ValueError, match=message):
            Combination(**kw)


@pytest.mark.parametrize(("kw", "message"), [
    ({"swa_record_bytes": 300}, "swa_record_bytes=300 is not a record size; allowed: 136, 200,"),
    ({"c128_record_bytes": 600}, "c128_record_bytes=600 is not a record size"),
    ({"swa_record_bytes": [584, 300]}, "swa_record_bytes has 2 values; the model has 43 layers"),
    ({"swa_record_bytes": [584] * 42 + [300]}, "swa_record_bytes=300 is not a record size"),
    ({"index_key_bytes": 0}, "index_key_bytes=0 must be a positive number of bytes"),
    ({"state_dtype_bytes": 3}, r"state_dtype_bytes=3 is not allowed; allowed: 4 \(float32\), 2 \(bfloat16\)"),
])
def test_bad_part(kw, message):
    with pytest.raises(ValueError, match=message):
        _geometry(584, **kw)


def test_the_engines_pools_hold_every_part():
    import torch

    from remnant.engine.pools import KVPools

    odd_keys = PoolGeometry([0, 4, 128], [584], index_key_bytes=100)
    with pytest.raises(ValueError, match="index keys of 100 bytes at index_head_dim=128 are no indexer key format"):
        KVPools(odd_keys, size_pools(odd_keys, 64 << 20))
    # Served: the pools hold bf16 state and MXFP4 keys (64 code bytes, then 4 exponents).
    served = PoolGeometry([0, 4, 128], [328], state_dtype_bytes=2, index_key_bytes=68)
    pools = KVPools(served, size_pools(served, 64 << 20))
    assert pools.c4_state[1].dtype == torch.bfloat16
    assert (pools.indexer[1].layout.data_bytes, pools.indexer[1].layout.tail_bytes) == (64, 4)
    # Packed window records, per layer: each layer's ring pages in its own record size, the
    # bytes the formula counts allocated, plus each page's padding to whole data rows (the
    # split layout's, as SGLang pads: 128 x 584 -> 130 x 576, 128 x 328 -> 132 x 320).
    windows = PoolGeometry([0, 4, 128], [328], swa_record_bytes=[584, 328, 584])
    pools = KVPools(windows, size_pools(windows, 64 << 20))
    assert [layout.record_bytes for layout in pools.swa.layouts] == [584, 328, 584]
    blocks = pools.swa_blocks.n
    assert pools.allocated_bytes()["swa"] == blocks * (2 * 130 * 576 + 132 * 320)
    assert pools.accounted_bytes()["swa"] == blocks * 128 * (584 + 328 + 584)
    # Packed C128 records: pages of 2, padded to whole 320-byte data rows (2 x 328 -> 3 x 320).
    c128 = PoolGeometry([0, 4, 128], [328], c128_record_bytes=328)
    pools = KVPools(c128, size_pools(c128, 64 << 20))
    assert pools.c128[2].record_bytes == 328 and pools.c128[2].buf.shape[1] == 3 * 320
    assert pools.accounted_bytes()["c128"] == pools.sizes.c128_records * 328


def test_the_engines_pools_serve_1_6x_and_1_83x_at_v4_flash_shapes():
    """The served combinations beyond 1.5x in the engine's own pools at V4-Flash's shapes:
    C4 and the CSA layers' windows packed at R = 256, MXFP4 keys, bf16 state, 1.6000x
    native's bytes per token; with every window and the C128 records packed too, 1.8291x.
    The pools hold the tokens the formula sizes (in 384 MiB with 4 request slots the fixed
    C128 state, which bf16 halves, is a sixth of the budget, so the token ratios are higher:
    1.78x and 2.04x; at 60 GiB the first is 1.61x)."""
    from remnant.engine.pools import KVPools

    budget = 384 << 20
    base = dataclasses.replace(_geometry(584), max_running_requests=4)
    tokens, per_token = {}, {}
    for combo in (NATIVE, C4_CSA_SWA_MXFP4_BF16, C4_SWA_C128_MXFP4_BF16):
        geometry = combination_geometry(base, combo)
        sizes = size_pools(geometry, budget)
        pools = KVPools(geometry, sizes)
        tokens[combo.name] = pools.num_pages * geometry.page_size
        per_token[combo.name] = sum(geometry.bytes_per_full_token().values())
        # What the pools allocate is what the formula counts, plus split pages' padding to
        # whole data rows (under 2 %; a C128 page of 2 records pads to 3 rows), and fits.
        held, counted = pools.allocated_bytes(), pools.accounted_bytes()
        for part, value in counted.items():
            assert value <= held[part] <= value * (1.5 if part == "c128" else 1.02), part
        assert sum(held.values()) - held["padding"] <= budget
    served, every = "c4+csa_swa+mxfp4_index+bf16_state", "c4+swa+c128+mxfp4_index+bf16_state"
    assert round(per_token["native"] / per_token[served], 4) == 1.6
    assert round(per_token["native"] / per_token[every], 4) == 1.8291
    assert tokens == {"native": 42496, served: 75776, every: 86784}
    at_60 = {c.name: size_pools(combination_geometry(_geometry(584), c), 60 << 30).full_tokens
             for c in (NATIVE, C4_CSA_SWA_MXFP4_BF16)}
    assert 1.60 < at_60[served] / at_60["native"] < 1.62
