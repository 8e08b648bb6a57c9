"""SGLang's own plugin loader against the real sglang 0.5.18 (each check in a fresh process)."""

import pkgutil

import pytest

from tests.sglang.env import needs_sglang, probe, run_loader

pytestmark = needs_sglang

BUDGET = 30 * 2**30  # bytes for the KV pools of one GPU


def test_entry_point_is_in_sglangs_group():
    from importlib.metadata import entry_points

    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP

    eps = [ep for ep in entry_points(group=GENERAL_PLUGINS_GROUP) if ep.name == "remnant"]
    assert [ep.value for ep in eps] == ["remnant.sglang.plugin:register"]


def test_every_patched_symbol_exists():
    from remnant.sglang.plugin import TARGETS

    assert len(TARGETS) == 13
    for target, hook, kind in TARGETS:
        assert callable(pkgutil.resolve_name(target)), target
        assert callable(hook) and kind in ("around", "after")


def test_kernel_mode_loader_patches_every_target():
    patched = probe("patched", REMNANT_MODE="kernel")
    assert patched and all(patched.values()), patched


def test_native_mode_leaves_sglang_untouched():
    patched = probe("patched", REMNANT_MODE="native")
    assert not any(patched.values()), patched
    assert not any(probe("patched").values())  # no REMNANT_MODE at all


@pytest.mark.parametrize("env, message", [
    ({"REMNANT_MODE": "kernel", "REMNANT_RETENTION": "192"},
     "remnant: retention=192 is not allowed with mode=kernel; kernel supports retention=256"),
    ({"REMNANT_MODE": "fast"}, "remnant: REMNANT_MODE=fast is not a mode; allowed: native, triton, kernel"),
    ({"REMNANT_MODE": "kernel", "REMNANT_WINDOW_RECORDS": "packed"},
     "remnant: REMNANT_WINDOW_RECORDS=packed is not served by the SGLang plugin"),
])
def test_bad_settings_stop_the_loader(env, message):
    proc = run_loader(**env)
    assert proc.returncode != 0 and "LOADED" not in proc.stdout
    assert message in proc.stderr


def engine_geometry(got: dict, combination):
    """remnant.engine.capacity's geometry of V4-Flash at the probe's server settings, with
    every part stored as `combination` says."""
    from remnant.engine.capacity import PoolGeometry, combination_geometry
    from tests.sglang.probe import FLASH_RATIOS

    geometry = PoolGeometry(FLASH_RATIOS, [584] * FLASH_RATIOS.count(4), window_size=128, index_head_dim=128,
                            page_size=got["page_size"], swa_ratio=got["swa_ratio"],
                            max_running_requests=got["max_running_requests"])
    return combination_geometry(geometry, combination)


def assert_engine_capacity(got: dict, combination) -> None:
    """SGLang's configurator (with the plugin) sizes as the engine's formula does."""
    from remnant.engine.capacity import size_pools

    geometry = engine_geometry(got, combination)
    assert got["bytes_per_full_token"] == pytest.approx(sum(geometry.bytes_per_full_token().values()), rel=1e-12)
    assert got["max_total_num_tokens"] == size_pools(geometry, BUDGET).full_tokens


def test_packed_capacity_equals_the_engines_analytic_capacity():
    from remnant.engine.capacity import C4_ONLY, NATIVE

    native = probe("configurator", BUDGET, REMNANT_MODE="native")
    packed = probe("configurator", BUDGET, REMNANT_MODE="kernel")
    assert native["class"] == packed["class"] == "DSV4PoolConfigurator"
    assert_engine_capacity(native, NATIVE)
    assert_engine_capacity(packed, C4_ONLY)
    ratio = packed["max_total_num_tokens"] / native["max_total_num_tokens"]
    assert ratio == pytest.approx(native["bytes_per_full_token"] / packed["bytes_per_full_token"], abs=2e-4)
    assert ratio == pytest.approx(1.2113, abs=2e-4)


@pytest.mark.parametrize("mode", ["native", "kernel"])
def test_bf16_compressor_state_counts_as_the_engines_formula(mode):
    """SGLANG_DSV4_COMPRESS_STATE_DTYPE=bfloat16 (host.compressor_state_dtype, passed
    through by the plugin's settings): SGLang's own configurator halves the state terms and
    the fixed C128 state, beside the plugin's packed C4 term, as remnant.engine.capacity."""
    from remnant.engine.capacity import Combination
    from remnant.sglang.settings import Settings

    env = Settings(mode, compressor_state_dtype="bfloat16").to_env()
    assert env["SGLANG_DSV4_COMPRESS_STATE_DTYPE"] == "bfloat16"
    got = probe("configurator", BUDGET, **env)
    fp32 = probe("configurator", BUDGET, REMNANT_MODE=mode)
    packed = ("c4",) if mode == "kernel" else ()
    assert_engine_capacity(got, Combination(packed=packed, state_dtype="bfloat16"))
    state = engine_geometry(got, Combination(packed=packed, state_dtype="bfloat16")).bytes_per_full_token()
    halved = state["c4_state"] + state["c4_indexer_state"]  # what bf16 saves per token: half of fp32's
    assert fp32["bytes_per_full_token"] - got["bytes_per_full_token"] == pytest.approx(halved, rel=1e-12)


