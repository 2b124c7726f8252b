"""A job's members as the poll finds them: real processes forked, reaped, left as zombies and
orphaned under a real launcher, read through the real /proc. The poll that keeps what it found
last (and looks only at the PIDs handed out since) must find what a fresh walk of the job's
tree finds, at every step, without walking the tree again."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from gpuwatch.jobs.walker import DEAD_PIDS_PER_LIVE, MAX_NEW_PIDS, JobWalker, _parents
from gpuwatch.model import GpuDevice, GpuProcessUsage, NodeSnapshot, NvmlReading, NvmlStatus
from gpuwatch.poll import Poller
from gpuwatch.simulate.demo import wait_for
from tests.realprocs import EMPTY_COMMAND_LINE
from tests.scenarios import parent, wait_not_running

# Makes this process read in /proc as one in the middle of an exec does (its command line and
# environment empty: see EMPTY_COMMAND_LINE); then it prints its PID and sleeps. Where prctl is
# refused it prints the negated errno and exits.
MID_EXEC = EMPTY_COMMAND_LINE + r"""
import time
errno = empty_command_line()
if errno:
    print(-errno, flush=True)
    raise SystemExit(1)
print(os.getpid(), flush=True)
time.sleep(600)
"""

# Answers each command on stdin with a PID once the change it asks for is done.
_LAUNCHER = r"""
import os, subprocess, sys
MID_EXEC = sys.argv[1]
kids = {}
def started(argv):
    p = subprocess.Popen(argv, stdout=subprocess.PIPE)
    kids[p.pid] = p
    return p
for line in sys.stdin:
    what, *arg = line.split()
    if what == "spawn":  # a child
        pid = started(["sleep", "600"]).pid
    elif what == "grand":  # a child with a child of its own (its PID answered)
        p = started([sys.executable, "-c",
                     "import subprocess, sys; c = subprocess.Popen(['sleep', '600']); "
                     "print(c.pid, flush=True); c.wait()"])
        p.stdout.readline()
        pid = p.pid
    elif what == "threads":  # a child with threads (whose TIDs /proc answers for too)
        p = started([sys.executable, "-c",
                     "import threading, time; e = threading.Event(); "
                     "[threading.Thread(target=e.wait, daemon=True).start() for _ in range(3)]; "
                     "print(flush=True); time.sleep(600)"])
        p.stdout.readline()
        pid = p.pid
    elif what == "orphan":  # a grandchild whose parent exits: it leaves the tree
        p = started(["sh", "-c", "sleep 600 >/dev/null & echo $!"])
        pid = int(p.stdout.readline())
        p.wait()
    elif what == "midexec":  # a child with a child that reads as one caught in an exec
        p = started([sys.executable, "-c",
                     "import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', "
                     "sys.argv[1]], stdout=subprocess.PIPE); "
                     "print(c.stdout.readline().decode(), end='', flush=True); c.wait()",
                     MID_EXEC])
        pid = int(p.stdout.readline())
    elif what == "churn":  # short-lived children, each gone before the next starts
        for _ in range(int(arg[0])):
            subprocess.run(["true"])
        pid = started(["sleep", "600"]).pid  # and one that stays
    elif what == "zombie":  # a child that exits, not reaped
        pid = started(["true"]).pid
    elif what == "reap":  # a child killed and reaped
        pid = int(arg[0])
        kids[pid].kill()
        kids[pid].wait()
    print(pid, flush=True)
"""


class _CountingWalker(JobWalker):
    """The real walker, counting its walks of the job trees (each reads every member's children
    file)."""

    walks = 0

    def descendants(self, roots: frozenset[int]) -> set[int]:
        self.walks += 1
        return super().descendants(roots)

    def assert_kept_as_read(self, snap: NodeSnapshot) -> None:
        """What the walker keeps of the trees (changed poll by poll, not worked out again) is
        what the poll's records say of them."""
        last = self._last
        assert last is not None
        assert last.shape == self._shape(last.roots | last.members, snap.processes)
        assert last.parents == _parents(last.shape)


