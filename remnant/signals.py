"""SIGINT and SIGTERM as runs see them.

The first signal stops a run (or a sweep, after its running cell) once what it did is
recorded; a second one stops at once, still writing what it can. Both arrive as
`Interrupted`, a KeyboardInterrupt that remembers which signal came, so the exit status
can say so: 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as shells do.
"""

from __future__ import annotations

import signal


class Interrupted(KeyboardInterrupt):
    """KeyboardInterrupt raised for SIGINT or SIGTERM; `signum` says which.

    Its message is empty for SIGINT (a plain Ctrl-C) and "signal N" otherwise.
    """

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__("" if signum == signal.SIGINT else f"signal {int(signum)}")
        self.signum = int(signum)


def signum_of(exc: BaseException) -> int:
    """The signal behind a KeyboardInterrupt: Python's own Ctrl-C handler raises one
    without a number, which is SIGINT's."""
    return int(getattr(exc, "signum", signal.SIGINT))


def exit_status(signum: int) -> int:
    """The exit status a shell reports for a process ended by `signum`."""
    return 128 + int(signum)


def describe(signum: int) -> str:
    """How run.json and the command line name a signal."""
    return "Ctrl-C (SIGINT)" if signum == signal.SIGINT else f"{signal.Signals(signum).name} (signal {int(signum)})"


def raise_interrupted(signum: int, frame: object) -> None:
    """Signal handler: raise Interrupted(signum) where the main thread is."""
    raise Interrupted(signum)
