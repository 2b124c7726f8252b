"""The human view of a node report: GPUs, GPU holders as process trees, then findings.

A tree is rooted at the holder's job root (gpuwatch.jobs.tree): its launcher, climbed further while
the ancestors belong to the same job, never PID 1. Processes with findings are marked in the tree
and listed with their reasons below it.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Optional

from gpuwatch.launch_env import WORKER_MARKER_KEYS
from gpuwatch.model import (
    AgentReading,
    BufferSize,
    HostProcess,
    Job,
    Kind,
    NodeReport,
    holds_gpu,
)
from gpuwatch.sinks.colour import paint
from gpuwatch.sinks.text import (
    UNICODE,
    Glyphs,
    Narrowing,
    clean,
    fit_widths,
    natural_widths,
    table_lines,
    wrap_parts,
    wrap_text,
    wrapped_table,
)
from gpuwatch.units import human_bytes, human_duration, plural, short_command


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
        details = f.details
        rows.append((
            clean(f.kind), clean(f.severity),
            str(f.pid) if f.pid is not None else f"GPU {gpus}",
            clean(f.name or "-"),
            f"{gpus}:{memory}" if f.gpu_memory_bytes is not None and f.pid else memory,
            human_duration(taken_at - wall(f.since)),
            clean(f.reason + finding_figures(details)),
        ))
        if f.kind == Kind.LEAK:
            notes[len(rows) - 1] = [clean(note) for note in leak_notes(details, verbose)]
    widths = fit_widths(natural_widths(rows), width, _FINDING_NARROWING, _MIN_REASON)

    def painted(r: int, column: int, text: str) -> str:
        return paint(text, rows[r][1]) if colour and r > 0 and column == 1 else text

    # Notes sit under the reason they go with, so the columns to the left stay readable.
    return wrapped_table(rows, widths, width, notes=notes, paint=painted, glyphs=glyphs)


def leak_notes(d: Mapping[str, Any], verbose: bool = False) -> list[str]:
    """Lines under a leak's reason: its culprit and how it was found, with the culprit's own
    growth (the reason is frozen as first given, these figures are not); what became of an
    allocation trace; with `verbose`, the traced sites and the largest one's traceback."""
    notes = []
    if _culprit_shown(d):
        found_by = f" ({d['found_by']})" if d.get("found_by") else ""
        figures = []
        if d.get("culprit_items_per_step") is not None:
            figures.append(f"+{d['culprit_items_per_step']:g} items/step")
        if d.get("culprit_bytes_per_step") is not None:
            figures.append(f"~{human_bytes(d['culprit_bytes_per_step'])}/step")
        notes.append(f"culprit `{d['culprit']}`{found_by}"
                     + (f": {', '.join(figures)}" if figures else ""))
    trace = d.get("trace")
    if isinstance(trace, Mapping):
        notes.append(_trace_phrase(trace, d.get("found_by"), verbose))
        if verbose:
            notes += _trace_detail(trace)
    return notes


def _culprit_shown(d: Mapping[str, Any]) -> bool:
    """A culprit gets a line of its own, except when the leak is that buffer growing alone:
    the reason names it already and its figures are the leak's."""
    culprit = d.get("culprit")
    return bool(culprit) and d.get("series") != f"buffer `{culprit}`"


def _trace_phrase(trace: Mapping[str, Any], found_by: Optional[str], verbose: bool) -> str:
    status, why = trace.get("status"), trace.get("why") or ""
    if status == "requested":
        return "tracing requested"
    if status == "refused":
        return "tracing refused by the process" + (f": {why}" if why else "")
    if status == "failed":
        return "tracing failed" + (f": {why}" if why else "")
    if status != "done":
        return f"tracing {status}"
    phrase = f"traced {trace.get('steps') or '?'} steps"
    sites = trace.get("sites") or []
    if found_by is None:
        phrase += ": no allocation site explains it"
    if sites and found_by != "traced":
        top = sites[0]
        phrase += (f" (largest: `{top.get('site')}`, "
                   f"~{human_bytes(top.get('bytes_per_step'))}/step)")
    if trace.get("traceback") and not verbose:
        phrase += "; `gpuwatch status -v` shows where it allocates"
    return phrase


