"""The host-process source against real processes: vanishing PIDs, zombies, ancestors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpuwatch.model import GpuProcessUsage
from gpuwatch.simulate.demo import wait_for
from gpuwatch.sources.processes import ProcessSource
from tests.realprocs import GIB
from tests.scenarios import pid_namespaces


def _usage(pid: int) -> GpuProcessUsage:
    return GpuProcessUsage(gpu_index=0, gpu_uuid="GPU-x", pid=pid, memory_bytes=GIB)


def test_a_pid_that_exited_before_it_was_read_is_kept_and_marked() -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    reading = ProcessSource().read([child.pid], {child.pid: (_usage(child.pid),)})
    gone = reading.processes[child.pid]
    assert gone.in_procfs is False
    assert gone.gpu_memory_bytes == GIB  # what NVML said is not lost
    assert reading.errors == ()  # a process exiting is normal, not a source error


def test_processes_exiting_during_polls_never_break_a_poll() -> None:
    source = ProcessSource()
    for _ in range(25):
        batch = [subprocess.Popen(["sleep", "0.005"]) for _ in range(20)]
        reading = source.read([p.pid for p in batch])
        for p in batch:
            p.wait()
        assert {p.pid for p in batch} <= set(reading.processes)
        assert reading.errors == ()
    # Every one of them has exited: once a poll ends without them, nothing of theirs is cached.
    source.forget_others(source.read([os.getpid()]).processes.values())
    assert all(pid not in {p.pid for p in batch} for pid, _ in source._static)


def test_ancestors_are_followed_up_to_pid_1() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        procs = ProcessSource().read([child.pid]).processes
        assert procs[child.pid].ppid == os.getpid()
        chain, pid = [], child.pid
        while pid in procs and procs[pid].ppid:
            chain.append(pid)
            pid = procs[pid].ppid  # type: ignore[assignment]
        assert pid == 1 and os.getpid() in chain
        assert procs[child.pid].cmdline[-1] == "import time; time.sleep(60)"
        assert procs[child.pid].start_time == procs[child.pid].identity[1]
    finally:
        child.kill()
        child.wait()


def test_a_zombie_is_read_with_its_state_and_no_command_line() -> None:
    child = subprocess.Popen(["true"])
    try:
        _wait_zombie(child.pid)
        p = ProcessSource().read([child.pid]).processes[child.pid]
        assert p.state == "zombie" and p.in_procfs
        assert p.cmdline == ()
        assert p.ppid == os.getpid()
    finally:
        child.wait()


def test_identity_separates_a_reused_pid_from_the_old_process() -> None:
    source = ProcessSource()
    child = subprocess.Popen(["sleep", "60"])
    try:
        first = source.read([child.pid]).processes[child.pid]
    finally:
        child.kill()
        child.wait()
    assert source.read([child.pid]).processes[child.pid].in_procfs is False
    assert first.identity == (child.pid, first.start_time) and first.start_time is not None


def _wait_zombie(pid: int) -> None:
    from gpuwatch.simulate.demo import wait_for

    def state() -> str | None:
        with open(f"/proc/{pid}/stat") as f:
            return "Z" if f.read().rsplit(")", 1)[1].split()[0] == "Z" else None

    wait_for(f"PID {pid} to become a zombie", state, 10)


def test_a_process_in_a_nested_pid_namespace_is_read_with_its_pid_there() -> None:
    """What a process inside a container writes down as a PID is its PID there (NSpid)."""
    if (why := pid_namespaces()) is not None:
        pytest.skip(why)
    source = ProcessSource()
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c",
                              "import time; time.sleep(60)"])
    try:
        inner = wait_for("the namespace's first process",
                         lambda: (source.children(outer.pid) or [None])[0], 10)
        procs = source.read([inner]).processes
        assert procs[inner].namespace_pids == (1,)
        assert procs[outer.pid].namespace_pids == ()
    finally:
        outer.kill()
        outer.wait()
