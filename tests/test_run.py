"""`gpuwatch run`: the supervisor run as users run it (`python -m gpuwatch run ... -- COMMAND`),
on real processes and real signals, under the fake NVML driver; what it did is read from its
`--json` summary, its stderr, /proc and the fake driver.

Every test starts the supervisor through `supervised()`, in a session of its own; however the test
ends, everything the supervisor started (its descendants, the members of its cgroup, every
process its summary lists) is killed by identity and waited for, and the job's cgroup removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuwatch.actions import supervisor
from gpuwatch.actions.cgroup import JobCgroup, supported_here
from gpuwatch.actions.signals import ProcessRef, Signaller
from gpuwatch.simulate.demo import read_json, wait_for
from gpuwatch.simulate.fakenvml import STATE_ENV, FakeNode
from gpuwatch.sources.processes import ProcessSource
from tests.daemonproc import WatchedNode, running_daemon
from tests.realprocs import EMPTY_COMMAND_LINE, GIB, gpuwatch
from tests.scenarios import (
    build_program,
    environ,
    orphan_adopter,
    parent,
    process_group,
    running,
    state,
    threads,
    wait_not_running,
)

START = 60.0
GONE = 30.0
#: How long the supervisor itself may take, beyond what a test waits for, to collect, read NVML,
#: print its summary and exit: a bound on behaviour, not a speed measurement.
SLACK = 5.0
#: What a process's end may lag the moment the supervisor's signal makes it due, on a loaded
#: machine (the kernel must schedule the signalled process and the supervisor's reaping loop):
#: a deadline's margin, not the behaviour under test (that each signal came, and when, is read
#: from the run's document).
LOADED = 6.0

#: A process of a job. argv: DIR NAME IGNORING UNTIL. It writes its PID to DIR/NAME once its
#: signal handling is in place (NAME may say {rank}: LOCAL_RANK, as a launcher sets it). If NAME is
#: in the comma-separated IGNORING it ignores SIGINT and SIGTERM (writing each to
#: DIR/NAME.signals), as a rank stuck in a collective does; else SIGINT ends it with 130 and
#: SIGTERM with 0. UNTIL: "stdin" exits 0 at the end of its standard input, "forever" never exits.
MEMBER = """\
import os, signal, sys
directory, name, ignoring, until = sys.argv[1:5]
name = name.format(rank=os.environ.get("LOCAL_RANK", ""))
def record(signum, _frame):
    with open(os.path.join(directory, name + ".signals"), "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
def stop(code):
    def handler(_signum, _frame):
        sys.exit(code)
    return handler
if name in ignoring.split(","):
    signal.signal(signal.SIGINT, record)
    signal.signal(signal.SIGTERM, record)
else:
    signal.signal(signal.SIGINT, stop(130))
    signal.signal(signal.SIGTERM, stop(0))
tmp = os.path.join(directory, "." + name)
with open(tmp, "w") as f:
    f.write(str(os.getpid()))
os.replace(tmp, os.path.join(directory, name))
if until == "stdin":
    while os.read(0, 4096):
        pass
    sys.exit(0)
while True:
    signal.pause()
"""

#: A job's command that starts one child. argv: DIR UNTIL -- CHILD... It writes the child's PID
#: to DIR/child.pid, then exits 0 at once ("now") or at the end of its standard input ("stdin"),
#: or runs until a signal ("forever"). SIGINT ends it with 130, SIGTERM with 143.
PARENT = """\
import os, signal, subprocess, sys
directory, until = sys.argv[1:3]
signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
child = subprocess.Popen(sys.argv[4:])
tmp = os.path.join(directory, ".child.pid")
with open(tmp, "w") as f:
    f.write(str(child.pid))
os.replace(tmp, os.path.join(directory, "child.pid"))
if until == "stdin":
    while os.read(0, 4096):
        pass
if until != "forever":
    sys.exit(0)
while True:
    signal.pause()
"""

#: A worker that starts a helper as a daemon does: fork, setsid() (a session and process group
#: of its own), fork again, and the middle process exits, so the helper is reparented. argv:
#: DIR -- HELPER... The worker then runs until a signal (SIGTERM: 143).
DOUBLE_FORK = """\
import os, signal, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
helper = sys.argv[3:]
middle = os.fork()
if middle == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(helper[0], helper)
    os._exit(0)
os.waitpid(middle, 0)
while True:
    signal.pause()
"""


# ---- the supervisor as a user runs it -------------------------------------------------------


def _stat_fields(pid: int) -> Optional[list[str]]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def _wait_collected(pid: int, what: str) -> None:
    """Until `pid` is gone from /proc: collected by the supervisor, not only a zombie. Every
    Python of a job under `gpuwatch run` has the agent's thread, and while exit tears it down
    the process is a zombie leader with a live thread, which the supervisor counts as running
    (a leader that exited while its NCCL heartbeat lives on holds the GPU): on a loaded machine,
    long enough for a second Ctrl+C to find it there."""
    wait_for(what, lambda: True if state(pid) is None else None, GONE)


def children_of(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and (fields := _stat_fields(int(name))) and int(fields[1]) == pid:
            out.append(int(name))
    return sorted(out)


def descendants_of(pid: int) -> list[int]:
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = children_of(todo.pop())
        found += kids
        todo += kids
    return found


def job_cgroup_of(pid: int) -> Optional[str]:
    """The `gpuwatch run` cgroup `pid` is in (its path in /proc/PID/cgroup), or None."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if (hierarchy == "0" or "pids" in controllers.split(",")) and "gpuwatch-run-" in path:
            return path
    return None


def cgroups_made_by(supervisor_pid: int, job: str) -> list[Path]:
    """Job cgroups named after job `job` and `supervisor_pid` (JobCgroup's
    `gpuwatch-run-NAME-PID`), v2 under this process's own cgroup, or v1 under pids/gpuwatch. (The
    PID alone is not enough: v1's pids/gpuwatch is the host's, and another worker's supervisor,
    in a PID namespace of its own, may have the same PID.)"""
    own = next((line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines()
                if line.startswith("0::")), "/")
    root = Path("/sys/fs/cgroup")
    parents = [root / own.lstrip("/"), root / "unified" / own.lstrip("/"),
               root / "pids" / "gpuwatch"]
    name = f"gpuwatch-run-{job}-{supervisor_pid}"
    return [p for d in parents if d.is_dir() for p in d.glob(name)]


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def test_a_job_cgroup_lists_no_pid_0_for_a_member_outside_this_pid_namespace(
        tmp_path: Path) -> None:
    """cgroup v2's cgroup.procs, read from a PID namespace, shows a member outside it as 0;
    signalling PID 0 would signal the supervisor's own process group."""
    (tmp_path / "cgroup.procs").write_text("0\n1234\n")
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "cgroup.procs").write_text("0\n5678\n")
    assert JobCgroup(tmp_path, "cgroup v2").pids() == {1234, 5678}


