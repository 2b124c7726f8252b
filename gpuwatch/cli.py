"""The `gpuwatch` command line."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from gpuwatch import __version__
from gpuwatch.config import EXIT_CONFIG

# Exit codes of `gpuwatch status`; --help lists them, docs/cli.md explains them.
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2  # Typer's own code for a bad flag
EXIT_NVML_UNAVAILABLE = 3
EXIT_PARTIAL = 4
# `gpuwatch reap`
EXIT_NOTHING_TO_DO = 3
EXIT_NOT_ALL_REAPED = 4

STATUS_EXIT_CODES = f"""\b
Exit codes:
  {EXIT_OK}  every GPU and process list was read
  {EXIT_ERROR}  gpuwatch itself failed
  {EXIT_USAGE}  bad command-line usage
  {EXIT_NVML_UNAVAILABLE}  NVML unavailable (no driver, no library, init failed): host view only
  {EXIT_PARTIAL}  NVML answered, but some GPU or call failed (the output marks which)
  {EXIT_CONFIG} bad configuration (the message names the key)
"""

app = typer.Typer(
    name="gpuwatch",
    help="Which processes hold GPU memory on this node, which belong to jobs that are gone, "
         "and what leaks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gpuwatch {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Optional[bool] = typer.Option(
        None, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    pass


_CONFIG_OPTION = typer.Option(
    None, "--config",
    help="Config file (default $GPUWATCH_CONFIG, else /etc/gpuwatch/gpuwatch.toml).")
_RUNTIME_OPTION = typer.Option(
    None, "--runtime-dir", help="Where agent.sock and state.sock live "
    "(default $GPUWATCH_RUNTIME_DIR, else /run/gpuwatch).")


def _load_config(config: Optional[Path], overrides: dict[str, Any]) -> Any:
    from gpuwatch.config import ConfigError, load_config

    try:
        return load_config(config, overrides=overrides)
    except ConfigError as exc:
        typer.echo(f"gpuwatch: bad configuration: {exc}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None


@app.command(epilog=STATUS_EXIT_CODES)
def status(
    as_json: bool = typer.Option(False, "--json",
                                 help="Print the status document (docs/json.md)."),
    poll: bool = typer.Option(False, "--poll", help="Poll once here even if a daemon is running."),
    verbose: bool = typer.Option(False, "--verbose", "-v",
                                 help="Also the allocation sites a leak's trace found and the "
                                      "traceback of the largest."),
    runtime_dir: Optional[Path] = _RUNTIME_OPTION,
    config: Optional[Path] = _CONFIG_OPTION,
) -> None:
    """GPUs, and the processes holding their memory as trees with user, job and RSS.

    Uses the running daemon's view when its state socket answers, else polls once; the output
    says which.
    """
    from gpuwatch.sinks.status_view import render_status

    cfg = _load_config(config, {"daemon.runtime_dir": runtime_dir})
    doc = _status_document(cfg, ask_daemon=not poll)
    if as_json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_status(doc, width=shutil.get_terminal_size((160, 40)).columns,
                                       verbose=verbose))
    raise typer.Exit(status_exit_code(doc))


def _status_document(cfg: Any, ask_daemon: bool) -> dict[str, Any]:
    from gpuwatch.detectors import assess
    from gpuwatch.history import History
    from gpuwatch.poll import Poller
    from gpuwatch.sinks.document import SOURCE_POLL, status_document
    from gpuwatch.sinks.state_socket import STATE_SOCKET_NAME, StateUnavailable, fetch_status

    why = "--poll given"
    if ask_daemon:
        try:
            return fetch_status(cfg.daemon.runtime_dir / STATE_SOCKET_NAME)
        except StateUnavailable as exc:
            why = str(exc)
    poller = Poller(hostname=cfg.daemon.node_name or None)
    try:
        snapshot = poller.poll()
    finally:
        poller.close()
    report = assess(snapshot, History(), cfg.detectors.for_single_poll())
    return status_document(report, source=SOURCE_POLL, source_detail=why)


@app.command()
def daemon(
    listen: Optional[str] = typer.Option(
        None, "--listen", help="HOST:PORT for /metrics (default :9966, all interfaces)."),
    interval: Optional[float] = typer.Option(None, "--interval", help="Seconds between polls."),
    config: Optional[Path] = _CONFIG_OPTION,
    runtime_dir: Optional[Path] = _RUNTIME_OPTION,
    state_dir: Optional[Path] = typer.Option(
        None, "--state-dir", help="Where the audit log lives "
        "(default $GPUWATCH_STATE_DIR, else /var/lib/gpuwatch)."),
    log_format: Optional[str] = typer.Option(None, "--log-format", help="text or json."),
    log_level: Optional[str] = typer.Option(None, "--log-level",
                                            help="debug, info, warning or error."),
) -> None:
    """The node daemon: polls NVML and /proc, serves Prometheus /metrics and the state socket.

    A bad configuration exits with 78 and names the key; another daemon already running on the
    same runtime directory, with 75 and its PID. SIGHUP reloads the configuration.
    """
    from gpuwatch.daemon import exec_daemon

    exec_daemon(config, {"daemon.listen": listen, "daemon.interval": interval,
                         "daemon.runtime_dir": runtime_dir, "daemon.state_dir": state_dir,
                         "daemon.log_format": log_format, "daemon.log_level": log_level})


REAP_EXIT_CODES = f"""\b
Exit codes:
  {EXIT_OK}  everything planned was reaped (or, with --dry-run, there is a plan)
  {EXIT_ERROR}  gpuwatch itself failed
  {EXIT_USAGE}  bad usage, or no --yes where there is no terminal to confirm on
  {EXIT_NOTHING_TO_DO}  nothing to do
  {EXIT_NOT_ALL_REAPED}  some could not be reaped (refused, identity changed, unkillable, survived)
  {EXIT_CONFIG} bad configuration
