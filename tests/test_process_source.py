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
from tests.scenarios import comm, pid_namespaces


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


def _arguments_in_place(pid: int) -> bool:
    """Whether the process's exec has put its arguments in place: Popen returns as soon as the
    child has its new memory, a moment before the kernel has set where its arguments are."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return bool(f.read())


def test_ancestors_are_followed_up_to_pid_1() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wait_for("the child's arguments", lambda: _arguments_in_place(child.pid) or None, 10)
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


def test_a_process_that_execs_is_read_again_with_what_it_runs_now() -> None:
    """An exec keeps the PID and the start time, so the identity: the name and the command line
    read for it before must not stay."""
    child = subprocess.Popen(["sh", "-c", "read line; exec sleep 60"], stdin=subprocess.PIPE)
    assert child.stdin is not None
    try:
        wait_for("the shell's arguments", lambda: _arguments_in_place(child.pid) or None, 10)
        source = ProcessSource()
        before = source.read([child.pid]).processes[child.pid]
        assert before.name == "sh" and before.cmdline == ("sh", "-c", "read line; exec sleep 60")
        child.stdin.write(b"go\n")
        child.stdin.flush()
        wait_for("the exec", lambda: (comm(child.pid) == "sleep"
                 and _arguments_in_place(child.pid)) or None, 10)
        after = source.read([child.pid]).processes[child.pid]
        assert after.identity == before.identity
        assert after.name == "sleep" and after.cmdline == ("sleep", "60")
        # Exited, it keeps what it ran: a zombie has no arguments left to read.
        child.kill()
        _wait_zombie(child.pid)
        gone = source.read([child.pid]).processes[child.pid]
        assert gone.state == "zombie" and gone.cmdline == ("sleep", "60")
    finally:
        child.kill()
        child.wait()


def test_processes_with_the_same_texts_share_what_was_made_of_them() -> None:
    """A launcher's ranks read the same command line, cgroup and environment: parsed once, for
    the first of them. One that differs in any text is parsed on its own."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "SLURM_JOB_ID": "4242"}
    same = [subprocess.Popen(["sleep", "60"], env=env) for _ in range(2)]
    other = subprocess.Popen(["sleep", "60"], env={**env, "RANK": "1"})
    try:
        pids = [p.pid for p in (*same, other)]
        wait_for("the sleeps' arguments",
                 lambda: all(_arguments_in_place(pid) for pid in pids) or None, 10)
        found = ProcessSource().read(pids).processes
        first, second, third = (found[pid] for pid in pids)
        assert first.launch_env["RANK"] == "0" and third.launch_env["RANK"] == "1"
        assert first.job is not None and first.job.id == "4242"
        # The same objects: made once (a job is made afresh each time it is worked out).
        assert first.job is second.job and first.launch_env is second.launch_env
        assert third.launch_env is not first.launch_env
        assert first.cmdline == third.cmdline == ("sleep", "60")
    finally:
        for p in (*same, other):
            p.kill()
            p.wait()


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
