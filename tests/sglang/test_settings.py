import json

from pathlib import Path

import pytest

from remnant.config_errors import ConfigError
from remnant.sglang.settings import (
    SUPPORTED_SGLANG_VERSIONS,
    Settings,
    check_sglang_version,
    from_env,
    parse_retention,
)


def test_native_is_the_default_and_ignores_retention():
    assert from_env({}) == Settings()
    assert from_env({"REMNANT_MODE": "native", "REMNANT_RETENTION": "192"}).packed is False


def test_uniform_and_per_layer_retention():
    s = from_env({"REMNANT_MODE": "triton", "REMNANT_RETENTION": "192"})
    assert s.mode == "triton" and s.retention == (192,) and s.values(3) == [192, 192, 192]
    s = from_env({"REMNANT_MODE": "triton", "REMNANT_RETENTION": "256, 192,448"})
    assert s.values(3) == [256, 192, 448]
    with pytest.raises(ConfigError, match="REMNANT_RETENTION has 3 values; the model has 21 CSA layers"):
        s.values(21)
    assert from_env({"REMNANT_MODE": "kernel"}).retention == (256,)


@pytest.mark.parametrize("env, message", [
    ({"REMNANT_MODE": "packed"}, "REMNANT_MODE=packed is not a mode; allowed: native, triton, kernel"),
    ({"REMNANT_MODE": "kernel", "REMNANT_RETENTION": "192"},
     "retention=192 is not allowed with mode=kernel; kernel supports retention=256"),
    ({"REMNANT_MODE": "triton", "REMNANT_RETENTION": "512"}, "REMNANT_RETENTION='512' is not allowed; allowed: 64,"),
    ({"REMNANT_MODE": "triton", "REMNANT_RETENTION": "256,100"}, r"REMNANT_RETENTION\[1\]='100' is not allowed"),
    ({"REMNANT_MODE": "triton", "REMNANT_RETENTION_MAP": "/nonexistent/map.json"},
     "REMNANT_RETENTION_MAP=/nonexistent/map.json is not a file"),
])
def test_bad_settings_name_the_variable(env, message):
    with pytest.raises(ConfigError, match=message):
        from_env(env)


def test_hicache_rule_is_the_run_configs_rule():
    from_env({"REMNANT_MODE": "kernel"}).check_hicache(True)  # R=256 may keep HiCache
    from_env({"REMNANT_MODE": "triton", "REMNANT_RETENTION": "192"}).check_hicache(False)
    with pytest.raises(ConfigError, match="hicache=true is not allowed with retention=192; retention other than 256"):
        from_env({"REMNANT_MODE": "triton", "REMNANT_RETENTION": "192"}).check_hicache(True)
    with pytest.raises(ConfigError, match="retention=256,192"):
        from_env({"REMNANT_MODE": "triton", "REMNANT_RETENTION": "256,192"}).check_hicache(True)


def test_map_file_is_accepted(tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({}))
    assert from_env({"REMNANT_MODE": "triton", "REMNANT_RETENTION_MAP": str(path)}).map_path == str(path)


def test_unsupported_sglang_names_the_supported_versions():
    check_sglang_version("0.5.18")
    assert SUPPORTED_SGLANG_VERSIONS == ("0.5.18",)
    with pytest.raises(RuntimeError, match=r"sglang==0.5.17 is not supported .*; supported: 0.5.18"):
        check_sglang_version("0.5.17")


def test_parse_and_export():
    assert parse_retention("64,448") == (64, 448)
    env = Settings("triton", (192,), "map.json").to_env()
    assert env["REMNANT_MODE"] == "triton" and env["REMNANT_RETENTION"] == "192"
    assert env["REMNANT_RETENTION_MAP"].endswith("/map.json")


def test_exported_settings_read_back_as_themselves(tmp_path):
    map_file = tmp_path / "map.json"
    map_file.write_text("{}")
    for s in (Settings(), Settings("kernel", (256,), policy="prefix"), Settings("triton", (256, 192)),
              Settings("triton", (192,), str(map_file), "attention")):
        assert from_env(s.to_env()) == s
    assert Settings("native", (192,), str(map_file), "attention").to_env() == {"REMNANT_MODE": "native"}