"""


@app.command(epilog=REAP_EXIT_CODES)
def reap(
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; send nothing."),
    yes: bool = typer.Option(False, "--yes", help="Do not ask for confirmation."),
    job: Optional[str] = typer.Option(None, "--job", help="Only this job's processes."),
    pids: Optional[list[int]] = typer.Option(None, "--pid", help="Only this PID (repeatable)."),
    kinds: Optional[list[str]] = typer.Option(
        None, "--kind", help="Finding kinds to act on (repeatable; default orphan, leftover, "
                             "zombie)."),
    user: Optional[str] = typer.Option(None, "--user", help="Only this user's processes."),
    older_than: float = typer.Option(0.0, "--older-than", min=0,
                                     help="Only findings open at least this many seconds."),
    grace: Optional[float] = typer.Option(None, "--grace", min=0,
                                          help="Seconds between SIGTERM and SIGKILL."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan and results as JSON."),
    poll: bool = typer.Option(False, "--poll", help="Plan from one poll here even if a daemon "
                                                   "is running."),
    runtime_dir: Optional[Path] = _RUNTIME_OPTION,
    config: Optional[Path] = _CONFIG_OPTION,
) -> None:
    """Free GPU memory held by processes of jobs that are gone, safely.

    Plans from the running daemon's findings (or one poll), never signals PID 1, the daemon,
    kernel threads, protected names or users, and checks each process's identity right before
    every signal. Every action goes to the audit log (reap.jsonl in the state directory).
    """
    from gpuwatch.actions.reaper import AUDIT_NAME, REAPABLE_KINDS, Filters, Reaper
    from gpuwatch.actions.release import holders, nvml_after
    from gpuwatch.detectors import KINDS
    from gpuwatch.runtime_dir import DAEMON_INFO_NAME
    from gpuwatch.sinks.reap_view import render_reap

    unknown = sorted(set(kinds or ()) - set(KINDS))
    if unknown:
        # A typo would otherwise read as "nothing to do": fatal in an epilog that trusts it.
        typer.echo(f"gpuwatch reap: unknown kind {', '.join(unknown)}; kinds: "
                   + ", ".join(KINDS), err=True)
        raise typer.Exit(EXIT_USAGE)
    cfg = _load_config(config, {"daemon.runtime_dir": runtime_dir})
    doc = _status_document(cfg, ask_daemon=not poll)
    daemon_pid = _daemon_pid(cfg.daemon.runtime_dir / DAEMON_INFO_NAME)
    reaper = Reaper(cfg, cfg.daemon.state_dir / AUDIT_NAME, daemon_pid=daemon_pid)
    filters = Filters(kinds=frozenset(kinds) if kinds else REAPABLE_KINDS, job=job,
                      pids=frozenset(pids or ()), user=user, older_than=older_than)
    actions = reaper.plan(doc, filters, dry_run=dry_run, grace=grace)
    if not actions:
        _print_reap(as_json, doc, [], dry_run, render_reap)
        raise typer.Exit(EXIT_NOTHING_TO_DO)
    if dry_run:
        _print_reap(as_json, doc, [(a, "planned", "") for a in actions], True, render_reap)
        raise typer.Exit(EXIT_OK)
    if not yes:
        if not sys.stdin.isatty():
            typer.echo("gpuwatch reap: refusing to signal without --yes (no terminal to "
                       "confirm on); --dry-run shows the plan", err=True)
            raise typer.Exit(EXIT_USAGE)
        sys.stdout.write(render_reap(doc, [(a, "planned", "") for a in actions], True))
        if not typer.confirm(f"Reap {len(actions)} process(es)?"):
            raise typer.Exit(EXIT_NOTHING_TO_DO)
    results = reaper.execute(actions, grace=grace)
    reading = nvml_after({r.action.pid for r in results if r.freed and r.action.pid})
    still_held = holders(reading) if reading.status.available else None
    rows = [(r.action, r.result, r.detail + _released(r, still_held)) for r in results]
    _print_reap(as_json, doc, rows, False, render_reap)
    raise typer.Exit(EXIT_OK if all(r.freed for r in results) else EXIT_NOT_ALL_REAPED)


def _print_reap(as_json: bool, doc: dict[str, Any], rows: list[Any], dry_run: bool,
                render: Any) -> None:
    if as_json:
        json.dump({"schema": 1, "source": doc["source"], "dry_run": dry_run,
                   "actions": [{**a.as_json(), "result": result, "detail": detail}
                               for a, result, detail in rows]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(doc, rows, dry_run))


def _released(r: Any, still_held: Optional[set[int]]) -> str:
    if not r.freed or r.action.gpu_memory_bytes is None or still_held is None:
        return ""
    if r.action.pid in still_held:
        return "; the driver still lists its GPU memory"
    return "; GPU memory released"


def _daemon_pid(info: Path) -> Optional[int]:
    try:
        pid = json.loads(info.read_text()).get("pid")
    except (OSError, ValueError, AttributeError):
        return None
    return pid if isinstance(pid, int) else None


DEMO_EXIT_CODES = """\b
Exit codes (128+N for signal N, as a shell reports it):
  0    --duration ran out
  1    the demo failed (no C compiler; a job or the daemon did not start)
  130  stopped by Ctrl+C (SIGINT)
  143  stopped by SIGTERM
  129  stopped by SIGHUP: its terminal closed
