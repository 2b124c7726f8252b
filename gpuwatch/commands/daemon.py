"""`gpuwatch daemon`: the node daemon, exec'd as `python -m gpuwatch.daemon` with the command
line's settings (same PID, as systemd expects; the daemon exits with its own codes)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from gpuwatch.commands.exit_codes import ExitCode
from gpuwatch.commands.options import DURATION, PATH, Option, config_option, runtime_option

_RUNNING = ExitCode.ALREADY_RUNNING
EXIT_CODES = f"""\b
Exit codes:
  {ExitCode.OK}   stopped by SIGTERM or SIGINT
  {ExitCode.ERROR}   could not start (the message names the address or directory)
  {ExitCode.USAGE}   bad command-line usage
  {_RUNNING}  another daemon runs on the same runtime directory (the message names it)
  {ExitCode.CONFIG}  bad configuration (the message names the key)
"""


@click.command(epilog=EXIT_CODES,
               short_help="The node daemon: /metrics, the state and agent sockets.")
@click.option("--listen", cls=Option, setting="daemon.listen", metavar="HOST:PORT",
              help="Where /metrics listens; :PORT is every interface.")
@click.option("--web-config", cls=Option, setting="daemon.web_config", type=PATH,
              metavar="FILE", when_unset="plain HTTP",
              help="TLS and basic auth for /metrics: a web config file as Prometheus exporters "
                   "read.")
@click.option("--interval", cls=Option, setting="daemon.interval", type=DURATION,
              metavar="DURATION", help="Time between polls: 1s, 500ms.")
@config_option
@runtime_option
@click.option("--state-dir", cls=Option, setting="daemon.state_dir", type=PATH, metavar="DIR",
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
