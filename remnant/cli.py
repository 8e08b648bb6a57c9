"""Command-line edge: the only module that imports Hydra.

`remnant-run` composes conf/ (shipped as remnant.conf) against the structured configs of
remnant.config, converts once to plain dataclasses, validates, and hands them to
remnant.run. Add your own config directories with Hydra's --config-dir or
hydra.searchpath.

Exit status: 0 the run (every cell of a sweep) ran to its end, completed or recorded as
failed in a sweep; 1 a single run failed or was degraded, or records could not be
written; 2 a configuration mistake (nothing ran); 128 + N a signal N stopped it (130
Ctrl-C, 143 SIGTERM). Every mistake is one line naming the key, the value and what is
allowed (a close match where there is one), never a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
import signal
import sys
from importlib import resources
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)

from remnant.config import CaptureConfig, ModeConfig, ModelConfig, RetentionConfig, RunConfig, validate
from remnant.config_errors import ConfigError
from remnant.hosts.base import HOSTS
from remnant.kv.modes import MODE_NAMES, mode_of
from remnant.signals import Interrupted, describe as describe_signal, exit_status, raise_interrupted, signum_of
from remnant.workloads.base import WORKLOADS

#: Config groups a user picks from, in the order --help lists them.
GROUPS = ("mode", "retention", "workload", "host", "model", "capture", "experiment")
#: ConfigStore nodes that are schemas behind the group files, not options.
SCHEMA_PREFIX = "base_"


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


# ---------------------------------------------------------------------------------------
# Config mistakes, each as one line


class ConfigProblem(ValueError):
    """A configuration mistake, already worded as one line for the user."""


class ConfigRejected(BaseException):
    """A single run's config mistake found before its directory is made. A BaseException,
    since Hydra turns a callback's Exception into a warning and carries on."""


def _close(word: str, choices: list[str]) -> str | None:
    found = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return found[0] if found else None


def _kind_of(node: object) -> str:
    kind = getattr(node, "kind", None) if not isinstance(node, DictConfig) else node.get("kind")
    return f" (kind {kind})" if isinstance(kind, str) and kind != "???" else ""


def unknown_key_message(full_key: str, fields: list[str], where: str) -> str:
    """`full_key` is not a field: say so with the closest field, or list them."""
    prefix, _, key = full_key.rpartition(".")
    close = _close(key, fields)
    head = f"{full_key} is not a field of {where}"
    if close:
        return f"{head}; did you mean {prefix + '.' if prefix else ''}{close}?"
    return f"{head}; its fields: {', '.join(fields)}"


def _fields(obj_type: object) -> list[str] | None:
    return [f.name for f in dataclasses.fields(obj_type)] if dataclasses.is_dataclass(obj_type) else None


def _where(prefix: str, node: object) -> str:
    return f"{prefix}{_kind_of(node)}" if prefix else "the run config"


def unknown_keys(cfg: DictConfig, prefix: str = "") -> str | None:
    """The first key of `cfg` that its structured config does not declare (one added with
    `+` or `++`, which OmegaConf.to_object would drop without a word), as one line."""
    fields = _fields(OmegaConf.get_type(cfg))
    for key in cfg.keys():
        full = f"{prefix}{key}"
        if fields is not None and key not in fields:
            return unknown_key_message(full, fields, _where(prefix.rstrip("."), cfg))
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not (node._is_none() or node._is_missing() or node._is_interpolation()):
            found = unknown_keys(node, f"{full}.")
            if found:
                return found
    return None


def _raw(cfg: DictConfig | None, name: str) -> object:
    if cfg is None:
        return None
    raw: object = OmegaConf.to_container(cfg, resolve=False)
    for part in name.split("."):
        raw = raw.get(part) if isinstance(raw, dict) else None
    return raw


def missing_value_message(cfg: DictConfig, name: str) -> str:
    """What to do about a config value that is missing: give it on the command line, or
    set the environment variable the config reads it from (`${oc.env:VAR,???}`)."""
    raw = _raw(cfg, name)
    env = re.findall(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)", raw) if isinstance(raw, str) else []
    if env:
        return f"{name} has no value: set {env[0]} in the environment, or give it on the command line ({name}=...)"
    return f"{name} has no value; give it on the command line ({name}=...)"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0].strip()


