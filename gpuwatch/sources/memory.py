"""Memory limits a process can run into: its cgroup's memory.max, and the node's MemAvailable.

A leak's projected out-of-memory point is measured against the tightest of these. Both are read
once per poll, and only for the cgroups of processes that matter (a handful of files).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Optional


def read_mem_available(procfs: str = "/proc") -> Optional[int]:
    try:
        with open(f"{procfs}/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class CgroupMemory:
    """memory.max and memory.current of cgroup v2 paths (v1's memory controller as a fallback)."""

    def __init__(self, root: str = "/sys/fs/cgroup") -> None:
        self._root = Path(root)

    def read(self, paths: Iterable[str]) -> dict[str, tuple[Optional[int], int]]:
        found: dict[str, tuple[Optional[int], int]] = {}
        for path in set(paths):
            figures = self._read_one(path.lstrip("/"))
            if figures is not None:
                found[path] = figures
        return found

    def _read_one(self, rel: str) -> Optional[tuple[Optional[int], int]]:
        for directory, limit_file, usage_file in (
                (self._root / rel, "memory.max", "memory.current"),
                (self._root / "memory" / rel, "memory.limit_in_bytes", "memory.usage_in_bytes")):
            usage = _read_int(directory / usage_file)
            if usage is None:
                continue
            limit = _read_int(directory / limit_file)
            # v1 says "no limit" with a huge page-rounded number rather than "max".
            if limit is not None and limit >= 1 << 60:
                limit = None
            return limit, usage
        return None


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None
