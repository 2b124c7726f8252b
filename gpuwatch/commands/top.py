"""`gpuwatch top`: the live, full-screen view (gpuwatch.app.top draws it and acts on keys)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import click

from gpuwatch.commands.exit_codes import CommandError, ExitCode
from gpuwatch.commands.options import (
    at_least_100ms,
    config_option,
    load_config,
    refresh_option,
    runtime_option,
)

EXIT_CODES = f"""\b
Exit codes (128+N for signal N, as a shell reports it):
  {ExitCode.OK}    quit with q
  {ExitCode.ERROR}    gpuwatch itself failed
  {ExitCode.USAGE}    no terminal (use `gpuwatch status --watch` or `status --json`), or bad usage
  {ExitCode.CONFIG}   bad configuration
  129  SIGHUP: its terminal closed
  {ExitCode.INTERRUPTED}  Ctrl+C (SIGINT)
  143  SIGTERM
"""


@click.command(epilog=EXIT_CODES,
               short_help="A live, full-screen view: GPUs, process trees, findings, reap.")
@refresh_option("Time between refreshes: 1s, 500ms.")
@click.option("--poll", is_flag=True, help="Poll here even if a daemon is running.")
@runtime_option
@config_option
def top(interval: float, poll: bool, runtime_dir: Optional[Path],
        config: Optional[Path]) -> int:
    """A live view of the node, as htop and nvitop give it: GPUs with memory bars, the process
    trees holding their memory with findings marked, and each process's RSS and GPU memory
    over time.

    Uses the running daemon's view when its state socket answers (asked again on every
    refresh), else polls of its own; the header says which. Keys: arrows or j/k move, s sorts,
    / filters by job or user, enter shows a process's details, r reaps an orphan, leftover or
    zombie after showing the plan, q quits. docs/top.md has the rest.
    """
    from gpuwatch.app.top import NO_TERMINAL, run_top
    from gpuwatch.runtime_dir import daemon_info

    at_least_100ms(interval, "--interval")
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise CommandError(NO_TERMINAL, ExitCode.USAGE)
    cfg = load_config(config, {"daemon.runtime_dir": runtime_dir})
    runtime = cfg.daemon.runtime_dir

    def daemon_pid() -> Optional[int]:
        info = daemon_info(runtime)
        return info.pid if info is not None else None

    # 0 (q), ExitCode.USAGE (no terminal it can drive) or 128+N (signal N).
    return run_top(cfg, interval, force_poll=poll, daemon_pid=daemon_pid)
