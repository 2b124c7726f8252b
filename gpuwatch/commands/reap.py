"""`gpuwatch reap`: plan from the daemon's findings (or one poll), show the plan, confirm, carry
it out through gpuwatch.app.reaping, and say with the exit code whether the GPU memory the plan
named is still held (what an epilog decides on)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import click

from gpuwatch.commands.exit_codes import CommandError, ExitCode
from gpuwatch.commands.options import (
    DURATION,
    Option,
    config_option,
    fitted,
    load_config,
    runtime_option,
)
from gpuwatch.vocabulary import ReapOutcome

if TYPE_CHECKING:
    from gpuwatch.actions.reap_plan import Spared
    from gpuwatch.app.reaping import Row
    from gpuwatch.model import NodeReport

_PERMISSION = ExitCode.NO_PERMISSION
EXIT_CODES = f"""\b
Exit codes:
  {ExitCode.OK}  no GPU memory the plan named is still held (or, with --dry-run, there is a plan)
  {ExitCode.ERROR}  gpuwatch itself failed
  {ExitCode.USAGE}  bad usage, or no --yes where there is no terminal to confirm on
  {ExitCode.NOTHING_TO_DO}  nothing to do
  {ExitCode.NOT_ALL_REAPED}  GPU memory the plan named is still held (a process not ended holds it,
     or NVML still lists an ended one's; NVML unreadable and a process not ended), or a
     process that --job or --pid names holds GPU memory and is protected (never signalled)
  {ExitCode.REFUSED_SERVICE}  none held, but a finding was refused as a service's process or the
     daemon's, or one under it (refused-service: the findings are wrong or out of date)
  {_PERMISSION} the audit log cannot be written (not root, nor the daemon's user): nothing
     was signalled (a --dry-run still prints its plan, unrecorded, and exits 0)
  {ExitCode.CONFIG} bad configuration
"""


@click.command(epilog=EXIT_CODES, short_help="End what holds GPU memory for jobs that are gone.")
@click.option("--dry-run", is_flag=True, help="Print the plan; send nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--job", metavar="JOB", help="Only this job's processes (its id, or SOURCE:ID).")
@click.option("--pod", metavar="NAMESPACE/NAME",
              help="Only this Kubernetes pod's processes.")
@click.option("--pid", "pids", type=int, multiple=True, metavar="PID",
              help="Only this PID (repeatable).")
@click.option("--kind", "kinds", cls=Option, multiple=True, metavar="KIND",
              shown_default=("orphan", "leftover", "zombie"),  # REAPABLE_KINDS: a test checks
              help="Finding kinds to act on (repeatable).")
@click.option("--user", metavar="USER", help="Only this user's processes.")
@click.option("--older-than", cls=Option, type=DURATION, default=0.0, metavar="DURATION",
              help="Only findings open at least this long: 90s, 5m, 2h.")
@click.option("--grace", cls=Option, setting="reaper.grace", type=DURATION, metavar="DURATION",
              help="Time between SIGTERM and SIGKILL: 10s, 1m.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan and results as JSON.")
@click.option("--poll", is_flag=True,
              help="Plan from one poll here even if a daemon is running.")
@runtime_option
@config_option
def reap(dry_run: bool, yes: bool, job: Optional[str], pod: Optional[str],
         pids: tuple[int, ...],
         kinds: tuple[str, ...], user: Optional[str], older_than: float, grace: Optional[float],
         as_json: bool, poll: bool, runtime_dir: Optional[Path], config: Optional[Path]
         ) -> ExitCode:
    """Free GPU memory held by processes of jobs that are gone, safely.

    Plans from the running daemon's findings (or one poll), never signals PID 1, the daemon,
    kernel threads or protected processes (by uid, system unit or root's executable, never by
    name), nor a leftover or orphan that is a service's (a raylet's agent, a notebook kernel) or
    the daemon's, and checks each process's identity right before every signal. Every action goes to
    the audit log (reap.jsonl in the state directory).
    """
    from gpuwatch.actions.reap_audit import AuditRefused, audit_refusal
    from gpuwatch.actions.reap_plan import REFUSED_SERVICE, Filters
    from gpuwatch.app.reaping import Reap
    from gpuwatch.commands.status_json import status_document
    from gpuwatch.model import KINDS, REAPABLE_KINDS
    from gpuwatch.runtime_dir import daemon_info
    from gpuwatch.sinks.document import from_json
    from gpuwatch.sinks.reap_view import render_reap
    from gpuwatch.units import plural

    unknown = sorted(set(kinds or ()) - set(KINDS))
    if unknown:
        # A typo would otherwise read as "nothing to do": fatal in an epilog that trusts it.
        raise CommandError(f"gpuwatch reap: unknown kind {', '.join(unknown)}; kinds: "
                           + ", ".join(KINDS), ExitCode.USAGE)
    cfg = load_config(config, {"daemon.runtime_dir": runtime_dir})
    report = from_json(status_document(cfg, ask_daemon=not poll))
    info = daemon_info(cfg.daemon.runtime_dir)
    reaper = Reap(cfg, daemon_pid=info.pid if info is not None else None)
    if pod is not None and (pod.count("/") != 1 or not all(pod.split("/"))):
        raise CommandError(f"gpuwatch reap: --pod takes NAMESPACE/NAME, not {pod!r}",
                           ExitCode.USAGE)
    filters = Filters(kinds=frozenset(kinds) if kinds else REAPABLE_KINDS, job=job,
                      pids=frozenset(pids or ()), user=user, older_than=older_than, pod=pod)
    actions = reaper.plan(report, filters, dry_run=dry_run, grace=grace)
    # Protected GPU holders the --job or --pid names: never signalled, their memory stays held.
    spared = reaper.spared(report, filters)
    if not actions:
        _print(as_json, report, [], dry_run, spared=spared)
        return ExitCode.NOT_ALL_REAPED if spared else ExitCode.NOTHING_TO_DO
    planned: list[Row] = [(a, ReapOutcome.PLANNED, "") for a in actions]
    if dry_run:
        _print(as_json, report, planned, True, spared=spared)
        if reaper.unrecorded:
            click.echo(f"gpuwatch reap: the plan is not recorded: {reaper.unrecorded}", err=True)
        return ExitCode.OK
    try:
        reaper.check_audit_writable()
    except AuditRefused as exc:
        raise CommandError(f"gpuwatch reap: nothing signalled: {exc}",
                           ExitCode.NO_PERMISSION) from None
    if not yes:
        if not sys.stdin.isatty():
            raise CommandError("gpuwatch reap: refusing to signal without --yes (no terminal to "
                               "confirm on); --dry-run shows the plan", ExitCode.USAGE)
        sys.stdout.write(render_reap(report, planned, True, **fitted()))
        if not click.confirm(f"Reap {plural(len(actions), 'process')}?"):
            return ExitCode.NOTHING_TO_DO
    try:
        done = reaper.carry_out(actions, grace=grace)
    except PermissionError as exc:  # taken away between the check and the plans' write
        raise CommandError(f"gpuwatch reap: {audit_refusal(reaper.audit_path, exc)}",
                           ExitCode.NO_PERMISSION) from None
    held = sorted({*done.held, *(s.pid for s in spared)})
    _print(as_json, report, done.rows, False, held, spared)
    # What an epilog decides on: whether the next job would find GPU memory taken, not whether
    # every line of the plan was carried out (a PID reused before the signal freed nothing, but
    # what it was planned for holds nothing either); then whether a finding named a service's
    # process, which no reap ends: the findings are wrong or out of date.
    if held:
        return ExitCode.NOT_ALL_REAPED
    if any(r.result == REFUSED_SERVICE for r in done.results):
        return ExitCode.REFUSED_SERVICE
    return ExitCode.OK


def _print(as_json: bool, report: NodeReport, rows: list[Row], dry_run: bool,
           held: Optional[list[int]] = None, spared: Sequence[Spared] = ()) -> None:
    """The plan, or what carrying it out did: reap's JSON document, or its text view."""
    if as_json:
        import json

        still = sorted({*(held or ()), *(s.pid for s in spared)})
        json.dump({"schema": 1, "source": report.source, "dry_run": dry_run,
                   "actions": [{**a.as_json(), "result": result, "detail": detail}
                               for a, result, detail in rows],
                   "protected": [s.as_json() for s in spared],
                   "still_held": None if dry_run else still},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        from gpuwatch.sinks.reap_view import render_reap

        if not dry_run and spared:
            held = sorted({*(held or ()), *(s.pid for s in spared)})
        sys.stdout.write(render_reap(report, rows, dry_run, held, spared=spared, **fitted()))
