"""A private single-node SLURM cluster for tests: munged, slurmctld and slurmd as root.

Debian's slurm-wlm and munge (.ci/run installs them as root). Everything lives in one
directory under /tmp: its own munge key and socket, a slurm.conf (SLURM_CONF points the
commands and the jobs at it), state, spool and logs, and two free ports; nothing under
/etc is read or written. No accounting storage (no slurmdbd), as on the smallest real
clusters: sacct answers "Slurm accounting storage is disabled".
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

#: The daemons and commands a cluster needs, and the Debian package of each.
NEEDED = {"munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client",
          "squeue": "slurm-client", "scancel": "slurm-client", "sinfo": "slurm-client"}


#: CPUs the node offers at least (SlurmdParameters=config_overrides in slurm_conf).
CPUS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In a daemon before it starts: SIGTERM when the test process ends, however it ends
    (PR_SET_PDEATHSIG), so no daemon outlives a killed test run."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def cannot_start() -> str | None:
    """Why a cluster cannot start on this machine, or None."""
    if os.geteuid() != 0:
        return f"SLURM tests start slurmctld and slurmd as root; this is uid {os.geteuid()} (.ci/run runs as root)"
    missing = sorted({pkg for cmd, pkg in NEEDED.items() if shutil.which(cmd) is None})
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} missing); .ci/run installs it as root: "
                "apt-get install slurm-wlm munge")
    return None


@dataclass
class Cluster:
    """A running cluster: `env` is the environment its commands (and jobs) need."""

    root: Path
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60, check=check)

    def jobs(self) -> dict[str, str]:
        """Job id (array tasks as A_I) -> state, of every job slurmctld still knows."""
        out = self.run("squeue", "--noheader", "--array", "--states=all", "--format=%i|%T").stdout
        return dict(line.split("|", 1) for line in out.split())

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(f"{p.name}: {line}" for p in sorted((self.root / "log").glob("*.log"))
                         for line in p.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True, timeout=30)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def slurm_conf(root: Path, node: str, cpus: int, mem_mib: int, ctld_port: int, slurmd_port: int) -> str:
    """The cluster's slurm.conf: one node, one partition, no cgroups, no accounting."""
    return f"""\
ClusterName=remnant-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.sock
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
# Test machines and containers may not delegate cgroups: track and bind tasks without them.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=512
# A job that ignores SIGTERM is killed 5 s later (the default, 30 s, slows the tests).
KillWait=5
ReturnToService=2
# The node offers the CPUs given below even where the machine has fewer (config_overrides),
# so that three one-CPU cells run at once on CI's two cores: their work is light.
SlurmdParameters=config_overrides
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mib} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def start(timeout_s: float = 60) -> Cluster:
    """Start munged, slurmctld and slurmd (in the foreground, as children) and wait until
    the node is idle. Raises RuntimeError with the daemons' last log lines otherwise."""
    # Short: a unix socket path (munge's) holds at most 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="remnant-slurm-", dir="/tmp"))
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir()
    os.chmod(root, 0o755)
    os.chmod(root / "munge", 0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    # What slurmd finds on this machine: the node's name, CPUs and memory.
    probe = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30)
    found = dict(item.split("=", 1) for item in probe.stdout.split() if "=" in item)
    node = found.get("NodeName") or socket.gethostname().split(".")[0]
    cpus = max(CPUS, int(found.get("CPUs") or os.cpu_count() or 1))
    mem_mib = int(found.get("RealMemory") or 4096) * 9 // 10
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, node, cpus, mem_mib, _free_port(), _free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    cluster = Cluster(root, env)
    try:
        def daemon(*cmd: str) -> None:
            log = open(root / "log" / f"{Path(cmd[0]).name}.stdout.log", "wb")
            cluster.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True, preexec_fn=_die_with_parent))

        daemon("munged", "--foreground", "--force", f"--socket={root}/munge/munge.sock", f"--key-file={key}",
               f"--log-file={root}/log/munged.log", f"--pid-file={root}/munge/munged.pid",
               f"--seed-file={root}/munge/munged.seed")
        deadline = time.monotonic() + timeout_s
        while not (root / "munge" / "munge.sock").exists():
            if time.monotonic() > deadline or cluster.procs[0].poll() is not None:
                raise RuntimeError(f"munged did not start:\n{cluster.log_tail()}")
            time.sleep(0.1)
        daemon("slurmctld", "-D", "-f", str(conf))
        daemon("slurmd", "-D", "-f", str(conf))
        while True:
            p = subprocess.run(["sinfo", "--noheader", "--format=%T"], env=env, capture_output=True, text=True)
            if p.returncode == 0 and p.stdout.strip() == "idle":
                return cluster
            dead = [proc.args[0] for proc in cluster.procs if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"the node is {p.stdout.strip() or p.stderr.strip()}"
                raise RuntimeError(f"SLURM did not start ({why}):\n{cluster.log_tail()}")
            time.sleep(0.2)
    except BaseException:
        cluster.stop()
        raise
