"""`python -m remnant.sglang.launch [--remnant-mode M] [--remnant-retention R] [--remnant-retention-map F] [--remnant-retention-policy P] SGLANG_ARGS...`

SGLang's launch_server with the Remnant plugin enabled. The --remnant-* flags (or the
REMNANT_* variables they stand for, remnant.sglang.settings) choose the mode and retention;
every other argument goes to SGLang unchanged, e.g.

    REMNANT_MODE=kernel python -m remnant.sglang.launch --model-path /models/DeepSeek-V4-Flash --tp 4

The flags become environment variables before SGLang starts, because SGLang loads
plugins again in each scheduler process it spawns, which inherit the environment. Flags
and variables are read together as Settings (checked: a bad value stops the launch before
SGLang starts) and written back by Settings.to_env, the one writer of REMNANT_*.
"""

from __future__ import annotations

import argparse
import os
import sys

from collections.abc import Mapping

from remnant.config import MODES
from remnant.sglang.settings import (ENV_MODE, ENV_RETENTION, ENV_RETENTION_MAP, ENV_RETENTION_POLICY,
                                     GENERAL_PLUGINS_GROUP, PLUGIN_NAME, from_env)

FLAGS = {"--remnant-mode": ENV_MODE, "--remnant-retention": ENV_RETENTION,
         "--remnant-retention-map": ENV_RETENTION_MAP, "--remnant-retention-policy": ENV_RETENTION_POLICY}


def split_args(argv: list[str], environ: Mapping[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """(the REMNANT_* variables of the --remnant-* flags over `environ`'s (default: this
    process's), as Settings.to_env writes them; SGLang's own arguments). A bad setting is a
    ConfigError naming the variable."""
    parser = argparse.ArgumentParser(prog="python -m remnant.sglang.launch", add_help=False)
    parser.add_argument("--remnant-mode", choices=MODES)
    parser.add_argument("--remnant-retention")
    parser.add_argument("--remnant-retention-map")
    parser.add_argument("--remnant-retention-policy")
    ours, rest = parser.parse_known_args(argv)
    given = {var: getattr(ours, flag[2:].replace("-", "_")) for flag, var in FLAGS.items()}
    merged = {**(os.environ if environ is None else environ), **{k: v for k, v in given.items() if v is not None}}
    return from_env(merged).to_env(), rest


def enable_plugin(env: dict[str, str]) -> None:
    """Export the settings, and keep Remnant loadable when SGLANG_PLUGINS restricts plugins."""
    os.environ.update(env)
    allowed = os.environ.get("SGLANG_PLUGINS", "").strip()
    if allowed and PLUGIN_NAME not in {x.strip() for x in allowed.split(",")}:
        os.environ["SGLANG_PLUGINS"] = f"{allowed},{PLUGIN_NAME}"


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
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
