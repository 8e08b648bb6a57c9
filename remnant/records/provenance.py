"""Provenance of a run: file digests, the code that ran, and the machine it ran on.

`environment()` describes the machine of the calling process. Call it where the server
runs (the server's host fills the environment, not the orchestrator's). Heavy modules
(torch, triton) are imported only inside the functions that need them.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import socket
import subprocess
from importlib import metadata
from pathlib import Path

import remnant

_GIT_TIMEOUT_S = 10.0
# Names the commit of a copy of the tree that has no .git (sources, the kernel benchmark).
GIT_COMMIT_ENV = "REMNANT_GIT_COMMIT"
_SMI_TIMEOUT_S = 10.0


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    """Lowercase hex sha256 of a file, read in chunks so large logs need little memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def artifact(path: str | os.PathLike, root: str | os.PathLike, sha256: str | None = None) -> dict:
    """Artifact entry of a run record: {"path" relative to root (posix), "sha256", "bytes"}.
    sha256: the file's, where the caller has already hashed it (a capture of some GB).

    Raises ValueError when `path` is not inside `root`, since a record may only point at
    files that travel with its run directory.
    """
    path, root = Path(path).resolve(), Path(root).resolve()
    if not path.is_relative_to(root):
        raise ValueError(f"artifact {path} is not inside the run directory {root}")
    return {
        "path": path.relative_to(root).as_posix(),
        "sha256": sha256 or sha256_file(path),
        "bytes": path.stat().st_size,
    }


def _git(root: Path, *args: str) -> str | None:
    """stdout of `git -C root ARGS`, or None when git is missing, slow or refuses."""
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=_GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _checkout_root() -> Path | None:
    """Top of the git checkout remnant is imported from, None for an installed package."""
    here = Path(remnant.__file__).resolve().parent
    # A wheel installed into a virtualenv that sits inside some other repository would
    # otherwise report that repository's commit.
    if {"site-packages", "dist-packages"} & set(here.parts):
        return None
    for d in (here, *here.parents):
        if (d / ".git").exists():  # a directory, or a file in worktrees and submodules
            return d
    return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def sources() -> dict:
    """What code ran: the `sources` object of a run record.

    git_sha / git_dirty describe the checkout remnant is imported from; dirty counts
    untracked, non-ignored files too, since they can change what runs. Both are None
    outside a checkout or without git. A copy of a checkout (as a lent GPU machine gets)
    names its commit in REMNANT_GIT_COMMIT (40 hex digits), which then wins over any .git
    beside it: such a copy may carry a stale .git (an earlier commit's, with the work tree
    showing as dirty), and git_dirty stays None, since nothing can tell. sglang_version is
    set where sglang is installed in this environment; image_digest is left to the host
    that ran a container.
    """
    sha = dirty = None
    root = _checkout_root()
    named = os.environ.get(GIT_COMMIT_ENV, "")
    if re.fullmatch(r"[0-9a-f]{40}", named):
        sha = named
    elif root is not None:
        out = _git(root, "rev-parse", "HEAD")
        if out and out.strip():
            sha = out.strip()
            status = _git(root, "status", "--porcelain")
            dirty = None if status is None else bool(status.strip())
    return {
        "remnant_version": remnant.__version__,
        "git_sha": sha,
        "git_dirty": dirty,
        "sglang_version": _version("sglang"),
        "image_digest": None,
    }


def _nvidia_driver() -> str | None:
    """NVIDIA driver version from nvidia-smi, None where it is absent (CPU, ROCm)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    # One driver serves every GPU of a host.
    return lines[0] if done.returncode == 0 and lines else None


def environment() -> dict:
    """The machine this process runs on: the `environment` object of a run record.

    GPUs are those torch sees (after CUDA_VISIBLE_DEVICES), with memory_total_mib in MiB.
    Listing them initializes CUDA in this process, so call it in the serving process or
    after any fork, not in a parent that forks CUDA workers later.
    """
    try:
        import torch
    except ImportError:
        torch = None
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None

    gpus = []
    if torch is not None and torch.cuda.is_available():
        driver = _nvidia_driver()
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({"name": props.name, "driver": driver,
                         "memory_total_mib": props.total_memory // (1 << 20)})
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": None if torch is None else torch.__version__,
        "triton": triton_version,
        "cuda": None if torch is None else torch.version.cuda,
        # os.cpu_count() is None only where the OS hides it; one CPU is certain.
        "cpu_count": os.cpu_count() or 1,
        "gpus": gpus,
        "collected_by": f"remnant {remnant.__version__}",
    }
