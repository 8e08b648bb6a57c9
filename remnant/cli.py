"""Command-line edge: the only module that imports Hydra.

`remnant-run` composes conf/ (shipped as remnant.conf) against the structured configs of
remnant.config, converts once to plain dataclasses, validates, and hands them to
remnant.run. Add your own config directories with Hydra's --config-dir or
hydra.searchpath.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from remnant.config import (
    ConfigError,
    EmbeddedHostConfig,
    ExternalHostConfig,
    ModeConfig,
    ModelConfig,
    RandomWorkloadConfig,
    RetentionConfig,
    LongContextWorkloadConfig,
    LongSWEWorkloadConfig,
    RunConfig,
    ShareGPTWorkloadConfig,
    SharedPrefixWorkloadConfig,
    validate,
)


def register_configs() -> None:
    """Schemas behind every conf/ file: a typo or a wrong type fails at compose time."""
    cs = ConfigStore.instance()
    cs.store(name="run_config", node=RunConfig)
    cs.store(group="mode", name="base_mode", node=ModeConfig)
    cs.store(group="retention", name="base_retention", node=RetentionConfig)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="workload", name="base_random", node=RandomWorkloadConfig)
    cs.store(group="workload", name="base_shared_prefix", node=SharedPrefixWorkloadConfig)
    cs.store(group="workload", name="base_sharegpt", node=ShareGPTWorkloadConfig)
    cs.store(group="workload", name="base_long_context", node=LongContextWorkloadConfig)
    cs.store(group="workload", name="base_longswe", node=LongSWEWorkloadConfig)
    cs.store(group="host", name="base_embedded", node=EmbeddedHostConfig)
    cs.store(group="host", name="base_external", node=ExternalHostConfig)


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Composed DictConfig -> RunConfig dataclasses, with the run rules enforced."""
    run_cfg = OmegaConf.to_object(cfg)
    validate(run_cfg)
    return run_cfg


def _fail(message: str, code: int = 2) -> None:
    print(f"remnant-run: error: {message}", file=sys.stderr)
    sys.exit(code)


@hydra.main(version_base=None, config_path="pkg://remnant.conf", config_name="config")
def _run(cfg: DictConfig) -> None:
    from omegaconf.errors import MissingMandatoryValue

    from remnant.run import execute_run, record_config_error

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress bar
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    try:
        run_cfg = to_run_config(cfg)
    except MissingMandatoryValue as exc:
        name = getattr(exc, "full_key", "") or str(exc).splitlines()[0]
        message = f"{name} has no value; give it on the command line ({name}=...)"
        if multirun:
            path = record_config_error(run_dir, OmegaConf.to_container(cfg, resolve=False), message)
            print(f"remnant-run: error: {message}", file=sys.stderr)
            print(path, flush=True)
            return
        _fail(message)
    except ConfigError as exc:
        if multirun:
            # One bad cell must not stop a sweep: record why and move to the next cell.
            message = str(exc).splitlines()[0]
            path = record_config_error(run_dir, OmegaConf.to_container(cfg, resolve=False), message)
            print(f"remnant-run: error: {message}", file=sys.stderr)
            print(path, flush=True)
            return
        _fail(str(exc).splitlines()[0])
    try:
        outcome = execute_run(run_cfg, run_dir)
    except FileExistsError as exc:
        _fail(str(exc))
    if outcome.error:
        first, *rest = outcome.error["message"].splitlines() or [""]
        print(f"remnant-run: run {outcome.status} at {outcome.error['stage']}: {first}", file=sys.stderr)
        for line in rest:
            print(f"    {line}", file=sys.stderr)
    if outcome.metrics:
        print(summary_line(outcome.metrics), file=sys.stderr)
    print(outcome.path, flush=True)
    if outcome.status != "completed" and not multirun:
        sys.exit(130 if outcome.status == "interrupted" else 1)


def summary_line(m: dict) -> str:
    def ms(d: dict) -> str:
        return "-" if d["p50"] is None else f"{d['p50']:.1f}"

    return (
        f"measured: {m['completed']} ok, {m['failed']} failed in {m['duration_s']:.1f}s | "
        f"TTFT p50 {ms(m['ttft_ms'])} ms | TPOT p50 {ms(m['tpot_ms'])} ms | "
        f"output {m['output_throughput']:.1f} tok/s | cache hit {m['cache_hit_rate'] or 0:.0%}"
    )


def run_main() -> None:
    """Entry point of `remnant-run`."""
    logging.basicConfig(level=logging.WARNING)
    register_configs()
    _run()
