"""Command-line edge: the only module that imports Hydra.

`remnant-run` composes conf/ (shipped as remnant.conf) against the structured configs of
remnant.config, converts once to plain dataclasses, validates, and hands them to
remnant.run. Add your own config directories with Hydra's --config-dir or
hydra.searchpath.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.experimental.callback import Callback
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from remnant.config import (
    ConfigError,
    EmbeddedHostConfig,
    ExternalHostConfig,
    LocalHostConfig,
    ModalHostConfig,
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
    cs.store(group="host", name="base_local", node=LocalHostConfig)
    cs.store(group="host", name="base_modal", node=ModalHostConfig)


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Composed DictConfig -> RunConfig dataclasses, with the run rules enforced."""
    run_cfg = OmegaConf.to_object(cfg)
    validate(run_cfg)
    return run_cfg


def _plain(cfg: DictConfig) -> dict:
    """The composed config as plain data, resolved where it can be (a missing value cannot)."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001 - an unresolvable config is still worth recording
        return OmegaConf.to_container(cfg, resolve=False)


def missing_value_message(cfg: DictConfig, name: str) -> str:
    """What to do about a config value that is missing: give it on the command line, or
    set the environment variable the config reads it from (`${oc.env:VAR,???}`)."""
    raw: object = OmegaConf.to_container(cfg, resolve=False)
    for part in name.split("."):
        raw = raw.get(part) if isinstance(raw, dict) else None
    env = re.findall(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)", raw) if isinstance(raw, str) else []
    if env:
        return f"{name} has no value: set {env[0]} in the environment, or give it on the command line ({name}=...)"
    return f"{name} has no value; give it on the command line ({name}=...)"


def _fail(message: str, code: int = 2) -> None:
    print(f"remnant-run: error: {message}", file=sys.stderr)
    sys.exit(code)


@hydra.main(version_base=None, config_path="pkg://remnant.conf", config_name="config")
def _run(cfg: DictConfig) -> None:
    from omegaconf.errors import MissingMandatoryValue

    from remnant.run import execute_run, previous_outcome, record_config_error, set_aside

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress bar
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    try:
        run_cfg = to_run_config(cfg)
    except (MissingMandatoryValue, ConfigError) as exc:
        if isinstance(exc, MissingMandatoryValue):
            name = getattr(exc, "full_key", "") or str(exc).splitlines()[0]
            message = missing_value_message(cfg, name)
        else:
            message = str(exc).splitlines()[0]
        if multirun:
            # One bad cell must not stop a sweep: record why and move to the next cell.
            path = record_config_error(run_dir, _plain(cfg), message)
            print(f"remnant-run: error: {message}", file=sys.stderr)
            print(path, flush=True)
            return
        _fail(message)
    previous = previous_outcome(run_dir)
    if previous is not None:
        if not multirun:
            _fail(f"{run_dir / 'run.json'} exists: a run directory holds one run")
        if previous == "completed" and not run_cfg.force:
            print(f"remnant-run: {run_dir} is complete; skipped (force=true runs it again)", file=sys.stderr)
            print(run_dir / "run.json", flush=True)
            return
        set_aside(run_dir, previous)
    outcome = execute_run(run_cfg, run_dir)
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


class SweepSummary(Callback):
    """Ends a sweep (`-m`) with one line per cell: status and headline metrics."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        import json

        sweep = Path(config.hydra.sweep.dir)
        rows = []
        for path in sorted(sweep.glob("*/run.json")):
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError):
                rows.append((path.parent.name, "unreadable", "-", "-"))
                continue
            m = doc.get("metrics") or {}
            ttft = (m.get("ttft_ms") or {}).get("p50")
            rows.append((path.parent.name, doc.get("status", "?"),
                         "-" if m.get("output_throughput") is None else f"{m['output_throughput']:.1f}",
                         "-" if ttft is None else f"{ttft:.1f}"))
        if not rows:
            return
        width = max(len(r[0]) for r in rows)
        print(f"\n{'cell':<{width}}  {'status':<11}  {'out tok/s':>9}  {'TTFT p50 ms':>11}", file=sys.stderr)
        for cell, status, tput, ttft in rows:
            print(f"{cell:<{width}}  {status:<11}  {tput:>9}  {ttft:>11}", file=sys.stderr)
        print(f"{sum(r[1] == 'completed' for r in rows)} of {len(rows)} cells completed; "
              f"remnant-report {sweep} for tables and plots", file=sys.stderr)


def run_main() -> None:
    """Entry point of `remnant-run`."""
    logging.basicConfig(level=logging.WARNING)
    register_configs()
    _run()


if __name__ == "__main__":  # python -m remnant.cli, where the console script is not installed
    run_main()
