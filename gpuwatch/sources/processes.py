"""Host-process source: the processes that matter, read from /proc through psutil.

It reads only what it is asked for (GPU holders) and their ancestors up to PID 1, so a poll costs
in proportion to GPU processes, not to every process on the host. What never changes for a given
process (command line, user, cgroup, launch environment, PID namespace) is read once per identity
(PID + start time) and cached; what does (state, RSS, threads, parent) is read on every poll.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Callable, NamedTuple, Optional, TypeVar, Union

import psutil

from gpuwatch.model import GpuProcessUsage, HostProcess, Job, ProcessReading, SourceError
from gpuwatch.sources.jobs import WORKER_MARKER_KEYS, attribute_job, parse_cgroup, parse_environ
from gpuwatch.sources.redact import redact_cmdline, redact_env

T = TypeVar("T")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# /proc/PID/stat state letters, named as psutil names them.
_STATES = {b"R": "running", b"S": "sleeping", b"D": "disk-sleep", b"T": "stopped",
           b"t": "tracing-stop", b"Z": "zombie", b"X": "dead", b"x": "dead", b"K": "wake-kill",
           b"W": "waking", b"P": "parked", b"I": "idle"}
_EMPTY_ENV: Mapping[str, str] = MappingProxyType({})
# Guards the ancestor walk against a corrupt or cyclic parent chain.
_MAX_DEPTH = 64


class ProcStat(NamedTuple):
    state: str
    ppid: int
    pgid: int
    sid: int
    threads: int
    start_time: float
    rss_bytes: int


@dataclass(frozen=True)
class _Static:
    name: Optional[str]
    cmdline: tuple[str, ...]
    uid: Optional[int]
    user: Optional[str]
    cgroup: Optional[str]
    job: Optional[Job]
    launch_env: Mapping[str, str]
    namespace_pids: tuple[int, ...]
    read_errors: tuple[str, ...]


class ProcessSource:
    def __init__(self, procfs: str = "/proc") -> None:
        self._procfs = procfs
        self._boot_time = psutil.boot_time()
        self._static: dict[tuple[int, float], _Static] = {}
        self._users: dict[int, str] = {}

    def read(self, pids: Iterable[int],
             gpu_usage: Optional[Mapping[int, tuple[GpuProcessUsage, ...]]] = None,
             known: Optional[Mapping[int, HostProcess]] = None) -> ProcessReading:
        """Read `pids` and every ancestor of theirs up to PID 1, skipping those in `known`.

        The result holds `known` too, so a poll can read in several steps.
        """
        usage = gpu_usage or {}
        found: dict[int, HostProcess] = dict(known or {})
        errors: list[SourceError] = []
        for pid in sorted(set(pids)):
            current: Optional[int] = pid
            depth = 0
            while current is not None and current > 0 and current not in found:
                try:
                    proc = self._read_one(current, usage.get(current, ()))
                except (OSError, ValueError, IndexError, psutil.Error) as exc:
                    # /proc in a state nobody expected: this process is marked, the poll goes on.
                    errors.append(SourceError("procfs", f"PID {current}: {exc}"))
                    proc = HostProcess(pid=current, gpu_usage=usage.get(current, ()),
                                       read_errors=(str(exc),))
                found[current] = proc
                depth += 1
                current = proc.ppid if depth < _MAX_DEPTH else None
        for pid in usage.keys() - (known or {}).keys():
            proc = found.get(pid)
            if proc is not None and proc.in_procfs and proc.pgid and proc.pgid != pid:
                found[pid] = replace(proc, group_leader_gone=self._gone(proc.pgid, found))
        return ProcessReading(processes=MappingProxyType(found), errors=tuple(errors))

    def _gone(self, pid: int, found: Mapping[int, HostProcess]) -> bool:
        """Whether `pid` no longer runs: absent from /proc, or a zombie. Its number cannot have
        been given to another process while a group or session it led lives on."""
        seen = found.get(pid)
        if seen is not None and seen.in_procfs:
            return seen.state in ("zombie", "dead")
        now = self.stat(pid)
        return now is None or now.state in ("zombie", "dead")

    def forget_others(self, processes: Iterable[HostProcess]) -> None:
        """Drop what is cached about every identity but these (the ones still seen)."""
        keep = {p.identity for p in processes}
        for key in self._static.keys() - keep:
            del self._static[key]

    def _read_one(self, pid: int, usage: tuple[GpuProcessUsage, ...]) -> HostProcess:
        dynamic = self.stat(pid)
        if dynamic is None:
            # Absent from /proc: exited (between NVML's list and ours, or mid-read), or living in
            # another PID namespace whose PIDs NVML reports. Kept, marked, never a crash.
            return HostProcess(pid=pid, in_procfs=False, gpu_usage=usage,
                               read_errors=("not in /proc (exited, or another PID namespace)",))
        wchan, stack = self._kernel_wait(pid) if dynamic.state == "disk-sleep" else (None, ())
        key = (pid, dynamic.start_time)
        static = self._static.get(key)
        if static is None:
            try:
                static = self._read_static(psutil.Process(pid), dynamic.state)
            except psutil.NoSuchProcess:
                return HostProcess(pid=pid, in_procfs=False, gpu_usage=usage,
                                   read_errors=("exited while being read",))
            self._static[key] = static
        return HostProcess(
            pid=pid,
            ppid=dynamic.ppid,
            pgid=dynamic.pgid,
            sid=dynamic.sid,
            start_time=dynamic.start_time,
            name=static.name,
            cmdline=static.cmdline,
            user=static.user,
            uid=static.uid,
            state=dynamic.state,
            rss_bytes=dynamic.rss_bytes,
            num_threads=dynamic.threads,
            cgroup=static.cgroup,
            job=static.job,
            launch_env=static.launch_env,
            namespace_pids=static.namespace_pids,
            gpu_usage=usage,
            read_errors=static.read_errors,
            wchan=wchan,
            kernel_stack=stack,
        )

    def _kernel_wait(self, pid: int) -> tuple[Optional[str], tuple[str, ...]]:
        """Where a process in uninterruptible sleep waits: its wait channel and, where readable
        (root), its kernel stack. Read only in D state, which is rare and short, so it costs a
        poll nothing otherwise; the unkillable detector tells the GPU driver from the rest."""
        wchan = self._read_proc_text(pid, "wchan")
        frames = []
        for line in (self._read_proc_text(pid, "stack") or "").splitlines():
            # "[<0>] uvm_va_space_destroy+0x4c/0x90 [nvidia_uvm]": the symbol and its module.
            parts = line.split()
            if len(parts) >= 2:
                frames.append(" ".join([parts[1].split("+", 1)[0], *parts[2:]]))
        wchan = (wchan or "").strip()
        return (wchan if wchan not in ("", "0") else None), tuple(frames)

    def stat(self, pid: Union[int, str]) -> Optional[ProcStat]:
        """What changes between polls, from the one /proc/PID/stat line (`pid` "self": this
        process, whatever PID namespace /proc was mounted for).

        Everything that changes between polls is in this line, so a poll costs one read per
        process; psutil would open several files and re-read the boot time each time.
        """
        try:
            with open(f"{self._procfs}/{pid}/stat", "rb") as f:
                line = f.read()
        except (FileNotFoundError, ProcessLookupError):
            return None
        # The command name may hold spaces and parentheses: split after its last ')'.
        fields = line[line.rfind(b")") + 2:].split()
        return ProcStat(
            state=_STATES.get(fields[0], fields[0].decode(errors="replace")),
            ppid=int(fields[1]),
            pgid=int(fields[2]),
            sid=int(fields[3]),
            threads=int(fields[17]),
            start_time=round(self._boot_time + int(fields[19]) / _CLOCK_TICKS, 2),
            rss_bytes=int(fields[21]) * _PAGE_SIZE,
        )

    def children(self, pid: int) -> list[int]:
        """Children forked by the process's main thread (/proc/PID/task/PID/children).

        Only the main thread's list is read: one small file, where launchers (torchrun, a
        shell, multiprocessing) fork from. A child forked by another thread is still found
        when it holds GPU memory or shares the job's cgroup or id.
        """
        try:
            with open(f"{self._procfs}/{pid}/task/{pid}/children", "rb") as f:
                return [int(c) for c in f.read().split()]
        except OSError:
            return []

    def descendants(self, root: int) -> set[int]:
        """Every descendant of `root`, from the children lists of each of their threads (a
        process may fork from any thread, where `children` reads only the main thread's):
        proportional to the tree, not to the host."""
        found: set[int] = set()
        todo = [root]
        while todo:
            pid = todo.pop()
            try:
                tasks = os.listdir(f"{self._procfs}/{pid}/task")
            except OSError:
                continue
            for tid in tasks:
                try:
                    with open(f"{self._procfs}/{pid}/task/{tid}/children", "rb") as f:
                        children = f.read().split()
                except OSError:
                    continue
                for child in map(int, children):
                    if child not in found:
                        found.add(child)
                        todo.append(child)
        return found

    def _read_static(self, p: psutil.Process, state: str) -> _Static:
        errors: list[str] = []
        name = _or_none(p.name)
        cmdline: tuple[str, ...] = ()
        if state != psutil.STATUS_ZOMBIE:  # a zombie has no command line left to read
            try:
                cmdline = redact_cmdline(p.cmdline())
            except psutil.AccessDenied:
                errors.append("command line not readable")
            except psutil.NoSuchProcess:
                pass
        uid = _or_none(lambda: p.uids().real)
        cgroup_text = self._read_proc_text(p.pid, "cgroup")
        env_raw = self._read_proc_bytes(p.pid, "environ")
        if env_raw is None and state != psutil.STATUS_ZOMBIE:
            errors.append("environment not readable (other user's process; run as root)")
        cgroup = parse_cgroup(cgroup_text) if cgroup_text is not None else None
        # Redacted before anything reads it, as the command line is: nothing downstream (the
        # document, the views, the job id in metric labels) ever sees a secret in MASTER_ADDR.
        launch_env = (MappingProxyType(redact_env(parse_environ(env_raw))) if env_raw
                      else _EMPTY_ENV)
        return _Static(
            name=name,
            cmdline=cmdline,
            uid=uid,
            user=self._user(uid),
            cgroup=cgroup.path if cgroup is not None else None,
            job=attribute_job(cgroup, launch_env),
            launch_env=launch_env,
            namespace_pids=self._namespace_pids(p.pid),
            read_errors=tuple(errors),
        )

    def _namespace_pids(self, pid: int) -> tuple[int, ...]:
        """The process's PIDs inside the nested PID namespaces it lives in (a container's), from
        the NSpid line of /proc/PID/status; empty in this /proc's own namespace."""
        for line in (self._read_proc_text(pid, "status") or "").splitlines():
            if line.startswith("NSpid:"):
                try:
                    return tuple(int(field) for field in line.split()[2:])
                except ValueError:
                    return ()
        return ()

    def _user(self, uid: Optional[int]) -> Optional[str]:
        if uid is None:
            return None
        user = self._users.get(uid)
        if user is None:
            try:
                user = pwd.getpwuid(uid).pw_name
            except KeyError:  # a container's user unknown to the host's passwd
                user = str(uid)
            self._users[uid] = user
        return user

    def _read_proc_bytes(self, pid: int, name: str) -> Optional[bytes]:
        try:
            with open(f"{self._procfs}/{pid}/{name}", "rb") as f:
                return f.read()
        except OSError:
            return None

    def _read_proc_text(self, pid: int, name: str) -> Optional[str]:
        raw = self._read_proc_bytes(pid, name)
        return raw.decode(errors="replace") if raw is not None else None

    # -- without NVML -----------------------------------------------------------------------
    def discover_gpu_candidates(self) -> set[int]:
        """PIDs that look like GPU work when NVML cannot say: holders of /dev/nvidia* files, and
        processes whose environment marks them distributed-training workers.

        Walks every process, so it is for the no-NVML fallback only.
        """
        candidates: set[int] = set()
        own = os.getpid()
        for entry in os.scandir(self._procfs):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            if pid == own:
                continue
            if self._holds_nvidia_device(pid) or self._has_worker_markers(pid):
                candidates.add(pid)
        return candidates

    def _holds_nvidia_device(self, pid: int) -> bool:
        fd_dir = f"{self._procfs}/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            return False
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}").startswith("/dev/nvidia"):
                    return True
            except OSError:
                continue
        return False

    def _has_worker_markers(self, pid: int) -> bool:
        raw = self._read_proc_bytes(pid, "environ")
        if not raw:
            return False
        return any(key in WORKER_MARKER_KEYS for key in parse_environ(raw))


def _or_none(fn: Callable[[], T]) -> Optional[T]:
    """A field that may be unreadable (another user's process, a zombie); the rest still counts."""
    try:
        return fn()
    except (psutil.AccessDenied, psutil.ZombieProcess):
        return None
