"""What `gpuwatch top` shows, as lines of styled text for a terminal of a given size.

Pure: a node report (read from a status document once, at the edge), the samples top has kept
and the state of the interface (sort, filter, selection, scroll) in; lines out, each a list of
(text, style) segments no wider than the terminal. No curses here, so every layout can be tested
without a terminal; gpuwatch/app/top.py only maps the style names to attributes and draws.

Here the screen's layout (header, GPU lines, the table, the panel, the message and key lines);
its rows are rows.py's (the process trees, filtered and sorted), its lines lines.py's, and the
pages over the table (a process's details, a reap's plan) details.py's.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

from gpuwatch.model import (
    GpuDevice,
    NodeReport,
)
from gpuwatch.sinks.proctree import (
    no_holders_sentence,
)
from gpuwatch.sinks.text import (
    ASCII,
    UNICODE,
    Glyphs,
    clean,
    cut,
    cut_left,
    fit_widths,
    glyphs_for,
)
from gpuwatch.sinks.top.details import confirm_lines, details_lines
from gpuwatch.sinks.top.lines import (
    BAR,
    CRITICAL,
    DIM,
    HEAD,
    INFO,
    KEY,
    MIN_HEIGHT,
    MIN_WIDTH,
    PLAIN,
    TITLE,
    WARNING,
    Line,
    SampleHistory,
    fit,
    sparkline,
)
from gpuwatch.sinks.top.rows import (
    CAPS,
    COLUMNS,
    COMMAND_COLUMN,
    JOB_COLUMN,
    MIN_COMMAND,
    NARROWING,
    PID_COLUMN,
    SORT_COLUMN,
    SORT_KEYS,
    SORT_NAMES,
    Row,
    ViewState,
    build_rows,
)
from gpuwatch.units import human_bytes
from gpuwatch.vocabulary import severity_rank

# What the screen (gpuwatch.app.top) and the tests take from here, wherever it is defined.
__all__ = ["ASCII", "BAR", "CRITICAL", "DIM", "HEAD", "INFO", "KEY", "SORT_KEYS", "SORT_NAMES",
           "TITLE", "UNICODE", "WARNING", "Glyphs", "Line", "ViewState", "build_rows", "clean",
           "confirm_lines", "cut", "cut_left", "details_lines", "glyphs_for", "sparkline"]

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
            self._widths = [min(w, CAPS.get(i, w)) for i, w in enumerate(natural)]
        return fit_widths([*self._widths[:COMMAND_COLUMN], 1 << 30], width, NARROWING,
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
            if i == SORT_COLUMN[state.sort]:
                name += self.glyphs.ascending if state.sort in ("pid", "job") else \
                    self.glyphs.descending
            head.add((name.ljust(widths[i]) + "  ") if i < COMMAND_COLUMN else name, HEAD)
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
            if i == JOB_COLUMN and len(cell) > w:
                job = row.job
                cell = cut_left(clean(job.id) if job else cell, w, self.glyphs)
            elif i == PID_COLUMN and len(cell) > w:
                cell = cut_left(cell, w, self.glyphs)
            else:
                cell = cut(cell, w, self.glyphs)
            line.add(cell.ljust(w) + "  ", (row.severity or PLAIN) if i == PID_COLUMN else PLAIN)
        room = widths[COMMAND_COLUMN]
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


