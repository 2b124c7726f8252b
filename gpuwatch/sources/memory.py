"""Memory limits a process can run into: its cgroup's memory.max, and the node's MemAvailable.

A leak's projected out-of-memory point is measured against the tightest of these. Both are read
once per poll, and only for the cgroups of processes that matter (a handful of files), through
plain string paths: pathlib interns every part of every path it makes, and a poll's parts, freed
after it, would churn the interpreter's table of interned strings on every poll.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from gpuwatch.sources.kernel_files import KeptFiles, read_or_none

#: Cgroup memory files kept open between polls (two a cgroup): past that, opened for each read.
KEPT_CGROUP_FILES = 64


def read_mem_available(procfs: str = "/proc") -> Optional[int]:
    return _meminfo(procfs, b"MemAvailable:")


class NodeMemory:
    """The node's MemAvailable, read at every poll from /proc/meminfo kept open (KeptFiles)."""

    def __init__(self, procfs: str = "/proc") -> None:
        self._path = f"{procfs}/meminfo"
        self._file = KeptFiles(1)

    def available(self) -> Optional[int]:
        return _field(self._file.read(self._path), b"MemAvailable:")

    def close(self) -> None:
        self._file.close()


def read_mem_total(procfs: str = "/proc") -> Optional[int]:
    """The node's MemTotal: the most host memory any process could hold."""
    return _meminfo(procfs, b"MemTotal:")


def _meminfo(procfs: str, key: bytes) -> Optional[int]:
    return _field(read_or_none(f"{procfs}/meminfo"), key)


def _field(raw: Optional[bytes], key: bytes) -> Optional[int]:
    """The figure on /proc/meminfo's line `key`, in bytes."""
    text = b"\n" + raw if raw is not None else b""
    at = text.find(b"\n" + key)
    if at < 0:
        return None
    try:
        return int(text[at + 1 + len(key):].split(None, 1)[0]) * 1024
    except (ValueError, IndexError):
        return None


class CgroupMemory:
    """memory.max and memory.current of cgroup v2 paths (v1's memory controller as a fallback),
    through descriptors kept open between the reads that ask for the same cgroups (KeptFiles)."""

    def __init__(self, root: str = "/sys/fs/cgroup") -> None:
        self._root = root.rstrip("/")
        self._files = KeptFiles(KEPT_CGROUP_FILES)
        #: The layout (_V2 or _V1) each path answered in at the last read: asked first next
        #: time, so a v1 node does not look for v2's files at every poll. (A memory controller
        #: is bound to one hierarchy: a path answers in one layout at a time.)
        self._layouts: dict[str, int] = {}

    def read(self, paths: Iterable[str]) -> dict[str, tuple[Optional[int], int]]:
        found: dict[str, tuple[Optional[int], int]] = {}
        layouts: dict[str, int] = {}
        for path in set(paths):
            first = self._layouts.get(path, _V2)
            for layout in (first, 1 - first):
                figures = self._read_one(path.lstrip("/"), layout)
                if figures is not None:
                    found[path], layouts[path] = figures, layout
                    break
        self._layouts = layouts
        self._files.forget_unread()
        return found

    def close(self) -> None:
        self._files.close()

    def _read_one(self, rel: str, layout: int) -> Optional[tuple[Optional[int], int]]:
        if layout == _V2:
            directory, limit_file, usage_file = (f"{self._root}/{rel}", "memory.max",
                                                 "memory.current")
        else:
            directory, limit_file, usage_file = (f"{self._root}/memory/{rel}",
                                                 "memory.limit_in_bytes", "memory.usage_in_bytes")
        usage = self._read_int(f"{directory}/{usage_file}")
        if usage is None:
            return None
        limit = self._read_int(f"{directory}/{limit_file}")
        # v1 says "no limit" with a huge page-rounded number rather than "max".
        if limit is not None and limit >= 1 << 60:
            limit = None
        return limit, usage

    def _read_int(self, path: str) -> Optional[int]:
        return _number(self._files.read(path))


#: CgroupMemory's layouts: cgroup v2's files, v1's memory controller's.
_V2, _V1 = 0, 1


def _number(text: Optional[bytes]) -> Optional[int]:
    """The number in a cgroup file; None for "max", and for a file missing or unreadable."""
    if text is None or text.strip() == b"max":
        return None
    try:
        return int(text)
    except ValueError:
        return None