@dataclass
class Supervised:
    """A running `gpuwatch run` and where it writes."""

    proc: subprocess.Popen[bytes]
    json_path: Path
    stderr_path: Path
    job: str
    pids_dir: Path
    #: PIDs the test learnt of that may outlive the supervisor (kept helpers, orphans).
    others: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def command_pid(self) -> int:
        """The command's PID: the supervisor's first child."""
        return wait_for("the command to start", lambda: (children_of(self.pid) or [None])[0],
                        START, alive=self.proc)

    def pid_of(self, name: str, check_running: bool = True) -> int:
        """A PID a job process wrote to pids_dir/NAME, once it is there (and running)."""
        def probe() -> Optional[int]:
            try:
                pid = int((self.pids_dir / name).read_text())
            except (OSError, ValueError):
                return None
            return pid if running(pid) or not check_running else None
        pid = wait_for(f"{name} to start", probe, START, alive=self.proc)
        self.others.append(pid)
        return pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def result(self, timeout: float = GONE) -> tuple[int, dict[str, Any], str]:
        """Wait for the supervisor to exit: (exit status, its --json summary, its stderr)."""
        code = self.proc.wait(timeout)
        doc = read_json(self.json_path)
        assert doc is not None, f"no --json summary; stderr:\n{self.stderr()}"
        return code, doc, self.stderr()


@contextlib.contextmanager
def supervised(tmp_path: Path, env: Mapping[str, str], command: Sequence[str],
               *options: str, stdin: Any = subprocess.DEVNULL,
               pids_dir: Optional[Path] = None,
               sigint_ignored: bool = False) -> Iterator[Supervised]:
    """`python -m gpuwatch run --json FILE --job-name NAME OPTIONS -- COMMAND` in a session of
    its own (with SIGINT ignored, as `cmd &` in a script starts it, if `sigint_ignored`).

    Afterwards, however the test ended: SIGKILL to the supervisor's group, to every descendant,
    to the members of its cgroup, to every process the summary lists (by identity) and to every
    PID the test noted; waits until none runs and removes the job's cgroup."""
    tag = uuid.uuid4().hex[:8]
    job = f"test-{tag}"
    pids_dir = pids_dir or new_dir(tmp_path)
    json_path = tmp_path / f"run-{tag}.json"
    stderr_path = tmp_path / f"run-{tag}.stderr"
    with open(stderr_path, "wb") as err, open(tmp_path / f"run-{tag}.stdout", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch", "run", "--json", str(json_path),
             "--job-name", job, *options, "--", *command],
            env=dict(env), stdin=stdin, stdout=out, stderr=err, start_new_session=True,
            preexec_fn=_ignore_sigint if sigint_ignored else None)
    run = Supervised(proc, json_path, stderr_path, job, pids_dir)
    try:
        yield run
    finally:
        found = descendants_of(proc.pid)
        groups = {g for p in found if (g := process_group(p)) is not None and g > 1}
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for g in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(g, signal.SIGKILL)
        _kill([*found, *run.others])
        doc = read_json(json_path) or {}
        signaller = Signaller()
        listed = [ProcessRef(p["pid"], p["start_time"]) for p in doc.get("processes", ())]
        for ref in listed:
            with contextlib.suppress(PermissionError):
                signaller.send(ref, signal.SIGKILL)
        cgroups = cgroups_made_by(proc.pid, job)
        in_cgroups = [pid for c in cgroups for pid in JobCgroup(
            c, "cgroup v1" if "pids" in c.parts else "cgroup v2").pids()]
        _kill(in_cgroups)
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(GONE)
        wait_not_running([*found, *run.others, *in_cgroups,
                          *(r.pid for r in listed if not signaller.ended(r))],
                         what="everything the supervisor started to end")

        def removed() -> Optional[bool]:
            for c in cgroups:
                with contextlib.suppress(FileNotFoundError):
                    try:
                        c.rmdir()
                    except OSError:  # busy until its last process is reaped
                        return None
            return True

        wait_for("the job's cgroup to be removed", removed, GONE)


