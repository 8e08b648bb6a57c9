"""A real small filesystem for disk-fault tests: a tmpfs of a few KB, or a read-only one.

Mounting needs root (CAP_SYS_ADMIN); where the mount is refused the test skips and says why.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    """Mount a tmpfs of `size` (mount's syntax: 64k, 1m) at `path`; unmount it afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {path} (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        # Lazy: a child that still holds a file there must not fail the unmount.
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(directory: Path, name: str = "filler") -> int:
    """Write into `directory` until its filesystem has no byte left; returns the bytes written."""
    written = 0
    fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for chunk in (65536, 4096, 512, 64, 1):
            while True:
                try:
                    n = os.write(fd, b"\0" * chunk)
                except OSError:
                    break
                written += n
                if n < chunk:
                    break
    finally:
        os.close(fd)
    return written
