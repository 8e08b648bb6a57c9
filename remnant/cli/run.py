"""`remnant-run`: one benchmark run, or a sweep of them (-m), composed by Hydra.

remnant-run composes conf/ (shipped as remnant.conf) against the structured configs of
remnant.config, converts once to plain dataclasses, validates, and hands them to
remnant.run. Add your own config directories with Hydra's --config-dir or
hydra.searchpath. Config mistakes become one line (remnant.cli.errors); what a sweep
shares with remnant-frontier (signals, its table, SLURM) is remnant.cli.sweep's. Exit
statuses: remnant.cli.sweep.
"""

from __future__ import annotations

import logging
import re
import sys
from importlib import resources
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from remnant.cli.errors import (CONFIG_ERRORS, SCHEMA_PREFIX, ConfigProblem, ConfigRejected, config_error_line, fail,
                                unknown_keys)
from remnant.cli.sweep import (SweepAborted, cell_starts, disk_error, entry, print_sweep_summary,
                               stop_after_interrupted_cell)
from remnant.config import CaptureConfig, ModeConfig, ModelConfig, RetentionConfig, RunConfig, validate
from remnant.hosts.base import HOSTS
from remnant.kv.modes import MODE_NAMES, mode_of
from remnant.workloads.base import WORKLOADS

#: Config groups a user picks from, in the order --help lists them.
GROUPS = ("mode", "retention", "workload", "host", "model", "capture", "experiment")


def register_configs() -> None:
    """Schemas behind every conf/ file: a typo or a wrong type fails at compose time. An
    open group's kinds (workload, host) come from their registries: conf/<group>/x.yaml
    names its kind's schema as `base_<kind>` in its defaults."""
    cs = ConfigStore.instance()
    cs.store(name="run_config", node=RunConfig)
    cs.store(group="mode", name="base_mode", node=ModeConfig)
    cs.store(group="retention", name="base_retention", node=RetentionConfig)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="capture", name="base_capture", node=CaptureConfig)
    for kinds in (WORKLOADS, HOSTS):
        for kind, cls in kinds.all().items():
            cs.store(group=kinds.group, name=f"{SCHEMA_PREFIX}{kind}", node=cls)
    register_resolvers()


def register_resolvers() -> None:
    """Sweep cells are named by what varies the run: native ignores retention, so its cells
    carry none (conf/config.yaml, hydra.sweep.subdir). Registered at import too, for a
    launcher that resolves the cell's directory in another process (submitit)."""
    OmegaConf.register_new_resolver("remnant_retention", retention_suffix, replace=True)


def retention_suffix(mode: str, retention: str) -> str:
    """A sweep cell's retention part: none for a mode that keeps no retention. A name that
    is no mode keeps it: validation, not the cell's name, reports that mistake."""
    keeps = mode_of(mode).keeps_retention if mode in MODE_NAMES else True
    return f"-{retention}" if keeps else ""


register_resolvers()


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Composed DictConfig -> RunConfig dataclasses, with the run rules enforced. A key no
    structured config declares (added with `+`) is an error, as a typo is."""
    unknown = unknown_keys(cfg)
    if unknown:
        raise ConfigProblem(unknown)
    run_cfg = OmegaConf.to_object(cfg)
    validate(run_cfg)
    return run_cfg


def _plain(cfg: DictConfig) -> dict:
    """The composed config as plain data, resolved where it can be (a missing value cannot)."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001 - an unresolvable config is still worth recording
        return OmegaConf.to_container(cfg, resolve=False)


def task_config(config: DictConfig) -> DictConfig:
    """The run's config without Hydra's own node, as the task function receives it."""
    import copy

    from omegaconf import open_dict, read_write

    task = copy.deepcopy(config)
    with read_write(task), open_dict(task):
        task.pop("hydra", None)
    return task


# ---------------------------------------------------------------------------------------
# --help


def group_options(group: str) -> list[str]:
    """The group's conf/ files, numbers in numeric order (r64 before r128)."""
    folder = resources.files("remnant.conf").joinpath(group)
    names = [p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml")]
    return sorted(names, key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)])


def _defaults() -> dict[str, str]:
    text = resources.files("remnant.conf").joinpath("config.yaml").read_text()
    return dict(re.findall(r"^\s*-\s*(\w+):\s*(\S+)", text, re.M))


