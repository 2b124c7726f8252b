"""What never changes for one process identity (PID + start time), read once when it is first
seen: its name and command line, its user, its cgroup and job, its launch environment, its PID
namespace. Read as psutil read it, from fewer files; what another user sets the size of is read
in part (CMDLINE_BYTES, ENVIRON_BYTES, CGROUP_BYTES), each cut counted (`truncated`), and what
is made of the texts is cached by the texts, bounded in bytes (`_Parsed`).
"""

from __future__ import annotations

import os
import pwd
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Generic, Optional, TypeVar

from gpuwatch.model import Executable, Job
from gpuwatch.sources.authority import RootDirectories, read_executable, system_unit
from gpuwatch.sources.jobs import CgroupInfo, attribute_job, parse_cgroup, parse_environ
from gpuwatch.sources.kernel_files import read_file, read_head
from gpuwatch.sources.redact import redact_cmdline, redact_env
from gpuwatch.vocabulary import ProcState

T = TypeVar("T")
_EMPTY_ENV: Mapping[str, str] = MappingProxyType({})
# How psutil decodes what it reads from /proc (command names, command lines): kept so that names
# and command lines read as they did when psutil read them.
_FS_ENCODING = sys.getfilesystemencoding()
_FS_ERRORS = sys.getfilesystemencodeerrors()
_UID_LINE = re.compile(rb"Uid:\t(\d+)\t(\d+)\t(\d+)")
# The kernel keeps at most 15 bytes of a program's name.
_COMM_LENGTH = 15
#: The longest file name (NAME_MAX): a name completed from argv[0] past it is no program's.
_NAME_MAX = 255
#: The most of a command line read (/proc/PID/cmdline): its owner sets its size, up to the 2 MiB
#: the kernel allows for arguments. One longer shows its first CMDLINE_BYTES, as arguments, and
#: then CMDLINE_CUT as one more: `ps` and the kernel's own process name are cut the same way.
CMDLINE_BYTES = 4096
CMDLINE_CUT = "…[cut at 4 KiB]"
#: The most of an environment read (/proc/PID/environ): a job's launch variables are set with the
#: job and lie well within it; a variable the cut falls in, and any after it, are not read.
ENVIRON_BYTES = 32768
#: The most of /proc/PID/cgroup read: a user may nest cgroups of its own below a delegated one.
#: A line the cut falls in is left out (with it the cgroup, on a unified hierarchy).
CGROUP_BYTES = 8192
#: The texts cut at the read, as `truncated` counts them (gpuwatch_text_truncated_total).
TRUNCATED_TEXTS = ("command_line", "environment", "cgroup")
# Parsed cgroups, environments and redacted command lines are cached by their raw text: the
# processes of one job share them, so a newcomer (a dataloader worker) mostly hits the cache.
# Each cache holds at most this many bytes of text (its keys, and what was made of them), so
# what processes long gone left in it stays small whatever their texts were.
_PARSED_BYTES = 1 << 20
# What a cached entry costs beyond its texts (the dict slot, the tuple, the objects made).
_ENTRY_OVERHEAD = 512


@dataclass(frozen=True)
class Static:
    """What never changes for one identity (PID and start time): what the process runs, whose
    it is, its cgroup and job, its launch environment."""

    name: Optional[str]
    cmdline: tuple[str, ...]
    uid: Optional[int]
    user: Optional[str]
    cgroup: Optional[str]
    system_unit: Optional[str]
    exe: Optional[Executable]
    job: Optional[Job]
    pod_uid: Optional[str]
    container_id: Optional[str]
    launch_env: Mapping[str, str]
    namespace_pids: tuple[int, ...]
    read_errors: tuple[str, ...]


