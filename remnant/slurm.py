"""SLURM sweeps through Hydra's submitit launcher: what the submitting process adds.

`remnant-run -m hydra/launcher=remnant_slurm ...` submits one SLURM job per cell (a job
array) and waits for them. remnant.cli.sweep calls this module when the launcher is
submitit's SlurmLauncher, so that:

- a request no node of the partition can meet (GPUs, CPUs, memory) is one line naming the
  hydra.launcher field and what the cluster offers, before anything is submitted;
- job states are read from `sacct` and, where the cluster keeps no job accounting (no
  slurmdbd: sacct says "Slurm accounting storage is disabled"), from `squeue`, so a job
  that was cancelled or killed is noticed instead of waited on for ever, and submitit's
  "Bypassing sacct error" warning does not repeat at every poll;
- Ctrl-C or SIGTERM of the submitting process cancels the sweep's jobs, whose cells then
  record themselves as interrupted.

It runs SLURM's own commands (sinfo, sacct, squeue, scancel) and imports submitit, never
Hydra (which stays in remnant.cli).
"""

from __future__ import annotations

import logging
import re
import subprocess
import time
from dataclasses import dataclass

from submitit.core import utils as submitit_utils
from submitit.slurm import slurm as submitit_slurm

#: The state of a job squeue no longer lists: slurmctld forgets a job MinJobAge seconds
#: (300 by default) after it ends, so it has ended.
ENDED = "ENDED"
#: Longest wait between two job-state polls of a sweep, in seconds. Jobs that finish are
#: seen within a second (their result file); this bounds how late a cancelled or killed
#: one is noticed, at one sacct or squeue call a minute.
POLL_MAX_S = 60

log = logging.getLogger("remnant.slurm")


# ---------------------------------------------------------------------------------------
# What the cluster offers, and requests it cannot meet


@dataclass(frozen=True)
class Node:
    """One node of a partition as sinfo reports it: CPUs, memory (MiB), GPUs (gres gpu)."""

    name: str
    partition: str
    cpus: int
    mem_mib: int
    gpus: int

    def offer(self) -> str:
        gpus = f"{self.gpus} GPUs" if self.gpus else "no GPUs"
        return f"node {self.name}: {self.cpus} CPUs, {self.mem_mib} MiB, {gpus}"


def gpu_count(gres: str) -> int:
    """GPUs in an sinfo gres field: "(null)" -> 0, "gpu:4" -> 4, "gpu:h100:8(S:0-1)" -> 8,
    "gpu:a100:2,gpu:v100:2,shard:8" -> 4."""
    total = 0
    for item in re.sub(r"\([^)]*\)", "", gres).split(","):
        parts = item.strip().split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def nodes(partition: str | None) -> tuple[str, list[Node]] | None:
    """The partition's nodes (the default partition when None) and its name; None where
    sinfo cannot answer (sbatch will then say what is wrong)."""
    try:
        p = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%P|%N|%c|%m|%G"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return None
    rows = []
    for line in p.stdout.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5 or not fields[2].isdigit() or not fields[3].isdigit():
            continue
        part, name, cpus, mem, gres = fields
        rows.append((part.endswith("*"), Node(name, part.rstrip("*"), int(cpus), int(mem), gpu_count(gres))))
    if partition is None:
        defaults = {n.partition for is_default, n in rows if is_default}
        if len(defaults) != 1:
            return None
        partition = defaults.pop()
    return partition, [n for _, n in rows if n.partition == partition]


def _asks(params: dict) -> list[tuple[str, str, int]]:
    """(resource, the hydra.launcher field and value that asks, amount per node)."""
    asks = []
    tasks = int(params.get("tasks_per_node") or 1)
    extra = params.get("additional_parameters") or {}
    if params.get("gpus_per_node"):
        asks.append(("gpus", f"gpus_per_node={params['gpus_per_node']}", int(params["gpus_per_node"])))
    elif params.get("gpus_per_task"):
        asks.append(("gpus", f"gpus_per_task={params['gpus_per_task']}", int(params["gpus_per_task"]) * tasks))
    elif params.get("gres") and gpu_count(str(params["gres"])):
        asks.append(("gpus", f"gres={params['gres']}", gpu_count(str(params["gres"]))))
    elif extra.get("gres") and gpu_count(str(extra["gres"])):
        asks.append(("gpus", f"additional_parameters.gres={extra['gres']}", gpu_count(str(extra["gres"]))))
    if params.get("cpus_per_task"):
        asks.append(("cpus", f"cpus_per_task={params['cpus_per_task']}", int(params["cpus_per_task"]) * tasks))
    if params.get("mem_gb"):
        asks.append(("mem_mib", f"mem_gb={params['mem_gb']}", int(params["mem_gb"]) * 1024))
    return asks


