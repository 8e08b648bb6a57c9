"""`remnant-frontier`: the highest load that meets an SLO (remnant.frontier), one search
per run, or a sweep of searches (-m). It takes every group and field of remnant-run
(remnant.cli.run) plus the SLO and the search's bounds.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from remnant.cli.errors import CONFIG_ERRORS, ConfigProblem, ConfigRejected, config_error_line, unknown_keys
from remnant.cli.run import group_options, register_configs, task_config, write_hydra_dir
from remnant.cli.sweep import (SweepAborted, SweepSummary, cell_starts, entry, print_table,
                               stop_after_interrupted_cell, sweep_records)
from remnant.config import validate

#: Config groups remnant-frontier adds to remnant-run's, in the order --help lists them.
FRONTIER_GROUPS = ("slo", "frontier")


def register_frontier_configs() -> None:
    """remnant-run's schemas, with FrontierConfig (a RunConfig plus slo and search) as the
    root schema: conf/frontier_config.yaml composes conf/config.yaml, whose defaults name the root
    schema `run_config`. OmegaConf refuses to merge a RunConfig into a FrontierConfig, so
    the name stands for FrontierConfig in this process rather than naming a second schema."""
    from remnant.frontier import FrontierConfig

    register_configs()
    ConfigStore.instance().store(name="run_config", node=FrontierConfig)


def to_frontier_config(cfg: DictConfig):
    """Composed DictConfig -> remnant.frontier.FrontierConfig, with the run rules (on the
    steps' shared config) and the search's rules enforced."""
    from remnant.frontier import validate_frontier

    unknown = unknown_keys(cfg)
    if unknown:
        raise ConfigProblem(unknown)
    frontier_cfg = OmegaConf.to_object(cfg)
    validate(frontier_cfg.run_config())
    validate_frontier(frontier_cfg)
    return frontier_cfg


class FrontierConfigCheck(Callback):
    """ConfigCheck for remnant-frontier: a mistake leaves no directory behind."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        HydraConfig.instance().set_config(config)
        task = task_config(config)
        try:
            to_frontier_config(task)
        except CONFIG_ERRORS as exc:
            raise ConfigRejected(config_error_line(exc, task)) from None


def print_frontier_summary(sweep: Path, stopped: str | None = None) -> list[tuple[str, str]]:
    """One line per search of a sweep: status, steps and the frontier. Returns (search,
    status) of the searches that did not complete."""
    rows = []
    for name, doc in sweep_records(sweep, "frontier.json"):
        if doc is None:
            rows.append((name, "unreadable", "-", "-"))
            continue
        front = doc.get("frontier") or {}
        load = front.get("load")
        shown = "none" if load is None else f"{'>=' if front.get('at_least') else ''}{load:g}"
        rows.append((name, doc.get("status", "?"), str(len(doc.get("steps") or [])), shown))
    missed = print_table(rows, ("search", "status", "steps", "frontier"),
                          f"searches completed; remnant-report {sweep} plots goodput against load")
    if stopped:
        print(f"remnant-frontier: stopped by {stopped}; the same command with hydra.sweep.dir={sweep} "
              "resumes, reusing the steps written", file=sys.stderr)
    return missed


class FrontierSweepSummary(SweepSummary):
    """SweepSummary for a sweep of searches: one line per search."""

    summary = staticmethod(print_frontier_summary)
    record = "frontier.json"


@hydra.main(version_base=None, config_path="pkg://remnant.conf", config_name="frontier_config")
def _frontier(cfg: DictConfig) -> None:
    from remnant.frontier import run_frontier

    cell_starts()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    try:
        frontier_cfg = to_frontier_config(cfg)
    except CONFIG_ERRORS as exc:
        # A single search was checked before its directory was made (FrontierConfigCheck);
        # in a sweep one bad search must not stop the others.
        message = config_error_line(exc, cfg)
        if not multirun:
            raise ConfigProblem(message) from None
        print(f"remnant-frontier: error: {out_dir.name}: {message}; no search ran there", file=sys.stderr)
        return
    field = frontier_cfg.search.axis().field

    def prepare_step(run_dir: Path, step_cfg) -> None:
        # The step's .hydra/ as remnant-run writes a cell's: the composed config with the
        # step's load, so the step reads like any run directory.
        from omegaconf import open_dict

        task = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
        with open_dict(task):
            task.workload[field] = getattr(step_cfg.workload, field)
        write_hydra_dir(run_dir, task)
        overrides = [*hc.overrides.task, f"workload.{field}={getattr(step_cfg.workload, field)}"]
        (run_dir / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(overrides), encoding="utf-8")

    outcome = run_frontier(frontier_cfg, out_dir, prepare_step=prepare_step)
    front = "none met the SLO" if outcome.frontier is None else f"{field}={outcome.frontier:g}"
    print(f"remnant-frontier: search {outcome.status} ({outcome.stopped}): frontier {front}", file=sys.stderr)
    if outcome.path is None:
        print(f"remnant-frontier: error: {outcome.write_error}", file=sys.stderr)
        if multirun:
            raise SweepAborted(outcome.write_error)
        sys.exit(1)
    print(outcome.path, flush=True)
    if outcome.status == "interrupted":
        stop_after_interrupted_cell(multirun, outcome.signum)
    if outcome.status != "completed" and not multirun:
        sys.exit(1)


def help_text() -> str:
    """`remnant-frontier --help`."""
    rows = [f"  {g:<9} {', '.join(group_options(g))}" for g in FRONTIER_GROUPS]
    return f"""usage: remnant-frontier [-m] [--exit-zero] [GROUP=OPTION ...] [FIELD=VALUE ...]

Find the highest load whose TTFT p99 and TPOT p99 meet an SLO, for one mode and workload:
double the load from search.start until a step misses the SLO or reaches search.max, then
bisect down to search.resolution. The load is workload.concurrency (closed loop, the
default) or workload.request_rate (search.load=request_rate: open loop, requests/s, with
workload.concurrency capping those in flight). Each step is a run directory as
remnant-run writes it (c0001/, c0002/, ... or r0.5/, r1/, ...); frontier.json beside them lists the steps,
their metrics, pass or miss, and the frontier (schema remnant/frontier). stdout carries
only the path of each frontier.json.

Takes every group and field of remnant-run (remnant-run --help), plus:
{chr(10).join(rows)}
  slo.ttft_p99_ms=MS slo.tpot_p99_ms=MS     the SLO (at least one; null is unchecked)
  search.load=concurrency|request_rate
  search.start=1 search.max=64 search.resolution=1 search.max_steps=12

Examples:
  remnant-frontier workload=smoke slo=cpu_smoke search.max=8
  remnant-frontier workload=sharegpt slo=interactive search.load=request_rate search.start=0.5 search.max=16 search.resolution=0.25
  remnant-frontier -m frontier=modes_smoke hydra.sweep.dir=multirun/frontier-modes
  remnant-report multirun/frontier-modes --out report/   goodput against load, each mode's frontier

Resume: the same command with the same hydra.run.dir (hydra.sweep.dir with -m) reuses every
step whose run.json is completed with the same config and request stream, and judges it
anew against the SLO given; force=true runs every step again. Ctrl-C or SIGTERM stops after
the running step is recorded; frontier.json then says interrupted.

Exit status: 0 the search ran to its end (a sweep: every search did); 1 a step failed to
run, or records could not be written (a sweep: any search that did not run to its end,
named on stderr; --exit-zero exits 0 all the same); 2 a configuration mistake; 130 / 143
Ctrl-C / SIGTERM.
"""


def main() -> None:
    """Entry point of `remnant-frontier`."""
    entry("remnant-frontier", help_text, register_frontier_configs, _frontier,
          print_frontier_summary, "search")
