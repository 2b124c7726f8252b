"""`gpuwatch run`: launch a job so that its end (Ctrl+C, a crash, a finished trainer) leaves
nothing behind. Its command line is gpuwatch.app.run's.

The supervisor owns the job's whole process tree:
- it is a child subreaper, so every process of the job, one that double-forks or calls setsid()
  included, is its descendant until the end; where it may, it also puts the job in a cgroup of its
  own (gpuwatch.actions.cgroup), which nothing can leave;
- it starts COMMAND as the leader of a new process group, with `GPUWATCH_RUN_ID` and
  `GPUWATCH_RUN_SUPERVISOR` (its PID and start time) in the environment every process of the job
  inherits: the daemon shows the job as `run:<id>`, and flags at once what outlives the
  supervisor;
- the first SIGINT, SIGTERM or SIGHUP is forwarded to every process of the job; whatever still
  runs `--grace` seconds later gets SIGTERM, then SIGKILL (gpuwatch.actions.signals: identity
  checked before every signal); a second stop signal ends everything at once;
- when COMMAND exits, whatever of the job still runs is a leftover: listed, given `--grace`
  seconds, then ended, unless `--keep-helpers`;
- it collects every zombie that comes its way, then reads NVML to prove the job's GPU memory was
  released, prints a summary (and `--json FILE` writes it) and exits with the shell's status for
  how the job ended, or EXIT_GPU_HELD when GPU memory was not released.

It sleeps in select() between events (signals, children exiting, the grace running out): idle, it
costs nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any, Callable, Optional

from gpuwatch.actions.cgroup import CgroupUnavailable, JobCgroup
from gpuwatch.actions.signals import OTHER, SAME, ZOMBIE, ProcessRef, Signaller
from gpuwatch.launch_env import (
    AGENT_BOOTSTRAP_DIR,
    AGENT_KEY,
    DEFAULT_GRACE,
    EXIT_GPU_HELD,
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    RUN_ID_KEY,
    RUN_SUPERVISOR_KEY,
)
from gpuwatch.run_result import GpuCheck, Member, ProcessIdentity, RunResult
from gpuwatch.sources.kernel_files import read_head
from gpuwatch.sources.nvml import NvmlSource
from gpuwatch.sources.proc_static import CMDLINE_BYTES, CMDLINE_CUT
from gpuwatch.sources.processes import ProcessSource, ProcStat
from gpuwatch.subreaper import become_subreaper, exited_children
from gpuwatch.units import human_bytes, plural, short_command
from gpuwatch.vocabulary import ProcState

#: Variables every process of the job inherits: the job's id, and the supervisor's identity
#: (what the daemon reads: gpuwatch.sources.jobs).
RUN_ID_VARIABLE = RUN_ID_KEY
SUPERVISOR_VARIABLE = RUN_SUPERVISOR_KEY

#: After the grace, SIGTERM; this long later, SIGKILL. The job has had `grace` seconds since the
#: first signal: SIGTERM is a last word, not a second grace.
KILL_AFTER = 0.5
#: Unattributed memory that appears on the job's GPUs during the run and stays after it: more than
#: a driver's own fluctuation.
UNATTRIBUTED_SLACK = 256 << 20

#: How often NVML is read while the job runs, to know which of its processes hold GPU memory
#: before they end (a trainer that exits by itself is gone by the time anyone asks).
GPU_SAMPLE = 5.0

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
#: The job runs in a process group of its own, so the terminal's job control reaches the
#: supervisor only: Ctrl+Z (SIGTSTP) is passed on to the job before the supervisor stops, and
#: `fg`/`bg` (SIGCONT) after it continues.
JOB_CONTROL = (signal.SIGTSTP, signal.SIGCONT)
#: After the last SIGKILL, how long what is left may take to go before it is given up on (a
#: process in uninterruptible sleep in a driver cannot be ended by any signal).
GIVE_UP_AFTER = 5.0
_TICK = 0.2
#: Guards the walk up a process's parents against a corrupt or cyclic chain.
_MAX_DEPTH = 64


class Supervisor:
    """Runs one job to its end and ends what it leaves (see the module's docstring)."""

    def __init__(self, command: Sequence[str], job_id: str, grace: float = DEFAULT_GRACE,
                 keep_helpers: bool = False, use_cgroup: bool = True,
                 out: Any = sys.stderr, agent: bool = True) -> None:
        self.command = list(command)
        self.job_id = job_id
        self.grace = grace
        self.keep_helpers = keep_helpers
        self.use_cgroup = use_cgroup
        self.agent = agent
        self.out = out
        self._procs = ProcessSource()
        self._signals = Signaller(self._procs)
        #: The job's processes by PID; `_past` keeps those whose PID was given to a new process.
        self._members: dict[int, Member] = {}
        self._past: list[Member] = []
        self._pending: list[int] = []
        self._nvml: Optional[NvmlSource] = None
        self._cgroup: Optional[JobCgroup] = None
        self._main_pid = 0
        self._main_status: Optional[int] = None
        self._baseline: dict[int, Optional[int]] = {}
        #: Puts back the signal handlers the supervisor replaced, once its summary is out.
        self.restore_signals: Callable[[], object] = lambda: None

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> RunResult:
        result = RunResult(self.job_id, self.command, time.time())
        become_subreaper()
        wakeup_read, wakeup_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        previous = {s: signal.signal(s, self._on_signal)
                    for s in (*STOP_SIGNALS, *JOB_CONTROL, signal.SIGCHLD)}
        old_wakeup = signal.set_wakeup_fd(wakeup_write)
        try:
            self._prepare_cgroup(result)
            self._nvml = NvmlSource()
            reading = self._nvml.read()
            self._baseline = {g.index: g.unattributed_memory_bytes for g in reading.gpus}
            try:
                self._start(result)
            except OSError as exc:
                result.exit_code = (EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError)
                                    else EXIT_NOT_EXECUTABLE)
                self._say(f"gpuwatch run: {self.command[0]}: {exc.strerror}")
                return result
            result.started = True
            self._supervise(result, wakeup_read)
            self._check_gpus(result)
            result.exit_code = self._exit_code(result)
            return result
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for signum, handler in previous.items():
                # The job is over: a stop signal now must not cut the summary short.
                signal.signal(signum, signal.SIG_IGN if signum in STOP_SIGNALS else handler)
            self.restore_signals = lambda: [signal.signal(n, h) for n, h in previous.items()]
            os.close(wakeup_read)
            os.close(wakeup_write)
            if self._cgroup is not None:
                # Kept helpers stay in it: removing it cannot succeed, so do not wait for it.
                kept = any(m.ended is None for m in self._members.values())
                self._cgroup.remove(timeout=0.0 if kept else 5.0)
            if self._nvml is not None:
                self._nvml.close()
            result.ended_at = time.time()
            result.members = sorted([*self._past, *self._members.values()],
                                    key=lambda m: (m.ref.pid, m.ref.start_time or 0.0))

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if signum != signal.SIGCHLD:
            self._pending.append(signum)

    def _prepare_cgroup(self, result: RunResult) -> None:
        if not self.use_cgroup:
            result.cgroup_reason = "--no-cgroup given"
            return
        name = "gpuwatch-run-" + re.sub(r"[^A-Za-z0-9_.-]", "_", self.job_id)[:80]
        try:
            self._cgroup = JobCgroup.create(f"{name}-{os.getpid()}")
        except CgroupUnavailable as exc:
            result.cgroup_reason = str(exc)
            return
        result.cgroup = f"{self._cgroup.mode} {self._cgroup.path}"

    def _start(self, result: RunResult) -> None:
        # /proc/self: in a PID namespace whose /proc was not mounted anew, /proc/<getpid()> is
        # another process.
        me = self._procs.stat("self")
        env = {**os.environ, RUN_ID_VARIABLE: self.job_id,
               SUPERVISOR_VARIABLE: f"{os.getpid()}:{me.start_time!r}" if me else ""}
        agent_environment(env, self.agent)
        cgroup = self._cgroup

        def in_the_child() -> None:
            # Before exec, so that whatever the command starts is in the job from the start.
            os.setpgid(0, 0)
            if cgroup is not None:
                cgroup.join(os.getpid())

        try:
            proc = subprocess.Popen(self.command, env=env, preexec_fn=in_the_child)
        except subprocess.SubprocessError:
            if cgroup is None:
                raise
            # Made, but the command could not join it (a cgroup v2 subtree we may create in but
            # not move into): run in the tree alone, as where none can be made.
            cgroup.remove(timeout=0.0)
            self._cgroup = cgroup = None
            result.cgroup, result.cgroup_reason = None, "could not join the job's cgroup"
            proc = subprocess.Popen(self.command, env=env, preexec_fn=in_the_child)
        # Its exit status is collected here, with every other child's (os.waitpid(-1)).
        proc.returncode = 0
        self._main_pid = proc.pid
        ref = self._signals.ref(proc.pid)  # not collected yet: it is this process, however fast
        if ref is not None:
            self._members[proc.pid] = Member(_identity(ref), short_command(
                os.path.basename(self.command[0])[:15], self.command))
        self._observe()

    def _supervise(self, result: RunResult, wakeup: int) -> None:
        ending_at: Optional[float] = None  # when what still runs gets SIGTERM, then SIGKILL
        stop_signals = 0
        sample_at = time.monotonic()
        event = True  # a signal or a child's exit since the last look; the first look is one
        given_up_at: Optional[float] = None
        while True:
            if ending_at is None and time.monotonic() >= sample_at:
                self._sample_gpus()
                sample_at = time.monotonic() + GPU_SAMPLE
            if event or ending_at is not None:
                self._collect()
                while self._pending:  # popped one by one: one arriving meanwhile is kept
                    signum = self._pending.pop(0)
                    if signum in JOB_CONTROL:
                        self._job_control(signum)
                        continue
                    stop_signals += 1
                    if stop_signals == 1:
                        result.ended_by = signal.Signals(signum).name
                        self._sample_gpus()
                        sent = self._forward(signum)
                        grace_ends = time.monotonic() + self.grace
                        # Ctrl+C while leftovers have their grace: it is not started again.
                        ending_at = grace_ends if ending_at is None else min(ending_at,
                                                                              grace_ends)
                        self._say_stopping(signum, sent, ending_at - time.monotonic())
                    else:  # a second Ctrl+C: the grace is over
                        ending_at = time.monotonic()
                        self._say_ending_now(signum)
                alive = self._observe()
                main_done = self._main_status is not None
                if main_done and ending_at is None:
                    if not alive:
                        return
                    for pid in alive:
                        self._members[pid].leftover = True
                    self._sample_gpus()
                    self._say_leftovers(alive)
                    if self.keep_helpers:
                        return
                    ending_at = time.monotonic() + self.grace
                if main_done and not alive:
                    return
                if ending_at is not None and time.monotonic() >= ending_at:
                    if given_up_at is None:
                        given_up_at = time.monotonic() + GIVE_UP_AFTER
                    elif time.monotonic() >= given_up_at:
                        self._give_up(alive)
                        return
                    self._end(alive)
                    ending_at = time.monotonic() + KILL_AFTER  # for what appears meanwhile
                    continue
            wake_at = (sample_at if ending_at is None
                       else min(ending_at, time.monotonic() + _TICK))
            event = _wait(wakeup, max(0.0, wake_at - time.monotonic()))

    # -- the job's processes -------------------------------------------------------------------
    def _observe(self) -> list[int]:
        """Every live process of the job now (descendants, and the cgroup's members), each
        recorded as a member the first time it is seen; those that vanished are marked ended."""
        found = self._procs.descendants(os.getpid())
        if self._cgroup is not None:
            found |= self._cgroup.pids()
        table = {pid: stat for pid in found if (stat := self._procs.stat(pid)) is not None}
        alive = []
        for pid in sorted(table):
            stat = table[pid]
            if not _runs(stat):
                continue
            member = self._members.get(pid)
            if member is None or member.ref.start_time != stat.start_time:
                if member is not None:
                    self._close(member)
                    self._past.append(member)
                member = Member(ProcessIdentity(pid, stat.start_time),
                                self._command_of(pid, argv_required=False) or "?")
                self._members[pid] = member
            else:  # a fork seen before its exec shows the program it became
                member.command = self._command_of(pid, argv_required=True) or member.command
            member.rss_bytes = stat.rss_bytes
            alive.append(pid)
        for pid, member in self._members.items():
            if member.ended is None and pid not in alive:
                self._close(member)
        return alive

    def _close(self, member: Optional[Member]) -> None:
        if member is None or member.ended is not None:
            return
        last = member.signals[-1] if member.signals else None
        member.ended = {None: "exited", "SIGTERM": "ended on SIGTERM",
                        "SIGKILL": "killed (SIGKILL)"}.get(last, f"exited after {last}")

    def _command_of(self, pid: int, *, argv_required: bool) -> str:
        """`pid`'s command line as a summary shows it; "" if it cannot be read. A process
        exiting (its memory gone) or in the middle of an exec reads an empty command line:
        recording a member then (`argv_required` false) names it by its bracketed process name,
        `[python]`; refreshing a known member's (`argv_required` true) gives "", so that the
        command it was seen running is kept rather than replaced by that name."""
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            # At most CMDLINE_BYTES, as the daemon reads it: a summary line shows less anyway.
            raw, cut = read_head(f"/proc/{pid}/cmdline", CMDLINE_BYTES)
            argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
            if cut:
                argv.append(CMDLINE_CUT)
        except OSError:
            return ""
        if not argv and argv_required:
            return ""
        return short_command(name, argv)

    def _collect(self) -> None:
        """Collect every child that exited: as the subreaper, the job's orphans are ours too."""
        for pid, status in exited_children():
            if pid == self._main_pid:
                self._main_status = _exit_code_of(status)
                main = self._members.get(pid)
                if main is not None and self._main_status < 0 and not main.signals:
                    main.ended = f"ended by {signal.Signals(-self._main_status).name}"

    def _send(self, pid: int, signum: int, record: bool = True) -> None:
        member = self._members[pid]
        runs = self._runs(member)  # before: a zombie leader's threads, not one that just exited
        try:
            sent = self._signals.send(_ref(member), signum)
            if record and (sent == SAME or (sent == ZOMBIE and runs)):
                self._record(member, signum)
        except PermissionError:
            pass  # a setuid program of the job: it will be listed as still running

    def _runs(self, member: Member) -> bool:
        """Whether the member still runs: also a zombie leader whose other threads live on."""
        stat = self._procs.stat(member.ref.pid)
        return stat is not None and stat.start_time == member.ref.start_time and _runs(stat)

    @staticmethod
    def _record(member: Member, signum: int) -> None:
        name = signal.Signals(signum).name
        if name != "SIGKILL" or name not in member.signals:  # resent while it dies: noted once
            member.signals.append(name)

    def _forward(self, signum: int) -> list[int]:
        alive = self._observe()
        for pid in alive:
            self._send(pid, signum)
        return alive

    def _job_control(self, signum: int) -> None:
        """Ctrl+Z: stop the job, then the supervisor itself (the shell sees it stopped); `fg`:
        the supervisor was continued, so continue the job."""
        if signum == signal.SIGTSTP:
            for pid in self._observe():
                self._send(pid, signal.SIGSTOP, record=False)
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            for pid in self._observe():
                self._send(pid, signal.SIGCONT, record=False)

    def _give_up(self, alive: list[int]) -> None:
        """What SIGKILL has not ended in GIVE_UP_AFTER seconds is stuck in the kernel (state D,
        a driver call that never returns): no signal can end it, and waiting on forever would
        only hide it. It is reported, and NVML's check says whether its GPU memory is held."""
        for pid in alive:
            stat = self._procs.stat(pid)
            where = "in uninterruptible sleep" if stat and stat.state == ProcState.DISK_SLEEP else \
                "still there"
            self._members[pid].ended = f"unkillable: {where} after SIGKILL"

    def _end(self, alive: list[int]) -> None:
        """SIGTERM to what still runs, KILL_AFTER seconds for it, then SIGKILL to all of it (and
        to what it started meanwhile), until nothing of the job runs."""
        if alive:
            for pid in alive:
                self._send(pid, signal.SIGTERM)
            deadline = time.monotonic() + KILL_AFTER
            while self._observe() and time.monotonic() < deadline:
                self._collect()
                time.sleep(0.02)
        for _ in range(100):  # a fork bomb inside the job cannot keep this going forever
            self._collect()
            left = self._observe()
            if not left:
                return
            if self._cgroup is not None:
                for pid in left:  # recorded before the cgroup kills them all at once
                    if self._runs(self._members[pid]):
                        self._record(self._members[pid], signal.SIGKILL)
                if not self._cgroup.kill():
                    for pid in left:
                        self._send(pid, signal.SIGKILL)
            else:
                for pid in left:
                    self._send(pid, signal.SIGKILL)
            time.sleep(0.02)

    # -- GPU memory ----------------------------------------------------------------------------
    def _sample_gpus(self) -> None:
        """Note which of the job's processes hold how much GPU memory, while they still do.

        Only NVML's holders are looked at, never all of /proc: a holder is the job's when its
        chain of parents reaches the supervisor (a subreaper: every process of the job does).
        """
        if self._nvml is None:
            return
        reading = self._nvml.read()
        if not reading.status.available:
            return
        held: dict[int, tuple[int, set[int]]] = {}
        for g in reading.gpus:
            for u in g.processes:
                memory, gpus = held.get(u.pid, (0, set()))
                held[u.pid] = (memory + (u.memory_bytes or 0), gpus | {g.index})
        for pid, (memory, gpus) in held.items():
            member = self._members.get(pid) or self._adopt(pid)
            if member is None or member.ended is not None:
                continue
            member.gpu_memory_bytes = max(member.gpu_memory_bytes or 0, memory)
            member.gpus = tuple(sorted({*member.gpus, *gpus}))

    def _adopt(self, pid: int) -> Optional[Member]:
        """Record `pid` as a member if it is a descendant of the supervisor."""
        me, current = os.getpid(), pid
        for _ in range(_MAX_DEPTH):
            stat = self._procs.stat(current)
            if stat is None or stat.ppid <= 1:
                return None
            if stat.ppid == me:
                ref = self._signals.ref(pid)
                if ref is None:
                    return None
                member = self._members[pid] = Member(
                    _identity(ref), self._command_of(pid, argv_required=False) or "?")
                return member
            current = stat.ppid
        return None

    def _check_gpus(self, result: RunResult) -> None:
        from gpuwatch.actions.release import holders, nvml_after

        members = [*self._past, *self._members.values()]
        # Every process of the job that ended, not only those a sample saw holding memory: one
        # may take and keep memory between two samples. Kept helpers still run: not checked.
        ended = {m.ref.pid: m for m in members if m.ended is not None}
        reading = nvml_after(ended)
        check = GpuCheck(nvml=reading.status.available)
        if not check.nvml:
            check.detail = f"{reading.status.message}: cannot check that GPU memory was released"
            result.gpu = check
            return
        check.held_bytes = sum(m.gpu_memory_bytes or 0 for m in members)
        for pid in holders(reading) & ended.keys():
            if self._signals.state(_ref(ended[pid])) == OTHER:
                continue  # the PID was given to a process outside the job since
            figures = [u.memory_bytes for g in reading.gpus for u in g.processes if u.pid == pid]
            known = [f for f in figures if f is not None]
            check.still_held[pid] = sum(known) if known else None
        used_gpus = {i for m in members for i in m.gpus}
        for g in reading.gpus:
            before = self._baseline.get(g.index)
            now = g.unattributed_memory_bytes
            if (g.index in used_gpus or not used_gpus) and before is not None and now is not None \
                    and now - before > UNATTRIBUTED_SLACK:
                check.unattributed_growth[g.index] = now - before
        result.gpu = check

    # -- the end -------------------------------------------------------------------------------
    def _exit_code(self, result: RunResult) -> int:
        result.command_status = self._main_status
        if result.gpu.nvml and not result.gpu.released:
            return EXIT_GPU_HELD
        if result.ended_by != "exit":
            return 128 + int(signal.Signals[result.ended_by])
        status = self._main_status or 0
        return 128 - status if status < 0 else status

    def _say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def _say_stopping(self, signum: int, sent: list[int], wait: float) -> None:
        """At once, as systemd and docker do: what a stop signal started, and how long it may
        take, so that a quiet terminal does not read as a hang."""
        name = signal.Signals(signum).name
        again = "Ctrl+C again" if signum == signal.SIGINT else f"{name} again"
        if not sent:
            self._say(f"gpuwatch run: {name}: stopping job run:{self.job_id}")
            return
        self._say(f"gpuwatch run: {name}: stopping job run:{self.job_id}: sent {name} to "
                  f"{plural(len(sent), 'process')}, waiting up to {max(0.0, wait):.3g} s for "
                  f"them to exit; {again} to end them now")

    def _say_ending_now(self, signum: int) -> None:
        left = [pid for pid, m in self._members.items() if m.ended is None and self._runs(m)]
        self._say(f"gpuwatch run: {signal.Signals(signum).name} again: ending "
                  f"{plural(len(left), 'process')} of job run:{self.job_id} now (SIGTERM, SIGKILL "
                  f"{KILL_AFTER:g} s later)")

    def _say_leftovers(self, alive: list[int]) -> None:
        one = len(alive) == 1
        what = "kept (--keep-helpers)" if self.keep_helpers else \
            f"ended after {self.grace:g} s unless {'it exits' if one else 'they exit'}"
        self._say(f"gpuwatch run: {self.command[0]} exited; {plural(len(alive), 'process')} of "
                  f"job run:{self.job_id} still {'runs' if one else 'run'}, {what}:")
        for pid in alive:
            m = self._members[pid]
            gpu = human_bytes(m.gpu_memory_bytes) if m.gpu_memory_bytes else "-"
            self._say(f"  {pid:>7}  RSS {human_bytes(m.rss_bytes):>10}  GPU {gpu:>10}  "
                      f"{m.command}")


