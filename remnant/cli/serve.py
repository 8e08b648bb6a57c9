"""`remnant-serve`: the embedded reference engine behind SGLang's HTTP API (docs/engine.md).

    remnant-serve --model-dir models/tiny --port 30000
    curl -s localhost:30000/generate -H 'Content-Type: application/json' \
        -d '{"text": "hi", "sampling_params": {"max_new_tokens": 8}}'

The app is remnant.engine.server's; its flags are defined once in remnant.engine.args,
where the hosts that start it write them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from remnant.api_key import SERVER_ENV as API_KEY_ENV
from remnant.engine.args import EngineArgs, RetentionArgs, add_capture_arguments, capture_from_namespace
from remnant.engine.server import bind, create_app
from remnant.kv.modes import MODE_NAMES

#: remnant.engine.server's logger: the listening line reads as the server's others do.
log = logging.getLogger("remnant.serve")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="remnant-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, type=Path, help="HF-style model directory (config.json + tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    p.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    p.add_argument("--mode", default="native", choices=MODE_NAMES)
    # The key's default comes from the environment, where ps and recorded command lines
    # cannot see it (the hosts pass it so).
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"require 'Authorization: Bearer <key>' on every route but /health* and /metrics* "
                        f"(default: ${API_KEY_ENV}; prefer it, a flag shows in ps)")
    RetentionArgs.add_arguments(p)
    EngineArgs.add_arguments(p)
    add_capture_arguments(p)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch
    import uvicorn

    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        retention = RetentionArgs.from_namespace(a)
        engine_args = EngineArgs.from_namespace(a)
        capture = capture_from_namespace(a)
        sock = bind(a.host, a.port)  # before loading: a taken port fails fast
        app = create_app(a.model_dir, a.mode, retention, engine_args, capture, a.api_key)
    except (ValueError, OSError) as exc:
        print(f"remnant-serve: error: {exc}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=a.log_level, access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    if a.port_file:
        from remnant.records.files import WriteError, atomic_write

        try:
            atomic_write(a.port_file, str(port).encode())
        except WriteError as exc:
            print(f"remnant-serve: error: {exc}", file=sys.stderr)
            return 1
    log.info("remnant-serve listening on http://%s:%d (pid %d)%s", a.host, port, os.getpid(),
             "; API key required on every route but /health* and /metrics*" if a.api_key else "")
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