def config_error_line(exc: BaseException, cfg: DictConfig | None = None) -> str:
    """A config mistake (Hydra's, OmegaConf's or a Remnant rule) as one line naming the
    key, the value and what is allowed."""
    if isinstance(exc, (ConfigProblem, ConfigError)):
        return _first_line(exc)
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        options = sorted(o for o in (exc.options or []) if not o.startswith(SCHEMA_PREFIX))
        if group and options:
            close = _close(option, options)
            hint = f"; did you mean {group}={close}?" if close else ""
            return f"{group}={option} is not an option of {group}; allowed: {', '.join(options)}{hint}"
    if isinstance(exc, OverrideParseException):
        return f"cannot read the override {exc.override!r}: {_first_line(exc)} (Hydra's override grammar)"
    # Hydra wraps OmegaConf's errors; the cause names the key.
    cause = exc
    while isinstance(cause, HydraException) and cause.__cause__ is not None:
        cause = cause.__cause__
    if isinstance(cause, OmegaConfBaseException):
        full_key = getattr(cause, "full_key", None) or ""
        msg = (getattr(cause, "msg", None) or _first_line(cause)).strip().splitlines()[0]
        if isinstance(cause, MissingMandatoryValue) and full_key:
            return missing_value_message(cfg, full_key) if cfg is not None else f"{full_key} has no value"
        if isinstance(cause, InterpolationResolutionError):
            env = re.search(r"Environment variable '([^']+)' not found", msg)
            raw = _raw(cfg, full_key)
            shown = f"{full_key}={raw}" if isinstance(raw, str) else full_key
            if env:
                return (f"{shown}: environment variable {env.group(1)} is not set; set it, or give "
                        f"{full_key}=... on the command line")
            return f"{shown}: {msg}"
        if type(cause).__name__ in ("ConfigKeyError", "ConfigAttributeError") and full_key:
            fields = _fields(getattr(cause, "object_type", None))
            if fields is not None:
                parent = full_key.rpartition(".")[0]
                return unknown_key_message(full_key, fields, _where(parent, None))
        if full_key:
            return f"{full_key}: {msg}"
        return msg
    return _first_line(exc)


CONFIG_ERRORS = (ConfigProblem, ConfigError, HydraException, OmegaConfBaseException)


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


def _task_config(config: DictConfig) -> DictConfig:
    """The run's config without Hydra's own node, as the task function receives it."""
    import copy

    from omegaconf import open_dict, read_write

    task = copy.deepcopy(config)
    with read_write(task), open_dict(task):
        task.pop("hydra", None)
    return task


def _fail(message: str, code: int = 2, prog: str = "remnant-run") -> None:
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(code)


# ---------------------------------------------------------------------------------------
# --help


def _options(group: str) -> list[str]:
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
        options = [f"{o} (default)" if o == default else o for o in _options(group)]
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


def capture_help_text() -> str:
    """`remnant-capture --help`."""
    return """usage: remnant-capture [GROUP=OPTION ...] [FIELD=VALUE ...]

Record calibration captures: remnant-run with capture=on. A native server (host=embedded,
or host=local: a container of the serving image, SGLang or the embedded engine) serves the
workload; each CSA layer hands its first capture.tokens decode queries (after RoPE) and
first capture.records C4 latents (before FP8) to a recorder, which writes
capture.safetensors (remnant-capture/1) into the run directory: at once when every layer
has both, else when the workload ends (the run asks for it before it stops the server).
run.json records the file's fingerprint; every map built from it, and every run that
serves with that map, carries it on.

  remnant-capture workload=smoke                          # embedded engine, CPU, seconds
  BENCH_DATASET_PATH=sharegpt.json remnant-capture workload=sharegpt
  remnant-capture workload=longswe capture.tokens=512
  BENCH_DATASET_PATH=sharegpt.json remnant-capture host=local model=dsv4_flash_0731 \\
      host.gpus=0,1,2,3 workload=sharegpt
  python -m remnant.kv.build_map --captures outputs/.../capture.safetensors \\
      --policy attention --retention 256 --out map.json
  remnant-run mode=kernel retention.map_path=map.json

Fields: capture.tokens (256), capture.records (4096), capture.source (default: the
workload's name; evaluate policies on a source they were not calibrated on).
host=external and host=modal are refused: Remnant cannot hand those servers capture
settings or bring their file back.
Everything else is remnant-run's (remnant-run --help); the capture needs mode=native.
"""