def _trace_detail(trace: Mapping[str, Any]) -> list[str]:
    sites = trace.get("sites") or []
    lines = []
    if sites:
        lines.append("allocation sites, largest first:")
        for site in sites:
            count = site.get("count_per_step")
            blocks = f", +{count:g} blocks/step" if isinstance(count, (int, float)) else ""
            lines.append(f"  `{site.get('site')}`  ~{human_bytes(site.get('bytes_per_step'))}"
                         f"/step{blocks}")
    if trace.get("traceback"):
        where = f" of `{sites[0].get('site')}`" if sites else ""
        lines.append(f"traceback{where}, oldest call first:")
        lines += [f"  {frame}" for frame in trace["traceback"]]
    return lines


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
    widths = fit_widths(natural_widths(rows), width, _GPU_NARROWING, 20)
    return [line[:width] if width > 0 else line
            for line in table_lines(rows, widths, right={0, 3, 4, 5}, glyphs=glyphs)]


def finding_figures(d: Mapping[str, Any]) -> str:
    """A leak's figures, appended to its reason: growth and projected OOM (the culprit's share is
    on a line of its own, see leak_notes)."""
    parts = []
    if d.get("cause") == "copy-on-write" and "private_growth_bytes" in d:
        parts.append(f"node's private memory +{human_bytes(d['private_growth_bytes'])} across "
                     f"{plural(d.get('workers', 0), 'worker')}, USS "
                     f"{human_bytes(d.get('uss_bytes_from'))} -> "
                     f"{human_bytes(d.get('uss_bytes_to'))}")
    if "growth_bytes_per_step" in d:
        parts.append(f"+{human_bytes(d['growth_bytes_per_step'])}/step")
    if "growth_bytes_per_second" in d:
        parts.append(f"+{human_bytes(d['growth_bytes_per_second'])}/s")
    if "culprit_items_per_step" in d and not _culprit_shown(d):
        parts.append(f"+{d['culprit_items_per_step']:g} items/step")
    if "projected_oom_step" in d:
        oom = f"out of memory at step ~{d['projected_oom_step']}"
        if "projected_oom_in_seconds" in d:
            oom += f" (in ~{human_duration(d['projected_oom_in_seconds'])})"
        parts.append(oom)
    elif "projected_oom_in_seconds" in d:
        parts.append(f"out of memory in ~{human_duration(d['projected_oom_in_seconds'])}")
    return f" [{', '.join(parts)}]" if parts else ""


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
    widths = fit_widths(natural_widths(rows), width, PROCESS_NARROWING, needed)

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


def agent_step_phrase(report: NodeReport, agent: AgentReading, taken_at: float) -> str:
    """'step 74 (advanced 1 s ago)': where an instrumented process's training loop is."""
    changed = report.snapshot.wall_or_none(agent.step_changed_at)
    ago = "?" if changed is None else f"{human_duration(taken_at - changed)} ago"
    return f"step {agent.step} (advanced {ago})"


def agent_cuda_phrase(agent: AgentReading) -> str:
    latest = agent.latest
    return (f"CUDA allocated {human_bytes(latest.cuda_allocated_bytes if latest else None)}, "
            f"reserved {human_bytes(latest.cuda_reserved_bytes if latest else None)}")


def agent_phrase(report: NodeReport, agent: AgentReading, taken_at: float) -> str:
    """What an instrumented process's agent reports, in one sentence: its step and when it
    last advanced, its memory as it measures it (top's details)."""
    finished = report.snapshot.wall_or_none(agent.finished_at)
    rss = agent.latest.rss_bytes if agent.latest else None
    return (f"{agent_step_phrase(report, agent, taken_at)}; RSS {human_bytes(rss)}; "
            f"{agent_cuda_phrase(agent)}"
            + ("; finished " + clock(finished) if finished else ""))


def _buffers(agent: AgentReading) -> Mapping[str, BufferSize]:
    return agent.latest.buffers if agent.latest else {}


def buffer_phrases(agent: AgentReading) -> list[str]:
    """Each buffer the agent watches: '`fetch_buffer`: 74 items, 148.0 MiB'."""
    out = []
    for name, b in sorted(_buffers(agent).items()):
        size = f", {human_bytes(b.bytes)}" if b.bytes is not None else ""
        items = plural(b.items, "item") if isinstance(b.items, int) else "? items"
        out.append(clean(f"`{name}`: {items}{size}"))
    return out


def agent_parts(report: NodeReport, agent: AgentReading, taken_at: float) -> list[str]:
    """The line `status` draws under an instrumented process, in parts a narrow terminal may
    wrap between: its step, its CUDA memory (the row has its RSS), each buffer it watches."""
    buffers = buffer_phrases(agent)
    parts = [f"agent: {agent_step_phrase(report, agent, taken_at)}"]
    latest = agent.latest
    if latest is not None and (latest.cuda_allocated_bytes is not None
                               or latest.cuda_reserved_bytes is not None):
        parts.append(agent_cuda_phrase(agent))
    finished = report.snapshot.wall_or_none(agent.finished_at)
    if finished:
        parts.append(f"finished {clock(finished)}")
    if buffers:
        parts += [f"buffer {buffers[0]}", *buffers[1:]]
    return [clean(part) for part in parts]