def request_problem(params: dict) -> str | None:
    """One line if no node of the partition can meet what each job asks for (a gres, CPU
    or memory request sbatch would refuse), naming the hydra.launcher field and what the
    partition offers; None when a node can, or when sinfo cannot say. params: the
    launcher's config, resolved."""
    partition = params.get("partition")
    found = nodes(partition)
    if found is None:
        return None
    name, members = found
    if not members:
        listing = subprocess.run(["sinfo", "--noheader", "--format=%R"], capture_output=True, text=True)
        known = sorted(set(listing.stdout.split())) if listing.returncode == 0 else []
        hint = f"; partitions: {', '.join(known)}" if known else ""
        return f"hydra.launcher.partition={partition} is not a partition of this cluster{hint}"
    words = {"gpus": "GPUs", "cpus": "CPUs", "mem_mib": "MiB of memory"}
    for resource, field, amount in _asks(params):
        best = max(members, key=lambda n: getattr(n, resource))
        if amount > getattr(best, resource):
            fix = "; hydra/launcher=remnant_slurm_cpu asks for none" if resource == "gpus" else ""
            return (f"hydra.launcher.{field} asks for {amount} {words[resource]} per job on one node; "
                    f"partition {name} has at most {getattr(best, resource)} ({best.offer()}){fix}")
    return None


def submission_error(exc: BaseException) -> str | None:
    """sbatch's refusal, raised by submitit at submission, as one line; None for any other
    error. submitit has already echoed sbatch's own words on stderr."""
    cause = exc.__cause__
    if not (isinstance(exc, submitit_utils.FailedJobError) and isinstance(cause, subprocess.CalledProcessError)):
        return None
    command = cause.cmd if isinstance(cause.cmd, (list, tuple)) else str(cause.cmd).split()
    if not command or command[0] != "sbatch":
        return None
    said = " ".join(str(cause.stderr or exc).split()) or f"exit status {cause.returncode}"
    return f"sbatch refused the sweep's jobs ({said}); check the hydra.launcher fields (remnant-run --cfg hydra)"


# ---------------------------------------------------------------------------------------
# Job states, with or without accounting


def _read_squeue(text: str) -> dict[str, dict[str, str]]:
    out = {}
    for line in text.splitlines():
        job_id, _, state = line.strip().partition("|")
        if job_id and state:
            out[job_id] = {"JobID": job_id, "State": state.split()[0]}
    return out