def capture_main() -> None:
    """Entry point of `remnant-capture`: remnant-run with capture=on."""
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(capture_help_text())
        return
    if not any(a.startswith(("capture=", "+capture=", "++capture=")) for a in sys.argv[1:]):
        sys.argv.insert(1, "capture=on")
    run_main()


# ---------------------------------------------------------------------------------------
# Sweeps: where they write, their end, and stopping them

#: The running sweep's directory (set when it starts; None for a single run), whether it
#: existed before the sweep, how many of its cells ran in this process (none where a
#: launcher ran them as SLURM jobs), the JobWatcher of its SLURM jobs (remnant.slurm), and
#: the record each cell writes (run.json, frontier.json).
_SWEEP: dict = {"dir": None, "existed": False, "cells_here": 0, "slurm": None, "record": "run.json",
                "not_completed": []}
#: remnant-run's and remnant-frontier's own flag (taken out before Hydra reads the command
#: line): a sweep exits 0 even where cells did not complete, as before exit status 1 was.
EXIT_ZERO_FLAG = "--exit-zero"


class SweepAborted(BaseException):
    """Stops a sweep where no later cell can do better (its records cannot be written).
    A BaseException, so Hydra's launcher does not record it as one cell's failure."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.message, self.code = message, code


def _sweep_records(sweep: Path, file_name: str):
    """(directory name, its `file_name` parsed, or None where unreadable) per subdirectory."""
    import json

    for path in sorted(sweep.glob(f"*/{file_name}")):
        try:
            yield path.parent.name, json.loads(path.read_text())
        except (OSError, ValueError):
            yield path.parent.name, None


def _print_table(rows: list[tuple[str, ...]], header: tuple[str, ...], tail: str) -> list[tuple[str, str]]:
    """A sweep's closing table on stderr: name, status, then right-aligned columns; then
    how many of the rows completed. Returns (name, status) of the rows that did not."""
    if not rows:
        return []
    widths = [max(len(r[i]) for r in [*rows, header]) for i in range(len(header))]
    for row in (header, *rows):
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])] + [v.rjust(w) for v, w in zip(row[2:], widths[2:])]
        print(("\n" if row is header else "") + "  ".join(cells).rstrip(), file=sys.stderr)
    print(f"{sum(r[1] == 'completed' for r in rows)} of {len(rows)} {tail}", file=sys.stderr)
    return [(r[0], r[1]) for r in rows if r[1] != "completed"]


def print_sweep_summary(sweep: Path, stopped: str | None = None) -> list[tuple[str, str]]:
    """One line per cell: status and headline metrics; then how many completed. Returns
    (cell, status) of the cells that did not complete."""
    from remnant.run_dir import leftovers

    rows = []
    for name, doc in _sweep_records(sweep, "run.json"):
        if doc is None:
            rows.append((name, "unreadable", "-", "-"))
            continue
        m = doc.get("metrics") or {}
        ttft = (m.get("ttft_ms") or {}).get("p50")
        rows.append((name, doc.get("status", "?"),
                     "-" if m.get("output_throughput") is None else f"{m['output_throughput']:.1f}",
                     "-" if ttft is None else f"{ttft:.1f}"))
    # A cell killed before it wrote run.json (a SLURM job killed or out of memory) is a row
    # too: the same command runs it again.
    recorded = {r[0] for r in rows}
    rows += [(d.name, "killed", "-", "-") for d in sorted(sweep.iterdir() if sweep.is_dir() else [])
             if d.is_dir() and d.name not in recorded and leftovers(d)]
    rows.sort(key=lambda r: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", r[0])])
    missed = _print_table(rows, ("cell", "status", "out tok/s", "TTFT p50 ms"),
                          f"cells completed; remnant-report {sweep} for tables and plots")
    if stopped:
        print(f"remnant-run: sweep stopped by {stopped}; the same command with hydra.sweep.dir={sweep} "
              "runs the cells left", file=sys.stderr)
    return missed


class SweepSummary(Callback):
    """Notes where a sweep (`-m`) writes, and ends it with one line per cell (`summary`).
    With submitit's SLURM launcher it first checks what each job asks of the cluster, and
    watches the jobs (remnant.slurm)."""

    summary = staticmethod(print_sweep_summary)
    #: The record each cell writes, whose path goes to stdout.
    record = "run.json"

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        sweep = Path(str(config.hydra.sweep.dir))
        _SWEEP.update(dir=sweep, existed=sweep.exists(), cells_here=0, slurm=None, not_completed=[])
        launcher = config.hydra.get("launcher")
        if launcher is not None and launcher.get("_target_") == _SLURM_LAUNCHER:
            from remnant import slurm

            params = OmegaConf.to_container(launcher, resolve=True)
            problem = slurm.request_problem(params)
            if problem:
                raise ConfigRejected(problem)
            _SWEEP["slurm"] = slurm.watch(str(params["submitit_folder"]))
        _SWEEP["record"] = self.record

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        _print_records_from_elsewhere()
        _SWEEP["not_completed"] = self.summary(Path(str(config.hydra.sweep.dir)))


def _print_records_from_elsewhere() -> None:
    """Where the cells ran in other processes (SLURM jobs), they printed their records'
    paths into their own logs: print each cell's here, as a sweep in this process does."""
    sweep = _SWEEP["dir"]
    if sweep is not None and _SWEEP["cells_here"] == 0:
        for path in sorted(sweep.glob(f"*/{_SWEEP['record']}")):
            print(path, flush=True)


