"""What `gpuwatch top` shows, as lines of styled text for a terminal of a given size.

Pure: a node report (read from a status document once, at the edge), the samples top has kept
and the state of the interface (sort, filter, selection, scroll) in; lines out, each a list of
(text, style) segments no wider than the terminal. No curses here, so every layout can be tested
without a terminal; gpuwatch/app/top.py only maps the style names to attributes and draws.

The process trees are status_view's (gpuwatch.sinks.proctree): the same processes shown (each GPU
holder, each process with a finding, with its chain up to its job root), the same cells and
markers, the same leak figures (gpuwatch.sinks.phrases).
Sorting orders whole trees (by the tree's total for a figure) and siblings within each tree, so a
tree is never torn apart.
"""

from __future__ import annotations

import datetime as _dt
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from gpuwatch.evidence import LeakEvidence
from gpuwatch.model import (
    Finding,
    GpuDevice,
    HostProcess,
    Job,
    Kind,
    NodeReport,
    gpu_memory,
)
from gpuwatch.sinks.details_doc import details_doc
from gpuwatch.sinks.phrases import agent_phrase, buffer_phrases, clock, finding_figures, leak_notes
from gpuwatch.sinks.proctree import (
    command_cell,
    gpu_cell,
    job_cell,
    no_holders_sentence,
    shown_pids,
    walk_trees,
)
from gpuwatch.sinks.text import (
    ASCII,
    UNICODE,
    Glyphs,
    clean,
    cut,
    cut_left,
    evidence,
    fit_widths,
    glyphs_for,
    wrap_text,
)
from gpuwatch.units import human_bytes, human_duration, plural
from gpuwatch.vocabulary import Severity, severity_rank

__all__ = ["ASCII", "UNICODE", "Glyphs", "clean", "cut", "cut_left", "glyphs_for"]

# ---- styles: names the screen maps to attributes (colours, or bold/reverse under NO_COLOR) ----

PLAIN = ""
TITLE = "title"
DIM = "dim"
HEAD = "head"  # the table's column names
# A finding's row and marker take its severity's style.
CRITICAL, WARNING, INFO = Severity.CRITICAL, Severity.WARNING, Severity.INFO
BAR = "bar"
KEY = "key"

#: The smallest terminal top draws on; below it, a line that says so.
MIN_WIDTH, MIN_HEIGHT = 40, 10

Segment = tuple[str, str]


class SampleHistory(Protocol):
    """What top has sampled of each process (feed.Samples): oldest first, each with `at`,
    `rss_bytes` and `gpu_memory_bytes`."""

    def of(self, pid: int) -> Sequence[Any]: ...


@dataclass
class Line:
    segments: list[Segment] = field(default_factory=list)
    #: The selected row: drawn in reverse video across the whole width.
    selected: bool = False

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.segments)

    def add(self, text: str, style: str = PLAIN) -> Line:
        if text:
            self.segments.append((text, style))
        return self


def fit(line: Line, width: int, ellipsis: str = "") -> Line:
    """`line` cut at `width` columns (the last one replaced by `ellipsis` where it was cut)."""
    if len(line.text) <= width:
        return line
    room = max(0, width - len(ellipsis))
    out = Line(selected=line.selected)
    for text, style in line.segments:
        if room <= 0:
            break
        out.add(text[:room], style)
        room -= len(text[:room])
    if ellipsis and width >= len(ellipsis):
        out.add(ellipsis, out.segments[-1][1] if out.segments else PLAIN)
    return out


