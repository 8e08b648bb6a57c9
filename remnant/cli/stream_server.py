"""A model-free stream server: SGLang's /generate frames, as fast as one core can send them.

    python -m remnant.cli.stream_server --port 0 --cpu 0 --tokenizer-dir models/tiny

Serves remnant.client.stream_server (what it answers, and how) on a port, pinned to one
CPU where --cpu says; prints the port on stdout once it listens. The client ceiling
benchmark (remnant.cli.ceiling) starts it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from remnant.client.stream_server import serve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m remnant.cli.stream_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port; the port is printed on stdout")
    p.add_argument("--cpu", type=int, default=None, help="pin this process to this CPU (os.sched_setaffinity)")
    p.add_argument("--tokenizer-dir", default=None, help="directory /model_info names as the tokenizer path")
    p.add_argument("--incremental", action="store_true", help="output_ids hold only the new id, as SGLang's "
                   "--incremental-streaming-output")
    a = p.parse_args(argv)
    if a.cpu is not None:
        allowed = sorted(os.sched_getaffinity(0))
        if a.cpu not in allowed:
            p.error(f"--cpu={a.cpu} is not a CPU this process may use; allowed: {allowed}")
        os.sched_setaffinity(0, {a.cpu})

    def ready(port: int) -> None:
        print(port, flush=True)

    try:
        asyncio.run(serve(a.host, a.port, a.tokenizer_dir, a.incremental, ready))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
