"""The `gpuwatch` command line: the group, its own options, and the commands wired into it.

Built on click directly: `gpuwatch status` with a daemon running is a socket read and a render,
and the command line is most of what it costs (docs/design-notes.md, "The command line: click").
Each command is a module of gpuwatch.commands that owns its options, the call into the
application layer, the render and its exit code (gpuwatch.commands.exit_codes.ExitCode); each
imports what it needs beyond click when it runs. A command that cannot go on raises a
CommandError, which `main` prints and exits with.
"""

from __future__ import annotations

import sys
from typing import Optional

import click

from gpuwatch import __version__
from gpuwatch.commands.agent_path import agent_path
from gpuwatch.commands.daemon import daemon
from gpuwatch.commands.demo import demo
from gpuwatch.commands.doctor import EXIT_CODES as DOCTOR_EXIT_CODES
from gpuwatch.commands.doctor import doctor
from gpuwatch.commands.exit_codes import CommandError, ExitCode
from gpuwatch.commands.options import Option, shown
from gpuwatch.commands.reap import reap
from gpuwatch.commands.run import run
from gpuwatch.commands.status import status
from gpuwatch.commands.top import top

__all__ = ["DOCTOR_EXIT_CODES", "Option", "app", "main", "shown"]

# The names tests and scripts import, from before the exit codes were ExitCode's members.
EXIT_OK = ExitCode.OK
EXIT_USAGE = ExitCode.USAGE
EXIT_CONFIG = ExitCode.CONFIG
EXIT_NVML_UNAVAILABLE = ExitCode.NVML_UNAVAILABLE
EXIT_PARTIAL = ExitCode.PARTIAL
EXIT_DOCTOR_WARNINGS = ExitCode.DOCTOR_WARNINGS
EXIT_DOCTOR_FAILURES = ExitCode.DOCTOR_FAILURES


class _Commands(click.Group):
    """Commands listed in `gpuwatch -h` in the order they are added (click sorts them)."""

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


# In the order `gpuwatch -h` lists them.
for _command in (status, daemon, reap, doctor, top, demo, run, agent_path):
    app.add_command(_command)


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
    except CommandError as exc:
        click.echo(exc.message, err=True)
        sys.exit(exc.code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort as exc:
        # click turns Ctrl+C into Abort; a shell reports a command Ctrl+C ended as 130.
        if isinstance(exc.__context__, KeyboardInterrupt):
            sys.exit(ExitCode.INTERRUPTED)
        click.echo("Aborted!", err=True)
        sys.exit(ExitCode.ERROR)
    except KeyboardInterrupt:
        sys.exit(ExitCode.INTERRUPTED)
    sys.exit(code if isinstance(code, int) else ExitCode.OK)


if __name__ == "__main__":
    main()