def sparkline(values: Sequence[Optional[float]], width: int, glyphs: Glyphs) -> str:
    """The last `width` values as bars, scaled from their minimum to their maximum (a flat line
    sits on the floor); an unknown value is a gap."""
    shown = list(values)[-width:] if width > 0 else []
    known = [v for v in shown if v is not None]
    if not known:
        return " " * len(shown)
    low, high = min(known), max(known)
    top = len(glyphs.spark) - 1
    out = []
    for v in shown:
        if v is None:
            out.append(" ")
        elif high == low:
            out.append(glyphs.spark[0])
        else:
            out.append(glyphs.spark[round((v - low) / (high - low) * top)])
    return "".join(out)


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
_PID, _USER, _JOB, _STATE, _RSS, _GPU, _COMMAND = range(len(COLUMNS))
_SORT_COLUMN = {"gpu": _GPU, "rss": _RSS, "pid": _PID, "job": _JOB}
#: Cells cut at these widths whatever the room: a 60-character job id would crowd the rest out.
_CAPS = {_PID: 32, _USER: 12, _JOB: 40, _STATE: 10, _RSS: 9, _GPU: 24}
#: COMMAND is cut first, down to this; then the steps below make room, one at a time.
MIN_COMMAND = 20
_NARROWING: tuple[tuple[str, int, int], ...] = (
    ("shrink", _JOB, 20), ("hide", _STATE, 0), ("hide", _USER, 0), ("shrink", _JOB, 14),
    ("hide", _RSS, 0), ("hide", _JOB, 0))


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


# ---- the layout ---------------------------------------------------------------------------------

@dataclass
class Chrome:
    """What the screen adds to the report: how often, what failed, what to say, what is being
    typed."""
    interval: float = 2.0
    #: The last refresh failed: why (the report shown is the previous one).
    error: Optional[str] = None
    message: str = ""
    message_style: str = PLAIN
    #: The filter being typed (None: no prompt open).
    prompt: Optional[str] = None
    #: The key line's text; the screen's current mode decides it.
    keys: Optional[str] = None


LIST_KEYS = ("q quit  ↑↓/jk PgUp/PgDn Home/End move  s sort (M R P J)  / filter  "
             "enter details  r reap")
LIST_KEYS_SHORT = "q quit  ↑↓ move  s sort  / filter  enter details  r reap"
DETAILS_KEYS = "Esc/enter/q close  ↑↓ PgUp/PgDn scroll"
CONFIRM_KEYS = "y reap now  any other key: cancel"
PROMPT_KEYS = "type a job or user  enter keep  Esc clear"


@dataclass
class Layout:
    gpu_lines: int
    body: int
    panel: int