# -- the system ----------------------------------------------------------------------------------
def _runs(stat: ProcStat) -> bool:
    """Not exited: a zombie counts as running while other threads of it live on (its main
    thread exited, its NCCL heartbeat did not): it still holds what the process held."""
    return stat.state != ProcState.DEAD and (stat.state != ProcState.ZOMBIE or stat.threads > 1)


def _wait(wakeup: int, timeout: Optional[float]) -> bool:
    """Sleep until a signal arrives (set_wakeup_fd writes to `wakeup`) or `timeout` passes;
    whether a signal arrived."""
    readable, _, _ = select.select([wakeup], [], [], timeout)
    if readable:
        with contextlib.suppress(BlockingIOError):
            while os.read(wakeup, 512):
                pass
    return bool(readable)


def _exit_code_of(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def agent_environment(env: dict[str, str], on: bool) -> None:
    """Have every Python process of the job load the agent at start (the bootstrap directory
    first on PYTHONPATH, GPUWATCH_AGENT=auto), unless the job's environment already says
    GPUWATCH_AGENT; with `on` false (--no-agent), GPUWATCH_AGENT=0, which also turns off a
    bootstrap the environment already had (a Slurm prolog's)."""
    if not on:
        env[AGENT_KEY] = "0"
        return
    env.setdefault(AGENT_KEY, "auto")
    old = env.get("PYTHONPATH", "")
    paths = [p for p in old.split(os.pathsep) if p != AGENT_BOOTSTRAP_DIR] if old else []
    env["PYTHONPATH"] = os.pathsep.join([AGENT_BOOTSTRAP_DIR, *paths])


def job_id_for(command: Sequence[str]) -> str:
    """A job id for `command` when none is given: its program's name and a random suffix."""
    base = os.path.basename(command[0]) if command else "job"
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', base)}-{uuid.uuid4().hex[:6]}"


def _identity(ref: ProcessRef) -> ProcessIdentity:
    return ProcessIdentity(ref.pid, ref.start_time)


def _ref(member: Member) -> ProcessRef:
    """The member's process, to be signalled (identity checked) or asked after."""
    return ProcessRef(member.ref.pid, member.ref.start_time)
