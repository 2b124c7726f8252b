"""Host-process source: the processes that matter, read straight from /proc.

It reads only what it is asked for (GPU holders) and their ancestors up to PID 1, so a poll costs
in proportion to GPU processes, not to every process on the host. What never changes for a given
process (command line, user, cgroup, launch environment, PID namespace) is read once per identity
(PID + start time, gpuwatch.sources.proc_static) and cached; what does (state, RSS, threads,
parent) is read on every poll, from the one /proc/PID/stat line.

Reads go through os.open/os.read, not open() (whose buffered file object costs more than the
read), and a process read at every poll keeps its stat file open: a pread of an open /proc file
skips the path walk, which is most of a read. An open /proc/PID file names the process it was
opened for, never a later one on the same PID (its reads fail with ESRCH once that process is
gone), so a kept descriptor cannot confuse a reused PID with its predecessor.

What another user sets the size of is read in part, never whole (docs/security.md, "Bytes, not
entries"): a command line to CMDLINE_BYTES (the rest shown cut, as `ps` cuts it), an environment
to ENVIRON_BYTES, a cgroup file to CGROUP_BYTES; each cut is counted (`truncated`). The caches of
what was made of these texts are bounded by the bytes they keep, not by how many entries.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import NamedTuple, Optional, TypeVar, Union

from gpuwatch.frozen import build
from gpuwatch.jobs.tree import descendants
from gpuwatch.launch_env import WORKER_MARKER_KEYS
from gpuwatch.model import (
    GpuProcessUsage,
    HostProcess,
    ProcessReading,
    SourceError,
)
from gpuwatch.sources.jobs import (
    parse_environ,
)
from gpuwatch.sources.kernel_files import KeptFiles, read_file, read_head, read_or_none
from gpuwatch.sources.proc_stat import (
    ARG_START,
    NUM_THREADS,
    PGID,
    PPID,
    RSS,
    SID,
    START_TIME,
    STATE,
    is_kernel_thread,
    parse_stat,
)
from gpuwatch.sources.proc_static import ENVIRON_BYTES, Static, StaticReader
from gpuwatch.vocabulary import ProcState

T = TypeVar("T")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# /proc/PID/stat state letters, named as psutil names them.
_STATES = {b"R": ProcState.RUNNING, b"S": ProcState.SLEEPING, b"D": ProcState.DISK_SLEEP,
           b"T": ProcState.STOPPED, b"t": ProcState.TRACING_STOP, b"Z": ProcState.ZOMBIE,
           b"X": ProcState.DEAD, b"x": ProcState.DEAD, b"K": ProcState.WAKE_KILL,
           b"W": ProcState.WAKING, b"P": ProcState.PARKED, b"I": ProcState.IDLE}
#: The states of a process that has exited.
_ENDED = frozenset(s for s in ProcState if s.ended)
_EMPTY_ENV: Mapping[str, str] = MappingProxyType({})
# Guards the ancestor walk against a corrupt or cyclic parent chain.
_MAX_DEPTH = 64
# Longer than any /proc/PID/stat line (52 numbers and a command name of at most 64 bytes).
_STAT_BYTES = 4096
# Kept stat descriptors never take more than this share of the file-descriptor limit: sockets
# (up to 256 /metrics connections) and the state files need the rest.
_FD_RESERVE = 512
_FD_MAX = 4096


class ProcStat(NamedTuple):
    state: str
    ppid: int
    pgid: int
    sid: int
    threads: int
    start_time: float
    rss_bytes: int


class ProcessSource:
    def __init__(self, procfs: str = "/proc") -> None:
        self._procfs = procfs
        self._boot_time = _boot_time(procfs)
        self._static: dict[tuple[int, float], tuple[tuple[bytes, bytes], Static]] = {}
        #: Each process's last record with the stat fields and GPU usage it was built from: a
        #: process whose fields did not change since is given the same (immutable) record.
        self._records: dict[int, tuple[tuple[object, ...], HostProcess]] = {}
        #: Each process's last stat line and GPU usage, with the record made of them: the same
        #: line (most processes, asleep between two polls) gives the same record, unparsed.
        self._lines: dict[int, tuple[bytes, tuple[GpuProcessUsage, ...], HostProcess]] = {}
        #: Open /proc/PID/stat descriptors of the processes read at the last poll. Kept only
        #: once a caller forgets what it no longer reads (forget_others), which closes them.
        self._fds: dict[int, int] = {}
        self._keep_fds = False
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        self._fd_budget = (_FD_MAX if soft == resource.RLIM_INFINITY
                           else max(0, min(_FD_MAX, soft - _FD_RESERVE)))
        self._statics = StaticReader(procfs)
        #: Texts cut at the read (TRUNCATED_TEXTS), counted once a read: each process's once.
        self.truncated = self._statics.truncated
        #: Whether the kernel makes /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN; `doctor`
        #: says when it does not). Without them children are found from every process's parent
        #: PID: one scan of /proc per poll for a poller, per call for any other caller.
        self.children_files = has_children_files(procfs)
        #: Without children files, the children of each PID as the last scan of /proc found them;
        #: kept until the poll is over (forget_others).
        self._by_parent: Optional[dict[int, list[int]]] = None
        #: This process's PID, and /proc/self's (own_pid) as read while it was.
        self._own_pid: Optional[tuple[int, Optional[int]]] = None
        #: /proc/loadavg, kept open: last_pid reads it at every poll.
        self._loadavg = KeptFiles(1)

    def read(self, pids: Iterable[int],
             gpu_usage: Optional[Mapping[int, tuple[GpuProcessUsage, ...]]] = None,
             known: Optional[Mapping[int, HostProcess]] = None) -> ProcessReading:
        """Read `pids` and every ancestor of theirs up to PID 1, skipping those in `known`.

        The result holds `known` too, so a poll can read in several steps.
        """
        usage = gpu_usage or {}
        self._statics.root_directories.forget()
        found: dict[int, HostProcess] = dict(known or {})
        errors: list[SourceError] = []
        for pid in sorted(set(pids)):
            current: Optional[int] = pid
            depth = 0
            while current is not None and current > 0 and current not in found:
                try:
                    proc = self._read_one(current, usage.get(current, ()))
                except (OSError, ValueError, IndexError) as exc:
                    # /proc in a state nobody expected: this process is marked, the poll goes on.
                    errors.append(SourceError("procfs", f"PID {current}: {exc}"))
                    proc = HostProcess(pid=current, gpu_usage=usage.get(current, ()),
                                       read_errors=(str(exc),))
                found[current] = proc
                depth += 1
                current = proc.ppid if depth < _MAX_DEPTH else None
        # A job's ranks share one group and so one leader: looked at once.
        leaders_gone: dict[int, bool] = {}
        for pid in usage.keys() - (known or {}).keys():
            proc = found.get(pid)
            if proc is not None and proc.in_procfs and proc.pgid and proc.pgid != pid \
                    and proc.pgid not in leaders_gone:
                leaders_gone[proc.pgid] = self._gone(proc.pgid, found)
        return ProcessReading(processes=MappingProxyType(found), errors=tuple(errors),
                              gone_group_leaders=frozenset(
                                  pgid for pgid, gone in leaders_gone.items() if gone))

    def _gone(self, pid: int, found: Mapping[int, HostProcess]) -> bool:
        """Whether `pid` no longer runs: absent from /proc, or a zombie. Its number cannot have
        been given to another process while a group or session it led lives on."""
        seen = found.get(pid)
        if seen is not None and seen.in_procfs:
            return seen.state in _ENDED
        now = self.stat(pid)
        return now is None or now.state in _ENDED

    def forget_others(self, processes: Iterable[HostProcess]) -> None:
        """Drop what is cached about every identity but these (the ones still seen), and close
        the stat files of the processes not among them."""
        keep = {p.identity for p in processes}
        for key in self._static.keys() - keep:
            del self._static[key]
        pids = {pid for pid, _ in keep}
        for cache in (self._records, self._lines):
            for pid in cache.keys() - pids:
                del cache[pid]
        for pid in self._fds.keys() - pids:
            os.close(self._fds.pop(pid))
        self._keep_fds = True
        self._by_parent = None

    def close(self) -> None:
        """Close the stat files kept open; the source stays usable (it opens them again)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._loadavg.close()
        self._by_parent = None

    def _stat_line(self, pid: int) -> Optional[bytes]:
        """The /proc/PID/stat line, None when there is no such process. Through the descriptor
        kept open for the PID when there is one; one that fails names a process that is gone,
        so the PID is looked up afresh (whatever runs on it now, if anything)."""
        fd = self._fds.get(pid)
        if fd is not None:
            try:
                line = os.pread(fd, _STAT_BYTES, 0)
                if line:
                    return line
            except OSError:
                pass
            del self._fds[pid]
            os.close(fd)
        try:
            fd = os.open(f"{self._procfs}/{pid}/stat", os.O_RDONLY)
        except (FileNotFoundError, ProcessLookupError):
            return None
        try:
            line = os.read(fd, _STAT_BYTES)
        except ProcessLookupError:  # exited between the open and the read
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if self._keep_fds and len(self._fds) < self._fd_budget and line:
            self._fds[pid] = fd
        else:
            os.close(fd)
        return line if line else None

    def _read_one(self, pid: int, usage: tuple[GpuProcessUsage, ...]) -> HostProcess:
        line = self._stat_line(pid)
        if line is None:
            self._lines.pop(pid, None)
            # Absent from /proc: exited (between NVML's list and ours, or mid-read), or living in
            # another PID namespace whose PIDs NVML reports. Kept, marked, never a crash.
            return HostProcess(pid=pid, in_procfs=False, gpu_usage=usage,
                               read_errors=("not in /proc (exited, or another PID namespace)",))
        # The line whole, as the last poll read it: every field the record is made of (and
        # more) is as it was, so the record is. A line of a process in D state is never kept.
        same = self._lines.get(pid)
        if same is not None and same[0] == line and same[1] == usage:
            return same[2]
        record = self._parse_one(pid, line, usage)
        kept = self._records.get(pid)
        if kept is not None and kept[1] is record and record.state != ProcState.DISK_SLEEP:
            self._lines[pid] = (line, usage, record)
        else:
            self._lines.pop(pid, None)
        return record

    def _parse_one(self, pid: int, line: bytes, usage: tuple[GpuProcessUsage, ...]
                   ) -> HostProcess:
        comm, fields = parse_stat(line)
        # What the process runs: its name and where its arguments start (0 where the kernel
        # does not say). An exec changes both, the arguments landing on a new stack, while the
        # identity stays; at 0 they are not in place yet (an exec in flight reads as an empty
        # command line). Either way what was read for the identity is read again.
        image = (comm, fields[ARG_START] if len(fields) > ARG_START else b"")
        # State, parent, group, session, threads, start time, RSS, the image and the GPU usage:
        # everything a record holds that can change for one identity. The start time makes a
        # reused PID a different key; a process in D state is read afresh (its wait channel
        # moves).
        key = (fields[STATE], fields[PPID], fields[PGID], fields[SID], fields[NUM_THREADS],
               fields[START_TIME], fields[RSS], image, usage)
        kept = self._records.get(pid)
        if kept is not None and kept[0] == key and fields[STATE] != b"D":
            return kept[1]
        state = _state(fields[STATE])
        start_time = round(self._boot_time + int(fields[START_TIME]) / _CLOCK_TICKS, 2)
        wchan, stack = self._kernel_wait(pid) if state == ProcState.DISK_SLEEP else (None, ())
        identity = (pid, start_time)
        known = self._static.get(identity)
        # A process that exited has no arguments left: it keeps what it ran.
        settled = True
        if known is not None and (known[0] == image or state in _ENDED):
            static = known[1]
        else:
            read = self._statics.read(pid, state, comm)
            if read is None:
                return HostProcess(pid=pid, in_procfs=False, gpu_usage=usage,
                                   read_errors=("exited while being read",))
            static = read
            # An exec sets where the arguments start a moment before it says where they end:
            # read in between, a process has an empty command line and its final image. It is
            # read again until it has one (a kernel thread, or a process whose arguments are
            # gone, never does: each costs a read a poll).
            settled = (bool(static.cmdline) or state in _ENDED
                       or is_kernel_thread(fields))
            if settled:
                self._static[identity] = (image, static)
        record = build(HostProcess, {
            "pid": pid,
            "in_procfs": True,
            "ppid": int(fields[PPID]),
            "pgid": int(fields[PGID]),
            "sid": int(fields[SID]),
            "start_time": start_time,
            "name": static.name,
            "cmdline": static.cmdline,
            "user": static.user,
            "uid": static.uid,
            "state": state,
            "rss_bytes": int(fields[RSS]) * _PAGE_SIZE,
            "num_threads": int(fields[NUM_THREADS]),
            "cgroup": static.cgroup,
            "system_unit": static.system_unit,
            "exe": static.exe,
            "job": static.job,
            "pod_uid": static.pod_uid,
            "container_id": static.container_id,
            "launch_env": static.launch_env,
            "namespace_pids": static.namespace_pids,
            "gpu_usage": usage,
            "read_errors": static.read_errors,
            "wchan": wchan,
            "kernel_stack": stack,
            "uss_bytes": None,
            "pss_bytes": None,
        })
        if settled:
            self._records[pid] = (key, record)
        else:
            self._records.pop(pid, None)  # made afresh at the next read
        return record

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
        if isinstance(pid, int):
            # Kept open where the budget allows, as for a record: a process looked at here is
            # often read whole next, in the same poll (a child just forked into a job's tree),
            # and a descriptor nobody reads again is closed once the poll is over.
            line = self._stat_line(pid)
        else:
            try:
                line = read_file(f"{self._procfs}/{pid}/stat", _STAT_BYTES)
            except (FileNotFoundError, ProcessLookupError):
                return None
        if not line:
            return None
        return self._proc_stat(parse_stat(line)[1])

    def _proc_stat(self, fields: list[bytes]) -> ProcStat:
        # (_read_one reads the same fields in the same way, without a ProcStat in between.)
        return ProcStat(
            state=_state(fields[STATE]),
            ppid=int(fields[PPID]),
            pgid=int(fields[PGID]),
            sid=int(fields[SID]),
            threads=int(fields[NUM_THREADS]),
            start_time=round(self._boot_time + int(fields[START_TIME]) / _CLOCK_TICKS, 2),
            rss_bytes=int(fields[RSS]) * _PAGE_SIZE,
        )

    def children(self, pid: int) -> list[int]:
        """Children forked by the process's main thread (/proc/PID/task/PID/children).

        Only the main thread's list is read: one small file, where launchers (torchrun, a
        shell, multiprocessing) fork from. A child forked by another thread is still found
        when it holds GPU memory or shares the job's cgroup or id. Without children files
        (children_files), every process whose parent is `pid`, from a scan of /proc.
        """
        if not self.children_files:
            by_parent = self._by_parent
            if by_parent is None:
                by_parent = self._children_by_parent()
                if self._keep_fds:  # a poller: it says when its poll is over
                    self._by_parent = by_parent
            return by_parent.get(pid, [])
        try:
            raw = read_file(f"{self._procfs}/{pid}/task/{pid}/children")
        except OSError:
            return []
        return [int(c) for c in raw.split()] if raw else []

    def own_pid(self) -> Optional[int]:
        """This process's PID in the /proc read (/proc/self), or None where that /proc does
        not show this process (mounted for another PID namespace, or a fixture directory).
        Looked up once for each PID of this process's own (a fork's child looks again)."""
        pid = os.getpid()
        if self._own_pid is None or self._own_pid[0] != pid:
            try:
                own: Optional[int] = int(os.readlink(os.path.join(self._procfs, "self")))
            except (OSError, ValueError):
                own = None
            self._own_pid = (pid, own)
        return self._own_pid[1]

    def live(self, pids: Iterable[int]) -> list[int]:
        """Those of `pids` that are a process or thread now, in their order: kill(pid, 0) each,
        a tenth of what a failed open of its /proc files costs, in one loop (churn hands the
        walker hundreds of PIDs a poll, most gone already). For PIDs of this process's
        namespace: the walker asks only where last_pid answers, that is where /proc is this
        namespace's."""
        found = []
        kill = os.kill
        for pid in pids:
            try:
                kill(pid, 0)
            except ProcessLookupError:
                continue
            except OSError:
                pass  # another user's (EPERM): it exists
            found.append(pid)
        return found

    def last_pid(self) -> Optional[int]:
        """The PID most recently handed out in this process's PID namespace (the last field of
        /proc/loadavg), or None when /proc is not this namespace's, or unreadable."""
        if self._procfs != "/proc" or self.own_pid() != os.getpid():
            return None  # /proc mounted for another PID namespace than ours
        raw = self._loadavg.read("/proc/loadavg")
        try:
            return int(raw.rsplit(None, 1)[-1]) if raw else None
        except ValueError:
            return None

    def descendants(self, root: int) -> set[int]:
        """Every descendant of `root`, from the children lists of each of their threads (a
        process may fork from any thread, where `children` reads only the main thread's):
        proportional to the tree, not to the host. Without children files (children_files),
        from one scan of every process's parent PID."""
        if not self.children_files:
            by_parent = self._children_by_parent()
            return descendants([root], lambda pid: by_parent.get(pid, ()))
        return descendants([root], self._every_threads_children)

    def _every_threads_children(self, pid: int) -> Iterator[int]:
        """The children each thread of `pid` forked (none where it is gone)."""
        try:
            tasks = os.listdir(f"{self._procfs}/{pid}/task")
        except OSError:
            return
        for tid in tasks:
            raw = read_or_none(f"{self._procfs}/{pid}/task/{tid}/children")
            yield from map(int, raw.split() if raw else ())

    def _children_by_parent(self) -> dict[int, list[int]]:
        """Every process of this /proc by its parent PID, in PID order: for a kernel without
        children files. A process that exits during the scan is left out, as it would be from a
        children file read a moment later; threads are not listed (/proc lists processes)."""
        by_parent: dict[int, list[int]] = {}
        pids = sorted(int(e.name) for e in os.scandir(self._procfs) if e.name.isdigit())
        for pid in pids:
            try:
                line = read_file(f"{self._procfs}/{pid}/stat", _STAT_BYTES)
                ppid = int(parse_stat(line)[1][PPID])
            except (OSError, ValueError):
                continue  # exited since it was listed
            by_parent.setdefault(ppid, []).append(pid)
        return by_parent

    def _read_proc_bytes(self, pid: int, name: str) -> Optional[bytes]:
        return read_or_none(f"{self._procfs}/{pid}/{name}")

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
        try:
            raw, cut = read_head(f"{self._procfs}/{pid}/environ", ENVIRON_BYTES)
        except OSError:
            return False
        if cut:
            raw = raw[:raw.rfind(b"\0") + 1]
        return any(key in WORKER_MARKER_KEYS for key in parse_environ(raw))



def has_children_files(procfs: str = "/proc") -> bool:
    """Whether the kernel behind `procfs` makes /proc/PID/task/TID/children, which it does when
    built with CONFIG_PROC_CHILDREN (most distribution kernels: CRIU needs them). Looked for in
    the directory of the first process listed that does not exit while it is looked at."""
    with os.scandir(procfs) as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            task = f"{procfs}/{entry.name}/task/{entry.name}"
            if os.path.exists(f"{task}/children"):
                return True
            if os.path.isdir(task):
                return False  # the process is there, its children file is not
    return True  # no process to look at: nothing says they are missing


def _state(letter: bytes) -> str:
    return _STATES.get(letter) or letter.decode(errors="replace")


def _boot_time(procfs: str) -> float:
    """When the system booted, in seconds since the epoch (the btime line of /proc/stat): a
    process's start time is this plus its start in clock ticks since boot, as psutil has it."""
    for line in read_file(f"{procfs}/stat").splitlines():
        if line.startswith(b"btime "):
            return float(line.split()[1])
    raise RuntimeError(f"no btime line in {procfs}/stat")
