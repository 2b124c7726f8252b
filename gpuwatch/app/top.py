"""`gpuwatch top` on the terminal: curses draws the view's lines, reads the keys, runs the dialogs.

Everything that decides what is on screen is in gpuwatch/sinks/top/view.py, a pure renderer;
this module maps its style names to curses attributes, keeps the mode (the list, a process's
details, a reap's confirmation, the filter prompt), turns keys into changes of the view's state
and carries out the reaps they ask for. The terminal is restored however top ends: `q`, Ctrl+C,
SIGTERM, SIGHUP, or an error of its own. A terminal that is gone (its window closed, with nobody
to send top a SIGHUP: a shell that ran it without exec, `sh -c "cd x && gpuwatch top"`) ends it
too, as a SIGHUP would: every read from a hung-up terminal fails at once, and a loop that took
that for "no key yet" would spin.
"""

from __future__ import annotations

import contextlib
import curses
import locale
import os
import signal
import sys
import termios
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from gpuwatch.app.status import StatusSource
from gpuwatch.config import Config
from gpuwatch.model import NodeReport
from gpuwatch.sinks.document import from_json
from gpuwatch.sinks.top.feed import Feed, Samples
from gpuwatch.sinks.top.view import (
    ASCII,
    BAR,
    CONFIRM_KEYS,
    CRITICAL,
    DETAILS_KEYS,
    DIM,
    HEAD,
    INFO,
    KEY,
    PROMPT_KEYS,
    SORT_KEYS,
    SORT_NAMES,
    TITLE,
    WARNING,
    Chrome,
    Line,
    TopView,
    ViewState,
    confirm_lines,
    details_lines,
    glyphs_for,
    overlay,
)
from gpuwatch.threads import start_without_signals
from gpuwatch.vocabulary import ReapOutcome

NO_TERMINAL = ("gpuwatch top needs a terminal; use `gpuwatch status --watch` or "
               "`status --json`")
#: How long get_wch waits for a key: how soon a new document or a reap's result shows.
TICK_MS = 250
#: How long a message stays on the message line.
MESSAGE_SECONDS = 8.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

Key = Union[str, int]
_ENTER = ("\n", "\r", curses.KEY_ENTER)
_ESCAPE = "\x1b"
_BACKSPACE = ("\x7f", "\x08", curses.KEY_BACKSPACE)
# What a terminal without UTF-8 gets instead of the few non-ASCII characters the view writes.
_TO_ASCII = str.maketrans({"·": "-", "…": "~", "↑": "^", "↓": "v", "▲": "^", "▼": "v",
                           "├": "|", "└": "`", "─": "-", "│": "|"})


class Stopped(BaseException):
    """A stop signal arrived (like KeyboardInterrupt, out of reach of `except Exception`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run_top(cfg: Config, interval: float = 2.0, force_poll: bool = False,
            daemon_pid: Callable[[], Optional[int]] = lambda: None) -> int:
    """Run until `q` (exit 0) or a stop signal (128+N, as a shell reports it); 2 without a
    terminal. `daemon_pid` names the daemon when a reap is planned (it is never signalled)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        sys.stderr.write(NO_TERMINAL + "\n")
        return 2
    locale.setlocale(locale.LC_ALL, "")
    try:
        curses.setupterm()
    except curses.error as exc:
        # initscr() would print its own message and exit(1) without a word of ours.
        sys.stderr.write(f"gpuwatch top: cannot drive this terminal (TERM="
                         f"{os.environ.get('TERM', '')!r}): {exc}\n")
        return 2
    source = StatusSource(cfg, force_poll)
    feed = Feed(lambda: from_json(source()), interval, close=source.close)
    stopping: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        # Once: a second signal must not cut short the restoring of the terminal.
        if not stopping:
            stopping.append(signum)
            raise Stopped(signum)

    reaping = Reaping(cfg, daemon_pid, force_poll, feed.refresh_now)
    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    try:
        feed.start()
        return _in_curses(lambda scr: Top(scr, feed, reaping, interval).loop(), stopping)
    except Stopped as exc:
        return 128 + exc.signum
    finally:
        stopping.append(0)
        feed.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        # A reap cut short would leave a process between SIGTERM and SIGKILL and no result in
        # the audit log: it is waited for (a second Ctrl+C, back to the default, still ends it).
        if reaping.busy:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write("gpuwatch top: finishing the reap under way...\n")
            reaping.wait()


