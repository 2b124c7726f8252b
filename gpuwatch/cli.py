"""The `gpuwatch` command line.

Built on click directly: `gpuwatch status` with a daemon running is a socket read and a render,
and the command line is most of what it costs (docs/design-notes.md, "The command line: click").
Everything a command needs beyond click is imported inside it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TypeVar

import click

from gpuwatch import __version__
from gpuwatch.app.run import (
    RUN_OPTIONS,
    RunArgs,
    job_name_problem,
)
from gpuwatch.config import (
    DEFAULT_CONFIG_PATH,
    DEFAULT_PORT,
    EXIT_CONFIG,
    setting_default,
    setting_env,
)
from gpuwatch.launch_env import EXIT_GPU_HELD, EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND
from gpuwatch.runtime_dir import EXIT_ALREADY_RUNNING

if TYPE_CHECKING:
    from gpuwatch.model import NodeReport

# Exit codes of `gpuwatch status`; --help lists them, docs/cli.md explains them.
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2  # click's own code for a bad flag
EXIT_NVML_UNAVAILABLE = 3
EXIT_PARTIAL = 4
# `gpuwatch reap`
EXIT_NOTHING_TO_DO = 3
EXIT_NOT_ALL_REAPED = 4
EXIT_REFUSED_SERVICE = 5
EXIT_NO_PERMISSION = 77  # sysexits' EX_NOPERM: the audit log cannot be written

STATUS_EXIT_CODES = f"""\b
Exit codes:
  {EXIT_OK}  every GPU and process list was read
  {EXIT_ERROR}  gpuwatch itself failed
  {EXIT_USAGE}  bad command-line usage
  {EXIT_NVML_UNAVAILABLE}  NVML unavailable (no driver, no library, init failed): host view only
  {EXIT_PARTIAL}  NVML answered, but some GPU or call failed (the output marks which)
  {EXIT_CONFIG} bad configuration (the message names the key)
"""

F = TypeVar("F", bound=Callable[..., Any])


class _Commands(click.Group):
    """Commands listed in `gpuwatch -h` in the order they are defined (click sorts them)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)


