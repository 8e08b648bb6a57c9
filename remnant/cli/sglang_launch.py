"""`python -m remnant.cli.sglang_launch [--remnant-mode M] [--remnant-retention R] [--remnant-retention-map F] [--remnant-retention-policy P] [--remnant-capture FILE ...] SGLANG_ARGS...`

SGLang's launch_server with the Remnant plugin enabled. The --remnant-* flags (or the
REMNANT_* variables they stand for, remnant.sglang.settings) choose the mode and retention;
every other argument goes to SGLang unchanged, e.g.

    REMNANT_MODE=kernel python -m remnant.cli.sglang_launch --model-path /models/DeepSeek-V4-Flash --tp 4

REMNANT_API_KEY, where set, becomes SGLang's --api-key (hosts pass the key through the
environment: remnant.api_key).

Capture mode (native only): --remnant-capture FILE [--remnant-capture-tokens N]
[--remnant-capture-records N] [--remnant-capture-source NAME] [--remnant-capture-model-id ID]
(REMNANT_CAPTURE*; the model id defaults to the --model-path value) records decode queries
and C4 latents into FILE (remnant.sglang.capture). Capture needs CUDA graphs off, so the
launcher adds SGLang's --disable-cuda-graph when capture is on (flag or variable).

The flags become environment variables before SGLang starts, because SGLang loads
plugins again in each scheduler process it spawns, which inherit the environment. Flags
and variables are read together as Settings (checked: a bad value stops the launch before
SGLang starts) and written back by Settings.to_env (CaptureSettings.to_env for capture),
the writers of REMNANT_*.
"""

from __future__ import annotations

import argparse
import os
import sys

from collections.abc import Mapping

from remnant.calibration.capture_recorder import (ENV_CAPTURE, ENV_CAPTURE_MODEL_ID, ENV_CAPTURE_RECORDS,
                                                  ENV_CAPTURE_SOURCE, ENV_CAPTURE_TOKENS)
from remnant.kv.modes import MODE_NAMES
from remnant.sglang.settings import (ENV_MODE, ENV_RETENTION, ENV_RETENTION_MAP, ENV_RETENTION_POLICY,
                                     GENERAL_PLUGINS_GROUP, PLUGIN_NAME, capture_from_env, from_env)

FLAGS = {"--remnant-mode": ENV_MODE, "--remnant-retention": ENV_RETENTION,
         "--remnant-retention-map": ENV_RETENTION_MAP, "--remnant-retention-policy": ENV_RETENTION_POLICY,
         "--remnant-capture": ENV_CAPTURE, "--remnant-capture-tokens": ENV_CAPTURE_TOKENS,
         "--remnant-capture-records": ENV_CAPTURE_RECORDS, "--remnant-capture-source": ENV_CAPTURE_SOURCE,
         "--remnant-capture-model-id": ENV_CAPTURE_MODEL_ID}

#: SGLang's flag that turns CUDA graphs off (decode and prefill), which capture needs.
DISABLE_CUDA_GRAPH = "--disable-cuda-graph"


def _model_path(args: list[str]) -> str | None:
    """The value of SGLang's --model-path in `args`, if given."""
    for i, arg in enumerate(args):
        if arg == "--model-path" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--model-path="):
            return arg.split("=", 1)[1]
    return None


def split_args(argv: list[str], environ: Mapping[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """(the REMNANT_* variables of the --remnant-* flags over `environ`'s (default: this
    process's), as Settings.to_env and CaptureSettings.to_env write them; SGLang's own
    arguments, with --disable-cuda-graph added when capture is on). A bad setting is a
    ConfigError naming the variable."""
    parser = argparse.ArgumentParser(prog="python -m remnant.cli.sglang_launch", add_help=False)
    parser.add_argument("--remnant-mode", choices=MODE_NAMES)
    parser.add_argument("--remnant-retention")
    parser.add_argument("--remnant-retention-map")
    parser.add_argument("--remnant-retention-policy")
    parser.add_argument("--remnant-capture", help="capture file to write (native mode only); adds SGLang's "
                        "--disable-cuda-graph, which capture needs")
    parser.add_argument("--remnant-capture-tokens", help="decode query tokens kept per CSA layer")
    parser.add_argument("--remnant-capture-records", help="C4 latents kept per CSA layer")
    parser.add_argument("--remnant-capture-source", help="what the server serves (a workload name)")
    parser.add_argument("--remnant-capture-model-id", help="the served model's id (default: --model-path)")
    ours, rest = parser.parse_known_args(argv)
    given = {var: getattr(ours, flag[2:].replace("-", "_")) for flag, var in FLAGS.items()}
    merged = {**(os.environ if environ is None else environ), **{k: v for k, v in given.items() if v is not None}}
    if not merged.get(ENV_CAPTURE_MODEL_ID, "").strip() and _model_path(rest):
        merged[ENV_CAPTURE_MODEL_ID] = _model_path(rest)
    settings = from_env(merged)
    capture = capture_from_env(settings, merged)
    env = settings.to_env()
    if capture is not None:
        env.update(capture.to_env())
        if DISABLE_CUDA_GRAPH not in rest:
            rest = [*rest, DISABLE_CUDA_GRAPH]
    return env, rest


def enable_plugin(env: dict[str, str]) -> None:
    """Export the settings, and keep Remnant loadable when SGLANG_PLUGINS restricts plugins."""
    os.environ.update(env)
    allowed = os.environ.get("SGLANG_PLUGINS", "").strip()
    if allowed and PLUGIN_NAME not in {x.strip() for x in allowed.split(",")}:
        os.environ["SGLANG_PLUGINS"] = f"{allowed},{PLUGIN_NAME}"


def keyed(server_args, environ: Mapping[str, str]) -> None:
    """Give SGLang the API key in REMNANT_API_KEY (remnant.api_key.SERVER_ENV), unless its
    own --api-key was given: hosts pass the key through the environment, because a
    command line is recorded (run.json's host.command) and shown by ps."""
    from remnant.api_key import SERVER_ENV

    if environ.get(SERVER_ENV) and not server_args.api_key:
        server_args.api_key = environ[SERVER_ENV]


def main(argv: list[str] | None = None) -> None:
    env, sglang_args = split_args(sys.argv[1:] if argv is None else argv)
    enable_plugin(env)
    from importlib.metadata import entry_points

    if not any(ep.name == PLUGIN_NAME for ep in entry_points(group=GENERAL_PLUGINS_GROUP)):
        raise SystemExit(f"remnant: no entry point {PLUGIN_NAME!r} in group {GENERAL_PLUGINS_GROUP}; "
                         f"install remnant with pip into this environment (pip install -e . or the wheel)")
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(sglang_args)
    keyed(server_args, os.environ)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
