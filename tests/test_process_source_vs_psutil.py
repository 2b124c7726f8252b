"""The hand-written /proc reader against psutil, over every process of this machine.

psutil is what gpuwatch read /proc with before it read it by hand, and what most tools read it
with: for each process both must say the same PID, parent, state, start time, real uid, RSS,
thread count, name and command line (gpuwatch's redacted, as it always is). Among them, on
purpose: a command name holding ")" and spaces, a setproctitle title, a zombie and, where this
PID namespace shows them, kernel threads.

A process changes while it is compared (its state, its RSS) or exits: each is read by psutil,
then by gpuwatch, then by psutil again, and a field passes when gpuwatch's value is psutil's on
both sides, or lies between two that differ. A process read again up to ATTEMPTS times and still
different fails; one that vanished is skipped, and only those.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import Any, Optional

import pytest

from gpuwatch.sources.proc_static import CMDLINE_BYTES, CMDLINE_CUT
from gpuwatch.sources.processes import ProcessSource
from gpuwatch.sources.redact import redact_cmdline
from tests.test_process_source import (  # the processes the pinning tests start
    _wait_zombie,
    kernel_threads,
    titled_process,
    tricky_process,
)

psutil = pytest.importorskip("psutil")

__all__ = ["titled_process", "tricky_process"]  # fixtures, used by name

ATTEMPTS = 20
FIELDS = ("ppid", "state", "start_time", "uid", "rss_bytes", "threads", "name", "cmdline")
#: Fields that move while a process runs: gpuwatch's value may be either side's, or between.
MOVING = ("state", "rss_bytes", "threads")
#: How far /proc/PID/stat's RSS (gpuwatch's) may be from /proc/PID/statm's (psutil's). Since
#: Linux 6.2 a process's RSS is three per-CPU counters (file, anon, shmem pages); stat sums them
#: without what each CPU holds back, up to the counter batch, max(32, 2 x CPUs), per CPU and
#: counter, where statm (and status, which agrees with it) fold it in on this kernel (6.18).
#: Measured here: up to 95 pages of the bound's 192 on 2 CPUs. Any other difference fails.
_CPUS = os.sysconf("SC_NPROCESSORS_ONLN")
RSS_SLACK = 3 * max(32, 2 * _CPUS) * _CPUS * os.sysconf("SC_PAGE_SIZE")


def psutil_view(pid: int) -> Optional[dict[str, Any]]:
    """What psutil says, None when the process is gone."""
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            try:
                args = p.cmdline()
            except psutil.ZombieProcess:  # psutil will not read a zombie's (empty) arguments
                args = []
            return {
                "ppid": p.ppid(),
                "state": p.status(),
                "start_time": p.create_time(),
                "uid": p.uids().real,
                "rss_bytes": p.memory_info().rss,
                "threads": p.num_threads(),
                "name": p.name(),
                "cmdline": tuple(redact_cmdline(args)) if args else (),
                "cmdline_bytes": len("\0".join(args).encode(errors="surrogateescape")),
            }
    except psutil.NoSuchProcess:
        return None


def gpuwatch_view(source: ProcessSource, pid: int) -> Optional[dict[str, Any]]:
    p = source.read([pid]).processes[pid]
    if not p.in_procfs:
        return None
    return {"ppid": p.ppid, "state": p.state, "start_time": p.start_time, "uid": p.uid,
            "rss_bytes": p.rss_bytes, "threads": p.num_threads, "name": p.name,
            "cmdline": p.cmdline}


def agrees_cut(mine: tuple[str, ...], full: tuple[str, ...], full_bytes: int) -> bool:
    """A command line gpuwatch read to CMDLINE_BYTES and showed cut: psutil's (whole) is longer,
    and gpuwatch's is its start: the same arguments, then the one the cut fell in as far as
    read, then CMDLINE_CUT."""
    if not mine or mine[-1] != CMDLINE_CUT or full_bytes < CMDLINE_BYTES:
        return False
    read = mine[:-1]
    if not read:
        return True
    whole, partial = read[:-1], read[-1]
    return (full[:len(whole)] == whole and len(full) > len(whole)
            and full[len(whole)].startswith(partial))


def agrees(field: str, mine: Any, before: Any, after: Any) -> bool:
    if field == "start_time":  # gpuwatch keeps two decimals
        return mine is not None and abs(mine - before) < 0.01 and abs(mine - after) < 0.01
    if field == "rss_bytes":
        return mine is not None and (min(before, after) - RSS_SLACK <= mine
                                     <= max(before, after) + RSS_SLACK)
    if mine == before == after:
        return True
    if field in MOVING and before != after:
        return mine in (before, after) or (
            isinstance(mine, int) and min(before, after) <= mine <= max(before, after))
    return False


def compare(source: ProcessSource, pid: int) -> Optional[list[str]]:
    """The fields that differ at the last attempt (empty when they agree); None when the process
    vanished while it was compared."""
    differ: list[str] = []
    for _ in range(ATTEMPTS):
        before = psutil_view(pid)
        mine = gpuwatch_view(source, pid)
        after = psutil_view(pid)
        if before is None or mine is None or after is None:
            if psutil_view(pid) is None:
                return None  # gone: the only reason to skip
            continue  # gone and its PID taken, or read mid-exit: again
        if abs(before["start_time"] - after["start_time"]) >= 0.01:
            continue  # the PID was reused between the reads
        differ = [f"{f}: gpuwatch {mine[f]!r}, psutil {before[f]!r} then {after[f]!r}"
                  for f in FIELDS if not agrees(f, mine[f], before[f], after[f])
                  and not (f == "cmdline" and before[f] == after[f]
                           and agrees_cut(mine[f], before[f], before["cmdline_bytes"]))]
        if not differ:
            return []
    return differ


@pytest.fixture
def zombie() -> Iterator[int]:
    child = subprocess.Popen(["true"])
    try:
        _wait_zombie(child.pid)
        yield child.pid
    finally:
        child.wait()


def test_every_process_reads_as_psutil_reads_it(
        tricky_process: subprocess.Popen[bytes], titled_process: subprocess.Popen[bytes],
        zombie: int) -> None:
    source = ProcessSource()
    wanted = {tricky_process.pid, titled_process.pid, zombie, *kernel_threads(limit=3)}
    compared: set[int] = set()
    vanished: set[int] = set()
    failures: dict[int, list[str]] = {}
    for pid in sorted(set(psutil.pids()) | wanted):
        differ = compare(source, pid)
        if differ is None:
            vanished.add(pid)
        elif differ:
            failures[pid] = differ
        else:
            compared.add(pid)
    assert not failures, "\n".join(f"PID {pid}: {'; '.join(d)}" for pid, d in failures.items())
    assert wanted <= compared, f"not compared: {wanted - compared}"
    # Most of the machine was compared, not skipped.
    assert len(compared) > 10 * len(vanished) and os.getpid() in compared
