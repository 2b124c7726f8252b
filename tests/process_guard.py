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
EXIT_DEADLINE = 15.0


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
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _process(pid: int) -> Process | None:
    """The process, unless it is gone or only a zombie (it has ended; its parent reaps it)."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return None
    args = _read(f"/proc/{pid}/cmdline").rstrip(b"\0").replace(b"\0", b" ")
    name = stat[stat.find(b"(") + 1:stat.rfind(b")")]
    command = (args or b"[" + name + b"]").decode(errors="replace")
    return Process(pid, int(fields[19]), int(fields[1]), command[:200])


def _tagged(pid: int, tag: bytes) -> bool:
    for entry in _read(f"/proc/{pid}/environ").split(b"\0"):
        if entry.startswith(TAG_KEY.encode() + b"="):
            return tag in entry.split(b"=", 1)[1].split(_SEPARATOR.encode())
    return False


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
    that are ending have had `deadline` seconds to go."""
    known = set(before)
    end = time.monotonic() + deadline
    while True:
        extra = [p for key, p in started_by_this_run(tag).items() if key not in known]
        if not extra or time.monotonic() >= end:
            return sorted(extra, key=lambda p: p.pid)
        time.sleep(0.05)


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
