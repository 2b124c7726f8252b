"""`gpuwatch demo`: a simulated node with real jobs on fake GPUs, watched by the real daemon
(gpuwatch.simulate.demo)."""

from __future__ import annotations

from typing import Optional

import click

from gpuwatch.commands.exit_codes import ExitCode
from gpuwatch.commands.options import DURATION, Option, at_least_100ms
from gpuwatch.config import DEFAULT_PORT

EXIT_CODES = f"""\b
Exit codes (128+N for signal N, as a shell reports it):
  {ExitCode.OK}    --duration ran out
  {ExitCode.ERROR}    the demo failed (no C compiler; a job or the daemon did not start)
  129  stopped by SIGHUP: its terminal closed
  {ExitCode.INTERRUPTED}  stopped by Ctrl+C (SIGINT)
  143  stopped by SIGTERM
"""


@click.command(epilog=EXIT_CODES, short_help="A simulated node with real jobs; no GPU needed.")
@click.option("--listen", cls=Option, default=f"127.0.0.1:{DEFAULT_PORT}", metavar="HOST:PORT",
              help="Where the demo daemon's /metrics listens (another free port is taken if "
                   "this one is busy).")
@click.option("--workers", cls=Option, type=click.IntRange(1, 64), default=2, metavar="N",
              help="Workers in the job (1-64).")
@click.option("--duration", cls=Option, type=DURATION, metavar="DURATION",
              when_unset="until Ctrl+C", help="Stop after this long: 90s, 10m.")
@click.option("--pace", cls=Option, type=DURATION, default=5.0, metavar="DURATION",
              help="Time per step of the story (orphans, leftovers); at least 100ms.")
def demo(listen: str, workers: int, duration: Optional[float], pace: float) -> int:
    """A simulated node with real jobs on fake GPUs, watched by the real daemon. No GPU needed.

    One job's trainer finishes and leaves its helpers behind (leftovers); the other's launcher
    is killed and leaves its workers behind (orphans); a third leaks. However the demo ends, it
    ends every process it started, the orphans included, and removes its temporary directory.
    """
    from gpuwatch.simulate.demo import run_demo

    at_least_100ms(pace, "--pace")
    return run_demo(listen, workers, duration, pace)