def members(doc: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {p["pid"]: p for p in doc["processes"]}


def line_of(text: str, pid: int) -> str:
    """The line of the final summary's table that starts with `pid`."""
    summary = text[text.index("gpuwatch run: job run:"):]
    found = [line for line in summary.splitlines() if line.split()[:1] == [str(pid)]]
    assert len(found) == 1, f"PID {pid} in:\n{text}"
    return found[0]


def gpu_used(env: Mapping[str, str]) -> list[int]:
    """Used memory of each GPU as the fake driver reports it, read as a user does."""
    result = gpuwatch(["status", "--json", "--poll"], env)
    assert result.stdout, result.stderr
    doc = json.loads(result.stdout)
    return [g["memory_used_bytes"] for g in doc["gpus"]]


def launcher(ready: Path, *args: str) -> list[str]:
    """The torchrun-like launcher (gpuwatch.simulate.job)."""
    return [sys.executable, "-m", "gpuwatch.simulate.job", "--ready", str(ready), *args]


def member(pids_dir: Path, name: str, ignoring: str = "", until: str = "forever") -> list[str]:
    """A MEMBER process (see there) writing its PID to pids_dir/NAME."""
    return [sys.executable, "-c", MEMBER, str(pids_dir), name, ignoring, until]


def new_dir(tmp_path: Path) -> Path:
    """A new directory for job processes to write their PIDs to."""
    path = tmp_path / f"pids-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    return path


def job_json(tmp_path: Path) -> Path:
    return tmp_path / f"job-{uuid.uuid4().hex[:8]}.json"


# ---- 1. Ctrl+C ------------------------------------------------------------------------------


@pytest.mark.sigint
def test_ctrl_c_ends_a_torchrun_job_and_kills_the_rank_that_ignores_it(
        tmp_path: Path, fake_node: FakeNode, cli_env: dict[str, str]) -> None:
    """Ctrl+C (SIGINT to the supervisor's process group, the terminal's foreground group) with
    four workers holding GPU memory, rank 3 ignoring SIGINT and SIGTERM: the launcher and ranks
    0-2 end on the forwarded SIGINT, rank 3 gets SIGTERM at the grace's end and SIGKILL
    KILL_AFTER later; all are gone soon after the grace, the run exits 130 and every byte of GPU
    memory is released."""
    grace = 1.5
    before = gpu_used(cli_env)
    ready = job_json(tmp_path)
    pids_dir = new_dir(tmp_path)
    workers_cmd = member(pids_dir, "rank{rank}", ignoring="rank3")
    command = launcher(ready, "--workers", "4", "--sigint-grace", "0.3", "--", *workers_cmd)
    with supervised(tmp_path, cli_env, command, "--grace", str(grace), pids_dir=pids_dir) as run:
        workers = [run.pid_of(f"rank{r}") for r in range(4)]
        info = wait_for("the launcher's ready file", lambda: read_json(ready), START,
                        alive=run.proc)
        assert sorted(info["workers"]) == sorted(workers)
        the_launcher = int(info["launcher"])
        for rank, pid in enumerate(workers):
            fake_node.hold(pid, device=rank % 2, used=(rank + 1) * GIB)
        # Seen by whoever reads NVML now, as the supervisor does on the stop signal.
        assert gpu_used(cli_env) == [before[0] + 4 * GIB, before[1] + 6 * GIB]

        sent = time.monotonic()
        os.killpg(run.pid, signal.SIGINT)
        bound = f"within grace ({grace:g} s) + {LOADED:g} s"
        wait_not_running([the_launcher, *workers[:3]], timeout=grace + LOADED,
                         what=f"the launcher and ranks 0-2 to end {bound}")
        wait_not_running([workers[3]], timeout=max(0.0, sent + grace + LOADED - time.monotonic()),
                         what=f"rank 3 to be killed {bound}")
        gone = time.monotonic() - sent
        code, doc, err = run.result(SLACK)

    assert code == 130, err
    assert doc["ended_by"] == "SIGINT" and doc["exit_code"] == 130
    assert doc["command_status"] == 130  # the launcher's own Ctrl+C exit
    assert gone >= grace + supervisor.KILL_AFTER, "rank 3 was given the grace, then KILL_AFTER"
    procs = members(doc)
    assert set(procs) == {the_launcher, *workers}
    assert procs[the_launcher]["signals"] == ["SIGINT"]
    for pid in workers[:3]:
        assert procs[pid]["signals"] == ["SIGINT"], procs[pid]
        assert procs[pid]["ended"] == "exited after SIGINT"
    stubborn = procs[workers[3]]
    assert stubborn["signals"] == ["SIGINT", "SIGTERM", "SIGKILL"]
    assert stubborn["ended"] == "killed (SIGKILL)"
    assert [p for p in procs.values() if p["ended"] == "killed (SIGKILL)"] == [stubborn]
    for rank, pid in enumerate(workers):
        assert procs[pid]["gpu_memory_bytes"] == (rank + 1) * GIB
        assert procs[pid]["gpus"] == [rank % 2]
    assert doc["gpu"]["nvml"] is True
    assert doc["gpu"]["released"] is True
    assert doc["gpu"]["held_bytes"] == 10 * GIB
    assert doc["gpu"]["still_held"] == []
    assert gpu_used(cli_env) == before
    # The summary people read names the rank that needed SIGKILL, and only that one.
    assert "killed (SIGKILL)" in line_of(err, workers[3])
    assert err.count("killed (SIGKILL)") == 1
    assert "stopped by SIGINT; exit 130" in err
    assert "GPU memory: 10.0 GiB held by the job, released" in err


# ---- 2. a helper that escapes the process group ---------------------------------------------


@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "no-cgroup"])
def test_a_double_forked_setsid_helper_is_caught_and_ended(
        tmp_path: Path, cli_env: dict[str, str], cgroup: bool) -> None:
    """A worker double-forks a helper that calls setsid(): the helper leaves the job's process
    group and session and its parent exits, so it is reparented to the supervisor (a child
    subreaper), and it stays in the job's cgroup where there is one. SIGTERM to the supervisor
    ends it with the rest, and the run exits 143."""
    if cgroup and (why := supported_here()) is not None:
        pytest.skip(f"no job cgroup can be made here: {why}")
    options = ["--grace", "1"] + ([] if cgroup else ["--no-cgroup"])
    pids_dir = new_dir(tmp_path)
    helper_cmd = member(pids_dir, "helper")
    command = [sys.executable, "-c", DOUBLE_FORK, str(pids_dir), "--", *helper_cmd]
    with supervised(tmp_path, cli_env, command, *options, pids_dir=pids_dir) as run:
        worker = run.command_pid()
        helper = run.pid_of("helper")
        wait_for("the helper to be reparented to the supervisor",
                 lambda: True if parent(helper) == run.pid else None, START)
        assert process_group(helper) != process_group(worker)
        assert os.getsid(helper) != os.getsid(worker)
        joined = job_cgroup_of(helper)
        if cgroup:
            assert joined is not None and joined == job_cgroup_of(worker)
        else:
            assert job_cgroup_of(helper) is None

        os.kill(run.pid, signal.SIGTERM)
        code, doc, err = run.result()
        assert not running(helper) and not running(worker)

    assert code == 143, err
    assert doc["ended_by"] == "SIGTERM"
    procs = members(doc)
    assert set(procs) == {worker, helper}
    assert procs[helper]["signals"] == ["SIGTERM"]
    assert procs[helper]["ended"] == "ended on SIGTERM"
    assert procs[worker]["ended"] == "ended on SIGTERM"
    if cgroup:
        assert joined is not None and doc["cgroup"].endswith(joined)
    else:
        assert doc["cgroup"] is None and doc["cgroup_reason"] == "--no-cgroup given"


# ---- 3. the trainer exits, its helpers do not -----------------------------------------------