"""


@app.command(epilog=DEMO_EXIT_CODES)
def demo(
    listen: str = typer.Option("127.0.0.1:9966", "--listen",
                               help="HOST:PORT for the demo daemon's /metrics (another free "
                                    "port is taken if this one is busy)."),
    workers: int = typer.Option(2, "--workers", min=1, max=64, help="Workers in the job."),
    duration: Optional[float] = typer.Option(
        None, "--duration", help="Stop after this many seconds (default: until Ctrl+C)."),
    pace: float = typer.Option(5.0, "--pace", min=0.1,
                               help="Seconds per step of the story (orphans, leftovers)."),
) -> None:
    """A simulated node with real jobs on fake GPUs, watched by the real daemon. No GPU needed.

    One job's trainer finishes and leaves its helpers behind (leftovers); the other's launcher
    is killed and leaves its workers behind (orphans); a third leaks. However the demo ends, it
    ends every process it started, the orphans included, and removes its temporary directory.
    """
    from gpuwatch.simulate.demo import run_demo

    raise typer.Exit(run_demo(listen, workers, duration, pace))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                "help_option_names": []})
def run(ctx: typer.Context) -> None:
    """Run a job so that Ctrl+C, a crash or a finished trainer leaves nothing behind.

    `gpuwatch run [--grace S] [--job-name N] [--keep-helpers] [--json FILE] -- COMMAND...`;
    `gpuwatch run --help` lists its options and exit codes.
    """
    from gpuwatch.actions.supervisor import main as run_main

    raise typer.Exit(run_main(ctx.args))


def status_exit_code(doc: dict[str, Any]) -> int:
    if not doc["nvml"]["available"]:
        return EXIT_NVML_UNAVAILABLE
    if any(g["errors"] for g in doc["gpus"]):
        return EXIT_PARTIAL
    return EXIT_OK


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
