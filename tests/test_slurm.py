"""Sweeps on a real single-node SLURM cluster through Hydra's submitit launcher.

Tests marked `slurm` start munged, slurmctld and slurmd as root (tests/slurm_cluster.py;
.ci/run installs slurm-wlm and munge) and run real sweeps of the embedded engine on the
smoke workload: each cell a SLURM job, run.json per cell, the closing table, a cell that
fails, jobs cancelled (scancel) and killed (scancel --signal=KILL) and the sweep resumed,
Ctrl-C of the submitting process, and requests the cluster cannot meet. Where SLURM cannot
start they skip and say why. The cluster keeps no job accounting, as small ones do.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import slurm_cluster
from tests.signals import default_sigint

BIN = Path(sys.executable).parent
#: A sweep on the CPU preset, each job one CPU and 2 GB (the test node offers 4 CPUs).
CPU_SWEEP = ("-m", "hydra/launcher=remnant_slurm_cpu", "workload=smoke")


def test_slurm_presets_compose():
    """Both presets compose onto submitit's SLURM launcher (no cluster needed)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from remnant.cli.run import register_configs

    GlobalHydra.instance().clear()
    register_configs()
    with initialize_config_module(config_module="remnant.conf", version_base=None):
        gpu = compose(config_name="config", overrides=["hydra/launcher=remnant_slurm"], return_hydra_config=True)
        cpu = compose(config_name="config", overrides=["hydra/launcher=remnant_slurm_cpu"], return_hydra_config=True)
    GlobalHydra.instance().clear()
    target = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert gpu.hydra.launcher._target_ == cpu.hydra.launcher._target_ == target
    assert (gpu.hydra.launcher.gpus_per_node, gpu.hydra.launcher.tasks_per_node) == (4, 1)
    assert (cpu.hydra.launcher.gpus_per_node, cpu.hydra.launcher.cpus_per_task, cpu.hydra.launcher.mem_gb) == (0, 1, 2)


@pytest.mark.parametrize("gres, gpus", [
    ("(null)", 0), ("gpu:4", 4), ("gpu:h100:8(S:0-1)", 8), ("gpu:a100:2,gpu:v100:2,shard:8", 4), ("shard:8", 0),
])
def test_gpus_are_counted_from_sinfo_gres(gres, gpus):
    pytest.importorskip("submitit")
    from remnant.slurm import gpu_count

    assert gpu_count(gres) == gpus


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="hydra-submitit-launcher is not installed")
    why = slurm_cluster.cannot_start()
    if why:
        pytest.skip(why)
    try:
        c = slurm_cluster.start()
    except RuntimeError as exc:
        pytest.skip(f"SLURM could not start here: {exc}")
    yield c
    c.stop()


def remnant_run(cluster, *args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "remnant-run"), *args], cwd=cwd, env=cluster.env, capture_output=True,
                          text=True, timeout=timeout)


def _doc(cell: Path) -> dict:
    return json.loads((cell / "run.json").read_text())