def test_a_policy_sglang_cannot_calibrate_is_refused_without_a_map(tmp_path):
    with pytest.raises(ValueError, match="REMNANT_RETENTION_POLICY=attention needs calibration captures"):
        from_env({"REMNANT_MODE": "kernel", "REMNANT_RETENTION_POLICY": "attention"})
    assert from_env({"REMNANT_MODE": "kernel", "REMNANT_RETENTION_POLICY": "prefix"}).packed
    map_file = tmp_path / "map.json"
    map_file.write_text("{}")
    s = from_env({"REMNANT_MODE": "kernel", "REMNANT_RETENTION_POLICY": "attention", "REMNANT_RETENTION_MAP": str(map_file)})
    assert s.map_path == str(map_file)


def test_hicache_rule_reads_the_maps_retention():
    # A valid schema example: R = 64 and 128 on its two layers, neither 256.
    path = Path(__file__).resolve().parents[2] / "schemas/retention-map/examples/valid/attention-two-layers.json"
    s = from_env({"REMNANT_MODE": "triton", "REMNANT_RETENTION_MAP": str(path)})
    s.check_hicache(False)
    with pytest.raises(ValueError, match="hicache=true is not allowed"):
        s.check_hicache(True)


# Parts beyond the C4 records ------------------------------------------------------------


@pytest.mark.parametrize("spelling, name", [("", "float32"), ("fp32", "float32"), ("float32", "float32"),
                                            ("bfloat16", "bfloat16"), (" BF16 ", "bfloat16")])
def test_state_dtype_is_sglangs_own_variable_in_every_mode(spelling, name):
    from remnant.engine.capacity import STATE_DTYPES
    from remnant.sglang.settings import STATE_DTYPE_SPELLINGS

    assert tuple(STATE_DTYPE_SPELLINGS) == tuple(STATE_DTYPES)  # the engine's names, SGLang's spellings
    for mode in ("native", "triton", "kernel"):
        s = from_env({"REMNANT_MODE": mode, "SGLANG_DSV4_COMPRESS_STATE_DTYPE": spelling})
        assert s.compressor_state_dtype == name
        assert s.to_env().get("SGLANG_DSV4_COMPRESS_STATE_DTYPE") == (None if name == "float32" else name)
        assert from_env(s.to_env()) == s


def test_a_state_dtype_sglang_refuses_is_refused_first():
    with pytest.raises(ConfigError, match="SGLANG_DSV4_COMPRESS_STATE_DTYPE=float16 is not allowed; allowed: float32, "
                                          "fp32, bfloat16, bf16"):
        from_env({"SGLANG_DSV4_COMPRESS_STATE_DTYPE": "float16"})


def test_parts_env_is_what_to_env_adds_beyond_mode_and_retention():
    s = Settings("kernel", compressor_state_dtype="bfloat16", index_key_format="mxfp4")
    assert s.parts_env() == {"SGLANG_DSV4_COMPRESS_STATE_DTYPE": "bfloat16", "REMNANT_INDEX_KEY_FORMAT": "mxfp4"}
    assert s.to_env() == {**Settings("kernel").to_env(), **s.parts_env()}
    assert Settings("native").parts_env() == {}


@pytest.mark.parametrize("mode", ["native", "triton", "kernel"])
def test_index_key_format_holds_in_every_mode_and_makes_the_plugin_resize(mode):
    s = from_env({"REMNANT_MODE": mode, "REMNANT_INDEX_KEY_FORMAT": "mxfp4"})
    assert s.index_key_format == "mxfp4" and s.resizes and from_env(s.to_env()) == s
    assert from_env({"REMNANT_MODE": mode}).index_key_format == "fp8"
    assert from_env({"REMNANT_MODE": mode}).resizes == (mode != "native")
    with pytest.raises(ConfigError, match="REMNANT_INDEX_KEY_FORMAT=fp4 is not allowed; allowed: fp8, mxfp4"):
        from_env({"REMNANT_MODE": mode, "REMNANT_INDEX_KEY_FORMAT": "fp4"})


