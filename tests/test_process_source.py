"""The host-process source against real processes: vanishing PIDs, zombies, ancestors."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pytest

from gpuwatch.model import GpuProcessUsage
from gpuwatch.simulate.demo import wait_for
from gpuwatch.sources import processes
from gpuwatch.sources.kernel_files import read_head
from gpuwatch.sources.proc_stat import (
    NUM_THREADS,
    PPID,
    RSS,
    STATE,
    is_kernel_thread,
    parse_stat,
)
from gpuwatch.sources.proc_static import CMDLINE_BYTES, CMDLINE_CUT, ENVIRON_BYTES
from gpuwatch.sources.processes import ProcessSource
from tests.realprocs import GIB, MIB, proc_without_children_files
from tests.scenarios import cmdline, comm, pid_namespaces, state


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


def _stat_line_settled(pid: int) -> bool:
    """The process sleeps, and its stat line read twice 50 ms apart is the same."""
    path = Path(f"/proc/{pid}/stat")
    before = path.read_bytes()
    time.sleep(0.05)
    return before == path.read_bytes() and state(pid) == "S"


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


def test_a_holder_whose_group_leader_exited_names_the_group_and_a_group_leader_none(
        ) -> None:
    """The group leader (a shell that started the holder in its own new group) is a zombie,
    then gone; a holder that leads its own group names none."""
    leader = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; exit 0"], stdout=subprocess.PIPE,
                              start_new_session=True)
    alive = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert leader.stdout is not None
        member = int(leader.stdout.readline())
        usage = {member: (_usage(member),), alive.pid: (_usage(alive.pid),)}
        source = ProcessSource()
        _wait_zombie(leader.pid)
        reading = source.read(usage, usage)
        assert reading.processes[member].pgid == leader.pid
        assert reading.gone_group_leaders == {leader.pid}
        leader.wait()
        assert source.read(usage, usage).gone_group_leaders == {leader.pid}
        # A holder that leads its own group: nobody else's leader to ask about.
        assert source.read([alive.pid], {alive.pid: (_usage(alive.pid),)}
                           ).gone_group_leaders == frozenset()
    finally:
        alive.kill()
        alive.wait()
        with contextlib.suppress(ProcessLookupError, NameError):
            os.kill(member, signal.SIGKILL)
        leader.wait()


def test_a_holder_whose_group_leader_runs_names_no_group() -> None:
    leader = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; read x"], stdout=subprocess.PIPE,
                              stdin=subprocess.PIPE, start_new_session=True)
    try:
        assert leader.stdout is not None
        member = int(leader.stdout.readline())
        usage = {member: (_usage(member),)}
        reading = ProcessSource().read(usage, usage)
        assert reading.processes[member].pgid == leader.pid
        assert reading.gone_group_leaders == frozenset()
    finally:
        with contextlib.suppress(ProcessLookupError, NameError):
            os.kill(member, signal.SIGKILL)
        leader.communicate(b"\n")


def _wait_zombie(pid: int) -> None:
    wait_for(f"PID {pid} to become a zombie", lambda: True if state(pid) == "Z" else None, 10)


def test_a_process_in_a_nested_pid_namespace_is_read_with_its_pid_there() -> None:
    """What a process inside a container writes down as a PID is its PID there (NSpid)."""
    if (why := pid_namespaces()) is not None:
        pytest.skip(why)
    source = ProcessSource()
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c",
                              "import time; time.sleep(60)"])
    inner: Optional[int] = None

    def running_python() -> Optional[int]:
        # unshare's child asks for SIGKILL at unshare's death (--kill-child) only after the
        # fork: until it runs the program it was asked to, killing unshare may leave it behind.
        for pid in source.children(outer.pid):
            with contextlib.suppress(OSError):
                if "import time; time.sleep(60)" in cmdline(pid):
                    return pid
        return None

    try:
        inner = wait_for("the namespace's first process", running_python, 30, alive=outer)
        procs = source.read([inner]).processes
        assert procs[inner].namespace_pids == (1,)
        assert procs[outer.pid].namespace_pids == ()
    finally:
        if inner is not None:  # the namespace's init, unshare's child: its end ends both
            os.kill(inner, signal.SIGKILL)
        outer.kill()
        outer.wait()


# -- the stat line: command names that look like fields --------------------------------------
#: Reads as "state R, parent 1" to a parser that splits at the first ")" or on spaces.
TRICKY_NAME = "x) R 1 (y z"


def test_a_stat_line_is_split_after_the_last_parenthesis_of_the_name() -> None:
    line = (b"4242 (" + TRICKY_NAME.encode() + b") S 77 4242 4242 0 -1 4194304 0 0 0 0 0 0 0 0 "
            b"20 0 3 0 123456 1000 250 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 "
            b"0 0 0 0 0 0 0 0 0 0 0\n")
    comm, fields = parse_stat(line)
    assert comm == TRICKY_NAME.encode()
    assert (fields[STATE], fields[PPID], fields[NUM_THREADS], fields[RSS]) == (
        b"S", b"77", b"3", b"250")
    assert not is_kernel_thread(fields)
    for broken in (b"", b"4242 no name here", b"4242 (cut) S 1 2"):
        with pytest.raises(ValueError):
            parse_stat(broken)


@pytest.fixture
def tricky_process(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real process whose command name (its executable's, through a link) holds ")", spaces
    and what looks like a state and a parent."""
    link = tmp_path / TRICKY_NAME
    link.symlink_to(shutil.which("sleep") or "/bin/sleep")
    child = subprocess.Popen([str(link), "60"])
    try:
        # Asleep in the kernel, too: just after its exec, `sleep` still runs for a moment
        # (loading its libraries, reading its argument), longer on a loaded machine.
        wait_for("the tricky name, asleep", lambda: (comm(child.pid) == TRICKY_NAME
                                                     and _arguments_in_place(child.pid)
                                                     and state(child.pid) == "S") or None, 30)
        yield child
    finally:
        child.kill()
        child.wait()