class TopView:
    """The rows of one report for one sort and filter, computed once and reused by every key
    that only moves the selection (a 512-process node is rebuilt on a refresh, not on a key)."""

    def __init__(self, glyphs: Glyphs = UNICODE) -> None:
        self.glyphs = glyphs
        self.report: Optional[NodeReport] = None
        self._rows_key: Optional[tuple[int, str, str]] = None
        self._rows: list[Row] = []
        self._widths: Optional[list[int]] = None

    def set_report(self, report: NodeReport) -> None:
        self.report = report
        self._rows_key = None

    def rows(self, state: ViewState) -> list[Row]:
        if self.report is None:
            return []
        key = (id(self.report), state.sort, state.filter)
        if key != self._rows_key:
            self._rows = build_rows(self.report, state.sort, state.filter, self.glyphs)
            self._rows_key = key
            self._widths = None
            self._follow(state)
        return self._rows

    # -- selection -----------------------------------------------------------------------------
    def _follow(self, state: ViewState) -> None:
        """Keep the selected process selected; when it left, the row now at its place."""
        rows = self._rows
        if not rows:
            state.selected, state.index = None, 0
            return
        for i, row in enumerate(rows):
            if row.pid == state.selected:
                state.index = i
                return
        state.index = min(state.index, len(rows) - 1)
        state.selected = rows[state.index].pid

    def move(self, state: ViewState, delta: int) -> None:
        rows = self.rows(state)
        if not rows:
            return
        state.index = max(0, min(len(rows) - 1, state.index + delta))
        state.selected = rows[state.index].pid

    def move_to(self, state: ViewState, index: int) -> None:
        self.move(state, index - state.index)

    def selected_row(self, state: ViewState) -> Optional[Row]:
        rows = self.rows(state)
        return rows[state.index] if rows and 0 <= state.index < len(rows) else None

    def layout(self, width: int, height: int) -> Layout:
        """Header 2 lines, GPUs, the table's head and body, the selected process's panel,
        the message line, the key line; the body gets what is left, the panel only what a
        taller terminal can spare."""
        panel = 3 if height >= 18 else (1 if height >= 13 else 0)
        room = height - (2 + 1 + panel + 2)
        gpus = len(self.report.snapshot.gpus) if self.report else 0
        gpu_lines = min(max(gpus, 1), max(1, room - 4))
        return Layout(gpu_lines, max(1, room - gpu_lines), panel)

    def page(self, width: int, height: int) -> int:
        return max(1, self.layout(width, height).body - 1)

    # -- drawing -------------------------------------------------------------------------------
    def render(self, state: ViewState, width: int, height: int,
               samples: Optional[SampleHistory],
               chrome: Chrome) -> list[Line]:
        """The whole screen: exactly `height` lines, none wider than `width`."""
        if width < MIN_WIDTH or height < MIN_HEIGHT:
            return _pad([Line().add(cut(f"terminal too small ({width}x{height}); gpuwatch top "
                                        f"needs {MIN_WIDTH}x{MIN_HEIGHT}", width, self.glyphs),
                                    WARNING)], height)
        lay = self.layout(width, height)
        lines = self.header(width, chrome)
        if self.report is None:
            lines.append(Line().add("waiting for the first refresh...", DIM))
            lines = _pad(lines, height - 2)
        else:
            lines += _pad(self.gpu_lines(width, lay.gpu_lines), lay.gpu_lines)
            lines += self.table(state, width, lay.body)
            lines += self.panel(state, width, lay.panel, samples)
        lines += [self.message_line(state, width, chrome), self.key_line(width, chrome)]
        return [fit(line, width) for line in _pad(lines, height)]

    def header(self, width: int, chrome: Chrome) -> list[Line]:
        report = self.report
        right = f"gpuwatch top · every {chrome.interval:g} s"
        first = Line()
        if report is None:
            first.add("gpuwatch top", TITLE)
            second = Line()
        else:
            snapshot = report.snapshot
            when = _dt.datetime.fromtimestamp(snapshot.wall(snapshot.taken_at),
                                              tz=_dt.timezone.utc)
            first.add(f"node {clean(snapshot.hostname)}", TITLE).add(f" · {when:%H:%M:%S}Z · ")
            first.add(source_phrase(report), DIM if report.source == "daemon" else WARNING)
            second = Line().add(nvml_phrase(report))
            counts = finding_counts(report)
            if counts:
                second.add(" · ")
                for i, (severity, n) in enumerate(counts):
                    plural = "s" if severity == WARNING and n != 1 else ""
                    second.add((", " if i else "") + f"{n} {severity}{plural}", severity)
        if chrome.error:
            first.add(f" · refresh failed: {clean(chrome.error)}", CRITICAL)
        first = fit(first, width, self.glyphs.ellipsis)
        if len(first.text) + 2 + len(right) <= width:
            first.add(" " * (width - len(first.text) - len(right))).add(right, DIM)
        return [first, fit(second, width, self.glyphs.ellipsis)]

    def gpu_lines(self, width: int, room: int) -> list[Line]:
        assert self.report is not None
        gpus = self.report.snapshot.gpus
        if not gpus:
            return [Line().add("no GPUs" if self.report.snapshot.nvml.available
                               else "no GPU information", DIM)]
        shown = gpus if len(gpus) <= room else gpus[:max(0, room - 1)]
        names = max(len(clean(g.name or "?")) for g in gpus)
        name_width = min(names, 24) if width >= 70 else 0
        lines = [self._gpu_line(g, width, name_width) for g in shown]
        if len(shown) < len(gpus):
            rest = gpus[len(shown):]
            used = sum(g.memory_used_bytes or 0 for g in rest)
            total = sum(g.memory_total_bytes or 0 for g in rest)
            share = f" ({100 * used / total:.0f}%)" if total else ""
            what = f"   +{len(rest)} more GPUs" if shown else f"{len(rest)} GPUs"
            lines.append(fit(Line().add(f"{what}: {human_bytes(used)}/{human_bytes(total)} "
                                        f"used{share}; a taller terminal shows each", DIM),
                             width, self.glyphs.ellipsis))
        return lines

    def _gpu_line(self, g: GpuDevice, width: int, name_width: int) -> Line:
        used, total = g.memory_used_bytes, g.memory_total_bytes
        share = used / total if used is not None and total else None
        util = g.utilization_gpu_percent
        # Padded to the widest figures a GPU can have, so that every GPU's bar has one length.
        figures = (f" {f'{human_bytes(used)}/{human_bytes(total)}':>19}"
                   f" {f'{share * 100:3.0f}%' if share is not None else '  ?'}"
                   f"  util {f'{util:3d}%' if util is not None else '   ?'}")
        count = len(g.processes)
        extra = ("  ? processes" if g.holders_unknown
                 else f"  {count} process{'es' if count != 1 else ''}").ljust(15)
        line = Line().add(f"GPU{g.index:>2} ", TITLE)
        if name_width:
            line.add(cut(clean(g.name or "?"), name_width, self.glyphs).ljust(name_width)
                     + " ")
        bar_width = min(60, width - len(line.text) - len(figures) - len(extra) - 2)
        if bar_width < 10:
            extra = ""
            bar_width = min(60, width - len(line.text) - len(figures) - 2)
        if bar_width >= 4:
            filled = round(bar_width * share) if share is not None else 0
            style = CRITICAL if share is not None and share >= 0.9 else (
                WARNING if share is not None and share >= 0.75 else BAR)
            line.add("[").add(self.glyphs.bar_used * filled, style)
            line.add(self.glyphs.bar_free * (bar_width - filled), DIM).add("]")
        line.add(figures).add(extra, DIM)
        unattributed = g.unattributed_memory_bytes
        if unattributed:
            line.add(f"  unattributed {human_bytes(unattributed)}", WARNING)
        if g.lost or g.errors:
            note = "LOST (needs a reset)" if g.lost else ""
            note += ("; " if note and g.errors else "") + "; ".join(
                f"{e.call}: {e.message}" for e in g.errors)
            line.add(f"  {clean(note)}", CRITICAL)
        return fit(line, width, self.glyphs.ellipsis)

    # -- the table -----------------------------------------------------------------------------
    def widths(self, state: ViewState, width: int) -> list[int]:
        """Each column's width for this terminal (0: hidden); the last, COMMAND, takes the rest.

        Widths come from every row, not only those on screen, so the columns stay put while the
        selection scrolls."""
        rows = self.rows(state)
        if self._widths is None:
            natural = [len(name) + 1 for name in COLUMNS]  # + 1: room for the sort mark
            for row in rows:
                for i, cell in enumerate(row.cells):
                    natural[i] = max(natural[i], len(cell))
            self._widths = [min(w, _CAPS.get(i, w)) for i, w in enumerate(natural)]
        return fit_widths([*self._widths[:_COMMAND], 1 << 30], width, _NARROWING,
                          MIN_COMMAND)

    def table(self, state: ViewState, width: int, height: int) -> list[Line]:
        """The column names, then `height` lines of the body, scrolled to keep the selected row
        (and the notes under it) in sight."""
        rows = self.rows(state)
        widths = self.widths(state, width)
        head = Line()
        for i, name in enumerate(COLUMNS):
            if not widths[i]:
                continue
            if i == _SORT_COLUMN[state.sort]:
                name += self.glyphs.ascending if state.sort in ("pid", "job") else \
                    self.glyphs.descending
            head.add((name.ljust(widths[i]) + "  ") if i < _COMMAND else name, HEAD)
        lines = [fit(head, width)]
        if not rows:
            empty = ("no process matches the filter" if state.filter.strip() or not self.report
                     else no_holders_sentence(self.report))
            return lines + _pad([Line().add(empty, DIM)], height)
        body = self.body(rows)
        selected = state.index
        first = next(i for i, (r, _) in enumerate(body) if r == selected)
        last = first + len(rows[selected].notes)
        if last >= state.scroll + height:
            state.scroll = last - height + 1
        if first < state.scroll:  # the row itself before its notes, when both cannot fit
            state.scroll = first
        state.scroll = max(0, min(state.scroll, len(body) - height))
        for r, note in body[state.scroll:state.scroll + height]:
            row = rows[r]
            if note is None:
                lines.append(self.row_line(row, widths, width, r == selected))
            else:
                indent = " " * min(len(row.prefix) + 3, 12)
                lines.append(fit(Line().add(f"{indent}{note}", row.severity or DIM), width,
                                 self.glyphs.ellipsis))
        return _pad(lines, height + 1)

    @staticmethod
    def body(rows: Sequence[Row]) -> list[tuple[int, Optional[str]]]:
        """(row index, None) for a row's line, (row index, note) for each line under it."""
        out: list[tuple[int, Optional[str]]] = []
        for i, row in enumerate(rows):
            out.append((i, None))
            out += [(i, note) for note in row.notes]
        return out

    def row_line(self, row: Row, widths: list[int], width: int, selected: bool) -> Line:
        line = Line(selected=selected)
        for i, cell in enumerate(row.cells):
            w = widths[i]
            if not w:
                continue
            if i == _JOB and len(cell) > w:
                job = row.job
                cell = cut_left(clean(job.id) if job else cell, w, self.glyphs)
            elif i == _PID and len(cell) > w:
                cell = cut_left(cell, w, self.glyphs)
            else:
                cell = cut(cell, w, self.glyphs)
            line.add(cell.ljust(w) + "  ", (row.severity or PLAIN) if i == _PID else PLAIN)
        room = widths[_COMMAND]
        for marker, severity in row.markers:
            line.add(marker[:room], severity)
            room -= len(marker[:room])
        line.add(cut(row.command, room, self.glyphs))
        return fit(line, width)

    # -- the panel of the selected process -----------------------------------------------------
    def panel(self, state: ViewState, width: int, height: int,
              samples: Optional[SampleHistory]) -> list[Line]:
        if height <= 0:
            return []
        row = self.selected_row(state)
        if row is None:
            return _pad([Line().add("no process selected", DIM)], height)
        title = Line().add(f"PID {row.pid} {clean(row.proc.name or '?')}", TITLE)
        if row.findings:
            f = row.findings[0]
            title.add(" · ").add(f"{f.kind} ({f.severity})", f.severity)
            title.add(f": {clean(f.reason)}")
            if len(row.findings) > 1:
                title.add(f" (+{len(row.findings) - 1} more: enter)", DIM)
        else:
            title.add(" · no findings", DIM)
        lines = [fit(title, width, self.glyphs.ellipsis)]
        history = samples.of(row.pid) if samples is not None else []
        for label, attr, now in (("RSS", "rss_bytes", row.proc.rss_bytes),
                                 ("GPU", "gpu_memory_bytes", row.gpu_memory_bytes))[:height - 1]:
            values = [getattr(s, attr) for s in history]
            last = values[-1] if values else now
            known = [v for v in values if v is not None]
            figures = f" {human_bytes(last)}"
            if known:
                figures += f"  min {human_bytes(min(known))}  max {human_bytes(max(known))}"
            figures += f"  {len(values)} sample{'' if len(values) == 1 else 's'}"
            room = max(0, min(len(values), width - 5 - len(figures)))
            line = Line().add(f"{label:<4} ", TITLE)
            line.add(sparkline(values, room, self.glyphs), BAR).add(figures, DIM)
            lines.append(fit(line, width, self.glyphs.ellipsis))
        return _pad(lines, height)

    # -- the two bottom lines ------------------------------------------------------------------
    def message_line(self, state: ViewState, width: int, chrome: Chrome) -> Line:
        if chrome.prompt is not None:
            line = Line().add("filter (job or user): ", TITLE).add(clean(chrome.prompt) + "_")
            # The end of what is typed stays in sight.
            return fit(line, width) if len(line.text) <= width else Line().add(
                cut_left(line.text, width, self.glyphs))
        if chrome.message:
            return fit(Line().add(clean(chrome.message), chrome.message_style), width,
                       self.glyphs.ellipsis)
        line = Line()
        rows = self.rows(state)
        if self.report is not None:
            if rows:
                line.add(f"{state.index + 1}/{len(rows)} processes", DIM)
            line.add(f" · sort: {SORT_NAMES[state.sort]}", DIM)
        if state.filter:
            line.add(f" · filter: {clean(state.filter)} (Esc clears)", WARNING)
        return fit(line, width, self.glyphs.ellipsis)

    def key_line(self, width: int, chrome: Chrome) -> Line:
        keys = chrome.keys or (LIST_KEYS if len(LIST_KEYS) <= width else LIST_KEYS_SHORT)
        if self.glyphs is ASCII:
            keys = keys.replace("↑↓", "up/down")
        return fit(Line().add(keys, KEY), width, self.glyphs.ellipsis)


