"""Atomic file writes: a reader never sees half a record, a crash never leaves one. And
write errors as one line naming the file: `cannot write PATH: No space left on device`
(an OSError raised by a write or fsync that fails mid-file names no file of its own)."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path
from typing import Iterator


class WriteError(OSError):
    """An OSError while writing `filename`; str() is the one line a user reads."""

    def __str__(self) -> str:
        return f"cannot write {self.filename}: {self.strerror}"


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Turn an OSError raised inside into a WriteError naming the file it names, else
    `path`, keeping its errno. Use around every write on a run's path."""
    try:
        yield
    except WriteError:
        raise
    except OSError as exc:
        raise WriteError(exc.errno, exc.strerror or str(exc), str(exc.filename or path)) from None


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Path(path).write_text(text) (UTF-8), with a WriteError naming `path`."""
    path = Path(path)
    with writing(path):
        path.write_text(text, encoding="utf-8")
    return path


def error_line(exc: OSError, where: str | os.PathLike) -> str:
    """An OSError of a write as one line: `cannot write PATH: why`, PATH the file the error
    names, else `where`."""
    if isinstance(exc, WriteError):
        return str(exc)
    return f"cannot write {exc.filename or where}: {exc.strerror or exc}"


def atomic_write(path: str | os.PathLike, data: bytes | list[bytes]) -> Path:
    """Write `data` (bytes, or chunks of bytes) to `path` through a temporary file and
    rename; a WriteError names `path` (not the temporary file) where it fails."""
    path = Path(path)
    with writing(path.parent):
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
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
    except OSError as exc:
        raise WriteError(exc.errno, exc.strerror or str(exc), str(path)) from None
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
