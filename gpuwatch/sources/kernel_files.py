"""Reading the small files the kernel makes (/proc, /sys/fs/cgroup): one descriptor, no file
object, no pathlib, since the poll reads hundreds of them and the kernel's own work is most of
what each costs."""

from __future__ import annotations

import os
from typing import Optional

from gpuwatch.bounded_read import read_at_most

#: One read takes a whole /proc or cgroup file but a long environment or command line.
READ_CHUNK = 1 << 16


def read_file(path: str, size: int = READ_CHUNK) -> bytes:
    """The whole file, `size` bytes a read; raises OSError as os.open and os.read do."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.read(fd, size)
        return data if len(data) < size else data + read_rest(fd, size)
    finally:
        os.close(fd)


def read_rest(fd: int, size: int = READ_CHUNK) -> bytes:
    """What is left of the open file, `size` bytes a read; raises OSError as os.read does."""
    parts = []
    while chunk := os.read(fd, size):
        parts.append(chunk)
    return b"".join(parts)


def read_head(path: str, limit: int) -> tuple[bytes, bool]:
    """At most the first `limit` bytes of the file, and whether it holds more: for a file whose
    size another user sets (a command line, an environment, a cgroup path), which is never read
    whole. Reads until `limit` + 1 bytes or the end (a /proc file may answer a read with less
    than asked); raises OSError as os.open and os.read do."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = read_at_most(fd, limit)
    finally:
        os.close(fd)
    return (data[:limit], True) if len(data) > limit else (data, False)


def read_or_none(path: str) -> Optional[bytes]:
    """The whole file; None when it is missing or cannot be read."""
    try:
        return read_file(path)
    except OSError:
        return None


class KeptFiles:
    """Small kernel files read again at every poll (/proc/meminfo, /proc/loadavg, a cgroup's
    memory.current) through descriptors kept open: a read at offset 0 of such a file makes the
    kernel write it afresh (seq_file), so the open and close, which cost as much as the read,
    are paid once. At most `most` are kept; past that a file is opened for each read. A
    descriptor whose read fails or comes back empty (its cgroup removed) is closed, and the
    path opened again, as if never kept."""

    def __init__(self, most: int = 64) -> None:
        self._most = most
        self._fds: dict[str, int] = {}
        #: The paths read since the last forget_unread().
        self._read: set[str] = set()

    def read(self, path: str) -> Optional[bytes]:
        """The whole file; None when it is missing or cannot be read."""
        self._read.add(path)
        fd = self._fds.get(path)
        if fd is not None:
            try:
                data = os.pread(fd, READ_CHUNK, 0)
                if 0 < len(data) < READ_CHUNK:
                    return data
            except OSError:
                pass
            del self._fds[path]
            os.close(fd)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            data = os.read(fd, READ_CHUNK)
        except OSError:
            os.close(fd)
            return None
        if len(data) < READ_CHUNK and len(self._fds) < self._most:
            self._fds[path] = fd  # (an empty read is kept too: the next read tries again)
            return data
        try:
            if len(data) == READ_CHUNK:
                data += read_rest(fd)
        except OSError:
            return None
        finally:
            os.close(fd)
        return data

    def forget_unread(self) -> None:
        """Close the descriptors of the paths not read since the last call."""
        for path in self._fds.keys() - self._read:
            os.close(self._fds.pop(path))
        self._read = set()

    def close(self) -> None:
        self._read = set()
        self.forget_unread()
