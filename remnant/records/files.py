"""Atomic file writes: a reader never sees half a record, a crash never leaves one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path: str | os.PathLike, data: bytes | list[bytes]) -> Path:
    """Write `data` (bytes, or chunks of bytes) to `path` through a temporary file and rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates the file 0600; records are meant to be read by others.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            for chunk in [data] if isinstance(data, bytes) else data:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
