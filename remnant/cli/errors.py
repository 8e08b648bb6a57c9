"""Config mistakes as one line: Hydra's, OmegaConf's and Remnant's rules, for remnant-run,
remnant-frontier and remnant-capture.

Every mistake is one line naming the key, the value and what is allowed (a close match
where there is one), never a traceback: `config_error_line` words it, `fail` prints it and
exits.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys

from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)

from remnant.config_errors import ConfigError

#: ConfigStore nodes that are schemas behind the group files, not options
#: (remnant.cli.run.register_configs names them so).
SCHEMA_PREFIX = "base_"


class ConfigProblem(ValueError):
    """A configuration mistake, already worded as one line for the user."""


class ConfigRejected(BaseException):
    """A single run's config mistake found before its directory is made. A BaseException,
    since Hydra turns a callback's Exception into a warning and carries on."""


def _close(word: str, choices: list[str]) -> str | None:
    found = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return found[0] if found else None


def _kind_of(node: object) -> str:
    kind = getattr(node, "kind", None) if not isinstance(node, DictConfig) else node.get("kind")
    return f" (kind {kind})" if isinstance(kind, str) and kind != "???" else ""


def unknown_key_message(full_key: str, fields: list[str], where: str) -> str:
    """`full_key` is not a field: say so with the closest field, or list them."""
    prefix, _, key = full_key.rpartition(".")
    close = _close(key, fields)
    head = f"{full_key} is not a field of {where}"
    if close:
        return f"{head}; did you mean {prefix + '.' if prefix else ''}{close}?"
    return f"{head}; its fields: {', '.join(fields)}"


def _fields(obj_type: object) -> list[str] | None:
    return [f.name for f in dataclasses.fields(obj_type)] if dataclasses.is_dataclass(obj_type) else None


def _where(prefix: str, node: object) -> str:
    return f"{prefix}{_kind_of(node)}" if prefix else "the run config"


def unknown_keys(cfg: DictConfig, prefix: str = "") -> str | None:
    """The first key of `cfg` that its structured config does not declare (one added with
    `+` or `++`, which OmegaConf.to_object would drop without a word), as one line."""
    fields = _fields(OmegaConf.get_type(cfg))
    for key in cfg.keys():
        full = f"{prefix}{key}"
        if fields is not None and key not in fields:
            return unknown_key_message(full, fields, _where(prefix.rstrip("."), cfg))
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not (node._is_none() or node._is_missing() or node._is_interpolation()):
            found = unknown_keys(node, f"{full}.")
            if found:
                return found
    return None


def _raw(cfg: DictConfig | None, name: str) -> object:
    if cfg is None:
        return None
    raw: object = OmegaConf.to_container(cfg, resolve=False)
    for part in name.split("."):
        raw = raw.get(part) if isinstance(raw, dict) else None
    return raw


def missing_value_message(cfg: DictConfig, name: str) -> str:
    """What to do about a config value that is missing: give it on the command line, or
    set the environment variable the config reads it from (`${oc.env:VAR,???}`)."""
    raw = _raw(cfg, name)
    env = re.findall(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)", raw) if isinstance(raw, str) else []
    if env:
        return f"{name} has no value: set {env[0]} in the environment, or give it on the command line ({name}=...)"
    return f"{name} has no value; give it on the command line ({name}=...)"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0].strip()


def config_error_line(exc: BaseException, cfg: DictConfig | None = None) -> str:
    """A config mistake (Hydra's, OmegaConf's or a Remnant rule) as one line naming the
    key, the value and what is allowed."""
    if isinstance(exc, (ConfigProblem, ConfigError)):
        return _first_line(exc)
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        options = sorted(o for o in (exc.options or []) if not o.startswith(SCHEMA_PREFIX))
        if group and options:
            close = _close(option, options)
            hint = f"; did you mean {group}={close}?" if close else ""
            return f"{group}={option} is not an option of {group}; allowed: {', '.join(options)}{hint}"
    if isinstance(exc, OverrideParseException):
        return f"cannot read the override {exc.override!r}: {_first_line(exc)} (Hydra's override grammar)"
    # Hydra wraps OmegaConf's errors; the cause names the key.
    cause = exc
    while isinstance(cause, HydraException) and cause.__cause__ is not None:
        cause = cause.__cause__
    if isinstance(cause, OmegaConfBaseException):
        full_key = getattr(cause, "full_key", None) or ""
        msg = (getattr(cause, "msg", None) or _first_line(cause)).strip().splitlines()[0]
        if isinstance(cause, MissingMandatoryValue) and full_key:
            return missing_value_message(cfg, full_key) if cfg is not None else f"{full_key} has no value"
        if isinstance(cause, InterpolationResolutionError):
            env = re.search(r"Environment variable '([^']+)' not found", msg)
            raw = _raw(cfg, full_key)
            shown = f"{full_key}={raw}" if isinstance(raw, str) else full_key
            if env:
                return (f"{shown}: environment variable {env.group(1)} is not set; set it, or give "
                        f"{full_key}=... on the command line")
            return f"{shown}: {msg}"
        if type(cause).__name__ in ("ConfigKeyError", "ConfigAttributeError") and full_key:
            fields = _fields(getattr(cause, "object_type", None))
            if fields is not None:
                parent = full_key.rpartition(".")[0]
                return unknown_key_message(full_key, fields, _where(parent, None))
        if full_key:
            return f"{full_key}: {msg}"
        return msg
    return _first_line(exc)


CONFIG_ERRORS = (ConfigProblem, ConfigError, HydraException, OmegaConfBaseException)


def fail(message: str, code: int = 2, prog: str = "remnant-run") -> None:
    """Print `message` as the command's one error line and exit with `code`."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(code)
