"""The `gpuwatch` command's entry point.

`gpuwatch run` goes in front of every training command, so it starts without the CLI framework:
Typer (and the pydantic it brings) would add tens of milliseconds to every job. Every other
command goes through gpuwatch.cli.
"""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:2] == ["run"]:
        from gpuwatch.actions.supervisor import main as run

        sys.exit(run(sys.argv[2:]))
    from gpuwatch.cli import main as cli

    cli()


if __name__ == "__main__":
    main()
