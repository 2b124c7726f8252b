"""`gpuwatch run`: the click command for what gpuwatch.app.run's fast path does not read itself
(-h, an unknown or malformed option, no command), built from the same RUN_OPTIONS, so that help,
usage and errors look like every other command's."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from gpuwatch.app.run import RUN_OPTIONS, RunArgs, job_name_problem
from gpuwatch.commands.exit_codes import ExitCode
from gpuwatch.commands.options import DURATION, PATH, F, Option

_HELD = ExitCode.GPU_HELD
EXIT_CODES = f"""\b
Exit codes:
  the command's own code, or 128+N when signal N ended it (as a shell reports it): 130 when
  Ctrl+C (SIGINT) ended the run, 143 SIGTERM, 129 SIGHUP, 131 SIGQUIT
  {ExitCode.USAGE}    bad command-line usage
  {_HELD}   the job ended but NVML still lists GPU memory of its processes, or its GPUs have
       more unattributed memory than before it: drain the node
  {ExitCode.NOT_EXECUTABLE}  the command could not be run
  {ExitCode.NOT_FOUND}  the command was not found
"""


def _job_name(ctx: click.Context, param: click.Parameter, value: Optional[str]
              ) -> Optional[str]:
    problem = job_name_problem(value) if value is not None else None
    if problem:
        raise click.BadParameter(problem, ctx, param)
    return value


def _run_options(f: F) -> F:
    """gpuwatch.app.run's options, which its fast path reads too."""
    for o in reversed(RUN_OPTIONS):
        if o.metavar is None:
            f = click.option(o.flag, o.dest, cls=Option, is_flag=True, help=o.help)(f)
        elif o.dest == "grace":
            f = click.option(o.flag, o.dest, cls=Option, type=DURATION, default=o.default,
                             metavar=o.metavar, help=o.help)(f)
        else:
            f = click.option(o.flag, o.dest, cls=Option, metavar=o.metavar, help=o.help,
                             type=PATH if o.dest == "json" else None,
                             callback=_job_name if o.dest == "job_name" else None)(f)
    return f


# Options end at the command's name: what follows is the command's own (`-- ` is optional).
@click.command(epilog=EXIT_CODES, context_settings={"allow_interspersed_args": False},
               short_help="Run a job so that nothing of it outlives it.")
@_run_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(command: tuple[str, ...], grace: float, job_name: Optional[str], keep_helpers: bool,
        json: Optional[Path], no_cgroup: bool, no_agent: bool) -> int:
    """Run COMMAND so that Ctrl+C, a crash or a finished trainer leaves nothing behind: every
    process it starts is ended, by identity, and NVML is read to check its GPU memory was
    released.

    \b
    gpuwatch run [OPTIONS] -- COMMAND [ARG...]
    """
    from gpuwatch.app.run import run as run_job

    # The command's own exit status, 128+N, or one of the ExitCode members above.
    return run_job(RunArgs(command=command, grace=grace, job_name=job_name,
                           keep_helpers=keep_helpers, json=json, no_cgroup=no_cgroup,
                           no_agent=no_agent))
