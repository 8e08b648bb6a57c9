"""Atomic file writes: a reader never sees half a record, a crash never leaves one."""

from __future__ import annotations

import errno
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


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append `line` (one line of text; a newline is added) to `path`, whole or not at all.

    One write() on an O_APPEND descriptor; when the disk fills mid-line (a short write or
    ENOSPC), the file is cut back to its length before, so a reader never meets half a
    line. Raises OSError naming `path` and keeping the errno.
    """
    data = (line + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        before = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            try:
                os.ftruncate(fd, before)
            except OSError:
                pass  # shrinking needs no space; if even that fails, the error below stands
            raise OSError(exc.errno, f"{exc.strerror or exc}: could not append a line to {path}") from None
    finally:
        os.close(fd)