def _snapshot(directory: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(directory)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _jobs_of(sweep: Path) -> list[str]:
    """The sweep's SLURM jobs (array tasks A_I) that have started, by their log folders."""
    return sorted(p.name for p in (sweep / ".submitit").iterdir() if p.is_dir() and "_" in p.name)


def _wait_for_requests(proc: subprocess.Popen, cells: list[Path], lines: int = 3, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    for cell in cells:
        requests = cell / "requests.jsonl"
        while not (requests.exists() and len(requests.read_text().splitlines()) >= lines):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"{requests} has not {lines} lines"
            time.sleep(0.2)


def _no_noise(p) -> None:
    """No traceback and no submitit warning at every poll ("Bypassing sacct error"): one
    line says that the cluster keeps no accounting and where job states come from."""
    text = p.stdout + p.stderr
    assert "Traceback" not in text and "Bypassing" not in text and "submitit" not in text, p.stderr
    assert text.count("sacct") == 1 and ("this cluster keeps no job accounting (sacct: Slurm accounting storage "
                                         "is disabled); job states come from squeue") in p.stderr


@pytest.mark.slow
@pytest.mark.slurm
def test_a_sweep_runs_each_cell_as_a_job_records_a_failed_cell_and_resumes(cluster, tmp_path):
    """Two cells, two jobs: one completes, one fails (its server cannot start on a 1 MiB
    KV budget) and is recorded so. Run again, the completed cell is left as it was and
    the failed one runs again."""
    sweep = tmp_path / "sweep"
    args = (*CPU_SWEEP, "host.kv_budget_mib=96,1", f"hydra.sweep.dir={sweep}")
    p = remnant_run(cluster, *args, cwd=tmp_path)
    # Every cell ran; the failed one makes the sweep exit 1, named on its last line.
    assert p.returncode == 1, p.stderr
    assert p.stderr.rstrip().endswith("1 cell(s) did not complete: 1-native-smoke-s0 (failed) "
                                      "(--exit-zero exits 0 all the same)")
    _no_noise(p)
    ok, bad = sweep / "0-native-smoke-s0", sweep / "1-native-smoke-s0"
    # stdout is each cell's run.json path (the jobs printed theirs into their own logs).
    assert p.stdout.splitlines() == [str(ok / "run.json"), str(bad / "run.json")]
    assert _doc(ok)["status"] == "completed" and _doc(ok)["metrics"]["completed"] == 6
    assert _doc(bad)["status"] == "failed" and _doc(bad)["error"]["stage"] == "serve"
    assert "kv budget" in _doc(bad)["error"]["message"]
    assert "1 of 2 cells completed" in p.stderr
    table = p.stderr[p.stderr.index("cell "):]
    assert "0-native-smoke-s0  completed" in table and "1-native-smoke-s0  failed" in table
    # Each cell ran as a job of one array, its logs under .submitit/<array>_<cell>/.
    jobs = _jobs_of(sweep)
    assert len(jobs) == 2 and len({j.split("_")[0] for j in jobs}) == 1
    log_out = next((sweep / ".submitit" / jobs[0]).glob("*_log.out")).read_text()
    assert str(ok / "run.json") in log_out
    # squeue may still list a job whose cell is written while slurmd tears it down.
    deadline = time.monotonic() + 15
    states = cluster.jobs()
    while any(states[j] == "RUNNING" for j in jobs) and time.monotonic() < deadline:
        time.sleep(0.2)
        states = cluster.jobs()
    assert [states[j] for j in jobs] == ["COMPLETED", "COMPLETED"]
    assert subprocess.run([str(BIN / "remnant-check"), str(sweep)], capture_output=True).returncode == 0

    before = _snapshot(ok)
    again = remnant_run(cluster, "--exit-zero", *args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr  # the 1 MiB cell fails again; --exit-zero keeps 0
    _no_noise(again)
    assert _snapshot(ok) == before  # skipped inside its job: files untouched
    new_jobs = sorted(set(_jobs_of(sweep)) - set(jobs))
    skipped_log = next((sweep / ".submitit" / new_jobs[0]).glob("*_log.err")).read_text()
    assert "is complete; skipped" in skipped_log
    assert len(list(bad.glob("run.failed-*.json"))) == 1 and _doc(bad)["status"] == "failed"


@pytest.mark.slow
@pytest.mark.slurm
def test_cancelled_and_killed_jobs_are_named_and_the_sweep_resumes(cluster, tmp_path):
    """Three cells: one short, two long. scancel one long job (its cell records itself
    interrupted, as SIGTERM asks) and SIGKILL the other's Python, as the kernel's OOM
    killer would (no run.json; the job ends FAILED). The sweep names both jobs, ends with
    the table and exit 1; the same command then skips the completed cell and runs the
    other two to completion, their earlier attempts set aside."""
    sweep = tmp_path / "sweep"
    args = (*CPU_SWEEP, "workload.measured_requests=6,100,101", f"hydra.sweep.dir={sweep}")
    cells = [sweep / f"{n}-native-smoke-s0" for n in range(3)]
    proc = subprocess.Popen([str(BIN / "remnant-run"), *args], cwd=tmp_path, env=cluster.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_requests(proc, cells[1:])
        by_cell = {int(j.split("_")[1]): j for j in _jobs_of(sweep)}
        cluster.run("scancel", by_cell[1])
        # scancel --signal=KILL would cancel (SIGTERM first): kill the job's Python itself,
        # the parent of the cell's server.
        server = subprocess.run(["pgrep", "-f", "--", f"--port-file {cells[2]}/server.port"],
                                capture_output=True, text=True).stdout.split()[0]
        os.kill(int(Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[1]), signal.SIGKILL)
        out, err = proc.communicate(timeout=150)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert "Traceback" not in err and "Bypassing" not in err
    assert f"remnant-run: error: SLURM job {by_cell[1]} ended CANCELLED without finishing its cell" in err
    assert f"remnant-run: error: SLURM job {by_cell[2]} ended FAILED; its logs: {sweep}/.submitit/{by_cell[2]}/" in err
    assert err.count("remnant-run: error:") == 2
    table = err[err.index("cell "):]
    assert "0-native-smoke-s0  completed" in table
    assert "1-native-smoke-s0  interrupted" in table and "2-native-smoke-s0  killed" in table
    assert "the same command with hydra.sweep.dir=" in err
    assert out.splitlines() == [str(cells[0] / "run.json"), str(cells[1] / "run.json")]
    assert _doc(cells[1])["error"]["message"] == "interrupted by SIGTERM (signal 15)"
    assert not (cells[2] / "run.json").exists() and (cells[2] / "requests.jsonl").exists()

    before = _snapshot(cells[0])
    again = remnant_run(cluster, *args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    _no_noise(again)
    assert "3 of 3 cells completed" in again.stderr
    assert _snapshot(cells[0]) == before
    assert [_doc(c)["metrics"]["completed"] for c in cells] == [6, 100, 101]
    assert len(list(cells[1].glob("run.interrupted-*.json"))) == 1
    assert len(list(cells[2].glob("requests.killed-*.jsonl"))) == 1


@pytest.mark.slow
@pytest.mark.slurm
def test_ctrl_c_of_the_submitting_process_cancels_the_jobs(cluster, tmp_path):
    """Ctrl-C of remnant-run while its jobs run: it cancels them, each records its cell as
    interrupted, and the sweep ends with the table and exit 130. No job is left."""
    sweep = tmp_path / "sweep"
    cells = [sweep / f"{n}-native-smoke-s{n}" for n in range(2)]
    proc = subprocess.Popen([str(BIN / "remnant-run"), *CPU_SWEEP, "workload.measured_requests=400", "seed=0,1",
                             f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=cluster.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        _wait_for_requests(proc, cells)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "cancelling the sweep's SLURM jobs" in err and "sweep stopped by Ctrl-C (SIGINT)" in err
    assert out.splitlines() == [str(c / "run.json") for c in cells]
    for cell in cells:
        assert _doc(cell)["status"] == "interrupted", cell
    assert set(cluster.jobs()[j] for j in _jobs_of(sweep)) == {"CANCELLED"}


@pytest.mark.slow
@pytest.mark.slurm
def test_requests_the_cluster_cannot_meet_are_one_line(cluster, tmp_path):
    """The GPU preset on a node without GPUs: one line naming the launcher field and what
    the partition has, exit 2, nothing submitted, no directory left. Another refusal of
    sbatch (a feature no node has) is one line of ours after sbatch's own."""
    sweep = tmp_path / "sweep"
    jobs_before = cluster.jobs()
    p = remnant_run(cluster, "-m", "hydra/launcher=remnant_slurm", "workload=smoke", f"hydra.sweep.dir={sweep}",
                    cwd=tmp_path)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("remnant-run: error: hydra.launcher.gpus_per_node=4 asks for 4 GPUs per job on one "
                               "node; partition debug has at most 0 (node ")
    assert lines[0].endswith(", no GPUs); hydra/launcher=remnant_slurm_cpu asks for none")
    assert p.stdout == "" and not sweep.exists()

    p = remnant_run(cluster, *CPU_SWEEP, "hydra.launcher.mem_gb=100000", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert p.returncode == 2 and "hydra.launcher.mem_gb=100000 asks for 102400000 MiB of memory" in p.stderr
    p = remnant_run(cluster, *CPU_SWEEP, "hydra.launcher.partition=gpu", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert p.returncode == 2 and p.stderr == (
        "remnant-run: error: hydra.launcher.partition=gpu is not a partition of this cluster; partitions: debug\n")

    p = remnant_run(cluster, *CPU_SWEEP, "hydra.launcher.constraint=nvlink", f"hydra.sweep.dir={sweep}",
                    cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (
        "remnant-run: error: sbatch refused the sweep's jobs (sbatch: error: Batch job submission failed: "
        "Invalid feature specification); "
        "check the hydra.launcher fields (remnant-run --cfg hydra)")
    assert "Traceback" not in p.stderr
    assert cluster.jobs() == jobs_before