def test_helpers_left_when_the_trainer_exits_are_ended_after_the_grace(
        tmp_path: Path, cli_env: dict[str, str]) -> None:
    """Seed 002: the workers finish (exit 0), the launcher exits with them, and its redis, actor
    and preprocessor run on. The supervisor lists all three as leftovers, gives them the grace,
    ends them with SIGTERM, and exits 0: the command's status."""
    grace = 1.5
    ready = job_json(tmp_path)
    command = launcher(ready, "--workers", "2", "--helpers", "redis,actor,preprocessor",
                       "--trainer-exit-after", "0.5", "--launcher-waits-for", "workers")
    with supervised(tmp_path, cli_env, command, "--grace", str(grace)) as run:
        info = wait_for("the job to start", lambda: read_json(ready), START, alive=run.proc)
        the_launcher = int(info["launcher"])
        helpers = {role: int(pid) for role, pid in info["helpers"].items()}
        run.others += helpers.values()
        wait_not_running([the_launcher, *info["workers"]], what="the trainer to finish")
        launcher_gone = time.monotonic()
        assert all(running(p) for p in helpers.values()), "the helpers run on"
        wait_for("the helpers to be reparented to the supervisor",
                 lambda: True if all(parent(p) == run.pid for p in helpers.values()) else None,
                 GONE)
        code, doc, err = run.result(grace + SLACK)
        ended = time.monotonic()
        assert not any(running(p) for p in helpers.values())

    assert code == 0, err
    assert ended - launcher_gone >= grace - 0.5, "the helpers were given the grace"
    assert doc["ended_by"] == "exit" and doc["command_status"] == 0 and doc["exit_code"] == 0
    procs = members(doc)
    for role, pid in helpers.items():
        assert procs[pid]["leftover"] is True, role
        assert procs[pid]["signals"] == ["SIGTERM"], role
        assert procs[pid]["ended"] == "ended on SIGTERM", role
        assert str(pid) in err.split("still run")[1].split("gpuwatch run: job")[0]
    assert [p for p, m in procs.items() if m["leftover"]] == sorted(helpers.values())
    assert "3 processes of job run:" in err
    assert f"ended after {grace:g} s unless they exit" in err


def test_keep_helpers_leaves_them_running_and_exits_at_once(
        tmp_path: Path, cli_env: dict[str, str]) -> None:
    """With --keep-helpers the leftovers are listed and left running (this test ends them), and
    the supervisor exits as soon as the command has: not after the grace (60 s here)."""
    ready = job_json(tmp_path)
    command = launcher(ready, "--workers", "1", "--helpers", "redis,actor,preprocessor",
                       "--trainer-exit-after", "0.5", "--launcher-waits-for", "workers")
    with supervised(tmp_path, cli_env, command, "--grace", "60", "--keep-helpers") as run:
        info = wait_for("the job to start", lambda: read_json(ready), START, alive=run.proc)
        helpers = sorted(int(pid) for pid in info["helpers"].values())
        run.others += helpers
        wait_not_running([int(info["launcher"]), *info["workers"]],
                         what="the trainer to finish")
        code, doc, err = run.result(SLACK)
        assert all(running(p) for p in helpers), "kept helpers still run"
        assert all(parent(p) != run.pid for p in helpers)

    assert code == 0, err
    procs = members(doc)
    assert [p for p, m in procs.items() if m["leftover"]] == helpers
    for pid in helpers:
        assert procs[pid]["signals"] == [] and procs[pid]["ended"] is None
        assert "still running (leftover)" in line_of(err, pid)
    assert "kept (--keep-helpers)" in err


# ---- 4. a zombie leader whose thread lives on -----------------------------------------------


@pytest.mark.parametrize("where", ["command", "child"])
def test_a_zombie_leader_with_a_live_thread_is_ended_and_collected(
        tmp_path: Path, fake_node: FakeNode, cli_env: dict[str, str], where: str) -> None:
    """tests/programs/zombie_leader.c: its main thread exits while a second thread lives on and
    holds GPU memory; /proc shows the leader as 'Z'. As the command, SIGTERM to the supervisor
    must reach it (exit 143); as a child of a command that exits 0, it is a leftover ended after
    the grace (exit 0). Either way it is gone and collected, and its memory released."""
    exe = str(build_program("zombie_leader", tmp_path))
    pids_dir = new_dir(tmp_path)
    command = [exe] if where == "command" else \
        [sys.executable, "-c", PARENT, str(pids_dir), "stdin", "--", exe]
    with supervised(tmp_path, cli_env, command, "--grace", "1",
                    stdin=subprocess.PIPE, pids_dir=pids_dir) as run:
        zombie = run.command_pid() if where == "command" else \
            run.pid_of("child.pid", check_running=False)
        run.others.append(zombie)
        wait_for("the zombie leader with its live thread",
                 lambda: True if state(zombie) == "Z" and threads(zombie) == 2 else None,
                 START, alive=run.proc)
        fake_node.hold(zombie, device=1, used=3 * GIB)
        assert gpu_used(cli_env)[1] == 3 * GIB
        assert run.proc.stdin is not None
        if where == "command":
            os.kill(run.pid, signal.SIGTERM)
        else:
            run.proc.stdin.close()  # the command exits 0; the zombie leader is left
        code, doc, err = run.result()
        assert state(zombie) is None, "ended and collected"

    assert code == (143 if where == "command" else 0), err
    procs = members(doc)
    z = procs[zombie]
    assert z["signals"] == ["SIGTERM"]
    assert z["ended"] == "ended on SIGTERM"
    assert z["gpu_memory_bytes"] == 3 * GIB and z["gpus"] == [1]
    assert z["leftover"] is (where == "child")
    assert doc["gpu"]["released"] is True
    assert gpu_used(cli_env)[1] == 0


# ---- 5. a child that ignores SIGTERM; a second Ctrl+C -----------------------------------------


def test_a_child_ignoring_sigterm_gets_sigkill_kill_after_the_grace(
        tmp_path: Path, cli_env: dict[str, str]) -> None:
    """SIGTERM to the supervisor: the command ends on it, its child ignores it, and the one
    after the grace; SIGKILL follows KILL_AFTER later, and not before."""
    grace = 1.0
    pids_dir = new_dir(tmp_path)
    child_cmd = member(pids_dir, "child", ignoring="child")
    command = [sys.executable, "-c", PARENT, str(pids_dir), "forever", "--", *child_cmd]
    with supervised(tmp_path, cli_env, command, "--grace", str(grace), pids_dir=pids_dir) as run:
        main = run.command_pid()
        child = run.pid_of("child")
        sent = time.monotonic()
        os.kill(run.pid, signal.SIGTERM)
        wait_not_running([child], timeout=grace + supervisor.KILL_AFTER + LOADED,
                         what="the child to be killed")
        gone = time.monotonic() - sent
        code, doc, err = run.result()

    assert gone >= grace + supervisor.KILL_AFTER, "SIGKILL came only KILL_AFTER after the grace"
    assert code == 143, err
    received = (pids_dir / "child.signals").read_text().split()
    assert received == ["SIGTERM", "SIGTERM"]  # forwarded, then at the grace's end
    procs = members(doc)
    assert procs[main]["ended"] == "ended on SIGTERM"
    assert procs[child]["signals"] == ["SIGTERM", "SIGTERM", "SIGKILL"]
    assert procs[child]["ended"] == "killed (SIGKILL)"