class ConfigCheck(Callback):
    """Checks a single run's config before Hydra makes its run directory, so a mistake
    leaves no directory behind (a sweep records a bad cell in its directory instead)."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        HydraConfig.instance().set_config(config)  # for ${hydra:...} in the run's fields
        task = _task_config(config)
        try:
            to_run_config(task)
        except CONFIG_ERRORS as exc:
            raise ConfigRejected(config_error_line(exc, task)) from None


def _remove_empty_sweep_dir() -> None:
    """A sweep stopped by a config mistake before any cell ran: remove the directory it
    made (holding only Hydra's multirun.yaml), so no run directory is left without a run."""
    sweep = _SWEEP["dir"]
    if sweep is None or _SWEEP["existed"] or not sweep.is_dir():
        return
    if all(p.name == "multirun.yaml" for p in sweep.iterdir()):
        for p in sweep.iterdir():
            p.unlink()
        sweep.rmdir()


def _disk_error(exc: OSError, what: str | Path = "the run directory") -> str:
    """A disk error before run.json was written, as one line naming the file (else `what`)."""
    from remnant.records.files import error_line

    return f"{error_line(exc, what)}; run.json could not be written"


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

    _cell_starts()
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
                raise SweepAborted(_disk_error(err, run_dir)) from None
            raise ConfigProblem(message) from None
        print(f"remnant-run: error: {message}", file=sys.stderr)
        print(path, flush=True)
        if not multirun:
            sys.exit(2)
        return
    if previous_outcome(run_dir) is not None and not multirun:
        _fail(f"{run_dir / RUN_JSON} exists: a run directory holds one run; give another hydra.run.dir")
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
        message = _disk_error(exc, run_dir)
        if multirun:
            raise SweepAborted(message) from None
        _fail(message, 1)
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
        _stop_after_interrupted_cell(multirun, outcome.signum)
    if outcome.status != "completed" and not multirun:
        sys.exit(1)


def _stop_after_interrupted_cell(multirun: bool, signum: int) -> None:
    """A cell recorded as interrupted stops its sweep: the launcher lets a KeyboardInterrupt
    through, and _entry reports it. In a launcher's job (SLURM: the sweep was started by
    another process) there is no sweep here to stop: end the job with the signal's exit
    status, without a traceback in its log."""
    if multirun and _SWEEP["dir"] is None:
        sys.exit(exit_status(signum))
    raise Interrupted(signum)


def summary_line(m: dict) -> str:
    def ms(d: dict) -> str:
        return "-" if d["p50"] is None else f"{d['p50']:.1f}"

    return (
        f"measured: {m['completed']} ok, {m['failed']} failed in {m['duration_s']:.1f}s | "
        f"TTFT p50 {ms(m['ttft_ms'])} ms | TPOT p50 {ms(m['tpot_ms'])} ms | "
        f"output {m['output_throughput']:.1f} tok/s | cache hit {m['cache_hit_rate'] or 0:.0%}"
    )


def _install_signal_handlers() -> None:
    """SIGINT and SIGTERM raise remnant.signals.Interrupted, which remembers the signal for
    the exit status. A SIGINT ignored by whoever started us (a background job) stays so."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, raise_interrupted)
    signal.signal(signal.SIGTERM, raise_interrupted)


def _cell_starts() -> None:
    """Each cell's task function starts here. In a SLURM job (submitit's launcher) _entry
    did not run, and submitit ignores SIGTERM: take SIGTERM back, so a cancelled job
    (scancel, a time limit) records its cell as interrupted, as Ctrl-C does here."""
    _SWEEP["cells_here"] += 1
    if signal.getsignal(signal.SIGTERM) is not raise_interrupted:
        _install_signal_handlers()


def _entry(prog: str, help_text_of, register, body, summary, what: str) -> None:
    """What remnant-run and remnant-frontier do around their Hydra task: --help, the
    schemas, signals, and one line (and the sweep's table) for every way it can end.
    what: the unit a sweep is made of ("cell", "search"), for the stop message."""
    logging.basicConfig(level=logging.WARNING)
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(help_text_of())
        return
    register()
    exit_zero = EXIT_ZERO_FLAG in sys.argv[1:]
    sys.argv[1:] = [a for a in sys.argv[1:] if a != EXIT_ZERO_FLAG]
    # Hydra's errors reach this function instead of being printed (with a traceback, or
    # a hint that does not fit typed configs) and ending in exit status 1.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    _install_signal_handlers()
    try:
        body()
        _exit_if_cells_missed(prog, what, exit_zero)
    except ConfigRejected as exc:
        _fail(str(exc), 2, prog)
    except CONFIG_ERRORS as exc:
        _remove_empty_sweep_dir()
        _fail(config_error_line(exc), 2, prog)
    except KeyboardInterrupt as exc:
        signum = signum_of(exc)
        if _SWEEP["slurm"] is not None:
            _cancel_slurm_jobs(prog, what)
            _print_records_from_elsewhere()
        if _SWEEP["dir"] is not None:
            summary(_SWEEP["dir"], stopped=describe_signal(signum))
        else:
            print(f"{prog}: stopped by {describe_signal(signum)}", file=sys.stderr)
        sys.exit(exit_status(signum))
    except SweepAborted as exc:
        print(f"{prog}: error: {exc.message}", file=sys.stderr)
        if _SWEEP["dir"] is not None:
            summary(_SWEEP["dir"], stopped=f"an error no later {what} can avoid")
        sys.exit(exc.code)
    except OSError as exc:
        _fail(_disk_error(exc, _SWEEP["dir"] or "the run directory"), 1, prog)
    except Exception as exc:
        if _SWEEP["slurm"] is None:
            raise
        _slurm_error(exc, prog, summary)


def _exit_if_cells_missed(prog: str, what: str, exit_zero: bool) -> None:
    """A sweep that ran to its end with cells failed, degraded or killed exits 1, naming
    them, so a script or CI sees it; --exit-zero keeps 0 (the summary table still shows them)."""
    missed = _SWEEP["not_completed"]
    if not missed:
        return
    shown = ", ".join(f"{name} ({status})" for name, status in missed[:5])
    more = f" and {len(missed) - 5} more" if len(missed) > 5 else ""
    if exit_zero:
        print(f"{prog}: {len(missed)} {what}(s) did not complete: {shown}{more}; exit 0 ({EXIT_ZERO_FLAG})",
              file=sys.stderr)
        return
    print(f"{prog}: error: {len(missed)} {what}(s) did not complete: {shown}{more} "
          f"({EXIT_ZERO_FLAG} exits 0 all the same)", file=sys.stderr)
    sys.exit(1)


#: hydra.launcher._target_ of Hydra's submitit launcher for SLURM (remnant.slurm's).
_SLURM_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"


def _cancel_slurm_jobs(prog: str, what: str) -> None:
    """Ctrl-C or SIGTERM of a SLURM sweep's submitting process: cancel its jobs, which
    record their cells as interrupted, and wait for them (a second signal stops waiting)."""
    from remnant import slurm

    print(f"{prog}: cancelling the sweep's SLURM jobs; each records its {what} as interrupted "
          "(Ctrl-C again stops waiting for them)", file=sys.stderr)
    cancelled = slurm.cancel(_SWEEP["slurm"])
    if cancelled:
        print(f"{prog}: scancel {' '.join(cancelled)}", file=sys.stderr)


def _slurm_error(exc: Exception, prog: str, summary) -> None:
    """An error of a SLURM sweep as one line: sbatch refused the jobs (exit 2, nothing
    ran), or a job ended without finishing its cell (exit 1, once the sweep's other jobs
    have ended, with the sweep's table)."""
    from remnant import slurm

    refused = slurm.submission_error(exc)
    if refused:
        _fail(refused, 2, prog)
    line = slurm.job_error(exc)
    if line is None:
        raise exc
    print(f"{prog}: error: {line}", file=sys.stderr)
    watcher = _SWEEP["slurm"]
    try:
        slurm.wait_ended(watcher)
    except KeyboardInterrupt as stop:
        _print_records_from_elsewhere()
        summary(_SWEEP["dir"], stopped=describe_signal(signum_of(stop)))
        sys.exit(exit_status(signum_of(stop)))
    # Hydra's launcher stops at the first job that ended without its result; say which
    # others did too.
    for job_id, state in watcher.ended_without_completing():
        if f"job {job_id} " not in line:
            print(f"{prog}: error: SLURM job {job_id} ended {state}; its logs: {watcher.logs(job_id)}/",
                  file=sys.stderr)
    _print_records_from_elsewhere()
    summary(_SWEEP["dir"])
    print(f"{prog}: the same command with hydra.sweep.dir={_SWEEP['dir']} runs again what did not complete",
          file=sys.stderr)
    sys.exit(1)


def run_main() -> None:
    """Entry point of `remnant-run`."""
    _entry("remnant-run", help_text, register_configs, _run, print_sweep_summary, "cell")


# ---------------------------------------------------------------------------------------
# remnant-frontier: the highest load that meets an SLO (remnant.frontier)

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
        task = _task_config(config)
        try:
            to_frontier_config(task)
        except CONFIG_ERRORS as exc:
            raise ConfigRejected(config_error_line(exc, task)) from None


def print_frontier_summary(sweep: Path, stopped: str | None = None) -> list[tuple[str, str]]:
    """One line per search of a sweep: status, steps and the frontier. Returns (search,
    status) of the searches that did not complete."""
    rows = []
    for name, doc in _sweep_records(sweep, "frontier.json"):
        if doc is None:
            rows.append((name, "unreadable", "-", "-"))
            continue
        front = doc.get("frontier") or {}
        load = front.get("load")
        shown = "none" if load is None else f"{'>=' if front.get('at_least') else ''}{load:g}"
        rows.append((name, doc.get("status", "?"), str(len(doc.get("steps") or [])), shown))
    missed = _print_table(rows, ("search", "status", "steps", "frontier"),
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

    _cell_starts()
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
        _stop_after_interrupted_cell(multirun, outcome.signum)
    if outcome.status != "completed" and not multirun:
        sys.exit(1)


def frontier_help_text() -> str:
    """`remnant-frontier --help`."""
    rows = [f"  {g:<9} {', '.join(_options(g))}" for g in FRONTIER_GROUPS]
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


def frontier_main() -> None:
    """Entry point of `remnant-frontier`."""
    _entry("remnant-frontier", frontier_help_text, register_frontier_configs, _frontier,
           print_frontier_summary, "search")


if __name__ == "__main__":  # python -m remnant.cli, where the console script is not installed
    run_main()
