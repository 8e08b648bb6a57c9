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
