"""Every conf/ file composes into a valid RunConfig; the run rules reject what they must."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from omegaconf.errors import MissingMandatoryValue

from remnant.cli.errors import ConfigProblem, config_error_line
from remnant.cli.run import register_configs, to_run_config
from remnant.config import RunConfig
from remnant.config_errors import ConfigError
from remnant.workloads.random import RandomWorkloadConfig

CONF = resources.files("remnant.conf")
GROUPS = ["mode", "retention", "workload", "host", "model", "experiment"]
# Options that need a value only the user can give.
REQUIRED = {("host", "external"): ["host.base_url=http://127.0.0.1:1"],
            # SGLang in a container needs a checkpoint directory and GPUs (any directory
            # and id pass the rules; nothing starts).
            ("host", "local"): ["host.gpus=0", f"model.path={Path(__file__).parent}"],
            ("workload", "sharegpt"): ["workload.dataset_path=/nonexistent/sharegpt.json"],
            # 128k in + 8k out is past the tiny model's 64k context: a V4-Flash-sized model.
            ("workload", "long_context"): ["model=dsv4_flash_attn"],
            ("experiment", "ctx128k_out8k_c24"): ["model=dsv4_flash_attn"],
            ("experiment", "ctx128k_out8k_ceiling"): ["model=dsv4_flash_attn"]}


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


def test_every_kind_lives_in_its_module_with_a_conf_file():
    """Workload and host kinds are found by their registries: remnant/<package>/<kind>.py
    holds the config class and conf/<group>/<kind>.yaml composes it."""
    from remnant.hosts.base import HOSTS
    from remnant.workloads.base import WORKLOADS

    for kinds in (WORKLOADS, HOSTS):
        found = kinds.all()
        assert found, kinds.group
        for kind, cls in found.items():
            assert cls.__module__ == f"{kinds.package}.{kind}" and cls.kind == kind
            assert CONF.joinpath(kinds.group, f"{kind}.yaml").is_file()
    with pytest.raises(ConfigError, match="workload.kind=moon is not a workload; allowed: long_context, longswe, "
                                          "random, shared_prefix, sharegpt"):
        WORKLOADS.get("moon")


def test_defaults():
    cfg = _compose([])
    assert (cfg.mode.name, cfg.retention.name, cfg.workload.name, cfg.host.kind, cfg.model.name) == (
        "native", "r256", "random", "embedded", "tiny")
    assert isinstance(cfg.workload, RandomWorkloadConfig)
    assert cfg.workload.counts() == (4, 12)
    assert cfg.workload.request_rate is None  # closed loop unless asked


def test_open_loop_fields_compose_for_every_kind():
    for workload in ("random", "longswe", "shared_prefix"):
        cfg = _compose([f"workload={workload}", "workload.request_rate=2.5", "workload.arrival=constant"])
        assert (cfg.workload.request_rate, cfg.workload.arrival) == (2.5, "constant")


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


def test_window_records():
    assert _compose(["mode=kernel"]).retention.window_records == "native"
    assert _compose(["mode=kernel", "retention.window_records=packed_csa"]).retention.window_records == "packed_csa"
    with pytest.raises(ConfigError, match="retention.window_records=all is not allowed; allowed: native, packed_csa, "
                                          "packed"):
        _compose(["mode=triton", "retention.window_records=all"])
    with pytest.raises(ConfigError, match="retention.c128_records=csa is not allowed; allowed: native, packed"):
        _compose(["mode=triton", "retention.c128_records=csa"])
    with pytest.raises(ConfigError, match="retention.window_records=packed_csa is served by host=embedded only; "
                                          "host=local's server takes no such setting"):
        _compose(["mode=kernel", "host=local", "host.server=embedded", "retention.window_records=packed_csa"])
    with pytest.raises(ConfigError, match="pack HCA or window-only layers, which take one uniform R"):
        _compose(["mode=triton", "retention.c128_records=packed", "retention.per_layer=[128,384]"])
    cfg = _compose(["mode=triton", "retention.window_records=packed", "retention.c128_records=packed"])
    assert cfg.retention.packs_other_layers()


@pytest.mark.parametrize(("override", "message"), [
    ("workload.request_timeout_s=inf", "workload.request_timeout_s=inf must be a finite number > 0"),
    ("workload.flush_timeout_s=0", "workload.flush_timeout_s=0.0 must be a finite number > 0"),
    ("workload.warmup_requests=-1", "workload.warmup_requests=-1 must be >= 0"),
    ("host.kv_budget_mib=0", "host.kv_budget_mib=0.0 must be a finite number > 0"),
    ("host.page_size=100", "host.page_size=100 must be a positive multiple of 128"),
    ("host.swa_ratio=1.5", r"host.swa_ratio=1.5 must be in \(0, 1\]"),
    ("host.device=tpu", "host.device=tpu is not allowed; allowed: cpu, cuda"),
    ("host.decode_path=fast", "host.decode_path=fast is not allowed; allowed: auto, reference, batched, kernels"),
    ("host.dtype=fp16", "host.dtype=fp16 is not allowed; allowed: auto, float32, bfloat16"),
    ("host.cuda_graph_max_bs=0", "host.cuda_graph_max_bs=0 must be >= 1"),
    ("model.n_routed_experts=4", "model.num_experts_per_tok=0 must be in 1..4"),
    ("model.o_lora_rank=64", "model.o_groups=0 must divide model.num_attention_heads=8"),
    ("model.expert_dtype=fp4", "model.expert_dtype=fp4 is not allowed"),
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


@pytest.mark.parametrize(("override", "message"), [
    ("seed=-1", "seed=-1 must be >= 0"),
    ("workload.seed=-1", "workload.seed=-1 must be >= 0"),
    ("host.threads=0", "host.threads=0 must be >= 1"),
    ("host.log_tail_lines=-5", "host.log_tail_lines=-5 must be >= 0"),
    ("host.chunked_prefill_size=0", "host.chunked_prefill_size=0 must be >= 1"),
    ("host.startup_timeout_s=nan", "host.startup_timeout_s=nan must be a finite number > 0"),
    ("model.hidden_size=3", "model.hidden_size=3 must be a positive multiple of 64"),
    ("model.index_topk=0", "model.index_topk=0 must be >= 1"),
    ("model.prompt_vocab_size=300", "model.prompt_vocab_size=300 must be <= model.vocab_size=258"),
    ("model.vocab_size=100", "model.vocab_size=100 is too small for the generated model directory"),
    ("model.rope_theta=0", "model.rope_theta=0 must be a finite number > 0"),
    ("workload.range_ratio=0", r"workload.range_ratio=0.0 must be in \(0, 1\]"),
    ("workload.stall_timeout_s=0", "workload.stall_timeout_s=0.0 must be a finite number > 0"),
    ("workload.deadline_s=-1", "workload.deadline_s=-1.0 must be a finite number > 0"),
    ("workload.max_failed_share=1.5", r"workload.max_failed_share=1.5 must be a share in \[0, 1\]"),
    ("workload.request_rate=0", "workload.request_rate=0.0 must be a finite number > 0"),
    ("workload.request_rate=inf", "workload.request_rate=inf must be a finite number > 0"),
    ("workload.arrival=bursty", "workload.arrival=bursty is not allowed; allowed: poisson, constant"),
    ("workload.saturation_cpu_share=0", "workload.saturation_cpu_share=0.0 must be a finite number > 0"),
    ("workload.saturation_dispatch_p99_ms=-1", "workload.saturation_dispatch_p99_ms=-1.0 must be a finite number > 0"),
    ("workload.input_len=10000000", "workload.input_len=10000000 \\+ workload.output_len=32 = 10000032 tokens per "
                                    "request is more than model=tiny's context length "
                                    "\\(model.max_position_embeddings=65536\\)"),
])
def test_numeric_fields_are_bounded_at_compose_time(override, message):
    with pytest.raises(ConfigError, match=message):
        _compose([override])


def test_every_workload_is_checked_against_the_context():
    with pytest.raises(ConfigError, match="workload.prefix_len=65536 \\+ workload.suffix_len=64 \\+ "
                                          "workload.output_len=16 = 65616 tokens"):
        _compose(["workload=shared_prefix", "workload.prefix_len=65536"])
    with pytest.raises(ConfigError, match="workload.max_input_len=65536 \\+ 128 output tokens"):
        _compose(["workload=sharegpt", "workload.dataset_path=x.json", "workload.max_input_len=65536"])
    assert _compose(["workload.input_len=65504", "workload.output_len=32"]).workload.input_len == 65504


@pytest.mark.parametrize(("override", "line"), [
    ("+workload.concurency=3", "workload.concurency is not a field of workload (kind random); "
                               "did you mean workload.concurrency?"),
    ("+host.port=1", "host.port is not a field of host (kind embedded); its fields: kind, api_key_env, "
                     "startup_timeout_s, "),
    ("++seeed=1", "seeed is not a field of the run config; did you mean seed?"),
])
def test_keys_added_with_plus_are_errors_like_typos(override, line):
    with pytest.raises(ConfigProblem) as err:
        _compose([override])
    assert str(err.value).startswith(line)


@pytest.mark.parametrize(("override", "line"), [
    ("workload.concurency=3", "workload.concurency is not a field of workload; did you mean workload.concurrency?"),
    ("mode=turbo", "mode=turbo is not an option of mode; allowed: kernel, native, triton"),
    ("mode=kernal", "mode=kernal is not an option of mode; allowed: kernel, native, triton; did you mean mode=kernel?"),
    ("workload.concurrency=abc", "workload.concurrency: Value 'abc' of type 'str' could not be converted to Integer"),
    ("workload.output_len=[1", "cannot read the override 'workload.output_len=[1': "),
])
def test_hydra_errors_are_one_line_naming_the_key(override, line):
    with pytest.raises(Exception) as err:
        _compose([override])
    text = config_error_line(err.value)
    assert text.startswith(line) and "\n" not in text
    assert "base_" not in text and "+workload" not in text  # no schema nodes, no append hint


def test_an_unset_environment_variable_is_one_line(monkeypatch):
    monkeypatch.delenv("REMNANT_UNSET_VAR", raising=False)
    GlobalHydra.instance().clear()
    register_configs()
    with initialize_config_module(config_module="remnant.conf", version_base=None):
        cfg = compose(config_name="config", overrides=["workload.output_len=${oc.env:REMNANT_UNSET_VAR}"])
    with pytest.raises(Exception) as err:
        to_run_config(cfg)
    assert config_error_line(err.value, cfg) == (
        "workload.output_len=${oc.env:REMNANT_UNSET_VAR}: environment variable REMNANT_UNSET_VAR is not set; "
        "set it, or give workload.output_len=... on the command line")
