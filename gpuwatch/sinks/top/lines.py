"""The lines `gpuwatch top` draws: each a list of (text, style) segments, the style names the
screen maps to attributes, a line cut to a width, and a sparkline of a figure over time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from gpuwatch.sinks.text import (
    Glyphs,
)
from gpuwatch.vocabulary import Severity

#: Styles: names the screen maps to attributes (colours, or bold/reverse under NO_COLOR).

PLAIN = ""
TITLE = "title"
DIM = "dim"
HEAD = "head"  # the table's column names
# A finding's row and marker take its severity's style.
CRITICAL, WARNING, INFO = Severity.CRITICAL, Severity.WARNING, Severity.INFO
BAR = "bar"
KEY = "key"

#: The smallest terminal top draws on; below it, a line that says so.
MIN_WIDTH, MIN_HEIGHT = 40, 10

Segment = tuple[str, str]


class SampleHistory(Protocol):
    """What top has sampled of each process (feed.Samples): oldest first, each with `at`,
    `rss_bytes` and `gpu_memory_bytes`."""

    def of(self, pid: int) -> Sequence[Any]: ...


@dataclass
class Line:
    segments: list[Segment] = field(default_factory=list)
    #: The selected row: drawn in reverse video across the whole width.
    selected: bool = False

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.segments)

    def add(self, text: str, style: str = PLAIN) -> Line:
        if text:
            self.segments.append((text, style))
        return self


def fit(line: Line, width: int, ellipsis: str = "") -> Line:
    """`line` cut at `width` columns (the last one replaced by `ellipsis` where it was cut)."""
    if len(line.text) <= width:
        return line
    room = max(0, width - len(ellipsis))
    out = Line(selected=line.selected)
    for text, style in line.segments:
        if room <= 0:
            break
        out.add(text[:room], style)
        room -= len(text[:room])
    if ellipsis and width >= len(ellipsis):
        out.add(ellipsis, out.segments[-1][1] if out.segments else PLAIN)
    return out


def sparkline(values: Sequence[Optional[float]], width: int, glyphs: Glyphs) -> str:
    """The last `width` values as bars, scaled from their minimum to their maximum (a flat line
    sits on the floor); an unknown value is a gap."""
    shown = list(values)[-width:] if width > 0 else []
    known = [v for v in shown if v is not None]
    if not known:
        return " " * len(shown)
    low, high = min(known), max(known)
    top = len(glyphs.spark) - 1
    out = []
    for v in shown:
        if v is None:
            out.append(" ")
        elif high == low:
            out.append(glyphs.spark[0])
        else:
            out.append(glyphs.spark[round((v - low) / (high - low) * top)])
    return "".join(out)