@pytest.mark.sigint
def test_a_second_ctrl_c_ends_everything_at_once(
        tmp_path: Path, cli_env: dict[str, str]) -> None:
    """A grace of 60 s: after the first Ctrl+C the child that ignores it runs on; the second
    Ctrl+C ends it at once (SIGTERM, SIGKILL KILL_AFTER later), and the run exits 130."""
    pids_dir = new_dir(tmp_path)
    child_cmd = member(pids_dir, "child", ignoring="child")
    command = [sys.executable, "-c", PARENT, str(pids_dir), "forever", "--", *child_cmd]
    with supervised(tmp_path, cli_env, command, "--grace", "60", pids_dir=pids_dir) as run:
        main = run.command_pid()
        child = run.pid_of("child")
        os.killpg(run.pid, signal.SIGINT)
        signals = pids_dir / "child.signals"
        wait_for("the first Ctrl+C forwarded",
                 lambda: True if signals.exists() and "SIGINT" in signals.read_text() else None,
                 START, alive=run.proc)
        _wait_collected(main, "the command to end on Ctrl+C and be collected")
        assert running(child)
        sent = time.monotonic()
        os.killpg(run.pid, signal.SIGINT)
        wait_not_running([child], timeout=supervisor.KILL_AFTER + LOADED,
                         what="the child to be ended at once on the second Ctrl+C")
        code, doc, err = run.result(SLACK)
        assert time.monotonic() - sent < 60

    assert code == 130, err
    assert doc["ended_by"] == "SIGINT"
    procs = members(doc)
    assert procs[child]["signals"] == ["SIGINT", "SIGTERM", "SIGKILL"]
    assert procs[child]["ended"] == "killed (SIGKILL)"
    assert signals.read_text().split() == ["SIGINT", "SIGTERM"]


@pytest.mark.sigint
def test_ctrl_c_says_at_once_what_the_run_waits_for_and_how_to_end_it_now(
        tmp_path: Path, cli_env: dict[str, str]) -> None:
    """A grace of 60 s: the first Ctrl+C is answered on stderr while the child that ignores it
    still runs (not 60 s later), naming the job, the processes signalled, the wait and how to
    cut it short; the second says it ends what is left now."""
    pids_dir = new_dir(tmp_path)
    child_cmd = member(pids_dir, "child", ignoring="child")
    command = [sys.executable, "-c", PARENT, str(pids_dir), "forever", "--", *child_cmd]
    with supervised(tmp_path, cli_env, command, "--grace", "60", pids_dir=pids_dir) as run:
        main = run.command_pid()
        child = run.pid_of("child")
        os.killpg(run.pid, signal.SIGINT)
        said = wait_for("the supervisor to say what it does", lambda: next(
            (line for line in run.stderr().splitlines() if "stopping job" in line), None),
            START, alive=run.proc)
        assert running(child), "said before the grace ran out"
        assert said == (f"gpuwatch run: SIGINT: stopping job run:{run.job}: sent SIGINT to 2 "
                        "processes, waiting up to 60 s for them to exit; Ctrl+C again to end "
                        "them now")
        _wait_collected(main, "the command to end on Ctrl+C and be collected")
        os.killpg(run.pid, signal.SIGINT)
        code, _, err = run.result(SLACK)
    assert code == 130, err
    assert (f"gpuwatch run: SIGINT again: ending 1 process of job run:{run.job} now (SIGTERM, "
            f"SIGKILL {supervisor.KILL_AFTER:g} s later)") in err.splitlines(), err


# ---- 6. the supervisor SIGKILLed ------------------------------------------------------------


def test_what_a_sigkilled_supervisor_leaves_keeps_running_and_the_daemon_flags_it(
        tmp_path: Path, fake_node: FakeNode, cli_env: dict[str, str]) -> None:
    """`gpuwatch run` itself SIGKILLed (the OOM killer, `kill -9`): nothing can end the job then.
    The subreaper is gone, so its children (the launcher here) are reparented to PID 1 or to the
    next child subreaper above it (`orphan_adopter()`); the workers stay the launcher's. The
    job's cgroup, where one was made, stays with them: nothing removes it. What remains keeps
    running, holding its GPU memory, and still names the dead supervisor in
    GPUWATCH_RUN_SUPERVISOR: the daemon (default configuration) flags every process of the job
    as an orphan of the gone supervisor at once, the launcher (no GPU memory) as well as its
    workers: within a few of its polls, well before `min_age` (10 s) or any grace."""
    ready = job_json(tmp_path)
    command = launcher(ready, "--workers", "2")
    with running_daemon(cli_env, tmp_path / "daemon") as daemon, \
            supervised(tmp_path, cli_env, command, "--grace", "1") as run:
        node = WatchedNode(fake_node, cli_env, daemon)
        info = wait_for("the job to start", lambda: read_json(ready), START, alive=run.proc)
        the_launcher, workers = int(info["launcher"]), [int(p) for p in info["workers"]]
        run.others += [the_launcher, *workers]
        cgroup = job_cgroup_of(the_launcher)
        for rank, pid in enumerate(workers):
            fake_node.hold(pid, device=rank, used=2 * GIB)
        node.holding(*workers)

        os.kill(run.pid, signal.SIGKILL)
        assert run.proc.wait(GONE) == -signal.SIGKILL
        wait_for("the launcher to be reparented",
                 lambda: True if parent(the_launcher) != run.pid else None, GONE)
        assert parent(the_launcher) == orphan_adopter()
        assert all(parent(w) == the_launcher for w in workers)
        assert all(running(p) for p in [the_launcher, *workers]), "what remains keeps running"
        assert job_cgroup_of(the_launcher) == cgroup
        if cgroup is not None:
            assert all(job_cgroup_of(w) == cgroup for w in workers)
            assert cgroups_made_by(run.pid, run.job), "the cgroup stays"
        assert gpu_used(cli_env) == [2 * GIB, 2 * GIB]

        found = node.findings_of("orphan", [the_launcher, *workers], timeout=START)
        for f in found.values():
            assert "gpuwatch run" in f["reason"] and str(run.pid) in f["reason"], f
        assert all(found[w]["severity"] == "critical" for w in workers)


