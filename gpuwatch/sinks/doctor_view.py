"""The human view of `gpuwatch doctor`: one line per check, what to do under each problem, and a
one-line count at the end.

It renders the same document `gpuwatch doctor --json` prints, so both views always agree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatch.sinks.colour import paint
from gpuwatch.sinks.text import clean, wrap_text
from gpuwatch.vocabulary import CheckStatus

_STATUS_WIDTH = 4


def render_doctor(doc: Mapping[str, Any], colour: bool = False, width: int = 0) -> str:
    """`colour`: the status words in colour (gpuwatch.sinks.colour.wants_colour decides);
    `width`: a terminal's, each summary and fix wrapped under itself (0: lines in full). A
    summary may quote what a process or a file holds: it is cleaned."""
    checks: Sequence[Mapping[str, Any]] = doc["checks"]
    name_width = max((len(c["name"]) for c in checks), default=0)
    indent = " " * (_STATUS_WIDTH + 2 + name_width + 2)
    lines = []
    for c in checks:
        status = f"{c['status']:<{_STATUS_WIDTH}}"
        if colour:
            # Padded before painting: escape codes take no columns but count as characters.
            status = paint(status, c["status"])
        summary = _wrapped(clean(c["summary"]), width, len(indent))
        lines.append(f"{status}  {c['name']:<{name_width}}  {summary[0]}")
        lines += [indent + more for more in summary[1:]]
        if c.get("fix") and c["status"] in (CheckStatus.WARN, CheckStatus.FAIL):
            fix = _wrapped(clean(c["fix"]), width, len(indent) + 2)
            lines.append(f"{indent}→ {fix[0]}")
            lines += [f"{indent}  {more}" for more in fix[1:]]
    lines += ["", summary_line(checks)]
    return "\n".join(lines) + "\n"


def _wrapped(text: str, width: int, indent: int) -> list[str]:
    room = width - indent
    if width <= 0 or room < 20 or len(text) <= room:
        return [text]
    return wrap_text(text, room, break_on_hyphens=False) or [""]


def summary_line(checks: Sequence[Mapping[str, Any]]) -> str:
    """'2 warnings, 1 failure (8 ok, 1 skipped)', or 'all ok (10 ok)'."""
    counts = Counter(c["status"] for c in checks)
    problems = []
    warn, fail = counts[CheckStatus.WARN], counts[CheckStatus.FAIL]
    ok, skip = counts[CheckStatus.OK], counts[CheckStatus.SKIP]
    if warn:
        problems.append(f"{warn} warning{'s' if warn != 1 else ''}")
    if fail:
        problems.append(f"{fail} failure{'s' if fail != 1 else ''}")
    rest = f"{ok} ok" + (f", {skip} skipped" if skip else "")
    return f"{', '.join(problems) or 'all ok'} ({rest})"
