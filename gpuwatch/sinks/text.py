"""Text as every human view writes it: what came from a process made safe for a terminal, a
finding's evidence in words, lines wrapped to a terminal's width, and tables fitted to it.

Every text sink (`status`, `top`, `reap`, `doctor`, `run`'s summary, the daemon's text log lines)
renders what a process chose (its command line, name, user, cgroup, job id, buffer names, a
reason quoting any of them) through `clean`, here and nowhere else. JSON output is never passed
through it: it stays exact.
"""

from __future__ import annotations

import datetime as _dt
import re
import textwrap
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from gpuwatch.printable import clean
from gpuwatch.units import human_bytes, human_duration

# ---- text from processes: clean() lives in gpuwatch.printable, under every layer (the log
# formatter uses it too), and is re-exported here for the views.


# ---- words ---------------------------------------------------------------------------------------


def evidence(key: str, value: Any) -> str:
    """One item of a finding's evidence (its `details`) as people read it: sizes in binary
    units, durations and moments in words, nothing as a Python repr (None is 'none', True 'yes'),
    and text from a process cleaned. The JSON document keeps the exact values."""
    return f"{clean(key)}: {evidence_value(key, value)}"


def evidence_value(key: str, value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        if key.endswith("_bytes") or key.endswith("_bytes_per_step"):
            return human_bytes(int(value)) + ("/step" if key.endswith("_per_step") else "")
        if key.endswith("_bytes_per_second"):
            return human_bytes(int(value)) + "/s"
        if key.endswith("_seconds"):
            return human_duration(float(value))
        if key.endswith("_at"):
            return _dt.datetime.fromtimestamp(float(value), tz=_dt.timezone.utc).strftime(
                "%Y-%m-%d %H:%M:%SZ")
        return f"{value:g}" if isinstance(value, float) else str(value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{clean(str(k))}: {evidence_value(str(k), v)}"
                               for k, v in value.items()) + "}" if value else "none"
    if isinstance(value, (list, tuple)):
        return ", ".join(evidence_value(key, v) for v in value) if value else "none"
    return clean(str(value))


#: A space between a figure and its unit ('48.0 MiB', '+2.0 GiB/step', '12 s', '3 min', '100 %'):
#: the units human_bytes and human_duration write, and a share.
_FIGURE_UNIT_SPACE = re.compile(
    r"(?<=\d) (?=(?:[KMGTPE]i?B|B)(?:/s|/step)?(?!\w)|(?:ms|s|sec|min|h|d|%)(?!\w))")
#: A word as textwrap finds them: what its whitespace separates.
_WORD = re.compile(r"[^\t\n\x0b\x0c\r ]+")
#: What stands for such a space while textwrap breaks lines: a character it never breaks at, as
#: wide as the space it stands for.
_GLUE = "\x00"


def wrap_text(text: str, width: int, **textwrap_kwargs: Any) -> list[str]:
    """textwrap.wrap(text, width, **textwrap_kwargs), except that a line never breaks between a
    figure and its unit ('48.0' at the end of one line, 'MiB' at the start of the next). A figure
    and unit too wide for a line together with the words they touch (after the longer indent)
    are left to textwrap as two words, so no line is wider than textwrap would make it."""
    if _GLUE in text:  # never after clean(); wrapped as textwrap would
        return textwrap.wrap(text, width, **textwrap_kwargs)
    room = width - max(len(textwrap_kwargs.get("initial_indent", "")),
                       len(textwrap_kwargs.get("subsequent_indent", "")))
    spaces = {m.start() for m in _FIGURE_UNIT_SPACE.finditer(text)}
    words = [(w.start(), w.end()) for w in _WORD.finditer(text)]
    glued = list(text)
    i = 0
    while i < len(words):
        start, end = words[i]
        joins: list[int] = []
        while end in spaces:  # a unit is a word after it: join the two ('1 s/2 min': three)
            joins.append(end)
            i += 1
            end = words[i][1]
        if end - start <= room:
            for at in joins:
                glued[at] = _GLUE
        i += 1
    return [line.replace(_GLUE, " ")
            for line in textwrap.wrap("".join(glued), width, **textwrap_kwargs)]


def wrap_parts(parts: Sequence[str], width: int, indent: str, separator: str = "; "
               ) -> list[str]:
    """`parts` joined by `separator` on lines of at most `width` (0: one line), each starting
    with `indent`; a line breaks between parts, never inside a figure, unless one part alone is
    wider than the room."""
    room = width - len(indent)
    if width <= 0:
        return [indent + separator.join(parts)]
    lines: list[str] = []
    line = ""
    for part in parts:
        candidate = f"{line}{separator}{part}" if line else part
        if len(candidate) + len(separator.rstrip()) <= room or not line:
            line = candidate
            continue
        lines.append(line + separator.rstrip())
        line = "  " + part
    lines.append(line)
    out = []
    for text in lines:
        out += ((wrap_text(text, max(10, room), subsequent_indent="  ",
                           break_on_hyphens=False) or [""]) if len(text) > room else [text])
    return [indent + text for text in out]


# ---- tables fitted to a width ------------------------------------------------------------------


@dataclass(frozen=True)
class Glyphs:
    spark: str
    bar_used: str
    bar_free: str
    ellipsis: str
    descending: str
    ascending: str
    #: Applied to the tree prefixes (None: kept as they are).
    tree: Optional[Mapping[int, str]] = None


UNICODE = Glyphs("▁▂▃▄▅▆▇█", "█", "░", "…", "▼", "▲")
ASCII = Glyphs("_.-~=+*#", "#", ".", "~", "v", "^", str.maketrans("├└─│", "|`-|"))


def glyphs_for(encoding: Optional[str]) -> Glyphs:
    return UNICODE if (encoding or "").lower().replace("-", "") in ("utf8", "utf_8") else ASCII


def cut(text: str, width: int, glyphs: Glyphs = UNICODE) -> str:
    if len(text) <= width:
        return text
    if width <= len(glyphs.ellipsis):
        return text[:max(0, width)]
    return text[:width - len(glyphs.ellipsis)] + glyphs.ellipsis


def cut_left(text: str, width: int, glyphs: Glyphs = UNICODE) -> str:
    """`text` cut at its start: what tells job ids (and a deep tree's PIDs) apart is at their
    end."""
    if len(text) <= width:
        return text
    if width <= len(glyphs.ellipsis):
        return text[len(text) - max(0, width):] if width > 0 else ""
    return glyphs.ellipsis + text[len(text) - width + len(glyphs.ellipsis):]


#: A step that makes room for the last column once it is down to its minimum: ("shrink", column,
#: to this width) or ("hide", column, 0), as ps, top and nvitop give way on a narrow terminal.
Narrowing = tuple[str, int, int]


def fit_widths(natural: Sequence[int], width: int, steps: Sequence[Narrowing],
               min_last: int, gap: int = 2) -> list[int]:
    """Each column's width for a line of `width` characters (0: hidden). The last column (the
    command, the reason: what says what a row is) takes what the others leave; while that is
    less than `min_last`, `steps` are taken one at a time, in order. `width` 0: no limit."""
    widths = list(natural)
    if width <= 0:
        return widths
    last = len(widths) - 1

    def room() -> int:
        # An empty last column (a GPU's note when it has none) takes no gap before it either.
        return width - sum(w + gap for w in widths[:last] if w) + (gap if not natural[last]
                                                                   else 0)

    for step, column, size in steps:
        if room() >= min(min_last, widths[last]):
            break
        if step == "hide":
            widths[column] = 0
        elif widths[column] > size:
            widths[column] = size
    widths[last] = max(0, min(widths[last], room()))
    return widths


def table_lines(rows: Sequence[Sequence[str]], widths: Sequence[int], *,
                right: Collection[int] = (), cut_at_start: Collection[int] = (),
                paint: Optional[Callable[[int, int, str], str]] = None,
                glyphs: Glyphs = UNICODE, gap: int = 2) -> list[str]:
    """`rows` (the first: the column names) in columns of `widths` (0: hidden). A cell longer
    than its column is cut, marked with the ellipsis (at its start for `cut_at_start`); `paint`
    (row, column, the cell padded) may wrap a cell in colour, after it is cut and padded, so
    that an escape sequence is never cut nor counted as columns."""
    last = max((i for i, w in enumerate(widths) if w), default=-1)
    out = []
    for r, row in enumerate(rows):
        cells = []
        for i, text in enumerate(row):
            w = widths[i]
            if not w:
                continue
            if len(text) > w:
                text = cut_left(text, w, glyphs) if i in cut_at_start else cut(text, w, glyphs)
            if i != last:
                text = text.rjust(w) if i in right else text.ljust(w)
            cells.append(paint(r, i, text) if paint is not None else text)
        out.append((" " * gap).join(cells).rstrip())
    return out


def natural_widths(rows: Sequence[Sequence[str]]) -> list[int]:
    return [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]


def fitted_widths(rows: Sequence[Sequence[str]], width: int, steps: Sequence[Narrowing],
                  min_last: int) -> list[int]:
    """fit_widths for the columns of `rows` (the first: the column names) as wide as their
    widest cell."""
    return fit_widths(natural_widths(rows), width, steps, min_last)


#: Narrower than this, a last column is cut (marked), not wrapped into a column of syllables.
_MIN_WRAP = 16


def wrapped_table(rows: Sequence[Sequence[str]], widths: Sequence[int], width: int, *,
                  notes: Optional[Mapping[int, Sequence[str]]] = None,
                  **how: Any) -> list[str]:
    """table_lines, with the last column (a reason: its end says what to do) wrapped under
    itself instead of cut when `width` is set and leaves it room enough, and `notes` (row ->
    lines) under the last column of their row, never cut (a culprit's file path cut short is of
    no use): wrapped there too, a word longer than the column broken across lines, so that no
    line is wider than the terminal, which would break it at column 0."""
    rows = [list(row) for row in rows]
    room = widths[-1]
    wrapped: dict[int, list[str]] = {}
    if width > 0 and room >= _MIN_WRAP:
        for i, row in enumerate(rows):
            if len(row[-1]) > room:
                wrapped[i] = wrap_text(row[-1], room, break_on_hyphens=False) or [""]
                row[-1] = wrapped[i][0]
    indent = " " * sum(w + how.get("gap", 2) for w in widths[:-1] if w)
    out = []
    for i, line in enumerate(table_lines(rows, widths, **how)):
        out.append(line)
        out += [indent + more for more in wrapped.get(i, [])[1:]]
        for note in (notes or {}).get(i, ()):
            out += [indent + part for part in _wrap_whole(note, room if width > 0 else 0)]
    return out


def _wrap_whole(text: str, room: int) -> list[str]:
    """`text` in lines of at most `room` characters, every character kept (0: one line)."""
    if room < _MIN_WRAP or len(text) <= room:
        return [text]
    return wrap_text(text, room, break_on_hyphens=False, break_long_words=True) or [""]


def columns(rows: Sequence[Sequence[str]], right: Collection[int] = ()) -> list[str]:
    """`rows` left-aligned in columns (those in `right` right-aligned), two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)]
        out.append("  ".join(cells).rstrip())
    return out
