"""What says which program a process is, from what its user cannot set: the file it runs
(/proc/PID/exe) and the system unit it was started in (/proc/PID/cgroup).

A process names itself (`comm`, through prctl(PR_SET_NAME) or the name of a link it was executed
through) and writes its own command line; neither says what it is. The kernel's link to the file
it runs, that file's owner and the directories above it, and the cgroup systemd's system manager
put it in, are what only root can arrange. The detectors decide from these facts which processes
are protected (gpuwatch.detectors.common.protected_by); nothing here judges.
"""

from __future__ import annotations

import functools
import os
import re
import stat
import sys
from typing import Optional

from gpuwatch.model import Executable

_FS_ENCODING = sys.getfilesystemencoding()
#: Group or others may write it: a file or directory not in its owner's hands alone.
_SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH
_UNIT = re.compile(r"[^/]+\.(?:service|scope)")
# The kernel appends this to a cgroup v2 path whose cgroup was removed (a zombie's, typically).
_DELETED_SUFFIX = " (deleted)"
#: Why an executable could not be read, as a process's read error says it.
EXE_NOT_READABLE = "executable not readable (another user's process; needs CAP_SYS_PTRACE)"


class RootDirectories:
    """Whether a directory and every one above it is root's alone (owned by root, writable by
    neither group nor others), each directory judged once until `forget()`.

    The processes a poll sees first mostly run files of a few directories (a job's ranks, its
    workers: one Python), and each directory up to / costs an lstat and a dirname. The process
    source forgets at each of its reads, so a verdict is never older than the read that uses it
    (milliseconds): a chmod is seen by the next poll, as it was without the memory."""

    def __init__(self, limit: int = 1024) -> None:
        self._limit = limit
        self._verdicts: dict[bytes, bool] = {}

    def forget(self) -> None:
        if self._verdicts:
            self._verdicts = {}

    def root_only(self, directory: bytes) -> bool:
        visited: list[bytes] = []
        while True:
            verdict = self._verdicts.get(directory)
            if verdict is not None:
                break
            visited.append(directory)
            try:
                up = os.lstat(directory)
            except OSError:
                verdict = False
                break
            if not stat.S_ISDIR(up.st_mode) or not _roots(up):
                verdict = False
                break
            if directory == b"/":
                verdict = True
                break
            directory = os.path.dirname(directory)
        if len(self._verdicts) + len(visited) > self._limit:
            self._verdicts = {}
        for checked in visited:  # each below the one that decided takes its verdict
            self._verdicts[checked] = verdict
        return verdict


def read_executable(procfs: str, pid: int, directories: RootDirectories
                    ) -> tuple[Optional[Executable], Optional[str]]:
    """The file process `pid` runs, and the read error to record (None when there is none).

    The link is read and the file stat'ed through it (the very file the process runs, wherever
    it is now); then the path the link names is looked up in this process's own view of the file
    system, and must name that same file (device and inode) in directories owned by root and
    writable by no one else, for the file to count as root's (`Executable.root_controlled`);
    the directories are judged through `directories`, the reader's for its current read.
    Another user's process without CAP_SYS_PTRACE: None and the error (protection by executable
    needs proof, so none is granted). A kernel thread, a zombie, a process gone: None, no error.

    The link is the kernel's, but not only exec sets it: prctl(PR_SET_MM_MAP) with an `exe_fd`
    points it at any file its caller may execute, and needs only CAP_CHECKPOINT_RESTORE in the
    caller's own user namespace, which any user can make (`unshare -U`). So the link is proof
    only for a process in gpuwatch's own user namespace: one in another is never root's.
    """
    link = f"{procfs}/{pid}/exe"
    try:
        target = os.readlink(link.encode())  # bounded by the kernel: at most PATH_MAX bytes
        st = os.stat(link)
    except PermissionError:
        return None, EXE_NOT_READABLE
    except OSError:
        return None, None
    return Executable(path=target.decode(_FS_ENCODING, "replace"), owner_uid=st.st_uid,
                      root_controlled=(_root_controlled(target, st, directories)
                                       and _in_our_user_namespace(procfs, pid))), None


def _in_our_user_namespace(procfs: str, pid: int) -> bool:
    """Whether process `pid` is in gpuwatch's own user namespace (where a user cannot set their
    process's executable link). True where the kernel has no user namespaces (no ns/user for
    either); False where the process's cannot be read."""
    ours = _own_user_namespace()
    if ours is None:
        return True
    try:
        theirs = os.stat(f"{procfs}/{pid}/ns/user")
    except FileNotFoundError:
        return not os.path.isdir(f"{procfs}/{pid}/ns")  # a procfs that says nothing of them
    except OSError:
        return False
    return (theirs.st_dev, theirs.st_ino) == ours


@functools.lru_cache(maxsize=1)
def _own_user_namespace() -> Optional[tuple[int, int]]:
    """This process's user namespace (it never changes), None where the kernel has none."""
    try:
        st = os.stat("/proc/self/ns/user")
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _root_controlled(path: bytes, st: os.stat_result, directories: RootDirectories) -> bool:
    """Whether `st` (the file a process runs) is the file at `path`, and only root could have put
    it there: it and every directory above it owned by root, writable by neither group nor others
    (/tmp, writable by all, fails however sticky: a hard link left there is nobody's proof)."""
    if not path.startswith(b"/") or not stat.S_ISREG(st.st_mode) or not _roots(st):
        return False
    try:
        here = os.lstat(path)
    except OSError:
        return False  # deleted or replaced since it was executed, or not in our view at all
    if (here.st_dev, here.st_ino) != (st.st_dev, st.st_ino):
        return False  # another file at that path here: another mount namespace's, or replaced
    return directories.root_only(os.path.dirname(path))


def _roots(st: os.stat_result) -> bool:
    return st.st_uid == 0 and not st.st_mode & _SHARED_WRITE


def system_unit(cgroup: bytes) -> Optional[str]:
    """The unit systemd's system manager started the process in, from /proc/PID/cgroup: the
    first component of its systemd path that is not a slice, when that is a .service or a .scope
    ("nvidia-persistenced.service"; for a user's own units, "user@1000.service"). Slices and the
    units right below them are made by systemd (root) alone; a unit delegates only what is below
    it, so a name a user or a container chose never comes first. The unified (v2) path is read,
    or on a v1 host the name=systemd one; None where neither names a unit so."""
    unified: Optional[bytes] = None
    named: Optional[bytes] = None
    for line in cgroup.split(b"\n"):
        parts = line.split(b":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == b"0" and not parts[1]:
            unified = parts[2] if unified is None else unified
        elif parts[1] == b"name=systemd":
            named = parts[2] if named is None else named
    path = unified if unified is not None else named
    if path is None:
        return None
    text = path.decode(errors="replace")
    if text.endswith(_DELETED_SUFFIX):
        text = text[: -len(_DELETED_SUFFIX)]
    # ".." where gpuwatch sits in a cgroup namespace of its own (a DaemonSet's): the names that
    # follow are still the host's.
    for segment in text.split("/"):
        if not segment or segment == ".." or segment.endswith(".slice"):
            continue
        return segment if _UNIT.fullmatch(segment) else None
    return None
