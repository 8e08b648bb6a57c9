import os

import pytest

from remnant.cli.sglang_launch import enable_plugin, keyed, split_args


def test_remnant_flags_become_env_and_the_rest_goes_to_sglang(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "map.json").write_text("{}")
    env, rest = split_args(["--model-path", "/m", "--remnant-mode", "triton", "--tp", "4",
                            "--remnant-retention", "192", "--remnant-retention-map", "map.json"], environ={})
    assert rest == ["--model-path", "/m", "--tp", "4"]
    assert env == {"REMNANT_MODE": "triton", "REMNANT_RETENTION": "192",
                   "REMNANT_RETENTION_MAP": os.path.abspath("map.json")}


def test_flags_override_the_environment_and_are_written_by_settings():
    env, _ = split_args(["--remnant-retention", "128"], environ={"REMNANT_MODE": "triton", "REMNANT_RETENTION": "256",
                                                                "REMNANT_RETENTION_POLICY": "prefix"})
    assert env == {"REMNANT_MODE": "triton", "REMNANT_RETENTION": "128", "REMNANT_RETENTION_POLICY": "prefix"}
    with pytest.raises(ValueError, match="REMNANT_RETENTION_POLICY=attention needs calibration captures"):
        split_args(["--remnant-mode", "kernel", "--remnant-retention-policy", "attention"], environ={})


def test_bad_mode_flag_is_refused():
    with pytest.raises(SystemExit):
        split_args(["--remnant-mode", "packed"])


def test_plugin_stays_allowed_under_a_sglang_plugins_whitelist(monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "other")
    monkeypatch.setenv("REMNANT_MODE", "native")  # so the undo removes what enable_plugin sets
    enable_plugin({"REMNANT_MODE": "kernel"})
    assert os.environ["SGLANG_PLUGINS"] == "other,remnant" and os.environ["REMNANT_MODE"] == "kernel"


def test_capture_flags_become_env_and_turn_cuda_graphs_off(tmp_path):
    path = tmp_path / "cap.safetensors"
    env, rest = split_args(["--model-path", "/models/V4", "--remnant-capture", str(path), "--tp", "4",
                            "--remnant-capture-tokens", "64", "--remnant-capture-records", "512",
                            "--remnant-capture-source", "sharegpt"], environ={})
    assert rest == ["--model-path", "/models/V4", "--tp", "4", "--disable-cuda-graph"]
    assert env == {"REMNANT_MODE": "native", "REMNANT_CAPTURE": str(path), "REMNANT_CAPTURE_TOKENS": "64",
                   "REMNANT_CAPTURE_RECORDS": "512", "REMNANT_CAPTURE_SOURCE": "sharegpt",
                   "REMNANT_CAPTURE_MODEL_ID": "/models/V4"}  # the model id defaults to --model-path
    env, rest = split_args(["--model-path=/m", "--disable-cuda-graph", "--remnant-capture-model-id", "org/V4"],
                           environ={"REMNANT_CAPTURE": str(path)})
    assert rest == ["--model-path=/m", "--disable-cuda-graph"]  # given once
    assert env["REMNANT_CAPTURE_MODEL_ID"] == "org/V4" and env["REMNANT_CAPTURE_TOKENS"] == "256"
    _, rest = split_args(["--model-path", "/m"], environ={})
    assert rest == ["--model-path", "/m"]  # no capture: SGLang's CUDA graphs stay as they are


def test_capture_with_a_packed_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="REMNANT_CAPTURE=.* is not allowed with REMNANT_MODE=kernel"):
        split_args(["--remnant-mode", "kernel", "--remnant-capture", str(tmp_path / "c.safetensors")], environ={})
    with pytest.raises(ValueError, match="REMNANT_CAPTURE_RECORDS='many' is not an integer"):
        split_args(["--remnant-capture", str(tmp_path / "c.safetensors"), "--remnant-capture-records", "many"],
                   environ={})


def test_the_key_in_the_environment_becomes_sglangs_api_key():
    from types import SimpleNamespace

    args = SimpleNamespace(api_key=None)
    keyed(args, {"REMNANT_API_KEY": "sk-sglang-test-key"})
    assert args.api_key == "sk-sglang-test-key"
    given = SimpleNamespace(api_key="sk-from-its-own-flag")
    keyed(given, {"REMNANT_API_KEY": "sk-sglang-test-key"})
    assert given.api_key == "sk-from-its-own-flag"
    unset = SimpleNamespace(api_key=None)
    keyed(unset, {})
    assert unset.api_key is None
