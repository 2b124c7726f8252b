"""Which processes this test run started, wherever they ended up.

Every process the suite starts carries the run's tag: conftest puts `TAG_KEY` in this process's
environment before anything is started, and children inherit it (a tag of an outer run is kept,
so a pytest run by a test tags its processes for both runs). A process keeps the environment it
was started with in /proc/PID/environ, whichever parent it has now, so a grandchild reparented to
PID 1 or to a subreaper, in a session of its own, is still found. A process started with an
environment built from nothing has no tag: it is found while it is a descendant of this process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

TAG_KEY = "GPUWATCH_TEST_RUN"
_SEPARATOR = ":"
# A process killed or ending as a test finishes may take a moment to go (it is exiting, or its
# parent has still to reap it): this long, on a loaded machine, before it counts as left behind.
# A run whose leftovers never end by themselves (the guard's own test, whose leaks sleep for ten
# minutes) waits less: GPUWATCH_TEST_EXIT_DEADLINE seconds.
EXIT_DEADLINE = float(os.environ.get("GPUWATCH_TEST_EXIT_DEADLINE", "15"))


def tag_this_run() -> str:
    """Add a tag of this run to the environment every process started from now on inherits."""
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    outer = os.environ.get(TAG_KEY)
    os.environ[TAG_KEY] = f"{outer}{_SEPARATOR}{tag}" if outer else tag
    return tag


@dataclass(frozen=True)
class Process:
    pid: int
    start_time: int  # clock ticks after boot: a PID reused by another process differs here
    ppid: int
    command: str

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.start_time)

    def __str__(self) -> str:
        return f"PID {self.pid} (parent {self.ppid}): {self.command}"


def _read(path: str) -> bytes:
    """The file's bytes (b"" if it cannot be read): with os.read, at half the cost of a file
    object, as the guard reads a file or two of every process on the machine twice a test."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return b""
    try:
        chunks = []
        while chunk := os.read(fd, 16384):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return b"".join(chunks)
    finally:
        os.close(fd)


#: PF_KTHREAD in /proc/PID/stat's flags: a kernel thread, which never has an environment.
_KERNEL_THREAD = 0x00200000
#: A process in the middle of execve(2) shows an empty environment for a moment (its new memory
#: is mapped, its environment not yet placed): an empty read is read again this many times, this
#: far apart, before the process counts as carrying no tag.
ENVIRON_REREADS = 5
ENVIRON_REREAD_PAUSE = 0.002


@dataclass(frozen=True)
class _Stat:
    state: bytes
    ppid: int
    flags: int
    start_time: int
    name: bytes


def _stat(pid: int) -> _Stat | None:
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    return _Stat(fields[0], int(fields[1]), int(fields[6]), int(fields[19]),
                 stat[stat.find(b"(") + 1:stat.rfind(b")")])


def _process(pid: int) -> Process | None:
    """The process, unless it is gone or only a zombie (it has ended; its parent reaps it)."""
    stat = _stat(pid)
    if stat is None or stat.state in (b"Z", b"X"):
        return None
    args = _read(f"/proc/{pid}/cmdline").rstrip(b"\0").replace(b"\0", b" ")
    command = (args or b"[" + stat.name + b"]").decode(errors="replace")
    return Process(pid, stat.start_time, stat.ppid, command[:200])


def _may_be_in_execve(pid: int) -> bool:
    """Whether an empty environment may be a process's in the middle of execve(2): not a kernel
    thread (kthreadd's child, or flagged so), not an init (parent 0), not a zombie."""
    stat = _stat(pid)
    return (stat is not None and stat.state not in (b"Z", b"X") and stat.ppid not in (0, 2)
            and not stat.flags & _KERNEL_THREAD)


def _environ(pid: int) -> bytes:
    """/proc/PID/environ; an empty one read again a few times (bounded) where the process may be
    caught in execve(2), which shows none for a moment."""
    environ = _read(f"/proc/{pid}/environ")
    if environ or not _may_be_in_execve(pid):
        return environ
    for _ in range(ENVIRON_REREADS):
        time.sleep(ENVIRON_REREAD_PAUSE)
        if environ := _read(f"/proc/{pid}/environ"):
            break
    return environ


_ENTRY = b"\0" + TAG_KEY.encode() + b"="


def _tagged(pid: int, tag: bytes) -> bool:
    environ = b"\0" + _environ(pid)
    at = environ.find(_ENTRY)  # the first, as getenv(3) finds it
    if at < 0:
        return False
    start = at + len(_ENTRY)
    stop = environ.find(b"\0", start)
    value = environ[start:] if stop < 0 else environ[start:stop]
    return tag in value.split(_SEPARATOR.encode())


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        here = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{here}/task")
        except OSError:
            continue
        for tid in tasks:
            for child in _read(f"/proc/{here}/task/{tid}/children").split():
                if int(child) not in found:
                    found.add(int(child))
                    todo.append(int(child))
    return found


def started_by_this_run(tag: str) -> dict[tuple[int, int], Process]:
    """Every running process that carries `tag`, or descends from this process."""
    me = os.getpid()
    mine = _descendants(me)
    encoded = tag.encode()
    found: dict[tuple[int, int], Process] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        if pid in mine or _tagged(pid, encoded):
            process = _process(pid)
            if process is not None:
                found[process.key] = process
    return found


def left_behind(tag: str, before: Iterable[tuple[int, int]],
                deadline: float = EXIT_DEADLINE) -> list[Process]:
    """The processes of this run that were not running at `before` and still run, once those
    that are ending have had `deadline` seconds to go. (While some are ending, only they are
    watched; the whole process list is read again once they have gone, and at the deadline.)"""
    known = set(before)
    end = time.monotonic() + deadline
    while True:
        extra = [p for key, p in started_by_this_run(tag).items() if key not in known]
        if not extra or time.monotonic() >= end:
            return sorted(extra, key=lambda p: p.pid)
        while extra and time.monotonic() < end:
            time.sleep(0.05)
            extra = [p for p in extra if (now := _process(p.pid)) is not None
                     and now.key == p.key]


def end(processes: Iterable[Process]) -> None:
    """SIGKILL each process that is still the one found (not a new one on its PID), so that one
    test's leftovers do not disturb the next."""
    processes = list(processes)
    for p in processes:
        now = _process(p.pid)
        if now is not None and now.key == p.key:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, signal.SIGKILL)
    end_by = time.monotonic() + EXIT_DEADLINE
    while time.monotonic() < end_by:
        if not any((q := _process(p.pid)) is not None and q.key == p.key for p in processes):
            return
        time.sleep(0.05)
