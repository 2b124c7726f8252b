"""The exit codes of `gpuwatch`'s commands, each meaning a name of its own.

A number means different things to different commands (3 is "NVML unavailable" to `status`,
"nothing to do" to `reap`, "warnings" to `doctor`): scripts and epilogs rely on the numbers, so
they stay, and each meaning is a member of its own here. docs/cli.md has the table; each
command's `-h` lists its own.
"""

from __future__ import annotations

from enum import IntEnum

from gpuwatch.config import EXIT_CONFIG
from gpuwatch.launch_env import EXIT_GPU_HELD, EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND
from gpuwatch.runtime_dir import EXIT_ALREADY_RUNNING, EXIT_UNSAFE_DIRECTORY


class ExitCode(IntEnum):
    """An exit status and what it means. Two meanings of one number are two members (an
    enumeration would make the second an alias of the first): equal as numbers, told apart by
    name."""

    meaning: str

    def __new__(cls, code: int, meaning: str) -> ExitCode:
        member = int.__new__(cls, code)
        member._value_ = (code, meaning)  # type: ignore[assignment]
        member.meaning = meaning
        return member

    # The number, wherever it is written (help epilogs, JSON), on every Python.
    def __str__(self) -> str:
        return str(int(self))

    def __format__(self, spec: str) -> str:
        return format(int(self), spec)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {int(self)}>"

    # Every command
    OK = 0, "success"
    ERROR = 1, "gpuwatch itself failed"
    USAGE = 2, "bad command-line usage (click's own code for a bad flag)"
    CONFIG = EXIT_CONFIG, "bad configuration (the message names the key)"
    # status
    NVML_UNAVAILABLE = 3, "status: NVML unavailable, host view only"
    PARTIAL = 4, "status: NVML answered, but some GPU or call failed"
    # reap
    NOTHING_TO_DO = 3, "reap: nothing to do"
    NOT_ALL_REAPED = 4, "reap: GPU memory the plan named is still held"
    REFUSED_SERVICE = 5, "reap: none held, but a finding was refused as a service's"
    NO_PERMISSION = 77, "reap: the audit log cannot be written (sysexits' EX_NOPERM)"
    # doctor
    DOCTOR_WARNINGS = 3, "doctor: at least one warning, no failure"
    DOCTOR_FAILURES = 4, "doctor: at least one failure"
    # daemon
    ALREADY_RUNNING = EXIT_ALREADY_RUNNING, "daemon: another daemon runs on the runtime directory"
    UNSAFE_DIRECTORY = EXIT_UNSAFE_DIRECTORY, "daemon: a directory another user can write"
    # run
    GPU_HELD = EXIT_GPU_HELD, "run: the job ended, its GPU memory was not released"
    NOT_EXECUTABLE = EXIT_NOT_EXECUTABLE, "run: the command could not be run"
    NOT_FOUND = EXIT_NOT_FOUND, "run: the command was not found"
    # top, demo, run: stopped by a signal (128+N, as a shell reports it)
    INTERRUPTED = 130, "stopped by Ctrl+C (SIGINT)"


class CommandError(Exception):
    """A command that cannot go on: `message` is written to stderr as it is, and `main` exits
    with `code`."""

    def __init__(self, message: str, code: ExitCode) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