def test_reaping_what_a_sigkilled_supervisor_left_removes_the_job_s_emptied_cgroup(
        tmp_path: Path, fake_node: FakeNode, cli_env: dict[str, str]) -> None:
    """The job of a SIGKILLed `gpuwatch run`, orphaned, is reaped by `gpuwatch reap --job`: its
    processes end, and the cgroup the supervisor made for it, empty now, goes with them."""
    if (why := supported_here()) is not None:
        pytest.skip(f"no job cgroup can be made here: {why}")
    ready = job_json(tmp_path)
    command = launcher(ready, "--workers", "2")
    with running_daemon(cli_env, tmp_path / "daemon") as daemon, \
            supervised(tmp_path, cli_env, command, "--grace", "1") as run:
        node = WatchedNode(fake_node, cli_env, daemon)
        info = wait_for("the job to start", lambda: read_json(ready), START, alive=run.proc)
        the_launcher, workers = int(info["launcher"]), [int(p) for p in info["workers"]]
        run.others += [the_launcher, *workers]
        (cgroup,) = cgroups_made_by(run.pid, run.job)
        assert job_cgroup_of(the_launcher) is not None
        for rank, pid in enumerate(workers):
            fake_node.hold(pid, device=rank, used=2 * GIB)
        node.holding(*workers)
        os.kill(run.pid, signal.SIGKILL)
        assert run.proc.wait(GONE) == -signal.SIGKILL
        node.findings_of("orphan", [the_launcher, *workers], timeout=START)
        assert cgroup.is_dir(), "the cgroup stays while its processes run"

        reaped = gpuwatch(["reap", "--job", f"run:{run.job}", "--yes", "--grace", "2"], cli_env)
        assert reaped.returncode == 0, reaped.stdout + reaped.stderr
        wait_not_running([the_launcher, *workers])
        assert not cgroup.exists(), f"{cgroup} is left behind"
        assert cgroups_made_by(run.pid, run.job) == []


def test_the_job_cgroups_of_a_process_are_read_from_its_proc_cgroup(tmp_path: Path) -> None:
    from gpuwatch.actions.cgroup import job_cgroups_of

    root, proc = tmp_path / "cgroup", tmp_path / "proc"
    (root / "unified").mkdir(parents=True)
    (root / "unified" / "cgroup.controllers").write_text("")

    def of(text: str) -> list[tuple[str, Path]]:
        (proc / "42").mkdir(parents=True, exist_ok=True)
        (proc / "42" / "cgroup").write_text(text)
        return [(c.mode, c.path) for c in job_cgroups_of(42, root, proc)]

    job = "gpuwatch-run-train-7"
    assert of(f"0::/user.slice/{job}/ranks\n4:pids:/gpuwatch/{job}\n3:memory:/{job}\n") == [
        ("cgroup v2", root / "unified" / "user.slice" / job),
        ("cgroup v1", root / "pids" / "gpuwatch" / job)]
    assert of("0::/user.slice/session-3.scope\n4:pids:/user.slice\n") == []
    assert of(f"0::/x/../{job}\n4:pids:/elsewhere/{job}\n0::{job}\n") == []
    assert job_cgroups_of(43, root, proc) == []  # exited


# ---- 7. exit codes --------------------------------------------------------------------------


@pytest.mark.parametrize(("script", "expected"), [
    ("import sys; sys.exit(3)", 3),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", 128 + signal.SIGSEGV),
    ("import sys; sys.exit(0)", 0),
], ids=["exit-3", "SIGSEGV", "exit-0"])
def test_the_exit_code_is_the_commands(tmp_path: Path, cli_env: dict[str, str], script: str,
                                       expected: int) -> None:
    with supervised(tmp_path, cli_env, [sys.executable, "-c", script]) as run:
        code, doc, err = run.result()
    assert code == expected, err
    assert doc["exit_code"] == expected and doc["ended_by"] == "exit"
    assert doc["command_status"] == (-signal.SIGSEGV if expected == 139 else expected)
    assert f"exit {expected}" in err.splitlines()[0]
    if expected == 139:
        assert "its command was ended by SIGSEGV" in err


@pytest.mark.parametrize("signum", [
    pytest.param(signal.SIGINT, marks=pytest.mark.sigint), signal.SIGTERM, signal.SIGHUP,
    signal.SIGQUIT,
], ids=["SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT"])
def test_a_stop_signal_to_the_supervisor_exits_128_plus_n(
        tmp_path: Path, cli_env: dict[str, str], signum: signal.Signals) -> None:
    pids_dir = new_dir(tmp_path)
    # A grace long enough for a starved machine: the job dies of the forwarded signal, and a
    # second SIGTERM (the grace's end) would say only that it was slow to.
    with supervised(tmp_path, cli_env, member(pids_dir, "job"), "--grace", "30",
                    pids_dir=pids_dir) as run:
        job = run.pid_of("job")
        os.kill(run.pid, signum)
        code, doc, err = run.result()
        assert not running(job)
    assert code == 128 + signum, err
    assert doc["ended_by"] == signal.Signals(signum).name
    assert members(doc)[job]["signals"] == [signal.Signals(signum).name]


@pytest.mark.sigint
def test_ctrl_z_stops_the_job_with_the_supervisor_and_fg_continues_both(
        tmp_path: Path, cli_env: dict[str, str]) -> None:
    """The job runs in a process group of its own, so the terminal's Ctrl+Z (SIGTSTP) reaches
    the supervisor alone: it stops the job, then itself; SIGCONT (`fg`) continues both."""
    pids_dir = new_dir(tmp_path)
    # A grace long enough for a starved machine: the job dies of the forwarded signal, and a
    # second SIGTERM (the grace's end) would say only that it was slow to.
    with supervised(tmp_path, cli_env, member(pids_dir, "job"), "--grace", "30",
                    pids_dir=pids_dir) as run:
        job = run.pid_of("job")
        os.kill(run.pid, signal.SIGTSTP)
        wait_for("the job and the supervisor stopped", lambda: True if state(job) == "T"
                 and state(run.pid) == "T" else None, 10)
        os.kill(run.pid, signal.SIGCONT)
        wait_for("both running again", lambda: True if state(job) != "T"
                 and state(run.pid) != "T" else None, 10)
        os.kill(run.pid, signal.SIGTERM)
        code, doc, err = run.result()
    assert code == 143, err
    assert members(doc)[job]["signals"] == ["SIGTERM"]  # job control is not a stop signal