def _pad(lines: list[Line], height: int) -> list[Line]:
    return (lines + [Line() for _ in range(height - len(lines))])[:max(0, height)]


# ---- phrases -------------------------------------------------------------------------------------

def source_phrase(report: NodeReport) -> str:
    if report.source == "daemon":
        return "from the running daemon"
    return f"own polls: {clean(report.source_detail or 'no daemon')}"


def nvml_phrase(report: NodeReport) -> str:
    nvml = report.snapshot.nvml
    if not nvml.available:
        return f"NVML unavailable: {clean(nvml.error or '?')} - host processes that look " \
               "like GPU work"
    out = f"NVML {nvml.nvml_version or '?'} · driver {nvml.driver_version or '?'}"
    if nvml.cuda_driver_version:
        out += f" · CUDA {nvml.cuda_driver_version}"
    return out


def finding_counts(report: NodeReport) -> list[tuple[str, int]]:
    counts: dict[str, int] = {}
    for f in report.findings:
        counts[f.severity] = counts.get(f.severity, 0) + 1
    return sorted(counts.items(), key=lambda kv: severity_rank(kv[0]))


# ---- overlays: a process's details, a reap's confirmation ---------------------------------------

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


def overlay(view: TopView, title: str, body: Iterable[Line], scroll: int, width: int,
            height: int, chrome: Chrome) -> tuple[list[Line], int]:
    """A full-screen page under the header: `body` scrolled to `scroll` (clamped, returned)."""
    if width < MIN_WIDTH or height < MIN_HEIGHT:
        return view.render(ViewState(), width, height, None, chrome), 0
    lines = view.header(width, chrome)
    lines.append(fit(Line().add(title, HEAD), width, view.glyphs.ellipsis))
    room = height - len(lines) - 2
    body = list(body)
    scroll = max(0, min(scroll, len(body) - room))
    lines += [fit(line, width, view.glyphs.ellipsis) for line in body[scroll:scroll + room]]
    lines = _pad(lines, height - 2)
    lines += [view.message_line(ViewState(), width, chrome) if chrome.message or chrome.prompt
              else Line(), view.key_line(width, chrome)]
    return [fit(line, width) for line in lines], scroll


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