class StaticReader:
    """Reads the static part of processes under `procfs`, keeping what it made of their texts."""

    def __init__(self, procfs: str = "/proc") -> None:
        self._procfs = procfs
        self._users: dict[int, str] = {}
        self._cgroups: _Parsed[str, Optional[CgroupInfo]] = _Parsed(_PARSED_BYTES // 4)
        self._environs: _Parsed[bytes, Mapping[str, str]] = _Parsed(_PARSED_BYTES)
        self._cmdlines: _Parsed[tuple[str, ...], tuple[str, ...]] = _Parsed(_PARSED_BYTES)
        self._statics: _Parsed[tuple[object, ...], Static] = _Parsed(_PARSED_BYTES)
        #: What was found of the directories above executables, during one read of the
        #: process source (ProcessSource.read forgets it at each).
        self.root_directories = RootDirectories()
        #: Texts cut at the read (TRUNCATED_TEXTS), counted once a read: each process's once.
        self.truncated: dict[str, int] = dict.fromkeys(TRUNCATED_TEXTS, 0)

    def read(self, pid: int, state: str, comm: bytes) -> Optional[Static]:
        """What never changes for one identity; None when the process exited while being read.

        Read as psutil read it (name, command line, real uid), from fewer files: the name is the
        stat line's, the uid and the NSpid come from one read of status. The processes of one
        job (a launcher's ranks, a rank's dataloader workers) read the same texts, so what is
        made of them is kept by the texts: a newcomer costs its reads and one lookup.
        """
        errors: list[str] = []
        base = f"{self._procfs}/{pid}"
        zombie = state == ProcState.ZOMBIE
        cmdline_raw: Optional[bytes] = None
        cmdline_cut = False
        if not zombie:  # a zombie has no command line left to read
            try:
                cmdline_raw, cmdline_cut = read_head(f"{base}/cmdline", CMDLINE_BYTES)
            except PermissionError:
                errors.append("command line not readable")
            except OSError:
                pass  # gone, or unreadable for a reason that leaves the rest readable
        uid: Optional[int] = None
        namespace_pids: tuple[int, ...] = ()
        try:
            status = read_file(f"{base}/status")
        except PermissionError:
            status = None
        except (FileNotFoundError, ProcessLookupError):
            if not zombie:
                return None
            status = None
        if status:
            found = _UID_LINE.search(status)
            uid = int(found.group(1)) if found else None
            namespace_pids = _namespace_pids(status)
        if cmdline_cut:
            self.truncated["command_line"] += 1
        cgroup_raw = self._read_cut(f"{base}/cgroup", CGROUP_BYTES, b"\n", "cgroup", errors)
        env_raw = self._read_cut(f"{base}/environ", ENVIRON_BYTES, b"\0", "environment",
                                errors)
        if env_raw is None and not zombie:
            errors.append("environment not readable (other user's process; run as root)")
        # What it runs, from the kernel's link (a zombie has none left): what protects it, where
        # its comm and command line say nothing (gpuwatch.sources.authority).
        exe, exe_error = (read_executable(self._procfs, pid, self.root_directories)
                          if not zombie else (None, None))
        if exe_error is not None:
            errors.append(exe_error)
        texts = (comm, cmdline_raw, cmdline_cut, uid, namespace_pids, cgroup_raw, env_raw, exe,
                 *errors)
        static = self._statics.get(texts)
        if static is None:
            cost = sum(len(t) for t in (cmdline_raw, cgroup_raw, env_raw) if t is not None)
            cost += len(exe.path) if exe is not None else 0
            static = self._statics.put(texts, self._parse_static(
                comm, cmdline_raw, cmdline_cut, uid, namespace_pids, cgroup_raw, env_raw, exe,
                tuple(errors)), 2 * cost)
        return static

    def _read_cut(self, path: str, limit: int, end: bytes, what: str,
                  errors: list[str]) -> Optional[bytes]:
        """At most `limit` bytes of the file, without the entry (ended by `end`) that a cut falls
        in; a cut is counted and said in `errors`. None when the file cannot be read."""
        try:
            raw, cut = read_head(path, limit)
        except OSError:
            return None
        if cut:
            self.truncated[what] += 1
            errors.append(f"{what} cut at {limit // 1024} KiB: what follows was not read")
            raw = raw[:raw.rfind(end) + 1]
        return raw

    def _parse_static(self, comm: bytes, cmdline_raw: Optional[bytes], cmdline_cut: bool,
                      uid: Optional[int], namespace_pids: tuple[int, ...],
                      cgroup_raw: Optional[bytes], env_raw: Optional[bytes],
                      exe: Optional[Executable], errors: tuple[str, ...]) -> Static:
        name = comm.decode(_FS_ENCODING, _FS_ERRORS)
        args = _split_cmdline(cmdline_raw, cmdline_cut) if cmdline_raw is not None else []
        cmdline: tuple[str, ...] = ()
        if args:
            key = tuple(args)
            # Redacted as cut: a secret the cut falls in shows no more of itself than a whole
            # one would (its flag or name comes before it).
            cmdline = self._cmdlines.get(key) or self._cmdlines.put(
                key, redact_cmdline(args), 2 * len(cmdline_raw or b""))
            if cmdline_cut:
                cmdline = (*cmdline, CMDLINE_CUT)
            if len(name) >= _COMM_LENGTH:
                # The kernel cut the name: the program's own, as psutil gives it; but no longer
                # than a file's name may be (argv[0] is the process's to write, up to the cut,
                # and the name is kept with each process's history, alive or departed).
                extended = os.path.basename(args[0])
                if extended.startswith(name) and len(extended) <= _NAME_MAX:
                    name = extended
        cgroup = (self._cgroup(cgroup_raw.decode(errors="replace"))
                  if cgroup_raw is not None else None)
        # Redacted before anything reads it, as the command line is: nothing downstream (the
        # document, the views, the job id in metric labels) ever sees a secret in MASTER_ADDR.
        launch_env = self._environ(env_raw) if env_raw else _EMPTY_ENV
        return Static(
            name=name,
            cmdline=cmdline,
            uid=uid,
            user=self._user(uid),
            cgroup=cgroup.path if cgroup is not None else None,
            system_unit=system_unit(cgroup_raw) if cgroup_raw is not None else None,
            exe=exe,
            job=attribute_job(cgroup, launch_env),
            pod_uid=cgroup.pod_uid if cgroup is not None else None,
            container_id=cgroup.container_id if cgroup is not None else None,
            launch_env=launch_env,
            namespace_pids=namespace_pids,
            read_errors=errors,
        )

    def _cgroup(self, text: str) -> Optional[CgroupInfo]:
        info = self._cgroups.get(text)
        return info if info is not None else self._cgroups.put(text, parse_cgroup(text),
                                                               2 * len(text))

    def _environ(self, raw: bytes) -> Mapping[str, str]:
        env = self._environs.get(raw)
        if env is None:
            parsed = redact_env(parse_environ(raw))
            env = self._environs.put(raw, MappingProxyType(parsed),
                                     len(raw) + sum(map(len, parsed.values())))
        return env

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


def _split_cmdline(raw: bytes, cut: bool = False) -> list[str]:
    """/proc/PID/cmdline split as psutil splits it, decoded as psutil decodes it (as text, so
    with its line endings translated). `cut`: `raw` is the start of a longer command line, cut
    wherever the read stopped (in an argument, a character)."""
    if cut:
        raw = _without_partial_character(raw)
    data = raw.decode(_FS_ENCODING, _FS_ERRORS)
    if "\r" in data:
        data = data.replace("\r\n", "\n").replace("\r", "\n")
    if not data:
        return []
    # NUL-separated, or spaces where setproctitle() rewrote the block (psutil issue 1179). Cut,
    # its end says nothing: any NUL in it says.
    ends = "\x00" in data if cut else data.endswith("\x00")
    sep = "\x00" if ends else " "
    if data.endswith(sep):
        data = data[:-1]
    args = data.split(sep)
    if sep == "\x00" and len(args) == 1 and " " in data:
        args = data.split(" ")
    return args


def _without_partial_character(data: bytes) -> bytes:
    """`data` less the UTF-8 sequence a cut left incomplete at its end, if any."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return data  # ASCII: nothing cut
        if byte >= 0xC0:  # the sequence's first byte says how long it is
            length = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data[:-back] if length > back else data
    return data


def _namespace_pids(status: bytes) -> tuple[int, ...]:
    """The process's PIDs inside the nested PID namespaces it lives in (a container's), from
    the NSpid line of /proc/PID/status; empty in this /proc's own namespace."""
    at = status.find(b"\nNSpid:")
    if at < 0:
        return ()
    end = status.find(b"\n", at + 1)
    # "NSpid:\t4242\t1": this namespace's PID, then the inner ones.
    fields = status[at + 7:end if end > 0 else len(status)].split()
    if len(fields) < 2:
        return ()  # this namespace's PID alone: most processes
    try:
        return tuple(map(int, fields[1:]))
    except ValueError:
        return ()


K = TypeVar("K")


class _Parsed(Generic[K, T]):
    """What was made of texts, by the texts, holding at most `budget` bytes: each entry is put
    with what it costs (its texts' bytes, about), and the oldest go to make room. An entry
    costing more than the whole budget is not kept."""

    __slots__ = ("_budget", "_entries", "size")

    def __init__(self, budget: int) -> None:
        self._budget = budget
        self._entries: dict[K, tuple[T, int]] = {}
        #: What the entries kept cost, in bytes.
        self.size = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> Optional[T]:
        entry = self._entries.get(key)
        return entry[0] if entry is not None else None

    def put(self, key: K, value: T, cost: int) -> T:
        cost += _ENTRY_OVERHEAD
        if cost > self._budget:
            return value
        entries = self._entries
        old = entries.pop(key, None)
        if old is not None:
            self.size -= old[1]
        while entries and self.size + cost > self._budget:
            self.size -= entries.pop(next(iter(entries)))[1]
        entries[key] = (value, cost)
        self.size += cost
        return value