@pytest.mark.sigint
def test_ctrl_c_works_when_the_supervisor_starts_with_sigint_ignored(
        tmp_path: Path, cli_env: dict[str, str]) -> None:
    """Started with SIGINT ignored (inherited, as `gpuwatch run ... &` in a script starts it),
    the supervisor installs its own handler: SIGINT still stops the run and reaches the job,
    whose processes get SIGINT's default disposition back at exec."""
    pids_dir = new_dir(tmp_path)
    command = [sys.executable, "-c", PARENT, str(pids_dir), "forever", "--", "sleep", "60"]
    with supervised(tmp_path, cli_env, command, "--grace", "1", pids_dir=pids_dir,
                    sigint_ignored=True) as run:
        with open(f"/proc/{run.pid}/status") as f:
            ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
        assert ignored & (1 << (signal.SIGINT - 1)), "started with SIGINT ignored"
        sleeper = run.pid_of("child.pid")
        os.killpg(run.pid, signal.SIGINT)
        code, doc, err = run.result()
        assert not running(sleeper)
    assert code == 130, err
    assert doc["ended_by"] == "SIGINT"
    assert members(doc)[sleeper]["ended"] == "exited after SIGINT"


def test_a_command_that_does_not_exist_exits_127_with_one_line(
        tmp_path: Path, cli_env: dict[str, str]) -> None:
    missing = str(tmp_path / "no-such-trainer")
    with supervised(tmp_path, cli_env, [missing, "--epochs", "3"]) as run:
        code, doc, err = run.result()
    assert code == supervisor.EXIT_NOT_FOUND == 127
    assert err.splitlines() == [f"gpuwatch run: {missing}: No such file or directory"]
    assert doc["exit_code"] == 127 and doc["processes"] == []
    assert cgroups_made_by(run.pid, run.job) == [], "the cgroup made for it is removed"


def test_a_command_that_cannot_be_run_exits_126(tmp_path: Path, cli_env: dict[str, str]
                                                ) -> None:
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    if os.access(script, os.X_OK):
        pytest.skip("root may execute any file here")
    with supervised(tmp_path, cli_env, [str(script)]) as run:
        code, _, err = run.result()
    assert code == supervisor.EXIT_NOT_EXECUTABLE, err
    assert len(err.splitlines()) == 1


# ---- 8. the job's environment ---------------------------------------------------------------


def test_every_process_of_the_job_names_its_run_and_its_supervisor(
        tmp_path: Path, cli_env: dict[str, str]) -> None:
    """GPUWATCH_RUN_ID and GPUWATCH_RUN_SUPERVISOR=<PID>:<start time> in a worker's environment
    (/proc/PID/environ), the start time as gpuwatch reads it, so the daemon can tell the
    supervisor from a process that got its PID later."""
    ready = job_json(tmp_path)
    with supervised(tmp_path, cli_env, launcher(ready, "--workers", "2"), "--grace", "1") as run:
        info = wait_for("the job to start", lambda: read_json(ready), START, alive=run.proc)
        own = ProcessSource().stat(run.pid)
        assert own is not None
        for pid in [int(info["launcher"]), *info["workers"]]:
            env = environ(pid)
            assert env[supervisor.RUN_ID_VARIABLE] == run.job
            sup_pid, _, start = env[supervisor.SUPERVISOR_VARIABLE].partition(":")
            assert int(sup_pid) == run.pid
            assert float(start) == own.start_time
        os.kill(run.pid, signal.SIGTERM)
        code, doc, err = run.result()
    assert code == 143, err
    assert doc["job"] == {"id": run.job, "source": "run"}


# ---- 9. GPU memory not released -------------------------------------------------------------


@pytest.mark.parametrize("how", [
    "command-exits", pytest.param("ctrl-c", marks=pytest.mark.sigint)])
def test_gpu_memory_still_listed_after_the_job_ended_exits_70(
        tmp_path: Path, fake_node: FakeNode, cli_env: dict[str, str], how: str) -> None:
    """A job's PID pinned as a ghost in the fake driver: NVML lists its memory after it exited,
    as a driver that failed to tear its context down does. Exit EXIT_GPU_HELD whatever the
    command's status, `released` false, `still_held` names that PID and only it.

    "command-exits": the command itself holds it and exits 0 by itself, within the
    supervisor's first GPU sample (no sample ever saw it hold memory): the end check still finds
    it. "ctrl-c": rank 0 of a torchrun-like job holds it, another rank memory that is released;
    Ctrl+C ends the job (70, not 130)."""
    pids_dir = new_dir(tmp_path)
    if how == "command-exits":
        command = member(pids_dir, "trainer", until="stdin")
    else:
        command = launcher(job_json(tmp_path), "--workers", "2", "--sigint-grace", "0.3", "--",
                           *member(pids_dir, "rank{rank}"))
    with supervised(tmp_path, cli_env, command, "--grace", "1", stdin=subprocess.PIPE,
                    pids_dir=pids_dir) as run:
        if how == "command-exits":
            ghost, released = run.pid_of("trainer"), None
        else:
            ghost, released = run.pid_of("rank0"), run.pid_of("rank1")
            fake_node.hold(released, device=1, used=1 * GIB)
        fake_node.hold(ghost, device=0, used=5 * GIB, ghost=True)
        assert run.proc.stdin is not None
        if how == "command-exits":
            run.proc.stdin.close()  # the trainer finishes: exit 0
        else:
            os.killpg(run.pid, signal.SIGINT)
        code, doc, err = run.result(supervisor_release_wait() + SLACK)
        assert not running(ghost)

    assert code == supervisor.EXIT_GPU_HELD == 70, err
    assert doc["ended_by"] == ("exit" if how == "command-exits" else "SIGINT")
    if how == "command-exits":
        assert doc["command_status"] == 0
    assert doc["gpu"]["nvml"] is True and doc["gpu"]["released"] is False
    assert doc["gpu"]["still_held"] == [{"pid": ghost, "memory_bytes": 5 * GIB}]
    assert f"GPU memory NOT released: PID {ghost} still listed by NVML (5.0 GiB)" in err
    assert len([line for line in err.splitlines() if "NOT released" in line]) == 1
    if released is not None:
        assert members(doc)[released]["gpu_memory_bytes"] == 1 * GIB
        assert gpu_used(cli_env) == [5 * GIB, 0]


