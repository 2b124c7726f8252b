"""The human view of a reap: the plan, or what came of it."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Sequence
from typing import Any, Optional

from gpuwatch.model import NodeReport
from gpuwatch.sinks.text import (
    UNICODE,
    Glyphs,
    Narrowing,
    clean,
    fitted_widths,
    wrap_text,
    wrapped_table,
)
from gpuwatch.units import human_bytes
from gpuwatch.vocabulary import FREED_OUTCOMES, ReapOutcome

#: PID NAME USER JOB KIND GPU-MEMORY ACTION SIGNALS|RESULT WHY: what gives way on a narrow
#: terminal, in order, for WHY (wrapped in what is left); never the PID, the name, the action.
_R_NAME, _R_USER, _R_JOB, _R_MEMORY, _R_OUTCOME = 1, 2, 3, 5, 7
_NARROWING: tuple[Narrowing, ...] = (
    ("shrink", _R_JOB, 20), ("hide", _R_USER, 0), ("shrink", _R_JOB, 14),
    ("hide", _R_MEMORY, 0), ("shrink", _R_OUTCOME, 16), ("hide", _R_JOB, 0),
    ("hide", _R_OUTCOME, 0), ("shrink", _R_NAME, 8))
_MIN_WHY = 24


def render_reap(report: NodeReport, rows: list[tuple[Any, str, str]], dry_run: bool,
                held: Optional[list[int]] = None, width: int = 0,
                glyphs: Glyphs = UNICODE, spared: Sequence[Any] = ()) -> str:
    """The plan (`dry_run`) or its results; `held`: the PIDs whose GPU memory the plan named is
    still held after acting (release.still_held). `spared`: the protected GPU holders the reap's
    --job or --pid names (reaper.Spared), said after the table: never signalled, still held.
    Fitted to `width` as `status` is (0: lines in full); every text a process chose is
    cleaned."""
    snapshot = report.snapshot
    when = _dt.datetime.fromtimestamp(snapshot.wall(snapshot.taken_at), tz=_dt.timezone.utc)
    via = "from the running daemon" if report.source == "daemon" else "one poll"
    head = clean(f"gpuwatch reap · node {snapshot.hostname} · findings of {when:%H:%M:%S}Z, {via}"
                 + (" · dry run: nothing is sent" if dry_run else ""))
    heads = wrap_text(head, width, subsequent_indent="  ") if width > 0 else [head]
    protected = [_spared_line(s) for s in spared]
    if width > 0:
        protected = [line for text in protected
                     for line in wrap_text(text, width, subsequent_indent="  ")]
    if not rows:
        if not protected:
            return "\n".join([*heads, "nothing to do"]) + "\n"
        still = ("" if dry_run else "\nGPU memory still held by PID "
                 + ", ".join(str(s.pid) for s in spared) + "\n")
        return "\n".join([*heads, "", *protected]) + "\n" + still
    table: list[tuple[str, ...]] = [("PID", "NAME", "USER", "JOB", "KIND", "GPU MEMORY",
                                     "ACTION", "SIGNALS" if dry_run else "RESULT", "WHY")]
    for a, result, detail in rows:
        job = a.job.shown if a.job else "-"
        memory = human_bytes(a.gpu_memory_bytes) if a.gpu_memory_bytes is not None else "-"
        outcome = ", ".join(a.signals) if dry_run else f"{result}: {detail}" if detail else result
        why = a.refused or a.reason
        table.append((str(a.pid) if a.pid is not None else "-", clean(a.name or "?"),
                      clean(a.user or "?"), clean(job), clean(a.kind), memory, a.action,
                      clean(outcome or "-"), clean(why)))
    widths = fitted_widths(table, width, _NARROWING, _MIN_WHY)
    freed = sum(a.gpu_memory_bytes or 0 for a, result, _ in rows
                if (result == ReapOutcome.PLANNED or result in FREED_OUTCOMES)
                and a.action not in ("refuse", "refuse-service", "report"))
    verb = "would free" if dry_run else "freed"
    rows_text = wrapped_table(table, widths, width, cut_at_start={_R_JOB}, glyphs=glyphs)
    if width > 0:
        # Narrower than what every step above leaves (PID, name, kind, action): cut.
        rows_text = [line[:width] for line in rows_text]
    lines = [*heads,
             "", *rows_text, "", *protected, *_service_lines(rows, dry_run),
             f"{verb} up to {human_bytes(freed)} of GPU memory"]
    if not dry_run:
        lines.append("GPU memory still held by PID " + ", ".join(map(str, sorted(held)))
                     if held else "no GPU memory the plan named is still held")
    return "\n".join(lines) + "\n"


def _service_lines(rows: list[tuple[Any, str, str]], dry_run: bool) -> list[str]:
    """What was refused as a service's (or the daemon's) own: findings that name it are wrong or
    out of date, and no reap ends it (`refuse-service`, `refused-service`)."""
    pids = [str(a.pid) for a, result, _ in rows
            if a.action == "refuse-service" or result == ReapOutcome.REFUSED_SERVICE]
    if not pids:
        return []
    verb = "would refuse" if dry_run else "refused"
    return [f"{verb} PID {', '.join(pids)}: live work of a service or of the daemon "
            "(refused-service); nothing of it is signalled"]


def _spared_line(s: Any) -> str:
    memory = human_bytes(s.gpu_memory_bytes) if s.gpu_memory_bytes is not None else "GPU memory"
    job = f", job {s.job.shown}" if s.job else ""
    return clean(f"not signalled: PID {s.pid} ({s.name or '?'}, {s.user or '?'}{job}) holds "
                 f"{memory} and is protected: {s.protected}")
