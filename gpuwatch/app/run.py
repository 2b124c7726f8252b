"""`gpuwatch run`'s command line: its options, said once, for click and for a fast path.

    gpuwatch run [--grace DURATION] [--job-name NAME] [--keep-helpers] [--json FILE]
                 [--no-cgroup] [--no-agent] -- COMMAND...

A supervisor goes in front of every training command, so its start-up is paid on every job:
click and the command definitions add about 15 ms. So the entry point hands `gpuwatch run` here
first, and a command line made only of these options is read without click. Anything else (-h,
an unknown or malformed option, no command) goes to the click command gpuwatch.cli builds from
the same RUN_OPTIONS: help, usage and errors look like every other command's, and a command
line click accepts runs exactly as the fast path would run it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

# `gpuwatch run`'s default grace and exit codes are the supervisor's vocabulary, kept below it
# (gpuwatch.launch_env).
from gpuwatch.launch_env import (
    DEFAULT_GRACE,
)
from gpuwatch.units import parse_duration

_JOB_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")


@dataclass(frozen=True)
class RunOption:
    flag: str
    dest: str
    #: None for a flag (no value).
    metavar: Optional[str]
    help: str
    default: Union[float, str, bool, None] = None


RUN_OPTIONS = (
    RunOption("--grace", "grace", "DURATION",
              "After a stop signal, or once the command exited with processes left, this long "
              "before SIGTERM and SIGKILL: 30s, 1m.", DEFAULT_GRACE),
    RunOption("--job-name", "job_name", "NAME",
              "The job's id, shown by the daemon as run:NAME (default: the command's name and a "
              "random suffix)."),
    RunOption("--keep-helpers", "keep_helpers", None,
              "When the command exits, leave what it started running (the daemon flags it).",
              False),
    RunOption("--json", "json", "FILE", "Also write the summary to FILE as JSON."),
    RunOption("--no-cgroup", "no_cgroup", None, "Do not put the job in a cgroup of its own.",
              False),
    RunOption("--no-agent", "no_agent", None,
              "Do not load the agent into the job's Python processes (by default each one reports "
              "its optimizer steps and RSS to the daemon: docs/agent.md).", False),
)


@dataclass(frozen=True)
class RunArgs:
    command: tuple[str, ...]
    grace: float = DEFAULT_GRACE
    job_name: Optional[str] = None
    keep_helpers: bool = False
    json: Optional[Path] = None
    no_cgroup: bool = False
    no_agent: bool = False


def job_name_problem(name: str) -> Optional[str]:
    if _JOB_NAME.fullmatch(name):
        return None
    return f"{name!r}: letters, digits and _.:@- only, at most 128"


def parse_fast(argv: Sequence[str]) -> Optional[RunArgs]:
    """`argv` read as click reads it, where it is only RUN_OPTIONS and a command; None for
    anything else (help, an error), which click answers."""
    by_flag = {o.flag: o for o in RUN_OPTIONS}
    values: dict[str, object] = {}
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-") or arg == "-":
            break
        flag, eq, inline = arg.partition("=")
        option = by_flag.get(flag)
        if option is None:
            return None
        if option.metavar is None:
            if eq:
                return None
            values[option.dest] = True
            i += 1
            continue
        if eq:
            text, i = inline, i + 1
        elif i + 1 < len(args):
            text, i = args[i + 1], i + 2
        else:
            return None
        if option.dest == "grace":
            try:
                values["grace"] = parse_duration(text)
            except ValueError:
                return None
        elif option.dest == "json":
            values["json"] = Path(text)
        else:
            values[option.dest] = text
    command = tuple(args[i:])
    name = values.get("job_name")
    if not command or (isinstance(name, str) and job_name_problem(name)):
        return None
    return RunArgs(command=command, **values)  # type: ignore[arg-type]


def main(argv: Optional[Sequence[str]] = None) -> Optional[int]:
    """Run the job that `argv` (run's arguments) names, and its exit status; None when the
    command line is not one the fast path reads (gpuwatch.entry then hands it to click)."""
    args = parse_fast(list(sys.argv[1:] if argv is None else argv))
    return None if args is None else run(args)


def run(args: RunArgs) -> int:
    """Run the job to its end; its summary on stderr (and in --json FILE); the exit status."""
    import json

    from gpuwatch.actions.supervisor import Supervisor, job_id_for
    from gpuwatch.sinks.run_view import render_run

    supervisor = Supervisor(list(args.command), args.job_name or job_id_for(args.command),
                            grace=args.grace, keep_helpers=args.keep_helpers,
                            use_cgroup=not args.no_cgroup, agent=not args.no_agent)
    result = supervisor.run()
    try:
        if result.started:
            sys.stderr.write(render_run(result))
        if args.json is not None:
            args.json.write_text(json.dumps(result.as_json(), indent=2) + "\n")
    finally:
        supervisor.restore_signals()
    return result.exit_code
