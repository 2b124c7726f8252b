"""Memory limits a process can run into: its cgroup's memory.max, and the node's MemAvailable.

A leak's projected out-of-memory point is measured against the tightest of these. Both are read
once per poll, and only for the cgroups of processes that matter (a handful of files), through
plain string paths: pathlib interns every part of every path it makes, and a poll's parts, freed
after it, would churn the interpreter's table of interned strings on every poll.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from gpuwatch.sources.kernel_files import read_or_none


def read_mem_available(procfs: str = "/proc") -> Optional[int]:
    return _meminfo(procfs, b"MemAvailable:")


def read_mem_total(procfs: str = "/proc") -> Optional[int]:
    """The node's MemTotal: the most host memory any process could hold."""
    return _meminfo(procfs, b"MemTotal:")


def _meminfo(procfs: str, key: bytes) -> Optional[int]:
    raw = read_or_none(f"{procfs}/meminfo")
    text = b"\n" + raw if raw is not None else b""
    at = text.find(b"\n" + key)
    if at < 0:
        return None
    try:
        return int(text[at + 1 + len(key):].split(None, 1)[0]) * 1024
    except (ValueError, IndexError):
        return None


class CgroupMemory:
    """memory.max and memory.current of cgroup v2 paths (v1's memory controller as a fallback)."""

    def __init__(self, root: str = "/sys/fs/cgroup") -> None:
        self._root = root.rstrip("/")

    def read(self, paths: Iterable[str]) -> dict[str, tuple[Optional[int], int]]:
        found: dict[str, tuple[Optional[int], int]] = {}
        for path in set(paths):
            figures = self._read_one(path.lstrip("/"))
            if figures is not None:
                found[path] = figures
        return found

    def _read_one(self, rel: str) -> Optional[tuple[Optional[int], int]]:
        for directory, limit_file, usage_file in (
                (f"{self._root}/{rel}", "memory.max", "memory.current"),
                (f"{self._root}/memory/{rel}", "memory.limit_in_bytes", "memory.usage_in_bytes")):
            usage = _read_int(f"{directory}/{usage_file}")
            if usage is None:
                continue
            limit = _read_int(f"{directory}/{limit_file}")
            # v1 says "no limit" with a huge page-rounded number rather than "max".
            if limit is not None and limit >= 1 << 60:
                limit = None
            return limit, usage
        return None


def _read_int(path: str) -> Optional[int]:
    """The number in a cgroup file; None for "max", and for a file missing or unreadable."""
    text = read_or_none(path)
    if text is None or text.strip() == b"max":
        return None
    try:
        return int(text)
    except ValueError:
        return None