def clock(epoch: Optional[float]) -> str:
    if epoch is None:
        return "?"
    return _dt.datetime.fromtimestamp(epoch, tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def no_holders_sentence(report: NodeReport) -> str:
    """What to say when no process is shown: nothing holds GPU memory, or who does is unknown
    (a GPU's process list could not be read), or, without NVML, nothing looks like GPU work."""
    snapshot = report.snapshot
    unread = [str(g.index) for g in snapshot.gpus if g.holders_unknown]
    if snapshot.nvml.available and unread:
        return (f"process list unreadable on GPU {', '.join(unread)}: who holds its memory is "
                "unknown")
    return ("no process holds GPU memory" if snapshot.nvml.available
            else "no process looks like GPU work (no /dev/nvidia* holder, no rank variables)")


def shown_pids(report: NodeReport, flagged: set[int]) -> set[int]:
    """Each GPU holder (and each process with a finding) with its chain up to its job root, and
    every process the report holds under these (the job trees' members without GPU memory).

    Without NVML the report holds look-alike GPU workers instead of holders: processes whose
    environment carries distributed-worker variables.
    """
    snapshot = report.snapshot
    procs = snapshot.processes
    nvml_available = snapshot.nvml.available
    blind = snapshot.blind_gpus
    shown: set[int] = set()
    for p in procs.values():
        # holds_gpu None: a holder of its GPU's last good read, unknown now; shown, with "?".
        seed = (holds_gpu(p, blind) is not False or not p.in_procfs) if nvml_available else (
            not WORKER_MARKER_KEYS.isdisjoint(p.launch_env))
        if not (seed or p.pid in flagged):
            continue
        shown.add(p.pid)
        root, current = snapshot.job_roots.get(p.pid), p
        while current is not None and current.pid != root and current.ppid in procs:
            current = procs[current.ppid]
            if current.pid == 1:
                break
            shown.add(current.pid)
    # And everything under them: the job trees' other members (a data loader's workers, a
    # helper, a launcher's other children) hold no GPU memory, yet their memory is the job's
    # and they are judged with it. The report holds them because the poll reads the job trees.
    children: dict[int, list[int]] = {}
    for p in procs.values():
        if p.ppid and p.pid != 1:
            children.setdefault(p.ppid, []).append(p.pid)
    todo = list(shown)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in shown:
                shown.add(child)
                todo.append(child)
    return shown


def walk_trees(procs: Mapping[int, HostProcess], shown: set[int],
               key: Optional[Callable[[int], Any]] = None
               ) -> Iterable[tuple[str, HostProcess]]:
    """Each tree depth first, as (prefix drawing its branch, process); roots and siblings in
    PID order, or by `key` (`gpuwatch top` sorts by a figure, keeping the trees whole)."""
    children: dict[int, list[int]] = {}
    for pid in shown:
        children.setdefault(procs[pid].ppid or 0, []).append(pid)
    roots = sorted((pid for pid in shown if procs[pid].ppid not in shown), key=key)

    def walk(pid: int, prefix: str, is_last: bool, is_root: bool
             ) -> Iterable[tuple[str, HostProcess]]:
        branch = "" if is_root else ("└─ " if is_last else "├─ ")
        yield prefix + branch, procs[pid]
        kids = sorted(children.get(pid, ()), key=key)
        below = prefix + ("" if is_root else ("   " if is_last else "│  "))
        for i, kid in enumerate(kids):
            yield from walk(kid, below, i == len(kids) - 1, False)

    for root in roots:
        yield from walk(root, "", True, True)


def job_cell(job: Optional[Job]) -> str:
    return f"{job.source}:{job.id}" if job else "-"


def gpu_cell(p: HostProcess) -> str:
    if not p.gpu_usage:
        return "-"
    return " ".join(f"{u.gpu_index}:{human_bytes(u.memory_bytes)}" for u in p.gpu_usage)


def command_cell(p: HostProcess, procs: Mapping[int, HostProcess], shown: set[int]) -> str:
    if not p.in_procfs:
        return "(not in /proc: exited, or another PID namespace)"
    command = short_command(p.name, p.cmdline)
    ppid = p.ppid
    if ppid and ppid not in shown:
        parent = procs.get(ppid)
        command += f"  (parent {ppid} {parent.name if parent else '?'})"
    return command


def columns(rows: Sequence[Sequence[str]], right: Collection[int] = ()
             ) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)]
        out.append("  ".join(cells).rstrip())
    return out

