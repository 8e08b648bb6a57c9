"""The error a user can fix in a configuration, and the checks of one field that raise it.

The floor of every config: the run config (remnant.config), each kind's config class
(remnant/hosts/, remnant/workloads/), the engine's arguments, the SGLang plugin's settings
and the capture recorder all raise ConfigError, so this module imports nothing of Remnant.
"""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """A run configuration a user can fix: the message names field, value and what is allowed."""


def positive_finite(value: float, field: str) -> None:
    """ConfigError unless `value` is a finite number > 0; `field` names it (host.x)."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{field}={value} must be a finite number > 0")


def at_least(obj: object, prefix: str, names: tuple[str, ...], minimum: int) -> None:
    """Integer fields of `obj` that must be >= minimum (None, where a field allows it, passes)."""
    for name in names:
        value = getattr(obj, name, None)
        if value is not None and value < minimum:
            raise ConfigError(f"{prefix}{name}={value} must be >= {minimum}")


def range_pair(value: list[int], field: str) -> None:
    """A [low, high] range of token counts or turns."""
    if len(value) != 2 or not 1 <= value[0] <= value[1]:
        raise ConfigError(f"{field}={list(value)} must be [low, high] with 1 <= low <= high")
