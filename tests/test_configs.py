"""Every conf/ file composes into a valid RunConfig; the run rules reject what they must."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from omegaconf.errors import MissingMandatoryValue

from remnant.cli import register_configs, to_run_config
from remnant.config import ConfigError, RandomWorkloadConfig, RunConfig

CONF = resources.files("remnant.conf")
GROUPS = ["mode", "retention", "workload", "host", "model", "experiment"]
# Options that need a value only the user can give.
REQUIRED = {("host", "external"): ["host.base_url=http://127.0.0.1:1"],
            # SGLang in a container needs a checkpoint directory and GPUs (any directory
            # and id pass the rules; nothing starts).
            ("host", "local"): ["host.gpus=0", f"model.path={Path(__file__).parent}"],
            ("workload", "sharegpt"): ["workload.dataset_path=/nonexistent/sharegpt.json"]}


def _options(group: str) -> list[str]:
    return sorted(p.name[:-5] for p in CONF.joinpath(group).iterdir() if p.name.endswith(".yaml"))


def _compose(overrides: list[str]) -> RunConfig:
    GlobalHydra.instance().clear()
    register_configs()
    with initialize_config_module(config_module="remnant.conf", version_base=None):
        return to_run_config(compose(config_name="config", overrides=overrides))


CASES = [(g, o) for g in GROUPS for o in _options(g)]


@pytest.mark.parametrize(("group", "option"), CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_every_conf_file_composes(group, option):
    cfg = _compose([f"{group}={option}", *REQUIRED.get((group, option), [])])
    if group == "experiment":
        assert cfg.workload.name == option  # an experiment names its runs after itself
    elif group != "host":
        assert getattr(cfg, group).name == option  # file name and `name` field agree


def test_groups_hold_what_the_design_names():
    assert _options("mode") == ["kernel", "native", "triton"]
    assert _options("retention") == [f"r{r}" for r in (128, 192, 256, 320, 384, 448, 64)]
    assert {"random", "smoke"} <= set(_options("workload"))
    assert {"embedded", "external"} <= set(_options("host"))
    assert "tiny" in _options("model")


def test_defaults():
    cfg = _compose([])
    assert (cfg.mode.name, cfg.retention.name, cfg.workload.name, cfg.host.kind, cfg.model.name) == (
        "native", "r256", "random", "embedded", "tiny")
    assert isinstance(cfg.workload, RandomWorkloadConfig)
    assert cfg.workload.counts() == (4, 12)


@pytest.mark.parametrize("retention", ["r64", "r128", "r192", "r320", "r384", "r448"])
def test_kernel_accepts_only_r256(retention):
    with pytest.raises(ConfigError, match=rf"retention={retention[1:]} is not allowed with mode=kernel; kernel supports retention=256"):
        _compose(["mode=kernel", f"retention={retention}"])
    assert _compose(["mode=kernel", "retention=r256"]).retention.retention == 256


@pytest.mark.parametrize("retention", ["r64", "r192", "r448"])
def test_triton_takes_any_step(retention):
    assert _compose(["mode=triton", f"retention={retention}"]).retention.name == retention


def test_hicache_requires_r256():
    with pytest.raises(ConfigError, match="hicache=true is not allowed with retention=r128"):
        _compose(["mode=triton", "retention=r128", "hicache=true"])
    _compose(["mode=triton", "retention=r256", "hicache=true"])
    _compose(["mode=native", "retention=r128", "hicache=true"])  # native ignores retention


def test_per_layer_retention_checks_length_and_values():
    with pytest.raises(ConfigError, match="retention.per_layer has 1 values; model=tiny has 2 CSA layers"):
        _compose(["mode=triton", "retention.per_layer=[128]"])
    with pytest.raises(ConfigError, match=r"retention.per_layer\[1\]=100 is not allowed; allowed: 64, 128"):
        _compose(["mode=triton", "retention.per_layer=[128,100]"])
    assert _compose(["mode=triton", "retention.per_layer=[128,384]"]).retention.values() == [128, 384]


def test_unknown_mode_value():
    with pytest.raises(ConfigError, match="mode=fast is not a mode; allowed: native, triton, kernel"):
        _compose(["mode.name=fast"])


def test_typo_and_wrong_type_fail_at_compose_time():
    with pytest.raises(ConfigCompositionException):
        _compose(["workload.concurency=3"])
    with pytest.raises(ConfigCompositionException):
        _compose(["workload.concurrency=abc"])
    with pytest.raises(ConfigCompositionException):
        _compose(["mode=turbo"])


def test_external_host_needs_base_url(monkeypatch):
    monkeypatch.delenv("REMNANT_BASE_URL", raising=False)
    with pytest.raises(MissingMandatoryValue, match="base_url"):
        _compose(["host=external"])
    monkeypatch.setenv("REMNANT_BASE_URL", "http://127.0.0.1:30000")
    assert _compose(["host=external"]).host.base_url == "http://127.0.0.1:30000"


def test_bad_compress_ratio():
    with pytest.raises(ConfigError, match=r"model.compress_ratios\[1\]=8 is not allowed"):
        _compose(["model.compress_ratios=[0,8,128,4]"])


def test_retention_map_path_and_policy(tmp_path):
    with pytest.raises(ConfigError, match="retention.map_path=.*nowhere.json is not a file"):
        _compose(["mode=triton", f"retention.map_path={tmp_path}/nowhere.json"])
    with pytest.raises(ConfigError, match="retention.policy=oracle is not a policy; allowed: magnitude"):
        _compose(["mode=kernel", "retention.policy=oracle"])
    assert _compose(["mode=kernel", "retention.policy=prefix"]).retention.policy == "prefix"


@pytest.mark.parametrize(("override", "message"), [
    ("workload.request_timeout_s=inf", "workload.request_timeout_s=inf must be a finite number > 0"),
    ("workload.flush_timeout_s=0", "workload.flush_timeout_s=0.0 must be a finite number > 0"),
    ("workload.warmup_requests=-1", "workload.warmup_requests=-1 must be >= 0"),
    ("host.kv_budget_mib=0", "host.kv_budget_mib=0.0 must be a finite number > 0"),
    ("host.page_size=100", "host.page_size=100 must be a positive multiple of 128"),
    ("host.swa_ratio=1.5", r"host.swa_ratio=1.5 must be in \(0, 1\]"),
    ("host.device=tpu", "host.device=tpu is not allowed; allowed: cpu, cuda"),
    ("host.decode_path=fast", "host.decode_path=fast is not allowed; allowed: auto, reference, kernels"),
    ("host.native_decode=fast", "host.native_decode=fast is not allowed; allowed: auto, flashmla, triton"),
    ("host.native_decode=flashmla", "host.native_decode=flashmla needs host.device=cuda"),
])
def test_ranges_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        _compose([override])


def test_kernels_decode_path_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="host.decode_path=kernels with host.device=cpu needs TRITON_INTERPRET=1"):
        _compose(["host.decode_path=kernels"])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _compose(["host.decode_path=kernels"]).host.decode_path == "kernels"


@pytest.mark.parametrize("url", ["localhost:30000", "http://[::1", "ftp://127.0.0.1:1"])
def test_external_base_url_must_be_http(url):
    with pytest.raises(ConfigError, match="is not an http\\(s\\) URL"):
        _compose(["host=external", f"host.base_url='{url}'"])