def terminal_gone(fd: int = 0) -> bool:
    """Whether the terminal top reads its keys from was hung up (closed under it): the kernel
    then fails every call on it with EIO, tcgetattr too."""
    try:
        termios.tcgetattr(fd)
    except (termios.error, OSError):
        return True
    return False


def _in_curses(body: Callable[[Any], int], stopping: list[int]) -> int:
    """curses.wrapper, with a restore that goes on when a step fails (the terminal is gone
    after a SIGHUP) and that no signal interrupts."""
    scr = curses.initscr()
    try:
        curses.noecho()
        curses.cbreak()
        scr.keypad(True)
        return body(scr)
    finally:
        stopping.append(0)
        for step in (lambda: scr.keypad(False), curses.echo, curses.nocbreak, curses.endwin):
            with contextlib.suppress(curses.error):
                step()


# ---- reaping from top ------------------------------------------------------------------------

@dataclass
class Plan:
    report: NodeReport
    pid: int
    kind: str
    filters: Any
    #: What `gpuwatch reap --dry-run --pid PID --kind KIND` prints for the same document.
    text: str
    command: str
    #: Each action in a sentence, for a terminal too narrow for the plan's table.
    in_full: list[str]


class Reaping:
    """Plans and carries out a reap of one process exactly as `gpuwatch reap --pid PID --kind
    KIND` does: the same orchestration (gpuwatch.app.reaping), filters, audit log and signalling
    path. Carrying it out takes the grace period, so it runs in a thread; the screen asks for the
    result."""

    def __init__(self, cfg: Config, daemon_pid: Callable[[], Optional[int]], force_poll: bool,
                 done: Callable[[], None]) -> None:
        self.cfg = cfg
        self._daemon_pid = daemon_pid
        self._force_poll = force_poll
        self._done = done
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[tuple[str, str]] = None
        self._lock = threading.Lock()

    @staticmethod
    def reapable(findings: Any) -> Optional[str]:
        from gpuwatch.actions.reap_plan import REAPABLE_KINDS

        return next((f.kind for f in findings if f.kind in REAPABLE_KINDS), None)

    def _reaper(self) -> Any:
        from gpuwatch.app.reaping import Reap

        return Reap(self.cfg, daemon_pid=self._daemon_pid())

    def plan(self, report: NodeReport, pid: int, kind: str) -> Plan:
        """The dry run's plan (audited as `reap --dry-run` audits it). Raises OSError when
        the audit log cannot be written."""
        from gpuwatch.actions.reap_plan import Filters
        from gpuwatch.sinks.reap_view import render_reap

        filters = Filters(kinds=frozenset({kind}), pids=frozenset({pid}))
        actions = self._reaper().plan(report, filters, dry_run=True)
        text = render_reap(report, [(a, ReapOutcome.PLANNED, "") for a in actions], True)
        command = (f"gpuwatch reap --dry-run --pid {pid} --kind {kind}"
                   + (" --poll" if self._force_poll else ""))
        in_full = [f"PID {a.pid} ({a.kind}): {a.action}"
                   + (f", {', '.join(a.signals)}" if a.signals else "")
                   + (f"; refused: {a.refused}" if a.refused else "") + f"; why: {a.reason}"
                   for a in actions]
        return Plan(report, pid, kind, filters, text, command, in_full)

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def start(self, plan: Plan) -> None:
        self._thread = threading.Thread(target=self._execute, args=(plan,),
                                        name="gpuwatch-top-reap", daemon=True)
        start_without_signals(self._thread)

    def _execute(self, plan: Plan) -> None:
        try:
            reaper = self._reaper()
            # Planned again, not a dry run this time, from the document the user confirmed:
            # the audit log then reads as it does for `gpuwatch reap --pid PID --kind KIND`.
            actions = reaper.plan(plan.report, plan.filters, dry_run=False)
            results = reaper.carry_out(actions, check_release=False).results
            if not results:
                result = (f"PID {plan.pid}: nothing to reap any more", WARNING)
            else:
                said = "reap: " + "; ".join(f"PID {r.action.pid} ({r.action.kind}): {r.result}"
                                 + (f": {r.detail}" if r.detail else "") for r in results)
                result = (said, INFO if all(r.freed for r in results) else WARNING)
        except Exception as exc:  # the audit log unwritable, a signal refused by the kernel
            result = (f"reap of PID {plan.pid} failed: {exc}", CRITICAL)
        with self._lock:
            self._result = result
        self._done()

    def result(self) -> Optional[tuple[str, str]]:
        with self._lock:
            result, self._result = self._result, None
        return result


