"""`gpuwatch doctor`: run the checks of gpuwatch.doctor's registry, print them (text or JSON)
and exit with the worst status."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import click

from gpuwatch.commands.exit_codes import CommandError, ExitCode
from gpuwatch.commands.options import DURATION, Option, config_option, fitted, runtime_option

_WARNINGS, _FAILURES = ExitCode.DOCTOR_WARNINGS, ExitCode.DOCTOR_FAILURES
EXIT_CODES = f"""\b
Exit codes:
  {ExitCode.OK}  every check ok (skipped ones count as ok)
  {ExitCode.ERROR}  gpuwatch itself failed
  {ExitCode.USAGE}  bad command-line usage (an unknown --check name included)
  {_WARNINGS}  at least one warning, no failure
  {_FAILURES}  at least one failure
"""


class _CheckOption(click.Option):
    """`--check NAME`, whose help lists the checks of the doctor's registry: read when the help
    is shown, so that the other commands never import the checks."""

    def get_help_record(self, ctx: click.Context) -> Optional[tuple[str, str]]:
        from gpuwatch.doctor import CHECK_NAMES

        self.help = f"Run only this check (repeatable): {', '.join(CHECK_NAMES)}."
        return super().get_help_record(ctx)


@click.command(epilog=EXIT_CODES,
               short_help="Check NVML, privileges, /proc, cgroups, the daemon, config, systemd.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the checks as JSON (docs/doctor.md).")
@click.option("--check", "only", cls=_CheckOption, multiple=True, metavar="NAME",
              help="Run only this check (repeatable).")
@click.option("--timeout", cls=Option, type=DURATION, default=2.0, metavar="DURATION",
              help="How long to wait for the daemon's sockets, its /metrics and systemctl: "
                   "500ms, 5s; at most 60s.")
@runtime_option
@config_option
def doctor(as_json: bool, only: tuple[str, ...], timeout: float, runtime_dir: Optional[Path],
           config: Optional[Path]) -> ExitCode:
    """Check what gpuwatch depends on, and say what to do about each problem.

    NVML and every GPU, this process's privileges, /proc's hidepid, the PID namespace, cgroups
    and job attribution, the daemon and its version, the agent socket, /metrics, the
    configuration, and the systemd unit. One line per check: ok, warn, fail or skip, what was
    found, and for warn and fail what to do (docs/doctor.md). A bad configuration is a failed
    check here, not exit 78: the other checks still run, with the defaults.
    """
    from gpuwatch import __version__
    from gpuwatch.doctor import (
        CHECK_NAMES,
        FAIL,
        WARN,
        Context,
        exit_status,
        load_config_for_doctor,
        run_checks,
    )
    from gpuwatch.sinks.colour import wants_colour
    from gpuwatch.sinks.doctor_view import render_doctor

    if not 0.1 <= timeout <= 60:
        raise click.BadParameter("between 100ms and 60s", param_hint="'--timeout'")
    unknown = sorted(set(only or ()) - set(CHECK_NAMES))
    if unknown:
        raise CommandError(f"gpuwatch doctor: unknown check {', '.join(unknown)}; checks: "
                           + ", ".join(CHECK_NAMES), ExitCode.USAGE)
    loaded = load_config_for_doctor(config, runtime_dir)
    ctx = Context(loaded.config, config_source=loaded.source, config_error=loaded.error,
                  timeout=timeout)
    checks = run_checks(ctx, only=frozenset(only or ()))
    worst = exit_status(checks)
    code = (ExitCode.DOCTOR_FAILURES if worst == FAIL else ExitCode.DOCTOR_WARNINGS
            if worst == WARN else ExitCode.OK)
    doc: dict[str, Any] = {"schema": 1, "gpuwatch_version": __version__,
                           "checks": [c.as_json() for c in checks], "exit_code": int(code)}
    if as_json:
        import json

        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        sys.stdout.write(render_doctor(doc, colour=wants_colour(sys.stdout),
                                       width=fitted()["width"]))
    return code