class JobWatcher(submitit_slurm.SlurmInfoWatcher):
    """submitit's SLURM job-state watcher, which reads sacct, with squeue where sacct
    cannot answer. Without accounting storage submitit's own watcher never learns that
    a job ended without a result (cancelled, killed, out of memory), so a sweep would
    wait on it for ever, warning at every poll.

    `accounting`: None until sacct is first asked, then whether it answers. `folder`:
    the launcher's submitit_folder, where each job's logs go (%j: the job id)."""

    def __init__(self, folder: str, delay_s: int = POLL_MAX_S) -> None:
        super().__init__(delay_s=delay_s)
        self.folder = folder
        self.accounting: bool | None = None
        self.said: set[str] = set()

    def _say_once(self, key: str, message: str) -> None:
        if key not in self.said:
            self.said.add(key)
            log.warning(message)

    def _sacct(self, command: list[str]) -> dict[str, dict[str, str]] | None:
        try:
            p = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self._say_once("sacct", f"sacct failed ({exc}); job states come from squeue")
            return None
        if p.returncode == 0:
            self.accounting = True
            return self.read_info(p.stdout)
        said = " ".join(p.stderr.split())
        if "accounting storage is disabled" in said:
            # No slurmdbd: ask squeue from now on, and say so once.
            self.accounting = False
            log.info("this cluster keeps no job accounting (sacct: %s); job states come from squeue", said)
        else:
            self._say_once("sacct", f"sacct failed ({said or f'exit status {p.returncode}'}); "
                                    "job states come from squeue until it answers")
        return None

    def _squeue(self, ids: set[str]) -> dict[str, dict[str, str]]:
        try:
            p = subprocess.run(["squeue", "--noheader", "--array", "--states=all", "--format=%i|%T",
                                f"--jobs={','.join(sorted(ids))}"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self._say_once("squeue", f"squeue failed ({exc}); job states unknown until it answers")
            return {}
        if p.returncode != 0 and "Invalid job id" not in p.stderr:
            self._say_once("squeue", f"squeue failed ({' '.join(p.stderr.split())}); "
                                     "job states unknown until it answers")
            return {}
        info = _read_squeue(p.stdout) if p.returncode == 0 else {}
        # A job squeue answers for no longer is one slurmctld has forgotten: it ended.
        for job_id in self._registered - self._finished:
            if job_id not in info:
                info[job_id] = {"JobID": job_id, "State": ENDED}
        return info

    def update(self) -> None:
        command = self._make_command()
        if command is None:
            return
        self._num_calls += 1
        info = self._sacct(command) if self.accounting is not False else None
        if info is None:
            info = self._squeue({job_id.split("_")[0] for job_id in self._registered - self._finished})
        self._info_dict.update(info)
        self._last_status_check = time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    def logs(self, job_id: str) -> str:
        """The folder of a job's logs (submitit's %j_%t_log.out and .err)."""
        return self.folder.replace("%j", job_id)

    def _cells(self, job_ids: set[str]) -> list[str]:
        """job_ids without the job arrays' own ids: submitit registers an array's id (A)
        besides its tasks (A_0, A_1, ...), and only the tasks run cells."""
        arrays = {job_id.split("_")[0] for job_id in job_ids if "_" in job_id}
        return sorted(job_id for job_id in job_ids if job_id not in arrays)

    def ended_without_completing(self) -> list[tuple[str, str]]:
        """(job id, state) of each job known to have ended other than COMPLETED."""
        return [(job_id, self._info_dict.get(job_id, {}).get("State", "UNKNOWN"))
                for job_id in self._cells(self._finished)
                if self._info_dict.get(job_id, {}).get("State") != "COMPLETED"]

    def running(self, force: bool = True) -> list[str]:
        """Jobs of this process not known to have ended, after asking the cluster (at once,
        or when submitit's backoff says so: at most every POLL_MAX_S)."""
        if self._registered - self._finished:
            self.update_if_long_enough("force" if force else "standard")
        return self._cells(self._registered - self._finished)


def watch(folder: str) -> JobWatcher:
    """Make submitit's SLURM jobs read their states through a JobWatcher, and keep
    submitit's log lines off stdout (stdout carries only run.json paths): submitit logs to
    its own stdout handler, and its warnings reach stderr through the root logger.
    folder: the launcher's submitit_folder."""
    watcher = JobWatcher(folder)
    # submitit's SlurmJob keeps one watcher for all its jobs, as a class attribute.
    submitit_slurm.SlurmJob.watcher = watcher
    submitit_logger = logging.getLogger("submitit")
    for handler in list(submitit_logger.handlers):
        submitit_logger.removeHandler(handler)
    submitit_logger.setLevel(logging.WARNING)
    return watcher


def cancel(watcher: JobWatcher, wait_s: float = 120) -> list[str]:
    """scancel this sweep's jobs (job arrays) that may not have ended, and wait until they
    have (they get SIGTERM and record their cells as interrupted). A second Ctrl-C stops
    the wait; the jobs are cancelled all the same. Returns the job ids given to scancel."""
    # Not asking the cluster first: cancelling a job that has just ended is harmless, and
    # the cancel goes out even if a second Ctrl-C comes at once.
    arrays = sorted({job_id.split("_")[0] for job_id in watcher._registered - watcher._finished})
    try:
        if arrays:
            subprocess.run(["scancel", *arrays], capture_output=True, timeout=60)
        deadline = time.monotonic() + wait_s
        while arrays and watcher.running() and time.monotonic() < deadline:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    return arrays


def wait_ended(watcher: JobWatcher) -> None:
    """Wait until every job of this sweep has ended (the cells still running when one of
    them ended without a result). Ctrl-C cancels those left (cancel)."""
    try:
        while watcher.running(force=False):
            time.sleep(1)
    except KeyboardInterrupt:
        cancel(watcher)
        raise


def job_error(exc: BaseException) -> str | None:
    """A job that ended without a result (cancelled, killed, timed out) or whose Python
    raised, as one line naming the job, its state and its logs; None for other errors."""
    if not isinstance(exc, (submitit_utils.UncompletedJobError, submitit_utils.FailedJobError)):
        return None
    text = str(exc)
    found = re.search(r"Job (\S+) \(task: \S+\) with path (\S+)\s+has not produced any output \(state: (\S+)\)",
                      text)
    if found:
        job_id, result, state = found.groups()
        logs = result.rpartition("/")[0]
        return f"SLURM job {job_id} ended {state} without finishing its cell; its logs: {logs}/"
    # The job's Python raised: submitit's message holds its traceback, then its log paths.
    trace = text.split("-" * 22)
    last = [line for line in (trace[1] if len(trace) > 2 else text).splitlines() if line.strip()]
    stderr = re.search(r"or at paths:\s+- (\S+)", text)
    where = f"; its log: {stderr.group(1)}" if stderr else ""
    return f"a SLURM job of the sweep failed: {last[-1].strip() if last else type(exc).__name__}{where}"