# The hosts that start SGLang pass the settings on -----------------------------------------


def _spec(tmp_path, mode="kernel"):
    from remnant.config import ModelConfig, RetentionConfig
    from remnant.hosts import ServerSpec

    return ServerSpec(mode, None if mode == "native" else RetentionConfig(policy="prefix"),
                      ModelConfig(name="dsv4", tp_size=4), tmp_path, tmp_path / "server.log", run_id="r1")


PARTS = {"compressor_state_dtype": "bfloat16", "index_key_format": "mxfp4"}


@pytest.mark.parametrize("mode", ["native", "kernel"])
def test_local_host_gives_sglang_the_parts(tmp_path, mode):
    from remnant.hosts.local import LocalHost, LocalHostConfig

    cfg = LocalHostConfig(**PARTS)
    cfg.validate()
    host, spec = LocalHost(cfg), _spec(tmp_path, mode)
    env = host._environment(spec, "r1", 31000, 31001)
    assert env["SGLANG_DSV4_COMPRESS_STATE_DTYPE"] == "bfloat16"
    got = from_env(env)
    assert (got.mode, got.compressor_state_dtype, got.index_key_format) == (mode, "bfloat16", "mxfp4")
    assert host._command(spec)[-1] == "--enable-deepseek-v4-fp4-indexer"
    default = LocalHost(LocalHostConfig())
    assert from_env(default._environment(spec, "r1", 31000, 31001)) == Settings(mode, **({} if mode == "native" else
                                                                                       {"policy": "prefix"}))
    assert "--enable-deepseek-v4-fp4-indexer" not in default._command(spec)


def test_modal_host_gives_sglang_the_parts(tmp_path):
    from remnant.hosts.modal import ModalHostConfig, ServeRequest

    app = pytest.importorskip("runners.modal.app", reason="modal is not installed (pip install -e '.[test]')")
    cfg = ModalHostConfig(model_revision="0123abc", **PARTS)
    cfg.validate()
    request = ServeRequest.from_json(ServeRequest.from_spec(_spec(tmp_path), cfg, "tok").to_json())
    argv, env = app.launch_plan(request, app.Settings(model_revision="0123abc"), tmp_path / "ckpt", tmp_path / "work")
    assert from_env(env) == Settings("kernel", (256,), policy="prefix", **PARTS)
    assert argv[-1] == "--enable-deepseek-v4-fp4-indexer"


@pytest.mark.parametrize("cfg, message", [
    ({"server": "embedded", "compressor_state_dtype": "bfloat16"},
     "host.compressor_state_dtype=bfloat16 is not passed to host.server=embedded's remnant-serve"),
    ({"compressor_state_dtype": "float16"}, "host.compressor_state_dtype=float16 is not allowed; allowed: float32, "
                                            "bfloat16"),
    ({"env": {"SGLANG_DSV4_COMPRESS_STATE_DTYPE": "bf16"}},
     "host.env sets SGLANG_DSV4_COMPRESS_STATE_DTYPE; give host.compressor_state_dtype instead"),
    ({"server": "embedded", "index_key_format": "mxfp4"},
     "host.index_key_format=mxfp4 is not passed to host.server=embedded's remnant-serve"),
    ({"index_key_format": "fp4"}, "host.index_key_format=fp4 is not allowed; allowed: fp8, mxfp4"),
    ({"server_args": ["--enable-deepseek-v4-fp4-indexer"]},
     "host.server_args holds --enable-deepseek-v4-fp4-indexer; give host.index_key_format=mxfp4 instead"),
    ({"env": {"REMNANT_INDEX_KEY_FORMAT": "mxfp4"}}, "host.env sets REMNANT_INDEX_KEY_FORMAT"),
])
def test_local_host_refuses_a_part_it_cannot_pass(cfg, message):
    from remnant.hosts.local import LocalHostConfig

    with pytest.raises(ConfigError, match=message):
        LocalHostConfig(**cfg).validate()