# ---- the screen ------------------------------------------------------------------------------

def attributes(colour: bool) -> dict[str, int]:
    """Style name -> curses attribute. Without colour (NO_COLOR, or a terminal without it),
    severities still stand out: bold and underlined for critical, bold for a warning, and
    every finding keeps its `[kind]` marker."""
    plain = {TITLE: curses.A_BOLD, DIM: curses.A_DIM, HEAD: curses.A_BOLD | curses.A_UNDERLINE,
             KEY: curses.A_DIM, CRITICAL: curses.A_BOLD | curses.A_UNDERLINE,
             WARNING: curses.A_BOLD, INFO: 0, BAR: 0}
    if not colour:
        return plain
    curses.start_color()
    background = -1
    try:
        curses.use_default_colors()  # the terminal's own background, not black
    except curses.error:
        background = curses.COLOR_BLACK
    for pair, fg in ((1, curses.COLOR_RED), (2, curses.COLOR_YELLOW), (3, curses.COLOR_CYAN),
                     (4, curses.COLOR_GREEN)):
        curses.init_pair(pair, fg, background)
    return {**plain, CRITICAL: curses.color_pair(1) | curses.A_BOLD,
            WARNING: curses.color_pair(2), INFO: curses.color_pair(3),
            BAR: curses.color_pair(4)}


def wants_colour() -> bool:
    # https://no-color.org: set and not empty means no colour, whatever the terminal can do.
    return not os.environ.get("NO_COLOR") and curses.has_colors()


