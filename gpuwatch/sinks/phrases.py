"""What every view says in words of a leak's evidence and of an instrumented process's agent:
a leak's figures and notes (culprit, allocation trace), an agent's step, memory and buffers.

Pure: a finding's evidence (gpuwatch.evidence) or an agent's reading in, phrases out.
`gpuwatch status` (status_view) and `gpuwatch top` (top/view) say the same things from here.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from typing import Optional

from gpuwatch.evidence import CopyOnWrite, Details, LeakEvidence, TraceSummary
from gpuwatch.model import AgentReading, BufferSize, NodeReport
from gpuwatch.printable import clean
from gpuwatch.units import human_bytes, human_duration, plural
from gpuwatch.vocabulary import FoundBy, TraceStatus


def leak_notes(d: Optional[Details], verbose: bool = False) -> list[str]:
    """Lines under a leak's reason: its culprit and how it was found, with the culprit's own
    growth (the reason is frozen as first given, these figures are not); what became of an
    allocation trace; with `verbose`, the traced sites and the largest one's traceback."""
    if not isinstance(d, LeakEvidence):
        return []
    notes = []
    c = d.culprit
    if c is not None and culprit_shown(d):
        found_by = f" ({c.found_by})" if c.found_by else ""
        figures = []
        if c.items_per_step is not None:
            figures.append(f"+{c.items_per_step:g} items/step")
        if c.bytes_per_step is not None:
            figures.append(f"~{human_bytes(c.bytes_per_step)}/step")
        notes.append(f"culprit `{c.name}`{found_by}"
                     + (f": {', '.join(figures)}" if figures else ""))
    if d.trace is not None:
        notes.append(_trace_phrase(d.trace, d.found_by, verbose))
        if verbose:
            notes += _trace_detail(d.trace)
    return notes


def culprit_shown(d: LeakEvidence) -> bool:
    """A culprit gets a line of its own, except when the leak is that buffer growing alone:
    the reason names it already and its figures are the leak's."""
    c = d.culprit
    return c is not None and bool(c.name) and d.series_text != f"buffer `{c.name}`"


def _trace_phrase(trace: TraceSummary, found_by: Optional[FoundBy], verbose: bool) -> str:
    status, why = trace.status, trace.why
    if status == TraceStatus.REQUESTED:
        return "tracing requested"
    if status == TraceStatus.REFUSED:
        return "tracing refused by the process" + (f": {why}" if why else "")
    if status == TraceStatus.FAILED:
        return "tracing failed" + (f": {why}" if why else "")
    phrase = f"traced {trace.steps or '?'} steps"
    if found_by is None:
        phrase += ": no allocation site explains it"
    if trace.sites and found_by != FoundBy.TRACED:
        top = trace.sites[0]
        phrase += f" (largest: `{top.site}`, ~{human_bytes(top.bytes_per_step)}/step)"
    if trace.traceback and not verbose:
        phrase += "; `gpuwatch status -v` shows where it allocates"
    return phrase


def _trace_detail(trace: TraceSummary) -> list[str]:
    lines = []
    if trace.sites:
        lines.append("allocation sites, largest first:")
        for site in trace.sites:
            count = site.count_per_step
            blocks = f", +{count:g} blocks/step" if count is not None else ""
            lines.append(f"  `{site.site}`  ~{human_bytes(site.bytes_per_step)}/step{blocks}")
    if trace.traceback:
        where = f" of `{trace.sites[0].site}`" if trace.sites else ""
        lines.append(f"traceback{where}, oldest call first:")
        lines += [f"  {frame}" for frame in trace.traceback]
    return lines


def finding_figures(d: Optional[Details]) -> str:
    """A leak's figures, appended to its reason: growth and projected OOM (the culprit's share is
    on a line of its own, see leak_notes)."""
    parts = []
    if isinstance(d, CopyOnWrite):
        parts.append(f"node's private memory +{human_bytes(d.private_growth_bytes)} across "
                     f"{plural(d.workers, 'worker')}, USS "
                     f"{human_bytes(d.uss_bytes_from)} -> {human_bytes(d.uss_bytes_to)}")
        parts.append(f"+{human_bytes(d.growth_bytes_per_second)}/s")
    if not isinstance(d, LeakEvidence):
        return f" [{', '.join(parts)}]" if parts else ""
    if d.growth_bytes_per_step is not None:
        parts.append(f"+{human_bytes(d.growth_bytes_per_step)}/step")
    if d.growth_bytes_per_second is not None:
        parts.append(f"+{human_bytes(d.growth_bytes_per_second)}/s")
    c = d.culprit
    if c is not None and c.items_per_step is not None and not culprit_shown(d):
        parts.append(f"+{c.items_per_step:g} items/step")
    oom = d.projection
    if oom is not None and oom.step is not None:
        text = f"out of memory at step ~{oom.step}"
        if oom.in_seconds is not None:
            text += f" (in ~{human_duration(oom.in_seconds)})"
        parts.append(text)
    elif oom is not None and oom.in_seconds is not None:
        parts.append(f"out of memory in ~{human_duration(oom.in_seconds)}")
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