def _completion_option(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> None:
    if value is None or ctx.resilient_parsing:
        return
    from gpuwatch import completion

    if param.name == "install_completion":
        completion.install_option(ctx, param, value)
    else:
        completion.show_option(ctx, param, value)


def _version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(f"gpuwatch {__version__}")
        ctx.exit()


@click.group(
    cls=_Commands,
    help="Which processes hold GPU memory on this node, which belong to jobs that are gone, "
         "and what leaks.",
    no_args_is_help=True,
    # Inherited by every subcommand's context: `gpuwatch status -h` as well as `gpuwatch -h`.
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_version,
              help="Print the version and exit.")
# `gpuwatch --install-completion` (bash, zsh, fish, PowerShell): docs/cli.md. The shell is the
# one the command is typed in unless named.
@click.option("--install-completion", metavar="[SHELL]", is_flag=False, flag_value="",
              expose_value=False, is_eager=True, callback=_completion_option,
              help="Install completion for the current shell, or for SHELL.")
@click.option("--show-completion", metavar="[SHELL]", is_flag=False, flag_value="",
              expose_value=False, is_eager=True, callback=_completion_option,
              help="Show completion for the current shell, or for SHELL, to copy it or "
                   "customize the installation.")
def app() -> None:
    pass


class _Duration(click.ParamType):
    """A command-line duration: `30`, `30s`, `5m`, `1h30m` (gpuwatch.units.parse_duration)."""

    name = "duration"

    def convert(self, value: Any, param: Optional[click.Parameter],
                ctx: Optional[click.Context]) -> float:
        from gpuwatch.units import parse_duration

        if isinstance(value, (int, float)):  # a default given as a number
            return float(value)
        try:
            return parse_duration(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


DURATION = _Duration()
_PATH = click.Path(path_type=Path)


def shown(value: Any, duration: bool) -> str:
    """A default as help shows it: a duration with its unit, anything else as written."""
    if duration and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:g}s"
    if isinstance(value, (tuple, list, frozenset)):
        return ", ".join(sorted(map(str, value)))
    return str(value)


class Option(click.Option):
    """An option whose help ends with its default, taken from the one place that sets it: the
    setting it overrides (`setting`, whose default is gpuwatch.config's, and which a GPUWATCH_*
    variable and the config file set too), or the option's own `default` (or `shown_default`,
    for one that is not a click default). `when_unset` words a default that is no value."""

    def __init__(self, *args: Any, setting: Optional[str] = None,
                 shown_default: Any = None, env: Optional[str] = None,
                 when_unset: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.setting = setting
        own = self.default if isinstance(self.default, (int, float, str, Path)) else None
        self.shown_default = (setting_default(setting) if setting is not None
                              else shown_default if shown_default is not None
                              else None if self.is_flag else own)
        self.env = setting_env(setting) if setting is not None else env
        if self.shown_default in (None, ""):
            said = when_unset
        else:
            said = shown(self.shown_default, isinstance(self.type, _Duration))
        if said is None:
            return
        more = "".join([f", or ${self.env}" if self.env else "",
                        f", or {setting} in the config file" if setting else ""])
        text = (self.help or "").rstrip(".")
        self.help = f"{text} (default {said}{more})."


def _config_option(f: F) -> F:
    return click.option(
        "--config", cls=Option, type=_PATH, metavar="FILE", shown_default=DEFAULT_CONFIG_PATH,
        env="GPUWATCH_CONFIG", help="Config file.")(f)


def _runtime_option(f: F) -> F:
    return click.option(
        "--runtime-dir", cls=Option, setting="daemon.runtime_dir", type=_PATH, metavar="DIR",
        help="Where agent.sock and state.sock live.")(f)


def _load_config(config: Optional[Path], overrides: dict[str, Any]) -> Any:
    from gpuwatch.config import ConfigError, load_config

    try:
        return load_config(config, overrides=overrides)
    except ConfigError as exc:
        click.echo(f"gpuwatch: bad configuration: {exc}", err=True)
        sys.exit(EXIT_CONFIG)


@app.command(epilog=STATUS_EXIT_CODES,
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
@click.option("--interval", "-n", cls=Option, type=DURATION, default=2.0, metavar="DURATION",
              help="With --watch, the time between refreshes: 1s, 500ms.")
@_runtime_option
@_config_option
def status(as_json: bool, poll: bool, verbose: bool, watch: bool, interval: float,
           runtime_dir: Optional[Path], config: Optional[Path]) -> None:
    """GPUs, and the processes holding their memory as trees with user, job and RSS.

    Uses the running daemon's view when its state socket answers, else polls once; the output
    says which. On a terminal lines are fitted to its width and severities are coloured (not
    with NO_COLOR set); piped or redirected, every line is written in full, without colour.
    """
    cfg = _load_config(config, {"daemon.runtime_dir": runtime_dir})
    if interval < 0.1:
        raise click.BadParameter("at least 100ms", param_hint="'--interval'")
    if not watch:
        from gpuwatch.sinks.document import from_json

        doc = _status_document(cfg, ask_daemon=not poll)
        report = from_json(doc)
        _print_status(doc, report, as_json, verbose)
        sys.exit(status_exit_code(report))
    sys.exit(_watch_status(cfg, as_json, verbose, poll, interval))


def _print_status(doc: dict[str, Any], report: NodeReport, as_json: bool, verbose: bool, *,
                  watching: bool = False) -> None:
    """`doc` as JSON, as the daemon (or the command's own poll) wrote it, or the text view of
    `report`, the same document read once (gpuwatch.sinks.document.from_json)."""
    tty = sys.stdout.isatty()
    if as_json:
        # Indented for one document; when watching, one per line, for line-reading consumers.
        text = json.dumps(doc, indent=None if watching else 2) + "\n"
    else:
        import shutil

        from gpuwatch.sinks.colour import wants_colour
        from gpuwatch.sinks.status_view import render_status
        from gpuwatch.sinks.text import glyphs_for

        text = render_status(report, width=shutil.get_terminal_size().columns if tty else 0,
                             verbose=verbose, colour=wants_colour(sys.stdout),
                             glyphs=glyphs_for(sys.stdout.encoding))
        if watching:
            # On a terminal, home and clear before drawing, as `watch` does; piped, each view
            # after a blank line.
            text = "\033[H\033[2J" + text if tty else text + "\n"
    sys.stdout.write(text)
    sys.stdout.flush()


def _watch_status(cfg: Any, as_json: bool, verbose: bool, poll: bool, interval: float) -> int:
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
                _print_status(doc, from_json(doc), as_json, verbose, watching=True)
                time.sleep(max(0.0, interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        return EXIT_OK


def _status_document(cfg: Any, ask_daemon: bool) -> dict[str, Any]:
    from gpuwatch.app.status import StatusSource

    with StatusSource(cfg, force_poll=not ask_daemon, one_shot=True) as source:
        return source()


DAEMON_EXIT_CODES = f"""\b
Exit codes:
  {EXIT_OK}   stopped by SIGTERM or SIGINT
  {EXIT_ERROR}   could not start (the message names the address or directory)
  {EXIT_USAGE}   bad command-line usage
  {EXIT_ALREADY_RUNNING}  another daemon runs on the same runtime directory (the message names it)
  {EXIT_CONFIG}  bad configuration (the message names the key)
"""


@app.command(epilog=DAEMON_EXIT_CODES,
             short_help="The node daemon: /metrics, the state and agent sockets.")
@click.option("--listen", cls=Option, setting="daemon.listen", metavar="HOST:PORT",
              help="Where /metrics listens; :PORT is every interface.")
@click.option("--web-config", cls=Option, setting="daemon.web_config", type=_PATH,
              metavar="FILE", when_unset="plain HTTP",
              help="TLS and basic auth for /metrics: a web config file as Prometheus exporters "
                   "read.")
@click.option("--interval", cls=Option, setting="daemon.interval", type=DURATION,
              metavar="DURATION", help="Time between polls: 1s, 500ms.")
@_config_option
@_runtime_option
@click.option("--state-dir", cls=Option, setting="daemon.state_dir", type=_PATH, metavar="DIR",
              help="Where the audit log lives.")
@click.option("--log-format", cls=Option, setting="daemon.log_format", metavar="FORMAT",
              help="text or json.")
@click.option("--log-level", cls=Option, setting="daemon.log_level", metavar="LEVEL",
              help="debug, info, warning or error.")
def daemon(listen: Optional[str], web_config: Optional[Path], interval: Optional[float],
           config: Optional[Path], runtime_dir: Optional[Path], state_dir: Optional[Path],
           log_format: Optional[str], log_level: Optional[str]) -> None:
    """The node daemon: polls NVML and /proc, serves Prometheus /metrics and the state socket.

    SIGHUP reloads the configuration.
    """
    from gpuwatch.daemon import exec_daemon

    exec_daemon(config, {"daemon.listen": listen, "daemon.web_config": web_config,
                         "daemon.interval": interval,
                         "daemon.runtime_dir": runtime_dir, "daemon.state_dir": state_dir,
                         "daemon.log_format": log_format, "daemon.log_level": log_level})


REAP_EXIT_CODES = f"""\b
Exit codes:
  {EXIT_OK}  no GPU memory the plan named is still held (or, with --dry-run, there is a plan)
  {EXIT_ERROR}  gpuwatch itself failed
  {EXIT_USAGE}  bad usage, or no --yes where there is no terminal to confirm on
  {EXIT_NOTHING_TO_DO}  nothing to do
  {EXIT_NOT_ALL_REAPED}  GPU memory the plan named is still held (a process not ended holds it,
     or NVML still lists an ended one's; NVML unreadable and a process not ended), or a
     process that --job or --pid names holds GPU memory and is protected (never signalled)
  {EXIT_REFUSED_SERVICE}  none held, but a finding was refused as a service's process or the
     daemon's, or one under it (refused-service: the findings are wrong or out of date)
  {EXIT_NO_PERMISSION} the audit log cannot be written (not root, nor the daemon's user): nothing
     was signalled (a --dry-run still prints its plan, unrecorded, and exits 0)
  {EXIT_CONFIG} bad configuration
"""


@app.command(epilog=REAP_EXIT_CODES,
             short_help="End what holds GPU memory for jobs that are gone.")
@click.option("--dry-run", is_flag=True, help="Print the plan; send nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--job", metavar="JOB", help="Only this job's processes (its id, or SOURCE:ID).")
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
@_runtime_option
@_config_option
def reap(dry_run: bool, yes: bool, job: Optional[str], pids: tuple[int, ...],
         kinds: tuple[str, ...], user: Optional[str], older_than: float, grace: Optional[float],
         as_json: bool, poll: bool, runtime_dir: Optional[Path], config: Optional[Path]) -> None:
    """Free GPU memory held by processes of jobs that are gone, safely.

    Plans from the running daemon's findings (or one poll), never signals PID 1, the daemon,
    kernel threads or protected processes (by uid, system unit or root's executable, never by
    name), nor a leftover or orphan that is a service's (a raylet's agent, a notebook kernel) or
    the daemon's, and checks each process's identity right before every signal. Every action goes to
    the audit log (reap.jsonl in the state directory).
    """
    from gpuwatch.actions.reaper import REFUSED_SERVICE, AuditRefused, Filters, audit_refusal
    from gpuwatch.app.reaping import Reap
    from gpuwatch.model import KINDS, REAPABLE_KINDS
    from gpuwatch.sinks.document import from_json
    from gpuwatch.sinks.reap_view import render_reap
    from gpuwatch.units import plural

    unknown = sorted(set(kinds or ()) - set(KINDS))
    if unknown:
        # A typo would otherwise read as "nothing to do": fatal in an epilog that trusts it.
        click.echo(f"gpuwatch reap: unknown kind {', '.join(unknown)}; kinds: "
                   + ", ".join(KINDS), err=True)
        sys.exit(EXIT_USAGE)
    cfg = _load_config(config, {"daemon.runtime_dir": runtime_dir})
    report = from_json(_status_document(cfg, ask_daemon=not poll))
    daemon_pid = _daemon_pid(cfg.daemon.runtime_dir)
    reaper = Reap(cfg, daemon_pid=daemon_pid)
    filters = Filters(kinds=frozenset(kinds) if kinds else REAPABLE_KINDS, job=job,
                      pids=frozenset(pids or ()), user=user, older_than=older_than)
    actions = reaper.plan(report, filters, dry_run=dry_run, grace=grace)
    # Protected GPU holders the --job or --pid names: never signalled, their memory stays held.
    spared = reaper.spared(report, filters)
    if not actions:
        _print_reap(as_json, report, [], dry_run, render_reap, spared=spared)
        sys.exit(EXIT_NOT_ALL_REAPED if spared else EXIT_NOTHING_TO_DO)
    if dry_run:
        _print_reap(as_json, report, [(a, "planned", "") for a in actions], True, render_reap,
                    spared=spared)
        if reaper.unrecorded:
            click.echo(f"gpuwatch reap: the plan is not recorded: {reaper.unrecorded}", err=True)
        sys.exit(EXIT_OK)
    try:
        reaper.check_audit_writable()
    except AuditRefused as exc:
        click.echo(f"gpuwatch reap: nothing signalled: {exc}", err=True)
        sys.exit(EXIT_NO_PERMISSION)
    if not yes:
        if not sys.stdin.isatty():
            click.echo("gpuwatch reap: refusing to signal without --yes (no terminal to "
                       "confirm on); --dry-run shows the plan", err=True)
            sys.exit(EXIT_USAGE)
        sys.stdout.write(render_reap(report, [(a, "planned", "") for a in actions], True,
                                     **_fitted()))
        if not click.confirm(f"Reap {plural(len(actions), 'process')}?"):
            sys.exit(EXIT_NOTHING_TO_DO)
    try:
        done = reaper.carry_out(actions, grace=grace)
    except PermissionError as exc:  # taken away between the check and the plans' write
        click.echo(f"gpuwatch reap: {audit_refusal(reaper.audit_path, exc)}", err=True)
        sys.exit(EXIT_NO_PERMISSION)
    held = sorted({*done.held, *(s.pid for s in spared)})
    _print_reap(as_json, report, done.rows, False, render_reap, held, spared)
    # What an epilog decides on: whether the next job would find GPU memory taken, not whether
    # every line of the plan was carried out (a PID reused before the signal freed nothing, but
    # what it was planned for holds nothing either); then whether a finding named a service's
    # process, which no reap ends: the findings are wrong or out of date.
    if held:
        sys.exit(EXIT_NOT_ALL_REAPED)
    sys.exit(EXIT_REFUSED_SERVICE if any(r.result == REFUSED_SERVICE for r in done.results)
             else EXIT_OK)


def _print_reap(as_json: bool, report: Any, rows: list[Any], dry_run: bool,
                render: Any, held: Optional[list[int]] = None,
                spared: Sequence[Any] = ()) -> None:
    if as_json:
        still = sorted({*(held or ()), *(s.pid for s in spared)})
        json.dump({"schema": 1, "source": report.source, "dry_run": dry_run,
                   "actions": [{**a.as_json(), "result": result, "detail": detail}
                               for a, result, detail in rows],
                   "protected": [s.as_json() for s in spared],
                   "still_held": None if dry_run else still},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        if not dry_run and spared:
            held = sorted({*(held or ()), *(s.pid for s in spared)})
        sys.stdout.write(render(report, rows, dry_run, held, spared=spared, **_fitted()))


def _fitted() -> dict[str, Any]:
    """How a human view fits where it is written: a terminal's width and glyphs; piped, every
    line in full."""
    import shutil

    from gpuwatch.sinks.text import glyphs_for

    tty = sys.stdout.isatty()
    return {"width": shutil.get_terminal_size().columns if tty else 0,
            "glyphs": glyphs_for(sys.stdout.encoding)}


def _daemon_pid(runtime_dir: Path) -> Optional[int]:
    """The daemon's PID as its daemon.json says, where that file is the daemon's to write (a
    runtime directory no other user may write, a file of root's or the directory owner's)."""
    from gpuwatch.runtime_dir import read_daemon_info

    info, _ = read_daemon_info(runtime_dir)
    pid = info.get("pid") if info is not None else None
    return pid if isinstance(pid, int) else None


# `gpuwatch doctor`
EXIT_DOCTOR_WARNINGS = 3
EXIT_DOCTOR_FAILURES = 4

DOCTOR_EXIT_CODES = f"""\b
Exit codes:
  {EXIT_OK}  every check ok (skipped ones count as ok)
  {EXIT_ERROR}  gpuwatch itself failed
  {EXIT_USAGE}  bad command-line usage (an unknown --check name included)
  {EXIT_DOCTOR_WARNINGS}  at least one warning, no failure
  {EXIT_DOCTOR_FAILURES}  at least one failure
"""


@app.command(epilog=DOCTOR_EXIT_CODES,
             short_help="Check NVML, privileges, /proc, cgroups, the daemon, config, systemd.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the checks as JSON (docs/doctor.md).")
@click.option("--check", "only", multiple=True, metavar="NAME",
              help="Run only this check (repeatable): config, nvml, privileges, executables, "
                   "proc-mount, pid-namespace, proc-children, cgroups, directories, daemon, "
                   "agent-socket, metrics, systemd.")
@click.option("--timeout", cls=Option, type=DURATION, default=2.0, metavar="DURATION",
              help="How long to wait for the daemon's sockets, its /metrics and systemctl: "
                   "500ms, 5s; at most 60s.")
@_runtime_option
@_config_option
def doctor(as_json: bool, only: tuple[str, ...], timeout: float, runtime_dir: Optional[Path],
           config: Optional[Path]) -> None:
    """Check what gpuwatch depends on, and say what to do about each problem.

    NVML and every GPU, this process's privileges, /proc's hidepid, the PID namespace, cgroups
    and job attribution, the daemon and its version, the agent socket, /metrics, the
    configuration, and the systemd unit. One line per check: ok, warn, fail or skip, what was
    found, and for warn and fail what to do (docs/doctor.md). A bad configuration is a failed
    check here, not exit 78: the other checks still run, with the defaults.
    """
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
        click.echo(f"gpuwatch doctor: unknown check {', '.join(unknown)}; checks: "
                   + ", ".join(CHECK_NAMES), err=True)
        sys.exit(EXIT_USAGE)
    loaded = load_config_for_doctor(config, runtime_dir)
    ctx = Context(loaded.config, config_source=loaded.source, config_error=loaded.error,
                  timeout=timeout)
    checks = run_checks(ctx, only=frozenset(only or ()))
    worst = exit_status(checks)
    code = (EXIT_DOCTOR_FAILURES if worst == FAIL else EXIT_DOCTOR_WARNINGS if worst == WARN
            else EXIT_OK)
    doc = {"schema": 1, "gpuwatch_version": __version__,
           "checks": [c.as_json() for c in checks], "exit_code": code}
    if as_json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        sys.stdout.write(render_doctor(doc, colour=wants_colour(sys.stdout),
                                       width=_fitted()["width"]))
    sys.exit(code)


TOP_EXIT_CODES = f"""\b
Exit codes (128+N for signal N, as a shell reports it):
  {EXIT_OK}    quit with q
  {EXIT_ERROR}    gpuwatch itself failed
  {EXIT_USAGE}    no terminal (use `gpuwatch status --watch` or `status --json`), or bad usage
  {EXIT_CONFIG}   bad configuration
  129  SIGHUP: its terminal closed
  130  Ctrl+C (SIGINT)
  143  SIGTERM
"""


@app.command(epilog=TOP_EXIT_CODES,
             short_help="A live, full-screen view: GPUs, process trees, findings, reap.")
@click.option("--interval", "-n", cls=Option, type=DURATION, default=2.0, metavar="DURATION",
              help="Time between refreshes: 1s, 500ms.")
@click.option("--poll", is_flag=True, help="Poll here even if a daemon is running.")
@_runtime_option
@_config_option
def top(interval: float, poll: bool, runtime_dir: Optional[Path],
        config: Optional[Path]) -> None:
    """A live view of the node, as htop and nvitop give it: GPUs with memory bars, the process
    trees holding their memory with findings marked, and each process's RSS and GPU memory
    over time.

    Uses the running daemon's view when its state socket answers (asked again on every
    refresh), else polls of its own; the header says which. Keys: arrows or j/k move, s sorts,
    / filters by job or user, enter shows a process's details, r reaps an orphan, leftover or
    zombie after showing the plan, q quits. docs/top.md has the rest.
    """
    from gpuwatch.app.top import NO_TERMINAL, run_top

    if interval < 0.1:
        raise click.BadParameter("at least 100ms", param_hint="'--interval'")
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        click.echo(NO_TERMINAL, err=True)
        sys.exit(EXIT_USAGE)
    cfg = _load_config(config, {"daemon.runtime_dir": runtime_dir})
    runtime = cfg.daemon.runtime_dir
    sys.exit(run_top(cfg, interval, force_poll=poll, daemon_pid=lambda: _daemon_pid(runtime)))


DEMO_EXIT_CODES = """\b
Exit codes (128+N for signal N, as a shell reports it):
  0    --duration ran out
  1    the demo failed (no C compiler; a job or the daemon did not start)
  129  stopped by SIGHUP: its terminal closed
  130  stopped by Ctrl+C (SIGINT)
  143  stopped by SIGTERM
"""


@app.command(epilog=DEMO_EXIT_CODES, short_help="A simulated node with real jobs; no GPU needed.")
@click.option("--listen", cls=Option, default=f"127.0.0.1:{DEFAULT_PORT}", metavar="HOST:PORT",
              help="Where the demo daemon's /metrics listens (another free port is taken if "
                   "this one is busy).")
@click.option("--workers", cls=Option, type=click.IntRange(1, 64), default=2, metavar="N",
              help="Workers in the job (1-64).")
@click.option("--duration", cls=Option, type=DURATION, metavar="DURATION",
              when_unset="until Ctrl+C", help="Stop after this long: 90s, 10m.")
@click.option("--pace", cls=Option, type=DURATION, default=5.0, metavar="DURATION",
              help="Time per step of the story (orphans, leftovers); at least 100ms.")
def demo(listen: str, workers: int, duration: Optional[float], pace: float) -> None:
    """A simulated node with real jobs on fake GPUs, watched by the real daemon. No GPU needed.

    One job's trainer finishes and leaves its helpers behind (leftovers); the other's launcher
    is killed and leaves its workers behind (orphans); a third leaks. However the demo ends, it
    ends every process it started, the orphans included, and removes its temporary directory.
    """
    from gpuwatch.simulate.demo import run_demo

    if pace < 0.1:
        raise click.BadParameter("at least 100ms", param_hint="'--pace'")
    sys.exit(run_demo(listen, workers, duration, pace))


RUN_EXIT_CODES = f"""\b
Exit codes:
  the command's own code, or 128+N when signal N ended it (as a shell reports it): 130 when
  Ctrl+C (SIGINT) ended the run, 143 SIGTERM, 129 SIGHUP, 131 SIGQUIT
  {EXIT_USAGE}    bad command-line usage
  {EXIT_GPU_HELD}   the job ended but NVML still lists GPU memory of its processes, or its GPUs have
       more unattributed memory than before it: drain the node
  {EXIT_NOT_EXECUTABLE}  the command could not be run
  {EXIT_NOT_FOUND}  the command was not found
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
                             type=_PATH if o.dest == "json" else None,
                             callback=_job_name if o.dest == "job_name" else None)(f)
    return f


# Options end at the command's name: what follows is the command's own (`-- ` is optional).
@app.command(epilog=RUN_EXIT_CODES, context_settings={"allow_interspersed_args": False},
             short_help="Run a job so that nothing of it outlives it.")
@_run_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(command: tuple[str, ...], grace: float, job_name: Optional[str], keep_helpers: bool,
        json: Optional[Path], no_cgroup: bool, no_agent: bool) -> None:
    """Run COMMAND so that Ctrl+C, a crash or a finished trainer leaves nothing behind: every
    process it starts is ended, by identity, and NVML is read to check its GPU memory was
    released.

    \b
    gpuwatch run [OPTIONS] -- COMMAND [ARG...]
    """
    from gpuwatch.app.run import run as run_job

    sys.exit(run_job(RunArgs(command=command, grace=grace, job_name=job_name,
                             keep_helpers=keep_helpers, json=json, no_cgroup=no_cgroup,
                             no_agent=no_agent)))


@app.command("agent-path", short_help="Print the directory that loads the agent into a job.")
def agent_path() -> None:
    """Print the directory which, first on PYTHONPATH with GPUWATCH_AGENT=auto, has every Python
    process load the agent at start (what `gpuwatch run` does for its job; docs/agent.md has
    recipes for Slurm, Kubernetes and torchrun)."""
    from gpuwatch.launch_env import AGENT_BOOTSTRAP_DIR

    click.echo(AGENT_BOOTSTRAP_DIR)


def status_exit_code(report: NodeReport) -> int:
    if not report.snapshot.nvml.available:
        return EXIT_NVML_UNAVAILABLE
    if any(g.errors for g in report.snapshot.gpus):
        return EXIT_PARTIAL
    return EXIT_OK


def main(args: Optional[list[str]] = None) -> None:
    import os

    # The name users type, also under `python -m gpuwatch`: usage lines and the completion
    # script (its _GPUWATCH_COMPLETE variable) say `gpuwatch`.
    instruction = os.environ.get("_GPUWATCH_COMPLETE")
    if instruction:
        from gpuwatch.completion import answer

        sys.exit(answer(app, "gpuwatch", instruction))
    try:
        code = app.main(args, prog_name="gpuwatch", standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort as exc:
        # click turns Ctrl+C into Abort; a shell reports a command Ctrl+C ended as 130.
        if isinstance(exc.__context__, KeyboardInterrupt):
            sys.exit(130)
        click.echo("Aborted!", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else EXIT_OK)


if __name__ == "__main__":
    main()