class Top:
    def __init__(self, scr: Any, feed: Feed, reaping: Reaping, interval: float) -> None:
        self.scr = scr
        self.feed = feed
        self.reaping = reaping
        # The encoding curses writes in (the C locale's codeset), which under Python's UTF-8
        # mode is not the one locale.getpreferredencoding() reports.
        self.glyphs = glyphs_for(getattr(scr, "encoding", None) or "ascii")
        self.ascii = self.glyphs is ASCII
        self.view = TopView(self.glyphs)
        self.state = ViewState()
        self.samples = Samples()
        self.chrome = Chrome(interval=interval)
        self.attrs = attributes(wants_colour())
        self.mode = "list"
        self.details_pid: Optional[int] = None
        self.details_scroll = 0
        self.plan: Optional[Plan] = None
        self.message_until = 0.0

    # -- the loop ------------------------------------------------------------------------------
    def loop(self) -> int:
        with contextlib.suppress(curses.error):
            curses.curs_set(0)
        if hasattr(curses, "set_escdelay"):
            curses.set_escdelay(25)  # Esc closes at once, not after ncurses' default second
        self.scr.timeout(TICK_MS)
        dirty = True
        while True:
            dirty |= self.take()
            if dirty:
                self.draw()
                dirty = False
            try:
                key = self.scr.get_wch()
            except curses.error:  # no key within the tick, or no terminal any more
                if terminal_gone():
                    raise Stopped(signal.SIGHUP) from None
                continue
            if self.handle(key):
                return 0
            dirty = True

    def take(self) -> bool:
        """What changed since the last tick: a new document, a reap's result, a message that
        expired. True when the screen needs drawing again."""
        changed = False
        update = self.feed.take()
        if update is not None:
            self.chrome.error = update.error
            if update.report is not None:
                self.samples.record(update.report)
                self.view.set_report(update.report)
            changed = True
        result = self.reaping.result()
        if result is not None:
            self.say(*result, seconds=3 * MESSAGE_SECONDS)
            changed = True
        if self.chrome.message and time.monotonic() > self.message_until \
                and not self.reaping.busy:
            self.chrome.message = ""
            changed = True
        return changed

    def say(self, message: str, style: str = INFO, seconds: float = MESSAGE_SECONDS) -> None:
        self.chrome.message, self.chrome.message_style = message, style
        self.message_until = time.monotonic() + seconds

    # -- drawing -------------------------------------------------------------------------------
    def draw(self) -> None:
        height, width = self.scr.getmaxyx()
        self.chrome.keys = {"details": DETAILS_KEYS, "confirm": CONFIRM_KEYS,
                            "prompt": PROMPT_KEYS}.get(self.mode)
        if self.mode == "details" and self.view.report is not None and self.details_pid:
            body = details_lines(self.view.report, self.details_pid, self.samples, width)
            lines, self.details_scroll = overlay(
                self.view, f"process {self.details_pid}", body, self.details_scroll, width,
                height, self.chrome)
        elif self.mode == "confirm" and self.plan is not None:
            lines, _ = overlay(self.view, f"reap PID {self.plan.pid} ({self.plan.kind})?",
                               confirm_lines(self.plan.text, self.plan.command, width,
                                             self.plan.in_full), 0, width, height, self.chrome)
        else:
            lines = self.view.render(self.state, width, height, self.samples, self.chrome)
        self.scr.erase()
        for y, line in enumerate(lines[:height]):
            self._draw_line(y, line, width)
        self.scr.noutrefresh()
        curses.doupdate()

    def _draw_line(self, y: int, line: Line, width: int) -> None:
        base = curses.A_REVERSE if line.selected else 0
        x = 0
        for text, style in line.segments:
            if self.ascii:
                text = text.translate(_TO_ASCII).encode("ascii", "replace").decode()
            self._put(y, x, text, self.attrs.get(style, 0) | base)
            x += len(text)
        if line.selected and x < width:
            self._put(y, x, " " * (width - x), base)

    def _put(self, y: int, x: int, text: str, attr: int) -> None:
        # The bottom-right cell: curses writes it, then fails to move the cursor past it.
        with contextlib.suppress(curses.error):
            self.scr.addstr(y, x, text, attr)

    # -- keys ----------------------------------------------------------------------------------
    def handle(self, key: Key) -> bool:
        """Act on one key; True to quit."""
        if key == curses.KEY_RESIZE:
            curses.update_lines_cols()
            self.scr.clear()  # everything drawn again: the old layout is meaningless now
            return False
        if key == "\x0c":  # Ctrl+L, as everywhere
            self.scr.clear()
            return False
        if self.mode == "prompt":
            self._prompt_key(key)
        elif self.mode == "details":
            self._details_key(key)
        elif self.mode == "confirm":
            self._confirm_key(key)
        else:
            return self._list_key(key)
        return False

    def _list_key(self, key: Key) -> bool:
        height, width = self.scr.getmaxyx()
        view, state = self.view, self.state
        if key == "q":
            return True
        if key in (curses.KEY_UP, "k"):
            view.move(state, -1)
        elif key in (curses.KEY_DOWN, "j"):
            view.move(state, 1)
        elif key == curses.KEY_PPAGE:
            view.move(state, -view.page(width, height))
        elif key == curses.KEY_NPAGE:
            view.move(state, view.page(width, height))
        elif key in (curses.KEY_HOME, "g"):
            view.move_to(state, 0)
        elif key in (curses.KEY_END, "G"):
            view.move_to(state, len(view.rows(state)) - 1)
        elif key == "s" or key in SORT_KEYS:
            if key == "s":
                state.next_sort()
            else:
                state.sort = SORT_KEYS[str(key)]
            self.say(f"sorted by {SORT_NAMES[state.sort]}", seconds=2)
        elif key in ("/", "f"):
            self.mode, self.chrome.prompt = "prompt", state.filter
        elif key == _ESCAPE and state.filter:
            state.filter = ""
            self.say("filter cleared", seconds=2)
        elif key in _ENTER:
            row = view.selected_row(state)
            if row is not None:
                self.mode, self.details_pid, self.details_scroll = "details", row.pid, 0
        elif key == "r":
            self._reap_key()
        return False

    def _prompt_key(self, key: Key) -> None:
        text = self.chrome.prompt or ""
        if key in _ENTER:
            self.mode, self.chrome.prompt = "list", None
            return
        if key == _ESCAPE:
            self.mode, self.chrome.prompt, self.state.filter = "list", None, ""
            return
        if key in _BACKSPACE:
            text = text[:-1]
        elif key == "\x15":  # Ctrl+U
            text = ""
        elif isinstance(key, str) and key.isprintable():
            text += key
        self.chrome.prompt = self.state.filter = text  # filtered as it is typed

    def _details_key(self, key: Key) -> None:
        height, _ = self.scr.getmaxyx()
        page = max(1, height - 6)
        if key in (_ESCAPE, "q", *_ENTER):
            self.mode = "list"
        elif key in (curses.KEY_UP, "k"):
            self.details_scroll = max(0, self.details_scroll - 1)
        elif key in (curses.KEY_DOWN, "j"):
            self.details_scroll += 1  # overlay() clamps it to the end
        elif key == curses.KEY_PPAGE:
            self.details_scroll = max(0, self.details_scroll - page)
        elif key == curses.KEY_NPAGE:
            self.details_scroll += page
        elif key in (curses.KEY_HOME, "g"):
            self.details_scroll = 0
        elif key in (curses.KEY_END, "G"):
            self.details_scroll = 1 << 30

    def _reap_key(self) -> None:
        row = self.view.selected_row(self.state)
        report = self.view.report
        if row is None or report is None:
            self.say("no process selected", WARNING)
            return
        if self.reaping.busy:
            self.say("a reap is under way; wait for its result", WARNING)
            return
        kind = self.reaping.reapable(row.findings)
        if kind is None:
            from gpuwatch.actions.reap_plan import REAPABLE_KINDS

            have = ", ".join(f.kind for f in row.findings) or "no finding"
            self.say(f"PID {row.pid} has nothing to reap ({have}); `r` reaps "
                     f"{', '.join(sorted(REAPABLE_KINDS))} findings", WARNING)
            return
        try:
            self.plan = self.reaping.plan(report, row.pid, kind)
        except OSError as exc:
            self.say(f"cannot plan a reap: the audit log {exc.filename or ''}: "
                     f"{exc.strerror or exc}", CRITICAL)
            return
        self.mode = "confirm"

    def _confirm_key(self, key: Key) -> None:
        plan, self.plan, self.mode = self.plan, None, "list"
        if key != "y" or plan is None:
            self.say("reap cancelled: nothing was sent", seconds=3)
            return
        self.reaping.start(plan)
        self.say(f"reaping PID {plan.pid} ({plan.kind}): SIGTERM, then SIGKILL after "
                 f"{self.reaping.cfg.reaper.grace:g} s if it is still there...", WARNING)
