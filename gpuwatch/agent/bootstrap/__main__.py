"""`python -m gpuwatch.agent.bootstrap --path`: print the bootstrap directory."""

from __future__ import annotations

import sys

from gpuwatch.agent.bootstrap import path


def main(argv: list[str]) -> int:
    if argv not in ([], ["--path"]):
        sys.stderr.write("usage: python -m gpuwatch.agent.bootstrap [--path]\n")
        return 2
    sys.stdout.write(path() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
