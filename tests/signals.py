"""Start child processes as a terminal would, so that a test's Ctrl-C reaches them."""

from __future__ import annotations

import signal


def default_sigint() -> None:
    """preexec_fn: SIGINT back to its default disposition. A shell starts a background job
    (`cmd &`, as a CI script or a detached session may start the suite) with SIGINT
    ignored, children inherit that, and Python then installs no KeyboardInterrupt handler,
    so a Ctrl-C test would wait out its timeout (seen here: a suite started as
    `(setsid bash .ci/run &)`)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