# Window and C128 records ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["triton", "kernel"])
def test_packed_csa_windows_round_trip_in_the_packed_modes(mode):
    s = from_env({"REMNANT_MODE": mode, "REMNANT_WINDOW_RECORDS": "packed_csa"})
    assert s.window_records == "packed_csa" and s.packed_windows and from_env(s.to_env()) == s
    assert s.parts_env() == {"REMNANT_WINDOW_RECORDS": "packed_csa"}
    assert not from_env({"REMNANT_MODE": mode}).packed_windows
    # Native ignores them, as it ignores retention.
    assert from_env({"REMNANT_MODE": "native", "REMNANT_WINDOW_RECORDS": "packed"}) == Settings()
    assert Settings("native", window_records="packed_csa").to_env() == {"REMNANT_MODE": "native"}


@pytest.mark.parametrize("env, message", [
    ({"REMNANT_WINDOW_RECORDS": "packed"},
     "REMNANT_WINDOW_RECORDS=packed is not served by the SGLang plugin: packing every layer's window needs maps of "
     "the HCA and window-only layers, calibrated at load, which SGLang cannot do"),
    ({"REMNANT_C128_RECORDS": "packed"},
     "REMNANT_C128_RECORDS=packed is not served by the SGLang plugin: the SGLang plugin does not pack the HCA layers' "
     "C128 records"),
    ({"REMNANT_WINDOW_RECORDS": "all"},
     "REMNANT_WINDOW_RECORDS=all is not allowed; allowed: native, packed_csa, packed"),
])
def test_records_the_plugin_cannot_serve_are_refused(env, message):
    with pytest.raises(ConfigError, match=message):
        from_env({"REMNANT_MODE": "triton", **env})


def _run_config(window_records="native", c128_records="native", host=None):
    from remnant.config import ModeConfig, ModelConfig, RetentionConfig, RunConfig
    from remnant.hosts.modal import ModalHostConfig
    from remnant.workloads.random import RandomWorkloadConfig

    retention = RetentionConfig(policy="prefix", window_records=window_records, c128_records=c128_records)
    return RunConfig(mode=ModeConfig("kernel"), workload=RandomWorkloadConfig(), host=host or ModalHostConfig(),
                     model=ModelConfig(tp_size=4), retention=retention)


def test_run_configs_give_sglang_hosts_the_windows_the_plugin_serves():
    from remnant.config import validate
    from remnant.hosts.local import LocalHostConfig

    validate(_run_config("packed_csa"))
    with pytest.raises(ConfigError, match="retention.window_records=packed is not served by the SGLang plugin: packing "
                                          "every layer's window .*; allowed with SGLang: native, packed_csa"):
        validate(_run_config("packed"))
    with pytest.raises(ConfigError, match="retention.c128_records=packed is not served by the SGLang plugin"):
        validate(_run_config(c128_records="packed"))
    with pytest.raises(ConfigError, match="retention.window_records=packed_csa is served by host=embedded only; "
                                          "host=local's server takes no such setting"):
        validate(_run_config("packed_csa", host=LocalHostConfig(server="embedded")))


def test_hosts_give_the_plugin_the_window_records(tmp_path):
    import dataclasses

    from remnant.config import RetentionConfig
    from remnant.hosts.local import LocalHost, LocalHostConfig
    from remnant.hosts.modal import ModalHostConfig, ServeRequest

    spec = dataclasses.replace(_spec(tmp_path), retention=RetentionConfig(policy="prefix", window_records="packed_csa"))
    env = LocalHost(LocalHostConfig())._environment(spec, "r1", 31000, 31001)
    assert from_env(env).packed_windows
    app = pytest.importorskip("runners.modal.app", reason="modal is not installed (pip install -e '.[test]')")
    request = ServeRequest.from_json(ServeRequest.from_spec(spec, ModalHostConfig(), "tok").to_json())
    _, env = app.launch_plan(request, app.Settings(), tmp_path / "ckpt", tmp_path / "work")
    assert from_env(env) == Settings("kernel", (256,), policy="prefix", window_records="packed_csa")