class _Holds:
    """An NVML that lists one process on one GPU."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def read(self) -> NvmlReading:
        usage = GpuProcessUsage(gpu_index=0, gpu_uuid=None, pid=self.pid, memory_bytes=1 << 30)
        return NvmlReading(status=NvmlStatus(available=True),
                           gpus=(GpuDevice(index=0, processes=(usage,)),))

    def close(self) -> None:
        pass


class _Launcher:
    def __init__(self) -> None:
        # A run id of its own, so the job is this launcher's tree and not the test run's.
        env = {**os.environ, "TORCHELASTIC_RUN_ID": f"members-{uuid.uuid4().hex[:8]}"}
        self.proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, MID_EXEC],
                                     stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.started: list[int] = []

    def ask(self, command: str) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        pid = int(self.proc.stdout.readline())
        self.started.append(pid)
        return pid

    def end(self) -> None:
        self.started += _tree(self.proc.pid)
        for pid in self.started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.kill()
        self.proc.wait()
        wait_not_running(self.started, 10)


@pytest.fixture
def launcher() -> Iterator[_Launcher]:
    job = _Launcher()
    try:
        yield job
    finally:
        job.end()


def _tree(root: int) -> set[int]:
    """Every process under `root`, walked afresh through the children files."""
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        for tid in os.listdir(f"/proc/{pid}/task") if os.path.exists(f"/proc/{pid}") else []:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids = {int(c) for c in f.read().split()}
            except OSError:
                continue
            todo.extend(kids - found)
            found |= kids
    return found


def _last_pid() -> int:
    with open("/proc/loadavg") as f:
        return int(f.read().split()[-1])


def _members(snap: NodeSnapshot, root: int) -> set[int]:
    return {pid for pid, r in snap.job_roots.items() if r == root and pid != root}


def test_a_job_tree_that_changes_is_followed_without_walking_it_again(
        launcher: _Launcher) -> None:
    holder = launcher.ask("spawn")
    poller = Poller(nvml=_Holds(holder), hostname="n")  # type: ignore[arg-type]
    walker = poller.job_walker = _CountingWalker(poller.processes)
    root = launcher.proc.pid
    mark = _last_pid()
    snap = poller.poll()
    assert snap.job_roots[holder] == root, "the launcher is the job's root"
    assert _members(snap, root) == _tree(root) == {holder}

    orphaned = []
    for step in ["spawn", "grand", "threads", "spawn", "zombie", "orphan", "reap", "spawn",
                 "reap", "grand", "reap", "threads"]:
        if step == "reap":
            victim = next(p for p in sorted(_tree(root)) if p != holder and parent(p) == root)
            # Its children (a "grand" step's) are orphaned by the reap: the fixture ends them.
            launcher.started += _tree(victim)
            launcher.ask(f"reap {victim}")
        elif step == "orphan":
            orphaned.append(launcher.ask(step))
            wait_for("the orphan to leave the tree",
                     lambda: orphaned[-1] not in _tree(root) or None, 10)
        else:
            launcher.ask(step)
        # The poller walks when more PIDs were handed out since its last poll than a walk
        # costs (a busy host): counted from before that poll to after this one.
        before, walked, mark = mark, walker.walks, _last_pid()
        snap = poller.poll()
        fresh = Poller(nvml=_Holds(holder), hostname="n").poll()  # type: ignore[arg-type]
        truth = _tree(root)
        assert _members(snap, root) == _members(fresh, root) == truth, step
        assert set(snap.processes) == set(fresh.processes), step
        assert not set(orphaned) & set(snap.processes), "an orphan left the job's tree"
        walker.assert_kept_as_read(snap)
        if _last_pid() - before <= MAX_NEW_PIDS:  # else the host was too busy to look: walked
            assert walker.walks == walked, f"{step}: the tree was walked again"


def test_a_job_starting_hundreds_of_short_lived_processes_between_polls_is_not_walked_again(
        launcher: _Launcher) -> None:
    """Churn inside a job (a rank running `true` in a loop, hundreds a second): the PIDs handed
    out since the last poll are mostly of processes gone already, each a failed open, and the
    one that stays is found among them without reading every member's children again."""
    holder = launcher.ask("spawn")
    poller = Poller(nvml=_Holds(holder), hostname="n")  # type: ignore[arg-type]
    walker = poller.job_walker = _CountingWalker(poller.processes)
    root = launcher.proc.pid
    poller.poll()
    for _ in range(3):
        before, walked = _last_pid(), walker.walks
        stays = launcher.ask("churn 300")
        snap = poller.poll()
        assert _members(snap, root) == _tree(root), "the tree as a walk finds it"
        assert stays in snap.processes
        walker.assert_kept_as_read(snap)
        # Unless the host handed out more PIDs than are looked at before walking.
        if _last_pid() - before <= DEAD_PIDS_PER_LIVE * MAX_NEW_PIDS:
            assert walker.walks == walked, "the tree was walked again"


def test_a_member_that_was_reparented_out_of_the_tree_leaves_the_snapshot(
        launcher: _Launcher) -> None:
    """A grandchild whose parent exits goes to init (or a subreaper above the launcher)."""
    holder = launcher.ask("spawn")
    poller = Poller(nvml=_Holds(holder), hostname="n")  # type: ignore[arg-type]
    root = launcher.proc.pid
    middle = launcher.ask("grand")
    grandchild = next(iter(_tree(middle)))
    launcher.started.append(grandchild)
    assert grandchild in poller.poll().processes
    launcher.ask(f"reap {middle}")
    wait_for("the grandchild to be reparented", lambda: parent(grandchild) != middle or None, 10)
    snap = poller.poll()
    assert middle not in snap.processes and grandchild not in snap.processes
    assert _members(snap, root) == _tree(root) == {holder}


def test_a_process_caught_in_the_middle_of_an_exec_stays_in_its_parents_job(
        launcher: _Launcher) -> None:
    """A process read while it execs has no command line nor environment yet, so nothing says
    its job: it is where its parent is (a child starts with its parent's environment), and its
    parent stays in the launcher's job rather than becoming a job of its own."""
    holder = launcher.ask("spawn")
    caught = launcher.ask("midexec")
    if caught < 0:
        pytest.skip(f"prctl(PR_SET_MM_MAP) refused here: {os.strerror(-caught)}")
    middle = parent(caught)
    assert middle is not None
    launcher.started.append(middle)
    with open(f"/proc/{caught}/cmdline", "rb") as f, open(f"/proc/{caught}/environ", "rb") as g:
        assert f.read() == g.read() == b"", "reads as an exec in flight"
    root = launcher.proc.pid
    snap = Poller(nvml=_Holds(holder), hostname="n").poll()  # type: ignore[arg-type]
    assert snap.processes[caught].cmdline == ()
    assert snap.job_roots[holder] == root
    assert snap.job_roots[middle] == root, "its parent is still a member of the launcher's job"
    assert snap.job_roots[caught] == root
    assert _members(snap, root) == _tree(root)
