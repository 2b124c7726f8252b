"""Colour on a terminal, and only there: severities in red and yellow, nothing when the output is
piped, when NO_COLOR is set (https://no-color.org) or when the terminal is `dumb`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Optional, TextIO

from gpuwatch.vocabulary import CheckStatus, Severity

# SGR parameters; bold red for what needs someone now, yellow for what can wait.
_SGR: Mapping[str, str] = {
    Severity.CRITICAL: "1;31",
    CheckStatus.FAIL: "1;31",
    Severity.WARNING: "33",
    CheckStatus.WARN: "33",
    Severity.INFO: "36",
    CheckStatus.OK: "32",
}


def wants_colour(stream: TextIO, environ: Optional[Mapping[str, str]] = None) -> bool:
    env = os.environ if environ is None else environ
    if env.get("NO_COLOR") or env.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or not a real stream
        return False


def paint(text: str, style: str) -> str:
    """`text` in the colour of `style` (a severity, or a check's ok/warn/fail); unchanged when
    the style has no colour."""
    sgr = _SGR.get(style)
    return f"\033[{sgr}m{text}\033[0m" if sgr else text