def test_a_command_name_with_parentheses_and_spaces_is_read_whole(
        tricky_process: subprocess.Popen[bytes]) -> None:
    pid = tricky_process.pid
    source = ProcessSource()
    p = source.read([pid]).processes[pid]
    assert p.name == TRICKY_NAME
    assert p.ppid == os.getpid() and p.state == "sleeping" and p.num_threads == 1
    assert p.cmdline[1:] == ("60",) and p.cmdline[0].endswith(TRICKY_NAME)
    stat = source.stat(pid)
    assert stat is not None and stat.ppid == os.getpid() and stat.state == "sleeping"
    assert stat.start_time == p.start_time
    from gpuwatch.doctor.privileges import _is_kernel_thread

    assert _is_kernel_thread(Path("/proc"), str(pid)) is False


# -- command lines rewritten by the process ---------------------------------------------------
TITLE = "ray::Trainer.train() rank=3"


@pytest.fixture
def titled_process() -> Iterator[subprocess.Popen[bytes]]:
    """A real process that rewrote its command line and name with setproctitle, as Ray's and
    gunicorn's workers do: the new title over the old arguments, padded with NULs."""
    pytest.importorskip("setproctitle")
    child = subprocess.Popen(
        [sys.executable, "-c", "import setproctitle, sys, time; "
         f"setproctitle.setproctitle({TITLE!r}); print(flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"\n"
        yield child
    finally:
        child.kill()
        child.wait()


def test_a_command_line_rewritten_by_setproctitle_reads_as_the_title(
        titled_process: subprocess.Popen[bytes]) -> None:
    p = ProcessSource().read([titled_process.pid]).processes[titled_process.pid]
    # The kernel keeps 15 bytes of the name; the title's first argument is the whole of it.
    assert p.name == TITLE and p.cmdline[0] == TITLE
    assert all(arg == "" for arg in p.cmdline[1:])  # the NUL padding, as psutil has it


def test_a_command_line_rewritten_with_spaces_is_split_on_them() -> None:
    """Perl's $0 (and setproctitle's older C form) writes one string with spaces and one NUL:
    split on the spaces, as psutil does (its issue 1179)."""
    perl = shutil.which("perl")
    if perl is None:
        pytest.skip("no perl on this machine")
    child = subprocess.Popen([perl, "-e", '$0 = "worker: rank 3 of 8"; $| = 1; print "\\n"; '
                              "sleep 60"], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"\n"
        p = ProcessSource().read([child.pid]).processes[child.pid]
        assert p.cmdline == ("worker:", "rank", "3", "of", "8")
    finally:
        child.kill()
        child.wait()


# -- kernel threads ---------------------------------------------------------------------------
def kernel_threads(limit: int = 5) -> list[int]:
    """Kernel threads this /proc shows (none in a PID namespace of a container's)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = parse_stat(f.read())[1]
            except (OSError, ValueError):
                continue
            if is_kernel_thread(fields):
                found.append(int(entry.name))
                if len(found) == limit:
                    break
    return found


def test_kernel_threads_read_with_their_name_and_no_command_line() -> None:
    pids = kernel_threads()
    if not pids:
        pytest.skip("no kernel thread in this PID namespace's /proc")
    reading = ProcessSource().read(pids)
    assert reading.errors == ()
    for pid in pids:
        p = reading.processes[pid]
        if not p.in_procfs:
            continue  # a worker thread the kernel stopped since
        assert p.name == comm(pid) and p.cmdline == ()
        assert p.uid == 0 and p.rss_bytes == 0 and p.ppid in (0, 2)
        assert p.job is None


# -- a kernel without children files (CONFIG_PROC_CHILDREN unset) ------------------------------
@pytest.fixture
def tree() -> Iterator[tuple[int, set[int]]]:
    """A shell with two children, one of which has a child of its own: (the shell, the rest)."""
    shell = subprocess.Popen(["sh", "-c", "sh -c 'sleep 60 & wait' & sleep 60 & wait"])
    try:
        below = wait_for("the tree", lambda: (found if len(
            found := ProcessSource().descendants(shell.pid)) == 3 else None), 10)
        yield shell.pid, below
    finally:
        for pid in ProcessSource().descendants(shell.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        shell.kill()
        shell.wait()


def test_without_children_files_children_come_from_parent_pids(
        tree: tuple[int, set[int]], tmp_path: Path) -> None:
    root, below = tree
    real = ProcessSource()
    mirror = ProcessSource(str(proc_without_children_files(tmp_path / "proc")))
    assert real.children_files is True and mirror.children_files is False
    assert mirror.descendants(root) == real.descendants(root) == below
    assert sorted(mirror.children(root)) == sorted(real.children(root))
    for pid in below:
        assert sorted(mirror.children(pid)) == sorted(real.children(pid))
    # Read through the copy, the processes are what they are through /proc.
    mine = mirror.read(below).processes
    theirs = real.read(below).processes
    for pid in below:
        assert (mine[pid].ppid, mine[pid].start_time, mine[pid].cmdline) == (
            theirs[pid].ppid, theirs[pid].start_time, theirs[pid].cmdline)
    # A poller's scan is kept until its poll is over, then made afresh.
    mirror.children(root)
    mirror.forget_others(mine.values())
    assert mirror._by_parent is None
    mirror.children(root)
    assert mirror._by_parent is not None


# -- texts another user sizes: read in part (docs/security.md, "Bytes, not entries") ----------
#: The most a command line can hold: 16 arguments of just under the kernel's 128 KiB each, about
#: 2 MiB with the environment (ARG_MAX).
LONG_ARGS = [chr(ord("a") + i) * 128_000 for i in range(16)]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _started(argv: list[str], env: Optional[dict[str, str]] = None) -> subprocess.Popen[bytes]:
    child = subprocess.Popen(argv, env=env)
    wait_for("the child's arguments", lambda: _arguments_in_place(child.pid) or None, 10)
    return child


def test_the_bounded_reader_reads_at_most_its_limit_and_says_whether_there_was_more(
        tmp_path: Path) -> None:
    path = tmp_path / "text"
    path.write_bytes(b"x" * 10_000)
    assert read_head(str(path), 4096) == (b"x" * 4096, True)
    assert read_head(str(path), 10_000) == (b"x" * 10_000, False)
    path.write_bytes(b"")
    assert read_head(str(path), 4096) == (b"", False)


def test_a_2_mib_command_line_is_read_to_4_kib_and_shown_cut() -> None:
    child = _started([*SLEEPER, "--password=hunter2", *LONG_ARGS])
    try:
        source = ProcessSource()
        snapshot = source.read([child.pid])
        p = snapshot.processes[child.pid]
        assert p.cmdline[:3] == tuple(SLEEPER[1:]) or p.cmdline[1:3] == tuple(SLEEPER[1:])
        assert p.cmdline[-1] == CMDLINE_CUT
        assert len("\0".join(p.cmdline[:-1]).encode()) <= CMDLINE_BYTES
        assert p.cmdline[-2].startswith("aaaa")  # the argument the cut fell in, as far as read
        # The redaction works on what was read: the secret before the cut is masked.
        assert "hunter2" not in " ".join(p.cmdline) and "--password=" in " ".join(p.cmdline)
        # Counted once for each process read cut: the child, and any ancestor of the test whose
        # own command line is long (a CI runner's `bash -c` script).
        cut = sum(1 for q in snapshot.processes.values() if q.cmdline[-1:] == (CMDLINE_CUT,))
        assert cut >= 1 and source.truncated["command_line"] == cut
        # Read once for the process: the next polls count nothing more.
        source.read([child.pid])
        assert source.truncated["command_line"] == cut
    finally:
        child.kill()
        child.wait()


def test_a_secret_the_cut_falls_in_is_still_redacted() -> None:
    # The cut falls 100 bytes into the token's value, well past its name.
    head = len("\0".join([sys.executable, *SLEEPER[1:]]).encode()) + 1
    token = "--api-token=" + "S3CRETs3cret" * 1000
    pad = "p" * (CMDLINE_BYTES - head - len("--api-token=") - 101)
    child = _started([*SLEEPER, pad, token])
    try:
        p = ProcessSource().read([child.pid]).processes[child.pid]
        assert p.cmdline[-1] == CMDLINE_CUT
        assert p.cmdline[-2].startswith("--api-token=")
        assert "S3CRET" not in " ".join(p.cmdline)
    finally:
        child.kill()
        child.wait()


def test_the_environment_is_read_to_32_kib_and_a_variable_the_cut_falls_in_is_left_out() -> None:
    # "RANK=3\0PAD=...\0SLURM_JOB_ID=4242\0": the cut falls after "SLURM_JOB_ID=42".
    pad = ENVIRON_BYTES - len("RANK=3\0PAD=\0SLURM_JOB_ID=42")
    child = _started(SLEEPER, env={"RANK": "3", "PAD": "x" * pad, "SLURM_JOB_ID": "4242"})
    try:
        source = ProcessSource()
        p = source.read([child.pid]).processes[child.pid]
        assert p.launch_env.get("RANK") == "3"
        assert "SLURM_JOB_ID" not in p.launch_env  # not "42": a value cut is not read at all
        assert p.job is None or p.job.id != "42"
        assert any("environment cut at 32 KiB" in e for e in p.read_errors)
        assert source.truncated["environment"] == 1
    finally:
        child.kill()
        child.wait()


def test_what_processes_with_huge_texts_leave_in_the_source_is_bounded_and_goes_with_them(
) -> None:
    """Twenty processes of 2 MiB command lines and 64 KiB environments, each its own: the source
    never holds more than its caches' bounds of them, and what it holds of the processes
    themselves goes when they do."""
    children = []
    tracemalloc.start()
    try:
        for i in range(20):
            children.append(_started([*SLEEPER, str(i), *LONG_ARGS[:15]],
                                     env={"RANK": str(i), "PAD": f"{i:02d}" * 32_768}))
        source = ProcessSource()
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        source.read([c.pid for c in children])
        held, peak = tracemalloc.get_traced_memory()
        assert held - base < 8 * MIB, "20 processes' reads kept"
        assert peak - base < 12 * MIB, "whole texts read"
        for c in children:
            c.kill()
            c.wait()
        source.forget_others(source.read([os.getpid()]).processes.values())
        after, _ = tracemalloc.get_traced_memory()
        assert after - base < 4 * MIB, "the caches are bounded in bytes"
    finally:
        tracemalloc.stop()
        for c in children:
            c.kill()
            c.wait()


def test_a_cgroup_file_is_read_to_8_kib_and_the_line_the_cut_falls_in_left_out(
        tmp_path: Path) -> None:
    """A user may nest cgroups of its own below a delegated one, as deep as it likes: the line
    whose path the cut falls in is not read, never taken as a shorter path."""
    child = _started(SLEEPER)
    try:
        pid = str(child.pid)
        proc = tmp_path / "proc"
        (proc / pid).mkdir(parents=True)
        os.symlink("/proc/stat", proc / "stat")
        for name in ("stat", "status", "cmdline", "environ"):
            os.symlink(f"/proc/{pid}/{name}", proc / pid / name)
        deep = "/system.slice/slurmstepd.scope/job_4242/step_0/user" + "/nest" * 2000
        (proc / pid / "cgroup").write_text(f"0::{deep}\n")
        source = ProcessSource(str(proc))
        p = source.read([child.pid]).processes[child.pid]
        assert p.cgroup is None and (p.job is None or p.job.id != "4242")
        assert any("cgroup cut at 8 KiB" in e for e in p.read_errors)
        assert source.truncated["cgroup"] == 1
        # A cgroup within the bound is read as it is.
        (proc / pid / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_4242/step_0\n")
        p = ProcessSource(str(proc)).read([child.pid]).processes[child.pid]
        assert p.cgroup == "/system.slice/slurmstepd.scope/job_4242/step_0"
    finally:
        child.kill()
        child.wait()


def test_a_process_whose_stat_line_did_not_change_keeps_its_record_unparsed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Most processes sleep between two polls: their stat line reads as it did, and the record
    made of it last time is theirs again, without the line being parsed. A change in the line
    (a stop), or in what NVML says the process holds, makes a new record."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        wait_for("the child's arguments", lambda: _arguments_in_place(child.pid) or None, 10)
        # Until sleep's loader has finished, its page faults and resident size still move.
        wait_for("the child asleep with a stat line that stays put",
                 lambda: _stat_line_settled(child.pid) or None, 10)
        source = ProcessSource()
        first = source.read([child.pid]).processes[child.pid]
        parsed: list[bytes] = []
        def counting(line: bytes) -> tuple[bytes, list[bytes]]:
            parsed.append(line)
            return parse_stat(line)

        monkeypatch.setattr(processes, "parse_stat", counting)
        again = source.read([child.pid]).processes[child.pid]
        assert again is first
        assert not [line for line in parsed if line.startswith(f"{child.pid} ".encode())]
        held = source.read([child.pid], {child.pid: (_usage(child.pid),)}).processes[child.pid]
        assert held is not first and held.gpu_memory_bytes == GIB
        child.send_signal(signal.SIGSTOP)
        wait_for("the stop", lambda: state(child.pid) == "T" or None, 10)
        stopped = source.read([child.pid]).processes[child.pid]
        assert stopped.state == "stopped" and not stopped.holds_gpu
        assert source.read([child.pid]).processes[child.pid] is stopped
    finally:
        child.kill()
        child.wait()