def supervisor_release_wait() -> float:
    from gpuwatch.actions.release import RELEASE_WAIT

    return RELEASE_WAIT


def test_without_nvml_the_summary_says_so_and_the_exit_code_is_the_commands(
        tmp_path: Path, fake_node: FakeNode, cli_env: dict[str, str]) -> None:
    """The fake library without a state file answers as a node without a loaded driver does
    (DRIVER_NOT_LOADED), whatever driver the machine has."""
    env = {**cli_env, STATE_ENV: str(tmp_path / "no-such-state")}
    with supervised(tmp_path, env, [sys.executable, "-c", "import sys; sys.exit(3)"]) as run:
        code, doc, err = run.result()
    assert code == 3, err
    assert doc["gpu"]["nvml"] is False and doc["gpu"]["released"] is None
    assert "NVML unavailable" in doc["gpu"]["detail"]
    assert "GPU memory: NVML unavailable" in err
    assert "cannot check that GPU memory was released" in err


# ---- 10. the cgroup -------------------------------------------------------------------------


def test_the_job_runs_in_a_cgroup_of_its_own_removed_at_the_end(
        tmp_path: Path, cli_env: dict[str, str]) -> None:
    if (why := supported_here()) is not None:
        pytest.skip(f"no job cgroup can be made here: {why}")
    pids_dir = new_dir(tmp_path)
    child_cmd = member(pids_dir, "child")
    command = [sys.executable, "-c", PARENT, str(pids_dir), "stdin", "--", *child_cmd]
    with supervised(tmp_path, cli_env, command, "--grace", "0.5",
                    stdin=subprocess.PIPE, pids_dir=pids_dir) as run:
        main = run.command_pid()
        child = run.pid_of("child")
        (made,) = cgroups_made_by(run.pid, run.job)
        assert {main, child} <= {int(p) for p in (made / "cgroup.procs").read_text().split()}
        assert job_cgroup_of(child) == job_cgroup_of(main) is not None
        assert made.name == f"gpuwatch-run-{run.job}-{run.pid}"
        assert run.proc.stdin is not None
        run.proc.stdin.close()
        code, doc, err = run.result()
        assert not made.exists(), "removed at the end"

    assert code == 0, err
    mode, _, path = doc["cgroup"].rpartition(" ")
    assert mode in ("cgroup v2", "cgroup v1") and Path(path) == made
    assert doc["cgroup_reason"] is None
    assert f"cgroup: {doc['cgroup']}" in err
    assert members(doc)[child]["leftover"] is True


def test_no_cgroup_runs_on_the_tree_alone_and_says_why(
        tmp_path: Path, cli_env: dict[str, str]) -> None:
    with supervised(tmp_path, cli_env, [sys.executable, "-c", "pass"], "--no-cgroup") as run:
        code, doc, err = run.result()
        assert cgroups_made_by(run.pid, run.job) == []
    assert code == 0, err
    assert doc["cgroup"] is None and doc["cgroup_reason"] == "--no-cgroup given"
    assert "cgroup: none (--no-cgroup given); the process tree alone" in err


# ---- a leftover caught exiting ----------------------------------------------------------------

#: A helper a job leaves behind. argv: DIR LINGER. It writes its PID to DIR/helper once its signal
#: handling is in place. Asked to stop (SIGTERM or SIGINT), it first reads in /proc as a process
#: caught exiting does, its command line empty (EMPTY_COMMAND_LINE), and writes what that gave
#: (0, or prctl's errno) to DIR/emptied; it then lingers LINGER seconds and exits 0.
LINGERING_HELPER = EMPTY_COMMAND_LINE + r"""
import signal, sys, time
directory, linger = sys.argv[1], float(sys.argv[2])
def write(name, text):
    tmp = os.path.join(directory, "." + name)
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(directory, name))
def stop(_signum, _frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    write("emptied", str(empty_command_line()))
    time.sleep(linger)
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
write("helper", str(os.getpid()))
while True:
    signal.pause()
"""


def test_the_summary_names_what_a_leftover_ran_when_it_is_caught_exiting(
        tmp_path: Path, cli_env: dict[str, str]) -> None:
    """A process exiting (or in the middle of an exec) reads an empty command line. A leftover
    that lingers so after the supervisor's SIGTERM, while the supervisor looks at it every tick,
    is still named in the summary's line and the --json document by what it ran, not by its
    bracketed process name ("[python]"). How long it lingers only decides how surely a
    supervisor that took the empty command line would be caught: the supervisor looks at it
    every 0.2 s, the helper lingers 3 s."""
    linger = 3.0
    pids_dir = new_dir(tmp_path)
    script = tmp_path / "lingering_helper.py"
    script.write_text(LINGERING_HELPER)
    command = [sys.executable, "-c", PARENT, str(pids_dir), "now", "--",
               sys.executable, str(script), str(pids_dir), str(linger)]
    # A grace far longer than the test: the helper ends on the forwarded SIGTERM, not the grace.
    with supervised(tmp_path, cli_env, command, "--grace", "600", pids_dir=pids_dir) as run:
        helper = run.pid_of("helper")
        wait_for("the supervisor to list the leftover",
                 lambda: True if "still run" in run.stderr() else None, START, alive=run.proc)
        # Forwarded after the supervisor looks at the job once more: the helper has run its
        # program since it wrote its PID, so that look reads its real command line.
        os.kill(run.pid, signal.SIGTERM)

        def emptied() -> Optional[int]:
            with contextlib.suppress(OSError, ValueError):
                return int((pids_dir / "emptied").read_text())
            return None

        errno = wait_for("the helper to empty its command line", emptied, START)
        if errno:
            pytest.skip(f"prctl(PR_SET_MM_MAP) refused here: {os.strerror(errno)}")
        with contextlib.suppress(OSError):  # unless it is already gone (a loaded machine)
            assert Path(f"/proc/{helper}/cmdline").read_bytes() == b"", "it reads as exiting"
        code, doc, err = run.result(linger + GONE)

    assert code == 128 + signal.SIGTERM and doc["ended_by"] == "SIGTERM", err
    record = members(doc)[helper]
    assert record["leftover"] is True and record["signals"] == ["SIGTERM"], record
    assert record["ended"] == "ended on SIGTERM", record
    line = line_of(err, helper)
    assert "(leftover)" in line, line
    assert f"lingering_helper.py {pids_dir} {linger}" in line, err
    assert "[python" not in line, err
    assert "lingering_helper.py" in record["command"], record
