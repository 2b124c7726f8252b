"""The pages `gpuwatch top` opens over its table: everything about one process (its details)
and a reap's plan to confirm."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Optional

from gpuwatch.model import (
    NodeReport,
    gpu_memory,
)
from gpuwatch.sinks.details_doc import details_doc
from gpuwatch.sinks.phrases import agent_phrase, buffer_phrases, clock, finding_figures, leak_notes
from gpuwatch.sinks.proctree import (
    job_cell,
)
from gpuwatch.sinks.text import (
    clean,
    evidence,
    wrap_text,
)
from gpuwatch.sinks.top.lines import DIM, PLAIN, TITLE, WARNING, Line, SampleHistory
from gpuwatch.sinks.top.rows import findings_by_pid
from gpuwatch.units import human_bytes, human_duration, plural


def wrap(text: str, width: int, indent: str = "") -> list[str]:
    """`text` in lines of at most `width`, broken at spaces where it can be (never between a
    figure and its unit), hard where not (a command line's one long argument, on lines of its
    own)."""
    out: list[str] = []
    for line in wrap_text(text, width, subsequent_indent=indent, break_long_words=False,
                          break_on_hyphens=False) or [""]:
        while len(line) > width > len(indent):
            out.append(line[:width])
            line = indent + line[width:]
        out.append(line)
    return out


def details_lines(report: NodeReport, pid: int, samples: Optional[SampleHistory],
                  width: int) -> list[Line]:
    """Everything about one process: its command line whole, its job, its figures per GPU, the
    samples top took of it, what its agent reports, and each finding with its evidence."""
    snapshot = report.snapshot
    procs = snapshot.processes
    p = procs.get(pid)
    if p is None:
        return [Line().add(f"PID {pid} is no longer in the document (it exited, or holds no "
                           "GPU memory any more)", WARNING)]
    out: list[Line] = []

    def say(text: str, style: str = PLAIN, label: str = "", indent: int = 0) -> None:
        head = f"{label:<10}" if label else " " * indent
        for i, chunk in enumerate(wrap(clean(text), max(10, width - len(head)), "  ")):
            line = Line()
            if head:
                line.add(head if i == 0 else " " * len(head), TITLE)
            out.append(line.add(chunk, style))

    say(f"PID {pid}  {p.name or '?'}  (user {p.user or '?'}, uid {p.uid})", TITLE)
    say(shlex.join(p.cmdline) if p.cmdline else f"[{p.name or '?'}]",
        label="command")
    parent = procs.get(p.ppid) if p.ppid else None
    say(f"{job_cell(report.job_of(p))}; job root {snapshot.job_roots.get(pid) or '-'}; "
        f"parent {p.ppid} ({parent.name if parent else '?'}); session {p.sid}, "
        f"group {p.pgid}", label="job")
    state = p.state or "-"
    if p.wchan:
        state += f", waiting in {p.wchan}"
    threads = plural(p.num_threads, "thread") if p.num_threads else "? threads"
    say(f"{state}; {threads}; started "
        f"{clock(snapshot.wall_or_none(p.start_time))}"
        + ("" if p.in_procfs else "; not in /proc (exited, or another PID namespace)"),
        label="state")
    gpus = ", ".join(f"GPU {u.gpu_index}: {human_bytes(u.memory_bytes)} ({u.kind})"
                     for u in p.gpu_usage) or "none"
    say(f"RSS {human_bytes(p.rss_bytes)}; GPU memory "
        f"{human_bytes(gpu_memory(p, snapshot.blind_gpus))} ({gpus})", label="memory")
    findings = findings_by_pid(report).get(pid, [])
    if not findings:
        say("none", DIM, label="findings")
    taken_at = snapshot.wall(snapshot.taken_at)
    for f in findings:
        out.append(Line().add(f"{f.kind} ({f.severity})", f.severity).add(
            f", open {human_duration(taken_at - snapshot.wall(f.since))}", DIM))
        say(f.reason + finding_figures(f.details), indent=2)
        for note in leak_notes(f.details, verbose=True):
            say(note, indent=2)
        for key, value in details_doc(f.details).items():
            if key != "trace":  # leak_notes said what the trace found
                say(evidence(key, value), DIM, indent=4)
    history = samples.of(pid) if samples is not None else []
    if history:
        for name, attr in (("RSS", "rss_bytes"), ("GPU memory", "gpu_memory_bytes")):
            known = [getattr(s, attr) for s in history if getattr(s, attr) is not None]
            if known:
                say(f"{name}: min {human_bytes(min(known))}, max {human_bytes(max(known))}, "
                    f"last {human_bytes(known[-1])}", label="samples")
        say(f"{len(history)} taken by top since {clock(history[0].at)}", DIM, label="samples")
    agent = snapshot.agents.get(pid)
    if agent is not None:
        say(agent_phrase(report, agent, taken_at), label="agent")
        for phrase in buffer_phrases(agent):
            say(phrase, label="buffer")
    if p.cgroup:
        say(p.cgroup, DIM, label="cgroup")
    if p.launch_env:
        say(" ".join(f"{k}={v}" for k, v in sorted(p.launch_env.items())), DIM, label="env")
    if p.kernel_stack:
        say(" < ".join(p.kernel_stack), DIM, label="kstack")
    if p.read_errors:
        say("; ".join(p.read_errors), WARNING, label="unread")
    return out


def confirm_lines(plan_text: str, command: str, width: int,
                  in_full: Sequence[str] = ()) -> list[Line]:
    """The plan exactly as `gpuwatch reap --dry-run` prints it (its table cut at the width,
    never rewrapped), each action `in_full` and wrapped where the table was cut, the command
    that prints the same plan, and what `y` does."""
    head, *table = plan_text.rstrip("\n").split("\n")
    # The first line is a sentence (node, findings of when, dry run): wrapped, not cut.
    out = [Line().add(chunk) for chunk in wrap(clean(head), width, "  ")]
    out += [Line().add(clean(line)) for line in table]
    if any(len(line) > width for line in table) and in_full:
        out.append(Line())
        for text in in_full:
            out += [Line().add(chunk) for chunk in wrap(clean(text), width, "    ")]
    out += [Line(), Line().add("the same plan: ", DIM).add(command),
            Line().add("y", TITLE).add(": reap now (SIGTERM, then SIGKILL after the grace; "
                                       "audited like `gpuwatch reap`)"),
            Line().add("any other key: cancel", DIM)]
    return out
