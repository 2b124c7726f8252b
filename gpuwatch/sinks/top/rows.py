"""The rows of `gpuwatch top`'s table: the process trees of a report (gpuwatch.sinks.proctree),
filtered by job or user and sorted by a figure (whole trees by the tree's total, siblings within
each tree), with each row's cells, finding markers and notes; and the state of the interface
that picks them (sort, filter, selection, scroll)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

from gpuwatch.evidence import LeakEvidence
from gpuwatch.model import (
    Finding,
    HostProcess,
    Job,
    Kind,
    NodeReport,
    gpu_memory,
)
from gpuwatch.sinks.phrases import finding_figures, leak_notes
from gpuwatch.sinks.proctree import (
    command_cell,
    gpu_cell,
    job_cell,
    shown_pids,
    walk_trees,
)
from gpuwatch.sinks.text import (
    UNICODE,
    Glyphs,
    clean,
)
from gpuwatch.units import human_bytes
from gpuwatch.vocabulary import severity_rank

# ---- the state of the interface ------------------------------------------------------------------

#: What `s` cycles through, in order; `M`, `R`, `P`, `J` pick one directly.
SORTS = ("gpu", "rss", "pid", "job")
SORT_NAMES = {"gpu": "GPU memory", "rss": "RSS", "pid": "PID", "job": "job"}
SORT_KEYS = {"M": "gpu", "R": "rss", "P": "pid", "J": "job"}


@dataclass
class ViewState:
    sort: str = "gpu"
    #: Text matched against each process's job (`source:id`) and user; empty: everything.
    filter: str = ""
    #: The selected process, followed across refreshes and re-sorts.
    selected: Optional[int] = None
    #: Where the selection was, for when its process leaves: the row now there is selected.
    index: int = 0
    #: The first line of the table's body on screen.
    scroll: int = 0

    def next_sort(self) -> None:
        self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]


# ---- rows: the process trees, sorted and filtered -----------------------------------------------

COLUMNS = ("PID", "USER", "JOB", "STATE", "RSS", "GPU MEM", "COMMAND")
(PID_COLUMN, USER_COLUMN, JOB_COLUMN, STATE_COLUMN, RSS_COLUMN, GPU_COLUMN,
 COMMAND_COLUMN) = range(len(COLUMNS))
SORT_COLUMN = {"gpu": GPU_COLUMN, "rss": RSS_COLUMN, "pid": PID_COLUMN, "job": JOB_COLUMN}
#: Cells cut at these widths whatever the room: a 60-character job id would crowd the rest out.
CAPS = {PID_COLUMN: 32, USER_COLUMN: 12, JOB_COLUMN: 40, STATE_COLUMN: 10, RSS_COLUMN: 9,
        GPU_COLUMN: 24}
#: COMMAND is cut first, down to this; then the steps below make room, one at a time.
MIN_COMMAND = 20
NARROWING: tuple[tuple[str, int, int], ...] = (
    ("shrink", JOB_COLUMN, 20), ("hide", STATE_COLUMN, 0), ("hide", USER_COLUMN, 0),
    ("shrink", JOB_COLUMN, 14), ("hide", RSS_COLUMN, 0), ("hide", JOB_COLUMN, 0))


@dataclass(frozen=True)
class Row:
    pid: int
    #: status_view's branch drawing before the PID (`├─ `), in this terminal's glyphs.
    prefix: str
    proc: HostProcess
    #: Its job (NodeReport.job_of) and its GPU memory in all (model.gpu_memory).
    job: Optional[Job]
    gpu_memory_bytes: Optional[int]
    findings: tuple[Finding, ...]
    #: PID (with prefix), USER, JOB, STATE, RSS, GPU MEM; COMMAND is `markers` + `command`.
    cells: tuple[str, ...]
    command: str
    #: Lines drawn under the row: a leak's figures and culprit.
    notes: tuple[str, ...]

    @property
    def severity(self) -> Optional[str]:
        ranked = sorted((f.severity for f in self.findings),
                        key=severity_rank)
        return ranked[0] if ranked else None

    @property
    def markers(self) -> list[tuple[str, str]]:
        return [(f"[{f.kind}] ", f.severity) for f in self.findings]


def findings_by_pid(report: NodeReport) -> dict[int, list[Finding]]:
    out: dict[int, list[Finding]] = {}
    for f in report.findings:
        if f.pid is not None:
            out.setdefault(f.pid, []).append(f)
    return out


def matches(report: NodeReport, p: HostProcess, text: str) -> bool:
    wanted = text.strip().lower()
    if not wanted:
        return True
    return wanted in job_cell(report.job_of(p)).lower() or wanted in (p.user or "").lower()


def build_rows(report: NodeReport, sort: str = "gpu", filter_text: str = "",
               glyphs: Glyphs = UNICODE) -> list[Row]:
    procs = report.snapshot.processes
    blind = report.snapshot.blind_gpus
    found = findings_by_pid(report)
    shown = shown_pids(report, set(found))
    if filter_text.strip():
        # A match keeps its chain up to its root, so it is still drawn in its tree.
        kept: set[int] = set()
        for pid in shown:
            if matches(report, procs[pid], filter_text):
                current: Optional[int] = pid
                while current in shown and current not in kept:
                    kept.add(current)
                    current = procs[current].ppid
        shown = kept
    rows = []
    for prefix, p in walk_trees(procs, shown, key=_sort_key(sort, report, shown)):
        pid = p.pid
        if glyphs.tree is not None:
            prefix = prefix.translate(glyphs.tree)
        its = tuple(found.get(pid, ()))
        job = report.job_of(p)
        rows.append(Row(
            pid=pid, prefix=prefix, proc=p, job=job, gpu_memory_bytes=gpu_memory(p, blind),
            findings=its,
            cells=(prefix + str(pid), clean(p.user or "?"), clean(job_cell(job)),
                   p.state or "-",
                   human_bytes(p.rss_bytes) if p.rss_bytes is not None else "-",
                   gpu_cell(p)),
            command=clean(command_cell(p, procs, shown)),
            notes=tuple(note for f in its for note in _row_notes(f)),
        ))
    return rows


def _sort_key(sort: str, report: NodeReport, shown: set[int]) -> Callable[[int], Any]:
    procs = report.snapshot.processes
    if sort == "pid":
        return lambda pid: pid
    if sort == "job":
        return lambda pid: (job_cell(report.job_of(procs[pid])), pid)
    blind = report.snapshot.blind_gpus

    def figure(p: HostProcess) -> Optional[int]:
        return gpu_memory(p, blind) if sort == "gpu" else p.rss_bytes

    totals = _subtree_totals(procs, shown, figure)
    return lambda pid: (-totals[pid], pid)


def _subtree_totals(procs: Mapping[int, HostProcess], shown: set[int],
                    figure: Callable[[HostProcess], Optional[int]]) -> dict[int, int]:
    """Each shown process's figure plus its shown descendants': a tree sorts by its total."""
    totals = {pid: figure(procs[pid]) or 0 for pid in shown}
    depth: dict[int, int] = {}
    for pid in shown:
        chain: list[int] = []
        current = pid
        while current in shown and current not in depth and current not in chain:
            chain.append(current)
            current = procs[current].ppid
        base = depth.get(current, -1)
        for i, member in enumerate(reversed(chain)):
            depth[member] = base + 1 + i
    for pid in sorted(shown, key=lambda p: -depth[p]):  # leaves first
        parent = procs[pid].ppid
        if parent in totals and parent != pid:
            totals[parent] += totals[pid]
    return totals


def _row_notes(f: Finding) -> list[str]:
    """Under a leak's row: its figures (growth, projected out-of-memory step) and its culprit."""
    if f.kind != Kind.LEAK:
        return []
    notes = []
    figures = finding_figures(f.details).strip()
    if figures:
        notes.append(f"leak {figures[1:-1]}")
    culprit_notes = leak_notes(f.details)
    culprit = f.details.culprit if isinstance(f.details, LeakEvidence) else None
    if culprit is not None and culprit.name and not any("culprit" in n for n in culprit_notes):
        # status_view names such a culprit in the reason (the buffer is what grows): here the
        # reason is not on screen, so the culprit gets its line.
        found_by = f" ({culprit.found_by})" if culprit.found_by else ""
        culprit_notes.insert(0, f"culprit `{culprit.name}`{found_by}")
    return notes + [clean(n) for n in culprit_notes]