def help_text() -> str:
    """`remnant-run --help`: the groups and their options, sweeps, outputs, exit statuses
    and the sibling commands."""
    defaults = _defaults()
    rows = []
    for group in GROUPS:
        default = defaults.get(group)
        options = [f"{o} (default)" if o == default else o for o in group_options(group)]
        if group == "experiment":
            options = ["none (default)", *options]
        rows.append((group, ", ".join(options)))
    import textwrap

    width = max(len(g) for g, _ in rows)
    groups = "\n".join(textwrap.fill(o, 90, initial_indent=f"  {g:<{width}}  ", subsequent_indent=" " * (width + 4))
                       for g, o in rows)
    return f"""usage: remnant-run [-m] [--exit-zero] [GROUP=OPTION ...] [FIELD=VALUE ...]

Run one benchmark: compose a mode, a retention, a workload, a host and a model from
config groups, start the server, drive it over HTTP and write run.json (validated against
schemas/run/). stdout carries only the path of each run.json; progress and errors go to
stderr, so `remnant-run ... | xargs remnant-check` works.

Config groups (GROUP=OPTION):
{groups}
  mode=native ignores retention. Your own groups: --config-dir DIR (DIR/workload/x.yaml).

Fields (FIELD=VALUE): every field is typed and checked before anything starts, e.g.
  workload.concurrency=8 workload.input_len=1024 workload.output_len=64 seed=1
  host.kv_budget_mib=64 workload.stall_timeout_s=60 workload.deadline_s=3600
  Show them all: remnant-run --cfg job [GROUP=OPTION ...]

Sweeps: -m (--multirun) runs one cell per combination, each in its own directory and with
  its own server: remnant-run -m mode=native,triton,kernel seed=0,1,2 workload=smoke
  The same command with the same hydra.sweep.dir resumes: a cell whose run.json is
  completed with the same config and request stream is skipped; any other is run again,
  its earlier records set aside (force=true runs every cell). Ctrl-C or SIGTERM stops the
  sweep after the running cell is recorded; a second one stops at once.
  On SLURM, one job per cell: hydra/launcher=remnant_slurm (GPUs) or remnant_slurm_cpu
  (pip install hydra-submitit-launcher; docs/configs.md).

Outputs: a run writes outputs/DATE/TIME-MODE-WORKLOAD/ (hydra.run.dir=DIR elsewhere); a
  sweep multirun/DATE/TIME/N-MODE[-RETENTION]-WORKLOAD-sSEED/ (hydra.sweep.dir=DIR). Each
  holds run.json, requests.jsonl (one line per request, as it ends), server.log and
  .hydra/ (the composed config).

Exit status: 0 completed (a sweep: every cell completed); 1 failed or degraded (more
  failed requests than workload.max_failed_share; a sweep: any cell failed, was degraded,
  killed or refused its config, each named on stderr); 2 a configuration mistake;
  130 / 143 stopped by Ctrl-C / SIGTERM. --exit-zero: a sweep exits 0 whatever its cells did.

Other commands:
  remnant-check PATH...       validate run.json and other records; flags run directories
                              without run.json (killed runs)
  remnant-report DIR --out D  tables with confidence intervals, paired comparisons, plots
  remnant-frontier            the highest concurrency meeting an SLO (remnant-frontier --help)
  remnant-capture             record calibration captures (remnant-capture --help)
  remnant-serve               the embedded reference engine alone, on a port
  remnant-kernels             time Remnant's Triton kernels against FlashMLA (CUDA GPU)

Hydra's own flags: --cfg job|hydra|all, --info, --config-dir DIR, --hydra-help.
"""


