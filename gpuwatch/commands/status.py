"""`gpuwatch status`: the status document (the running daemon's, or one poll here), as text or
JSON, once or every --interval; its exit code says whether every GPU and process list was read."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import click

from gpuwatch.commands.exit_codes import ExitCode
from gpuwatch.commands.options import (
    at_least_100ms,
    config_option,
    load_config,
    refresh_option,
    runtime_option,
)
from gpuwatch.commands.status_json import document_exit_code, print_json, status_document

if TYPE_CHECKING:
    from gpuwatch.config import Config
    from gpuwatch.model import NodeReport

EXIT_CODES = f"""\b
Exit codes:
  {ExitCode.OK}  every GPU and process list was read
  {ExitCode.ERROR}  gpuwatch itself failed
  {ExitCode.USAGE}  bad command-line usage
  {ExitCode.NVML_UNAVAILABLE}  NVML unavailable (no driver, no library, init failed): host view only
  {ExitCode.PARTIAL}  NVML answered, but some GPU or call failed (the output marks which)
  {ExitCode.CONFIG} bad configuration (the message names the key)
"""


@click.command(epilog=EXIT_CODES,
               short_help="GPUs and the process trees holding them, with findings.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the status document (docs/json.md).")
@click.option("--poll", is_flag=True, help="Poll once here even if a daemon is running.")
@click.option("--verbose", "-v", is_flag=True,
              help="Also the allocation sites a leak's trace found and the traceback of the "
                   "largest.")
@click.option("--watch", "-w", is_flag=True,
              help="Show it again every --interval until Ctrl+C, as `watch` does (with --json: "
                   "one document per line).")
@refresh_option("With --watch, the time between refreshes: 1s, 500ms.")
@runtime_option
@config_option
def status(as_json: bool, poll: bool, verbose: bool, watch: bool, interval: float,
           runtime_dir: Optional[Path], config: Optional[Path]) -> ExitCode:
    """GPUs, and the processes holding their memory as trees with user, job and RSS.

    Uses the running daemon's view when its state socket answers, else polls once; the output
    says which. On a terminal lines are fitted to its width and severities are coloured (not
    with NO_COLOR set); piped or redirected, every line is written in full, without colour.
    """
    cfg = load_config(config, {"daemon.runtime_dir": runtime_dir})
    at_least_100ms(interval, "--interval")
    if watch:
        return _watch(cfg, as_json, verbose, poll, interval)
    doc = status_document(cfg, ask_daemon=not poll)
    if as_json:  # the document as it came: no report to read it into (nor the model to import)
        _print(doc, None, as_json, verbose)
        return document_exit_code(doc)
    from gpuwatch.sinks.document import from_json

    report = from_json(doc)
    _print(doc, report, as_json, verbose)
    return exit_code(report)


def exit_code(report: NodeReport) -> ExitCode:
    if not report.snapshot.nvml.available:
        return ExitCode.NVML_UNAVAILABLE
    if any(g.errors for g in report.snapshot.gpus):
        return ExitCode.PARTIAL
    return ExitCode.OK


def _print(doc: dict[str, Any], report: Optional[NodeReport], as_json: bool, verbose: bool,
           *, watching: bool = False) -> None:
    """`doc` as JSON, as the daemon (or the command's own poll) wrote it, or the text view of
    `report`, the same document read once (gpuwatch.sinks.document.from_json)."""
    if as_json:
        print_json(doc, watching)
        return
    assert report is not None, "the text view renders the report"
    import shutil

    from gpuwatch.sinks.colour import wants_colour
    from gpuwatch.sinks.status_view import render_status
    from gpuwatch.sinks.text import glyphs_for

    tty = sys.stdout.isatty()
    text = render_status(report, width=shutil.get_terminal_size().columns if tty else 0,
                         verbose=verbose, colour=wants_colour(sys.stdout),
                         glyphs=glyphs_for(sys.stdout.encoding))
    if watching:
        # On a terminal, home and clear before drawing, as `watch` does; piped, each view
        # after a blank line.
        text = "\033[H\033[2J" + text if tty else text + "\n"
    sys.stdout.write(text)
    sys.stdout.flush()


def _watch(cfg: Config, as_json: bool, verbose: bool, poll: bool, interval: float) -> ExitCode:
    """`status --watch`: redraw every `interval` on a terminal, append when piped (each view
    after a blank line, each JSON document on a line of its own); Ctrl+C ends it with 0. Without
    a daemon, its own polls keep one history, as top's do."""
    import signal
    import time

    from gpuwatch.app.status import StatusSource
    from gpuwatch.sinks.document import from_json

    # Ctrl+C ends it even where the shell started it with SIGINT ignored (`cmd &` in a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StatusSource(cfg, force_poll=poll) as source:
            while True:
                started = time.monotonic()
                doc = source()
                _print(doc, None if as_json else from_json(doc), as_json, verbose,
                       watching=True)
                time.sleep(max(0.0, interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        return ExitCode.OK
