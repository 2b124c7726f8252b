"""How figures read to people: bytes in binary units, durations in the largest sensible unit,
counts with their nouns."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Optional

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: Optional[int]) -> str:
    if n is None:
        return "?"
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0,
                   "d": 86400.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)")


def parse_duration(text: str) -> float:
    """Seconds in `text`: `30`, `30s`, `1.5m`, `500ms`, `2h`, `1d`, or parts added up (`1m30s`),
    as `sleep`, `timeout` and Prometheus take them. A bare number is seconds. Raises ValueError
    with a message that says what is accepted."""
    cleaned = text.strip().lower()
    total, at = 0.0, 0
    while at < len(cleaned):
        match = _DURATION_PART.match(cleaned, at)
        if match is None or (match.group(2) and match.group(2) not in _DURATION_UNITS) or (
                not match.group(2) and (at, match.end()) != (0, len(cleaned))):
            raise ValueError(f"{text!r} is not a duration: give seconds (30), or a number with "
                             "a unit (500ms, 30s, 5m, 2h, 1d, 1m30s)")
        total += float(match.group(1)) * _DURATION_UNITS.get(match.group(2), 1.0)
        at = match.end()
        while at < len(cleaned) and cleaned[at] == " ":
            at += 1
    if not cleaned:
        raise ValueError("an empty duration: give seconds (30), or a number with a unit (30s, 5m)")
    return total


def clock_time(epoch: float) -> str:
    """'09:14:03Z': a moment that stays the same on every poll, unlike '14 s ago'."""
    import datetime as _dt  # here: most commands never show a clock time

    return _dt.datetime.fromtimestamp(epoch, tz=_dt.timezone.utc).strftime("%H:%M:%SZ")


def human_duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} d"


#: Endings after which a plural takes "es": process -> processes, box -> boxes.
_ES_ENDINGS = ("s", "sh", "ch", "x")


def plural(n: int, one: str, many: Optional[str] = None) -> str:
    """'1 thread', '2 threads', '1 process', '2 processes', '0 boxes': the count and its noun,
    "es" added after s, sh, ch and x, "s" after anything else. `many` gives an irregular plural
    ('1 gpuwatch_ metric family', '2 gpuwatch_ metric families')."""
    if n == 1:
        return f"{n} {one}"
    if many is None:
        many = one + ("es" if one.endswith(_ES_ENDINGS) else "s")
    return f"{n} {many}"


#: How long a process name (`comm`) can be: the kernel keeps its first 15 bytes.
_COMM_LENGTH = 15


def short_command(name: Optional[str], cmdline: Sequence[str]) -> str:
    """A command line for a table row or a sentence: the program by its base name, since its
    directory (`/opt/conda/envs/train/bin/python`) would push the arguments that tell processes
    apart out of sight; a script run through its #! line by the script's name, as the kernel
    names the process (`python3 /usr/local/bin/torchrun --nproc-per-node 8` reads `torchrun
    --nproc-per-node 8`). The full command line stays in the process record."""
    if not cmdline:
        return f"[{name or '?'}]"
    args = list(cmdline)
    if (len(args) > 1 and name and _base(args[0])[:_COMM_LENGTH] != name
            and _base(args[1])[:_COMM_LENGTH] == name):
        args = args[1:]
    return " ".join((_base(args[0]), *args[1:]))


def _base(program: str) -> str:
    return program.rsplit("/", 1)[-1] or program
