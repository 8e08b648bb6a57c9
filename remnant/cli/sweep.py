"""What remnant-run and remnant-frontier share around their Hydra task: signals, the
command's end in one line for every way it can end (`entry`), and sweeps: where they
write, their closing table, SLURM's jobs and stopping them.

Exit status: 0 the run (every cell of a sweep) ran to its end, completed or recorded as
failed in a sweep; 1 a single run failed or was degraded, or records could not be
written; 2 a configuration mistake (nothing ran); 128 + N a signal N stopped it (130
Ctrl-C, 143 SIGTERM).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from remnant.cli.errors import CONFIG_ERRORS, ConfigRejected, config_error_line, fail
from remnant.signals import Interrupted, describe as describe_signal, exit_status, raise_interrupted, signum_of

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


def sweep_records(sweep: Path, file_name: str):
    """(directory name, its `file_name` parsed, or None where unreadable) per subdirectory."""
    import json

    for path in sorted(sweep.glob(f"*/{file_name}")):
        try:
            yield path.parent.name, json.loads(path.read_text())
        except (OSError, ValueError):
            yield path.parent.name, None


def print_table(rows: list[tuple[str, ...]], header: tuple[str, ...], tail: str) -> list[tuple[str, str]]:
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
    for name, doc in sweep_records(sweep, "run.json"):
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
    missed = print_table(rows, ("cell", "status", "out tok/s", "TTFT p50 ms"),
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


def disk_error(exc: OSError, what: str | Path = "the run directory") -> str:
    """A disk error before run.json was written, as one line naming the file (else `what`)."""
    from remnant.records.files import error_line

    return f"{error_line(exc, what)}; run.json could not be written"


def stop_after_interrupted_cell(multirun: bool, signum: int) -> None:
    """A cell recorded as interrupted stops its sweep: the launcher lets a KeyboardInterrupt
    through, and entry reports it. In a launcher's job (SLURM: the sweep was started by
    another process) there is no sweep here to stop: end the job with the signal's exit
    status, without a traceback in its log."""
    if multirun and _SWEEP["dir"] is None:
        sys.exit(exit_status(signum))
    raise Interrupted(signum)

def _install_signal_handlers() -> None:
    """SIGINT and SIGTERM raise remnant.signals.Interrupted, which remembers the signal for
    the exit status. A SIGINT ignored by whoever started us (a background job) stays so."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, raise_interrupted)
    signal.signal(signal.SIGTERM, raise_interrupted)


def cell_starts() -> None:
    """Each cell's task function starts here. In a SLURM job (submitit's launcher) entry
    did not run, and submitit ignores SIGTERM: take SIGTERM back, so a cancelled job
    (scancel, a time limit) records its cell as interrupted, as Ctrl-C does here."""
    _SWEEP["cells_here"] += 1
    if signal.getsignal(signal.SIGTERM) is not raise_interrupted:
        _install_signal_handlers()


def entry(prog: str, help_text_of, register, body, summary, what: str) -> None:
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
        fail(str(exc), 2, prog)
    except CONFIG_ERRORS as exc:
        _remove_empty_sweep_dir()
        fail(config_error_line(exc), 2, prog)
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
        fail(disk_error(exc, _SWEEP["dir"] or "the run directory"), 1, prog)
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
        fail(refused, 2, prog)
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
