"""The `gpuwatch` command's entry point.

`gpuwatch run` goes in front of every training command, and `gpuwatch status --json` is what
scripts and health checks run every few seconds, so both start without the CLI framework where
they can (gpuwatch.app.run, gpuwatch.commands.status_json): click and the command definitions
would add 10-15 ms to each. Every other command goes through gpuwatch.cli.
"""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:2] == ["run"]:
        from gpuwatch.app.run import main as run

        status = run(sys.argv[2:])
        if status is not None:
            sys.exit(status)
        # -h, an unknown or malformed option, no command: click's `run`, built from the same
        # options, says it as every other command does.
    elif sys.argv[1:2] == ["status"]:
        from gpuwatch.commands.status_json import main as status_json

        status = status_json(sys.argv[2:])
        if status is not None:
            sys.exit(status)
    from gpuwatch.cli import main as cli

    cli()


if __name__ == "__main__":
    main()
