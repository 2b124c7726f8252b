"""`gpuwatch status --json`: the status document as it came, and the exit code read off it.

Monitoring scripts, epilogs and health checks run `gpuwatch status --json` every few seconds, so
its start-up is paid on every look: click and the other commands' definitions are about a fifth
of it. The entry point hands a command line made only of `--json` and `--poll` here first and it
is answered without click; anything else (another option, -h, a bad configuration, whose message
click's `status` words) returns None, and gpuwatch.cli answers it, through the same functions.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

from gpuwatch.commands.exit_codes import ExitCode

if TYPE_CHECKING:
    from gpuwatch.config import Config
    from gpuwatch.document_types import StatusDocument

#: The options a fast command line may hold (`--json` among them), each any number of times.
FAST_OPTIONS = frozenset({"--json", "--poll"})


def main(argv: Sequence[str]) -> Optional[int]:
    """`status`'s arguments answered without click, and the exit code; None for a command line
    that is not `--json` with at most `--poll`, or a configuration that does not load."""
    if "--json" not in argv or not FAST_OPTIONS.issuperset(argv):
        return None
    from gpuwatch.config import ConfigError, load_config

    try:
        cfg = load_config()
    except ConfigError:
        return None
    try:
        doc = status_document(cfg, ask_daemon="--poll" not in argv)
        print_json(doc)
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`| head`, a script that stopped reading): said by nobody, and
        # the exit code click's commands end with then. What is left unflushed goes nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.ERROR
    return document_exit_code(doc)


def status_document(cfg: Config, ask_daemon: bool) -> dict[str, Any]:
    """The running daemon's document, or (not `ask_daemon`, or none answers) one poll's."""
    from gpuwatch.app.status import StatusSource

    with StatusSource(cfg, force_poll=not ask_daemon, one_shot=True) as source:
        return source()


def print_json(doc: dict[str, Any], watching: bool = False) -> None:
    """`doc` as JSON, as the daemon (or the command's own poll) wrote it: indented, or one
    document a line when watching, for line-reading consumers."""
    import json

    sys.stdout.write(json.dumps(doc, indent=None if watching else 2) + "\n")
    sys.stdout.flush()


def document_exit_code(doc: StatusDocument) -> ExitCode:
    """The exit code of the report `doc` was rendered from (commands.status.exit_code), read
    off the document itself: what `status --json` needs of it, without reading the whole into
    the model's types."""
    if not doc["nvml"]["available"]:
        return ExitCode.NVML_UNAVAILABLE
    if any(g["errors"] for g in doc["gpus"]):
        return ExitCode.PARTIAL
    return ExitCode.OK
