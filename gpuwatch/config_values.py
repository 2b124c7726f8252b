"""The checks of a setting's value (gpuwatch.config): each returns the value normalised or raises
ValueError saying what was expected ("a number > 0"), which the config names with the key and
where the value came from."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from gpuwatch.units import parse_duration
from gpuwatch.vocabulary import KINDS, Kind


def positive_float(v: Any) -> float:
    try:
        f = float(v) if not isinstance(v, bool) else 0.0
    except (TypeError, ValueError):
        f = 0.0
    if not 0 < f < float("inf"):
        raise ValueError("a number > 0")
    return f


def positive_int(v: Any) -> int:
    try:
        i = int(v) if not isinstance(v, (bool, float)) else 0
    except (TypeError, ValueError):
        i = 0
    if i < 1:
        raise ValueError("an integer >= 1")
    return i


def path(v: Any) -> Path:
    if not isinstance(v, (str, Path)) or not str(v):
        raise ValueError("a path")
    return Path(v)


def non_negative_float(v: Any) -> float:
    try:
        f = float(v) if not isinstance(v, bool) else -1.0
    except (TypeError, ValueError):
        f = -1.0
    if not 0 <= f < float("inf"):
        raise ValueError("a number >= 0")
    return f


def seconds(v: Any) -> float:
    """A duration: a number of seconds, or a string with units ("30s", "5m", "1h30m")."""
    if isinstance(v, str):
        try:
            return parse_duration(v)
        except ValueError:
            raise ValueError("a duration (seconds, or \"30s\", \"5m\")"
                             ) from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("a duration (seconds, or \"30s\", \"5m\")")
    return float(v)


def positive_seconds(v: Any) -> float:
    f = seconds(v)
    if not 0 < f < float("inf"):
        raise ValueError("a duration > 0 (seconds, or \"30s\", \"5m\")")
    return f


def non_negative_seconds(v: Any) -> float:
    f = seconds(v)
    if not 0 <= f < float("inf"):
        raise ValueError("a duration >= 0 (seconds, or \"30s\", \"5m\")")
    return f


def non_negative_int(v: Any) -> int:
    try:
        i = int(v) if not isinstance(v, (bool, float)) else -1
    except (TypeError, ValueError):
        i = -1
    if i < 0:
        raise ValueError("an integer >= 0")
    return i


def names(v: Any) -> tuple[str, ...]:
    items = v.split(",") if isinstance(v, str) else v
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise ValueError("a list of names")
    return tuple(i.strip() for i in items if i.strip())


def kinds(v: Any) -> tuple[Kind, ...]:
    given = names(v)
    found = tuple(Kind.parse(n) for n in given)
    unknown = [n for n, k in zip(given, found) if k is None]
    if unknown:
        raise ValueError("a list of finding kinds, each one of " + ", ".join(KINDS)
                         + f" ({_quoted(unknown[0])} is none)")
    return tuple(k for k in found if k is not None)


def _quoted(name: str, limit: int = 40) -> str:
    return repr(name if len(name) <= limit else name[:limit] + "...")


def absolute_paths(v: Any) -> tuple[str, ...]:
    paths = names(v)
    if not all(p.startswith("/") and "\0" not in p for p in paths):
        raise ValueError("a list of absolute paths")
    return tuple(os.path.normpath(p) for p in paths)


def unit_names(v: Any) -> tuple[str, ...]:
    units = names(v)
    if not all(u.endswith((".service", ".scope")) and "/" not in u for u in units):
        raise ValueError('a list of systemd unit names ("nvidia-persistenced.service")')
    return units


def boolean(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    # on/off too: GPUWATCH_AGENT_TRACING is also read by the agent in training processes, which
    # takes "off", and a gpuwatch command run from such a shell reads the same environment.
    word = v.strip().lower() if isinstance(v, str) else None
    if word in ("true", "yes", "on", "1", "false", "no", "off", "0"):
        return word in ("true", "yes", "on", "1")
    raise ValueError("true or false")


def int_between(low: int, high: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        try:
            i = int(v) if not isinstance(v, (bool, float)) else low - 1
        except (TypeError, ValueError):
            i = low - 1
        if not low <= i <= high:
            raise ValueError(f"an integer from {low} to {high}")
        return i
    return check


def one_of(*choices: str) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if v not in choices:
            raise ValueError("one of " + ", ".join(choices))
        return str(v)
    return check
