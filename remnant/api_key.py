"""API keys of secured servers (`remnant-serve --api-key`, SGLang's `--api-key`): where a
run reads one, how it sends one, and how records are kept free of it.

A key never sits in a config. `host.api_key_env` names the environment variable that
holds it, so run.json's resolved config and .hydra/ record the name alone. A server that
a host starts gets the key in its environment (SERVER_ENV), never on its command line,
which run.json's `host.command` records and `ps` shows. Every request a run sends (the
readiness and /server_info probes, the load client's /generate and /flush_cache, a
capture's write request) carries `Authorization: Bearer <key>`.

What a server echoes is scrubbed before it is recorded: SGLang's /server_info returns its
ServerArgs with `api_key` in them and its log prints them, so run.py replaces the key
wherever it appears in run.json (`redact`), server.log and requests.jsonl (`redact_file`).
Plain Python: imports nothing heavy.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from remnant.config_errors import ConfigError

#: The variable remnant-serve (and remnant.cli.sglang_launch) reads its key from.
SERVER_ENV = "REMNANT_API_KEY"
#: Server flags whose value is a key: refused in configs, which are recorded.
KEY_FLAGS = ("--api-key", "--admin-api-key")
#: What stands for a key in a record.
REDACTED = "<redacted>"
#: Shorter keys are refused: replacing a key of a few characters wherever it occurs would
#: rewrite ordinary words and numbers in the records.
MIN_KEY_CHARS = 8

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def read_key(env_name: str | None, field: str = "host.api_key_env") -> str | None:
    """The key held by environment variable `env_name` (None where no variable is named).
    ConfigError names `field` and the variable, never the value, where the name is not a
    variable name, the variable is unset or empty, or its key cannot be sent or scrubbed."""
    if env_name is None:
        return None
    if not _ENV_NAME.fullmatch(str(env_name)):
        raise ConfigError(f"{field}={env_name} is not an environment variable name (letters, digits and _, "
                          "not starting with a digit); name the variable that holds the key, not the key")
    key = os.environ.get(env_name, "")
    if not key:
        raise ConfigError(f"{field}={env_name}, but environment variable {env_name} is not set or empty; "
                          f"export {env_name}=<the server's API key>")
    if not (key.isascii() and key.isprintable()) or key != key.strip():
        raise ConfigError(f"{field}={env_name}: the key in {env_name} cannot travel in an HTTP header; "
                          "allowed: printable ASCII without leading or trailing spaces")
    if len(key) < MIN_KEY_CHARS:
        raise ConfigError(f"{field}={env_name}: the key in {env_name} has {len(key)} characters; allowed: at "
                          f"least {MIN_KEY_CHARS}, so that it can be told apart from other text and kept out "
                          "of the records")
    return key


def bearer(key: str | None) -> dict[str, str]:
    """The request headers that carry `key` ({} without one)."""
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def refuse_inline_keys(args: list[str], env: dict[str, str], args_field: str, env_field: str) -> None:
    """ConfigError where server arguments or server environment in a config carry a key
    themselves: the config is recorded, and the key with it."""
    for arg in args:
        flag = str(arg).split("=", 1)[0]
        if flag in KEY_FLAGS:
            raise ConfigError(f"{args_field} holds {flag}: a key there would be recorded with the config; put "
                              "the key in an environment variable and name it: host.api_key_env=VAR")
    if SERVER_ENV in env:
        raise ConfigError(f"{env_field} sets {SERVER_ENV}: a key there would be recorded with the config; put the "
                          "key in an environment variable and name it: host.api_key_env=VAR")


def redact(value: object, key: str | None) -> object:
    """`value` (JSON-like: dicts, lists, strings, scalars) with every occurrence of `key`
    in its strings replaced by REDACTED."""
    if not key:
        return value
    if isinstance(value, str):
        return value.replace(key, REDACTED) if key in value else value
    if isinstance(value, dict):
        return {k: redact(v, key) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, key) for v in value]
    return value


def redact_file(path: Path, key: str | None) -> bool:
    """Overwrite each occurrence of `key` in the file at `path` with as many `*`, in place
    (a key holds no newline, so line by line): it needs no disk space, so it works on the
    full disk a failing run may have left. Returns whether the file held the key."""
    path = Path(path)
    if not key or not path.is_file():
        return False
    needle = key.encode()
    found = False
    with open(path, "r+b") as f:
        while line := f.readline():
            if needle in line:
                end = f.tell()
                f.seek(end - len(line))
                f.write(line.replace(needle, b"*" * len(needle)))
                f.seek(end)
                found = True
    return found


def redact_inline_keys(config: object) -> object:
    """A plain config with the values of KEY_FLAGS in argument lists and SERVER_ENV in
    environment maps replaced: for the record of a config refused for holding them."""
    if isinstance(config, dict):
        return {k: REDACTED if k == SERVER_ENV else redact_inline_keys(v) for k, v in config.items()}
    if not isinstance(config, list):
        return config
    out, hide_next = [], False
    for item in config:
        flag = item.split("=", 1)[0] if isinstance(item, str) else None
        if hide_next:
            out.append(REDACTED)
        elif flag in KEY_FLAGS and "=" in item:
            out.append(f"{flag}={REDACTED}")
        else:
            out.append(redact_inline_keys(item))
        hide_next = not hide_next and item in KEY_FLAGS
    return out