class ConfigCheck(Callback):
    """Checks a single run's config before Hydra makes its run directory, so a mistake
    leaves no directory behind (a sweep records a bad cell in its directory instead)."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        HydraConfig.instance().set_config(config)  # for ${hydra:...} in the run's fields
        task = task_config(config)
        try:
            to_run_config(task)
        except CONFIG_ERRORS as exc:
            raise ConfigRejected(config_error_line(exc, task)) from None


# ---------------------------------------------------------------------------------------
# The run


def write_hydra_dir(run_dir: Path, cfg: DictConfig) -> None:
    """.hydra/ as Hydra writes it (config.yaml, hydra.yaml, overrides.yaml), but only for a
    cell that runs: a skipped cell's files are left as they are (conf/config.yaml sets
    hydra.output_subdir to null, so Hydra itself writes nothing)."""
    from remnant.records.files import write_text, writing

    out = run_dir / ".hydra"
    with writing(out):
        out.mkdir(parents=True, exist_ok=True)
    hc = HydraConfig.get()
    write_text(out / "config.yaml", OmegaConf.to_yaml(cfg))
    write_text(out / "hydra.yaml", OmegaConf.to_yaml(HydraConfig.instance().cfg))
    write_text(out / "overrides.yaml", OmegaConf.to_yaml(hc.overrides.task))


@hydra.main(version_base=None, config_path="pkg://remnant.conf", config_name="config")
def _run(cfg: DictConfig) -> None:
    from remnant.run import execute_run, record_config_error
    from remnant.run_dir import KILLED, RUN_JSON, make_way, previous_outcome

    cell_starts()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress bar
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    try:
        run_cfg = to_run_config(cfg)
    except CONFIG_ERRORS as exc:
        message = config_error_line(exc, cfg)
        # One bad cell must not stop a sweep: record why and move to the next cell. A single
        # run's config was checked before its directory was made (ConfigCheck); where that
        # did not run, it is recorded the same way, so no directory is left without a run.json.
        try:
            make_way(run_dir, None)
            path = record_config_error(run_dir, _plain(cfg), message)
        except OSError as err:
            if multirun:
                raise SweepAborted(disk_error(err, run_dir)) from None
            raise ConfigProblem(message) from None
        print(f"remnant-run: error: {message}", file=sys.stderr)
        print(path, flush=True)
        if not multirun:
            sys.exit(2)
        return
    if previous_outcome(run_dir) is not None and not multirun:
        fail(f"{run_dir / RUN_JSON} exists: a run directory holds one run; give another hydra.run.dir")
    try:
        earlier = make_way(run_dir, run_cfg)
        if earlier.reuse:
            print(f"remnant-run: {run_dir} is complete; skipped (the same config and request stream; "
                  "force=true runs it again)", file=sys.stderr)
            print(run_dir / RUN_JSON, flush=True)
            return
        if earlier.outcome == KILLED:
            print(f"remnant-run: {run_dir} holds an attempt that left no run.json; its files are set aside "
                  f"as *.{KILLED}-*", file=sys.stderr)
        elif earlier.outcome is not None:
            print(f"remnant-run: {run_dir}: {earlier.why}; running it again ({len(earlier.moved)} earlier file(s) "
                  f"set aside as *.{earlier.outcome}-*)", file=sys.stderr)
        write_hydra_dir(run_dir, cfg)
        outcome = execute_run(run_cfg, run_dir)
    except OSError as exc:
        message = disk_error(exc, run_dir)
        if multirun:
            raise SweepAborted(message) from None
        fail(message, 1)
    except KeyboardInterrupt:
        # A signal while run.json was being written: it is written; say where.
        if (run_dir / RUN_JSON).exists():
            print(run_dir / RUN_JSON, flush=True)
        raise
    ended, rest = None, []
    if outcome.error:
        first, *rest = outcome.error["message"].splitlines() or [""]
        ended = f"run {outcome.status} at {outcome.error['stage']}: {first}"
    if ended and outcome.path is not None:
        print(f"remnant-run: {ended}", file=sys.stderr)
        for line in rest:
            print(f"    {line}", file=sys.stderr)
    if outcome.metrics:
        print(summary_line(outcome.metrics), file=sys.stderr)
    if outcome.path is None:
        # No run.json says how the run ended: one line does, and why run.json is missing
        # (a sweep's stop prints it).
        message = f"{ended}; {outcome.write_error}" if ended else outcome.write_error
        if multirun:
            raise SweepAborted(message)
        print(f"remnant-run: error: {message}", file=sys.stderr)
        for line in rest:
            print(f"    {line}", file=sys.stderr)
        sys.exit(1)
    print(outcome.path, flush=True)
    if outcome.status == "interrupted":
        stop_after_interrupted_cell(multirun, outcome.signum)
    if outcome.status != "completed" and not multirun:
        sys.exit(1)


def summary_line(m: dict) -> str:
    def ms(d: dict) -> str:
        return "-" if d["p50"] is None else f"{d['p50']:.1f}"

    return (
        f"measured: {m['completed']} ok, {m['failed']} failed in {m['duration_s']:.1f}s | "
        f"TTFT p50 {ms(m['ttft_ms'])} ms | TPOT p50 {ms(m['tpot_ms'])} ms | "
        f"output {m['output_throughput']:.1f} tok/s | cache hit {m['cache_hit_rate'] or 0:.0%}"
    )


def main() -> None:
    """Entry point of `remnant-run`."""
    entry("remnant-run", help_text, register_configs, _run, print_sweep_summary, "cell")
