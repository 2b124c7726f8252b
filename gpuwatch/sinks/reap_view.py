"""The human view of a reap: the plan, or what came of it."""

from __future__ import annotations

import datetime as _dt
from typing import Any, Optional

from gpuwatch.sinks.status_view import columns
from gpuwatch.units import human_bytes


def render_reap(doc: dict[str, Any], rows: list[tuple[Any, str, str]], dry_run: bool,
                held: Optional[list[int]] = None) -> str:
    """The plan (`dry_run`) or its results; `held`: the PIDs whose GPU memory the plan named is
    still held after acting (release.still_held)."""
    when = _dt.datetime.fromtimestamp(doc["taken_at"], tz=_dt.timezone.utc)
    via = "from the running daemon" if doc["source"] == "daemon" else "one poll"
    head = (f"gpuwatch reap · node {doc['node']} · findings of {when:%H:%M:%S}Z, {via}"
            + (" · dry run: nothing is sent" if dry_run else ""))
    if not rows:
        return f"{head}\nnothing to do\n"
    table: list[tuple[str, ...]] = [("PID", "USER", "JOB", "KIND", "GPU MEMORY", "ACTION",
                                     "SIGNALS" if dry_run else "RESULT", "WHY")]
    for a, result, detail in rows:
        job = f"{a.job['source']}:{a.job['id']}" if a.job else "-"
        memory = human_bytes(a.gpu_memory_bytes) if a.gpu_memory_bytes is not None else "-"
        outcome = ", ".join(a.signals) if dry_run else f"{result}: {detail}" if detail else result
        why = a.refused or a.reason
        table.append((str(a.pid) if a.pid is not None else "-", a.user or "?", job, a.kind,
                      memory, a.action, outcome or "-", why))
    freed = sum(a.gpu_memory_bytes or 0 for a, result, _ in rows
                if result in ("planned", "exited", "killed", "reaped", "gone")
                and a.action != "refuse")
    verb = "would free" if dry_run else "freed"
    lines = [head, "", *columns(table), "", f"{verb} up to {human_bytes(freed)} of GPU memory"]
    if not dry_run:
        lines.append("GPU memory still held by PID " + ", ".join(map(str, sorted(held)))
                     if held else "no GPU memory the plan named is still held")
    return "\n".join(lines) + "\n"
