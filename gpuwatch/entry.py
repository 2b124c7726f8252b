"""The `gpuwatch` command's entry point.

`gpuwatch run` goes in front of every training command, so it starts without the CLI framework
where it can (gpuwatch.app.run): click and the command definitions would add about 15 ms to
every job. Every other command goes through gpuwatch.cli.
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
    from gpuwatch.cli import main as cli

    cli()


if __name__ == "__main__":
    main()
