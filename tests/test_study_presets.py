"""The H200 study presets (conf/experiment/h200_*.yaml) hold the capacities their comments
state, by SGLang's pool formula (remnant.engine.capacity) at the model and KV budget they
compose: the ceiling preset puts native at 24 requests and the packed modes above it, and
the shared-prefix preset's pool holds G16 in every mode and G32 only in the packed ones."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from remnant.cli.run import register_configs, to_run_config
from remnant.engine.capacity import PoolGeometry, size_pools
from remnant.kv.formats import CSA_RATIO, packed_record_bytes
from remnant.workloads.long_context import ceiling


def _compose(experiment: str):
    GlobalHydra.instance().clear()
    register_configs()
    with initialize_config_module(config_module="remnant.conf", version_base=None):
        return to_run_config(compose(config_name="config", overrides=[f"experiment={experiment}"]))


def _full_tokens(cfg, record_bytes: int) -> int:
    n_c4 = sum(1 for r in cfg.model.compress_ratios if r == CSA_RATIO)
    geometry = PoolGeometry(list(cfg.model.compress_ratios), [record_bytes] * n_c4,
                            max_running_requests=cfg.host.max_running_requests)
    return size_pools(geometry, int(cfg.host.kv_budget_mib * (1 << 20))).full_tokens


def test_the_ceiling_preset_fills_native_with_24_requests():
    cfg = _compose("h200_ctx16k_out1k_ceiling")
    request = cfg.workload.input_len + cfg.workload.output_len
    counts = {}
    for name, record in (("native", 584), ("packed", packed_record_bytes(256))):
        tokens = _full_tokens(cfg, record)
        info = {"capacity": {"max_total_num_tokens": tokens, "page_size": 256,
                             "max_running_requests": cfg.host.max_running_requests}}
        counts[name] = (tokens, ceiling(info, request))
    assert counts == {"native": (425_728, 24), "packed": (515_840, 29)}


@pytest.mark.parametrize(("groups", "native_fits", "packed_fits"), [(16, True, True), (32, False, True),
                                                                     (40, False, False)])
def test_the_shared_prefix_pool_holds_what_its_comment_says(groups, native_fits, packed_fits):
    cfg = _compose("h200_shared_prefix_c16")
    prefix_pages = -(-cfg.workload.prefix_len // 256)
    held = {name: _full_tokens(cfg, record) // 256 // prefix_pages
            for name, record in (("native", 584), ("packed", packed_record_bytes(256)))}
    assert held == {"native": 31, "packed": 38}
    assert (groups <= held["native"], groups <= held["packed"]) == (native_fits, packed_fits)


def test_every_h200_study_runs_the_three_modes_on_the_gpu_model():
    from importlib import resources

    from omegaconf import OmegaConf

    presets = sorted(p.name[:-5] for p in resources.files("remnant.conf").joinpath("experiment").iterdir()
                     if p.name.startswith("h200_"))
    assert len(presets) == 4
    for name in presets:
        cfg = _compose(name)
        assert (cfg.model.name, cfg.host.device) == ("dsv4_flash_h200", "cuda"), name
        raw = OmegaConf.load(str(resources.files("remnant.conf").joinpath("experiment", f"{name}.yaml")))
        assert raw.hydra.sweeper.params.mode == "native,triton,kernel", name
