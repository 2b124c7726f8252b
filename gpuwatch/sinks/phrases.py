"""What every view says in words of a leak's evidence and of an instrumented process's agent:
a leak's figures and notes (culprit, allocation trace), an agent's step, memory and buffers.

Pure: a finding's details or an agent's reading in, phrases out. `gpuwatch status`
(status_view) and `gpuwatch top` (top/view) say the same things from here.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from typing import Any, Optional

from gpuwatch.model import AgentReading, BufferSize, NodeReport
from gpuwatch.printable import clean
from gpuwatch.units import human_bytes, human_duration, plural


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
