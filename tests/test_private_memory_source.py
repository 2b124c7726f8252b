"""Private memory (USS, PSS) read from /proc/PID/smaps_rollup, against psutil's
memory_full_info(), over real processes: a parent holding memory and the child it forked, which
shares it. A figure passes when gpuwatch's equals psutil's read just before or just after (a
process may change between the reads). Another user's process is counted unreadable, reported
once, and the read goes on."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pytest

from gpuwatch.model import HostProcess
from gpuwatch.sources.private_memory import PrivateMemory, PrivateMemorySource, parse_rollup
from gpuwatch.sources.processes import ProcessSource
from tests.scenarios import wait_not_running

psutil = pytest.importorskip("psutil")

#: A parent that fills 32 MiB, forks a child that writes over half of it (copying those pages
#: for itself), and prints both PIDs once the child has written; both then sleep.
SHARING = r"""
import os, sys, time
data = bytearray(b"\x01") * (32 << 20)
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    for offset in range(0, 16 << 20, 4096):
        data[offset] = 2
    os.write(write, b".")
    time.sleep(600)
    os._exit(0)
os.read(read, 1)
print(os.getpid(), pid, flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def sharing_processes() -> Iterator[tuple[int, int]]:
    proc = subprocess.Popen([sys.executable, "-c", SHARING], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        yield pids[0], pids[1]
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
        wait_not_running(pids)


def record(pid: int) -> HostProcess:
    reading = ProcessSource().read([pid])
    return reading.processes[pid]


def psutil_figures(pid: int) -> tuple[int, int]:
    info = psutil.Process(pid).memory_full_info()
    return info.uss, info.pss


def mine(pid: int) -> Optional[PrivateMemory]:
    found, errors = PrivateMemorySource().read([record(pid)], now=0.0)
    assert errors == []
    return found.get(pid)


def test_uss_and_pss_read_as_psutil_reads_them_for_a_parent_and_its_forked_child() -> None:
    with sharing_processes() as (parent, child):
        for pid in (parent, child, os.getpid()):
            # This process's own figures move while it reads them: PSS with every process
            # sharing a page that starts or exits, and the suite's other workers start many.
            for _ in range(50):
                before = psutil_figures(pid)
                figures = mine(pid)
                after = psutil_figures(pid)
                assert figures is not None
                ours = (figures.uss_bytes, figures.pss_bytes)
                # Read between psutil's two reads: each figure lies between theirs (PSS moves
                # whenever a process sharing a page starts or exits, on a busy host often).
                if ours in (before, after) or all(
                        min(b, a) <= o <= max(b, a) for o, b, a in zip(ours, before, after)):
                    break
            else:
                pytest.fail(f"PID {pid}: gpuwatch {ours}, psutil {before} then {after}")
        # The child copied 16 MiB of the parent's pages: private to it now.
        child_figures = mine(child)
        assert child_figures is not None and child_figures.uss_bytes >= 16 << 20


def test_the_rollup_text_gives_uss_as_private_clean_and_dirty_and_pss() -> None:
    raw = (b"55d0c0a2a000-7ffd8f5fe000 ---p 00000000 00:00 0    [rollup]\n"
           b"Rss:              348160 kB\nPss:              201234 kB\n"
           b"Pss_Anon:         190000 kB\nShared_Clean:      10000 kB\n"
           b"Private_Clean:      1024 kB\nPrivate_Dirty:    346112 kB\n")
    assert parse_rollup(raw) == PrivateMemory((1024 + 346112) * 1024, 201234 * 1024)
    assert parse_rollup(b"Rss: 12 kB\n") is None
    assert parse_rollup(b"Private_Clean: x kB\nPrivate_Dirty: 1 kB\n") is None


def test_a_process_that_exited_is_counted_vanished_and_not_an_error() -> None:
    proc = subprocess.Popen(["sleep", "600"])
    p = record(proc.pid)
    proc.kill()
    proc.wait()
    source = PrivateMemorySource()
    found, errors = source.read([p], now=0.0)
    assert (found, errors, source.vanished, source.unreadable) == ({}, [], 1, 0)


def test_figures_are_read_again_only_once_every_seconds_have_passed() -> None:
    with sharing_processes() as (parent, _):
        source = PrivateMemorySource(every=3.0)
        p = record(parent)
        source.read([p], now=100.0)
        source.read([p], now=102.0)
        assert source.reads == 1
        found, _ = source.read([p], now=103.0)
        assert source.reads == 2 and parent in found


#: Run as another user: reads its own process and the PID given (a root process), twice.
AS_ANOTHER_USER = r"""
import os, sys
from gpuwatch.model import HostProcess
from gpuwatch.sources.private_memory import PrivateMemorySource
source = PrivateMemorySource()
procs = [HostProcess(pid=os.getpid(), start_time=1.0), HostProcess(pid=int(sys.argv[1]),
                                                                   start_time=2.0)]
found, errors = source.read(procs, now=0.0)
again, errors_again = source.read(procs, now=10.0)
print(sorted(found) == sorted(again) == [os.getpid()], source.unreadable, len(errors),
      len(errors_again), errors[0].source)
print(errors[0].message)
"""


def test_another_users_process_is_counted_unreadable_and_reported_once() -> None:
    from tests.localusers import local_user

    user = local_user("daemon")
    root = Path(__file__).resolve().parent.parent
    # (The system interpreter: this one may live where the other user cannot reach.)
    result = user.run(["/usr/bin/python3", "-c", AS_ANOTHER_USER, str(os.getpid())],
                      env={"PYTHONPATH": str(root), "PATH": os.environ.get("PATH", "")},
                      cwd="/")
    assert result.returncode == 0, result.stderr
    first, message = result.stdout.splitlines()
    assert first == "True 1 1 0 procfs"
    assert message == (f"PID {os.getpid()}: private memory (smaps_rollup) not readable "
                       "(another user's process; run as root)")


def test_one_call_walks_at_most_its_rss_budget_reading_the_longest_unread_first() -> None:
    with sharing_processes() as pids:
        first, second = sorted(pids)
        source = PrivateMemorySource(max_rss_walked=1)  # one process a call, whatever its size
        procs = [record(first), record(second)]
        found, _ = source.read(procs, now=1.0)
        assert (source.reads, set(found)) == (1, {first})
        found, _ = source.read(procs, now=2.0)  # the other one now; the first's figures kept
        assert (source.reads, set(found)) == (2, {first, second})
        source.read(procs, now=3.0)
        assert source.reads == 3 and source._last[procs[0].identity][0] == 3.0
