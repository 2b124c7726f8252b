"""The human view of a node report: GPUs, GPU holders as process trees, then findings.

A tree is rooted at the holder's job root (gpuwatch.jobs.tree): its launcher, climbed further while
the ancestors belong to the same job, never PID 1. Processes with findings are marked in the tree
and listed with their reasons below it.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Sequence
from typing import Optional

from gpuwatch.model import (
    Kind,
    NodeReport,
)
from gpuwatch.sinks.colour import paint
from gpuwatch.sinks.phrases import agent_parts, finding_figures, leak_notes
from gpuwatch.sinks.proctree import (
    command_cell,
    gpu_cell,
    job_cell,
    no_holders_sentence,
    shown_pids,
    walk_trees,
)
from gpuwatch.sinks.text import (
    UNICODE,
    Glyphs,
    Narrowing,
    clean,
    fitted_widths,
    table_lines,
    wrap_parts,
    wrap_text,
    wrapped_table,
)
from gpuwatch.units import human_bytes, human_duration


def render_status(report: NodeReport, width: int = 0, verbose: bool = False,
                  colour: bool = False, glyphs: Glyphs = UNICODE) -> str:
    """The table view of `report` (`gpuwatch status` reads it from a status document with
    gpuwatch.sinks.document.from_json) fitted to `width` (0: never cut, for a pipe or a file):
    on a narrow terminal the less telling columns give way first, as in ps, top and nvitop, and
    a row always keeps its command's name; sentences and reasons are wrapped. `verbose` adds
    what a leak's allocation trace found: its sites and the traceback of the largest; `colour`
    paints severities and finding markers with ANSI colours. Every text a process chose is cleaned
    (gpuwatch.sinks.text.clean)."""
    lines = [*_wrap(_header(report), width), ""]
    lines += _gpu_table(report, width, glyphs)
    lines.append("")
    lines += _process_table(report, width, colour, glyphs)
    if report.findings:
        lines += ["", *_findings_table(report, width, verbose, colour, glyphs)]
    return "\n".join(lines).rstrip() + "\n"


def _wrap(text: str, width: int) -> list[str]:
    """Sentences are wrapped, not cut: the end of one (a socket's path, why NVML failed) is
    what the reader needs."""
    if width <= 0:
        return text.splitlines()
    return [wrapped for line in text.splitlines()
            for wrapped in wrap_text(line, width, subsequent_indent="  ") or [""]]


#: The findings table: FINDING SEVERITY PID NAME GPU-MEMORY FOR REASON; what gives way first
#: for the reason, which is wrapped in the room left (never less than _MIN_REASON columns).
_F_SEVERITY, _F_NAME, _F_MEMORY, _F_FOR = 1, 3, 4, 5
_FINDING_NARROWING: tuple[Narrowing, ...] = (
    ("hide", _F_FOR, 0), ("shrink", _F_NAME, 10), ("hide", _F_MEMORY, 0),
    ("hide", _F_SEVERITY, 0), ("hide", _F_NAME, 0))
_MIN_REASON = 30


def _findings_table(report: NodeReport, width: int, verbose: bool = False,
                    colour: bool = False, glyphs: Glyphs = UNICODE) -> list[str]:
    rows: list[Sequence[str]] = [("FINDING", "SEVERITY", "PID", "NAME", "GPU MEMORY", "FOR",
                                  "REASON")]
    notes: dict[int, list[str]] = {}
    wall = report.snapshot.wall
    taken_at = wall(report.snapshot.taken_at)
    for f in report.findings:
        gpus = ",".join(map(str, f.gpus))
        memory = human_bytes(f.gpu_memory_bytes) if f.gpu_memory_bytes is not None else "-"
        rows.append((
            clean(f.kind), clean(f.severity),
            str(f.pid) if f.pid is not None else f"GPU {gpus}",
            clean(f.name or "-"),
            f"{gpus}:{memory}" if f.gpu_memory_bytes is not None and f.pid else memory,
            human_duration(taken_at - wall(f.since)),
            clean(f.reason + finding_figures(f.details)),
        ))
        if f.kind == Kind.LEAK:
            notes[len(rows) - 1] = [clean(note) for note in leak_notes(f.details, verbose)]
    widths = fitted_widths(rows, width, _FINDING_NARROWING, _MIN_REASON)

    def painted(r: int, column: int, text: str) -> str:
        return paint(text, rows[r][1]) if colour and r > 0 and column == 1 else text

    # Notes sit under the reason they go with, so the columns to the left stay readable.
    return wrapped_table(rows, widths, width, notes=notes, paint=painted, glyphs=glyphs)


def _header(report: NodeReport) -> str:
    snapshot = report.snapshot
    when = _dt.datetime.fromtimestamp(snapshot.wall(snapshot.taken_at), tz=_dt.timezone.utc)
    via = "from the running daemon" if report.source == "daemon" else "one poll"
    if report.source_detail:
        via += f" ({report.source_detail})"
    nvml = snapshot.nvml
    if nvml.available:
        driver = f"NVML {nvml.nvml_version or '?'} · driver {nvml.driver_version or '?'}"
        if nvml.cuda_driver_version:
            driver += f" · CUDA {nvml.cuda_driver_version}"
    else:
        driver = (f"NVML unavailable: {nvml.error} - showing host processes that look like "
                  "GPU work")
    return (clean(f"node {snapshot.hostname} · {when:%Y-%m-%d %H:%M:%S}Z · {via}") + "\n"
            + clean(driver))


_GPU_NARROWING: tuple[Narrowing, ...] = (("shrink", 1, 12), ("hide", 3, 0), ("hide", 1, 0))


def _gpu_table(report: NodeReport, width: int = 0, glyphs: Glyphs = UNICODE) -> list[str]:
    gpus = report.snapshot.gpus
    if not gpus:
        return ["no GPUs" if report.snapshot.nvml.available else "no GPU information"]
    rows: list[Sequence[str]] = [("GPU", "NAME", "MEMORY USED / TOTAL", "UNATTRIBUTED", "UTIL",
                                  "PROCS", "")]
    for g in gpus:
        note = ""
        if g.lost:
            note = "LOST (needs a reset): "
        if g.errors:
            note += "; ".join(f"{e.call}: {e.message}" for e in g.errors)
        rows.append((
            str(g.index),
            clean(g.name or "?"),
            _memory_cell(g.memory_used_bytes, g.memory_total_bytes),
            human_bytes(g.unattributed_memory_bytes),
            f"{g.utilization_gpu_percent}%" if g.utilization_gpu_percent is not None else "?",
            "?" if g.holders_unknown else str(len(g.processes)),
            clean(note),
        ))
    widths = fitted_widths(rows, width, _GPU_NARROWING, 20)
    return [line[:width] if width > 0 else line
            for line in table_lines(rows, widths, right={0, 3, 4, 5}, glyphs=glyphs)]


def _memory_cell(used: Optional[int], total: Optional[int]) -> str:
    if used is None or total is None:
        return f"{human_bytes(used)} / {human_bytes(total)}"
    share = 100 * used / total if total else 0
    return f"{human_bytes(used)} / {human_bytes(total)} ({share:.0f}%)"


#: The process table: PID USER JOB STATE RSS GPU-MEMORY COMMAND, and what gives way, in order,
#: once COMMAND is down to what shows each row's markers and program name (as top does).
_P_PID, _P_USER, _P_JOB, _P_STATE, _P_RSS, _P_GPU, _P_COMMAND = range(7)
PROCESS_NARROWING: tuple[Narrowing, ...] = (
    ("shrink", _P_JOB, 20), ("hide", _P_STATE, 0), ("hide", _P_USER, 0), ("shrink", _P_JOB, 14),
    ("hide", _P_RSS, 0), ("hide", _P_JOB, 0), ("shrink", _P_PID, 10))
#: COMMAND keeps at least this much, and always each row's markers and program name: a little
#: more than top's, which has a panel and a details page for the rest.
MIN_COMMAND = 30


def _process_table(report: NodeReport, width: int, colour: bool = False,
                   glyphs: Glyphs = UNICODE) -> list[str]:
    snapshot = report.snapshot
    procs = snapshot.processes
    taken_at = snapshot.wall(snapshot.taken_at)
    kinds: dict[int, list[str]] = {}
    severities: dict[int, list[str]] = {}
    for f in report.findings:
        if f.pid is not None:
            kinds.setdefault(f.pid, []).append(clean(f.kind))
            severities.setdefault(f.pid, []).append(f.severity)
    shown = shown_pids(report, set(kinds))
    if not shown:
        return [no_holders_sentence(report)]
    rows: list[Sequence[str]] = [("PID", "USER", "JOB", "STATE", "RSS", "GPU MEMORY", "COMMAND")]
    pids: list[int] = []
    under: dict[int, list[str]] = {}  # row -> parts of the agent's line
    needed = MIN_COMMAND
    for depth_prefix, p in walk_trees(procs, shown):
        pids.append(p.pid)
        if glyphs.tree is not None:
            depth_prefix = depth_prefix.translate(glyphs.tree)
        markers = "".join(f"[{k}] " for k in kinds.get(p.pid, ()))
        command = clean(command_cell(p, procs, shown))
        needed = max(needed, len(markers) + len(command.split(" ", 1)[0]))
        rows.append((
            depth_prefix + str(p.pid),
            clean(p.user or "?"),
            clean(job_cell(report.job_of(p))),
            p.state or "-",
            human_bytes(p.rss_bytes) if p.rss_bytes is not None else "-",
            gpu_cell(p),
            markers + command,
        ))
        agent = snapshot.agents.get(p.pid)
        if agent is not None:
            under[len(rows) - 1] = agent_parts(report, agent, taken_at)
    widths = fitted_widths(rows, width, PROCESS_NARROWING, needed)

    def painted(r: int, column: int, text: str) -> str:
        if not colour or r == 0 or column != _P_COMMAND:
            return text
        pid = pids[r - 1]
        at = 0
        for kind, severity in zip(kinds.get(pid, ()), severities.get(pid, ())):
            marker = f"[{kind}]"
            if text[at:at + len(marker)] != marker:
                break  # cut short: an escape sequence is never cut in half
            coloured = paint(marker, severity)
            text = text[:at] + coloured + text[at + len(marker):]
            at += len(coloured) + 1
        return text

    table = table_lines(rows, widths, cut_at_start={_P_PID, _P_JOB}, paint=painted,
                        glyphs=glyphs)
    # What an instrumented process's agent reports, under its row at its command's column.
    indent = " " * min(sum(w + 2 for w in widths[:_P_COMMAND] if w), 16)
    out = []
    for i, line in enumerate(table):
        out.append(line)
        if i in under:
            out += wrap_parts(under[i], width, indent)
    return out