def test_sglangs_configurator_alone_counts_fp8_keys_under_the_fp4_indexer():
    """What the plugin mends, in the wheel: SGLang's FP4 indexer pool stores 68 bytes a key
    but SGLang's sizing counts 132 with or without the flag (native, no plugin hooks)."""
    from remnant.sglang.sizing import counted_index_key_bytes, fp4_index_key_bytes

    fp8, fp4 = probe("pool", REMNANT_MODE="native"), probe("pool", "on", REMNANT_MODE="native")
    for got, key in ((fp8, 132), (fp4, fp4_index_key_bytes(128))):
        assert {b[1] for b in got["indexer_buffers"]} == {got["indexer_page_size"] * key}
    assert fp4_index_key_bytes(128) == 68 and counted_index_key_bytes(128) == 132
    alone = probe("configurator", BUDGET, "on", REMNANT_MODE="native")
    assert alone["bytes_per_full_token"] == probe("configurator", BUDGET, REMNANT_MODE="native")["bytes_per_full_token"]


@pytest.mark.parametrize("mode", ["native", "triton", "kernel"])
def test_mxfp4_index_keys_count_the_pools_bytes_as_the_engines_formula(mode):
    from remnant.engine.capacity import Combination
    from remnant.sglang.settings import Settings

    packed = () if mode == "native" else ("c4",)
    env = Settings(mode, index_key_format="mxfp4").to_env()
    assert env["REMNANT_INDEX_KEY_FORMAT"] == "mxfp4"
    got = probe("configurator", BUDGET, "on", **env)
    assert_engine_capacity(got, Combination(packed=packed, index_keys="mxfp4"))
    if packed:  # a packed mode counts what the pool stores, the setting given or not
        alone = probe("configurator", BUDGET, "on", REMNANT_MODE=mode)
        assert alone["bytes_per_full_token"] == got["bytes_per_full_token"]


def test_native_mode_with_mxfp4_keys_registers_the_sizing_hooks_only():
    from remnant.sglang.plugin import SIZING_TARGETS

    patched = probe("patched", REMNANT_MODE="native", REMNANT_INDEX_KEY_FORMAT="mxfp4")
    patched.pop("backend.dequantize_k_cache_paged")
    assert {t for t, on in patched.items() if on} == {t for t, _, _ in SIZING_TARGETS}
    assert len(SIZING_TARGETS) == 2


def test_every_part_sglang_stores_itself_with_packed_c4_gives_the_engines_ratio():
    """C4 records packed, bf16 state and MXFP4 keys: docs/kv.md's 1.4393x per full token."""
    from remnant.engine.capacity import Combination
    from remnant.sglang.settings import Settings

    env = Settings("kernel", compressor_state_dtype="bfloat16", index_key_format="mxfp4").to_env()
    got = probe("configurator", BUDGET, "on", **env)
    native = probe("configurator", BUDGET, REMNANT_MODE="native")
    assert_engine_capacity(got, Combination(packed=("c4",), index_keys="mxfp4", state_dtype="bfloat16"))
    assert native["bytes_per_full_token"] / got["bytes_per_full_token"] == pytest.approx(1.4393, abs=1e-4)


def test_mxfp4_setting_needs_sglangs_fp4_indexer():
    need = "REMNANT_INDEX_KEY_FORMAT=mxfp4 needs SGLang's --enable-deepseek-v4-fp4-indexer"
    for mode in ("native", "kernel"):
        off = probe("server_check", "off", REMNANT_MODE=mode, REMNANT_INDEX_KEY_FORMAT="mxfp4")
        assert need in (off.get("error") or ""), off
        on = probe("server_check", "off", "on", REMNANT_MODE=mode, REMNANT_INDEX_KEY_FORMAT="mxfp4")
        assert on == {"error": None}


def test_triton_per_layer_capacity_counts_each_layers_bytes():
    from tests.sglang.probe import FLASH_RATIOS

    values = [64, 448] * 10 + [192]
    got = probe("configurator", BUDGET, REMNANT_MODE="triton", REMNANT_RETENTION=",".join(map(str, values)))
    native = probe("configurator", BUDGET, REMNANT_MODE="native")
    freed = sum(584 - (r + 72) for r in values) / 4
    assert got["bytes_per_full_token"] == pytest.approx(native["bytes_per_full_token"] - freed, rel=1e-12)
    assert FLASH_RATIOS.count(4) == len(values)


def test_hicache_rule_at_server_args_check():
    on = probe("server_check", "on", REMNANT_MODE="triton", REMNANT_RETENTION="192")
    assert "hicache=true is not allowed with retention=192" in (on.get("error") or ""), on
    assert probe("server_check", "off", REMNANT_MODE="triton", REMNANT_RETENTION="192") == {"error": None}
    assert probe("server_check", "on", REMNANT_MODE="kernel") == {"error": None}  # R=256 may keep HiCache


def test_what_the_hooks_read_exists():
    """Names the hooks read from SGLang's objects besides the patched targets."""
    import dataclasses

    from sglang.srt.layers.attention import deepseek_v4_backend as backend
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4LayerItem, DeepSeekV4TokenToKVPool
    from sglang.srt.model_executor.pool_configurator import DSV4PoolConfigurator

    assert isinstance(backend._is_sm120, bool) and backend._LARGE_INDEXER_QUERY_THRESHOLD > 0
    fields = {f.name for f in dataclasses.fields(backend.DSV4AttnMetadata)}
    assert {"c4_sparse_page_indices", "c4_sparse_topk_lengths", "swa_page_indices", "swa_topk_lengths"} <= fields
    for name in ("store_cache", "forward", "_forward_prefill_sparse"):
        assert callable(getattr(backend.DeepseekV4AttnBackend, name))
    for name in ("get_swa_key_buffer_radix", "get_extra_key_buffer", "set_extra_key_buffer_fused"):
        assert callable(getattr(DeepSeekV4TokenToKVPool, name))
    assert "compress_layer_id" in DeepSeekV4LayerItem._fields
    assert callable(DSV4PoolConfigurator.calculate_pool_sizes)
