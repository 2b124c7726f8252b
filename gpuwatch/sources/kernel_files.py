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
        if len(data) < size:
            return data
        parts = [data]
        while chunk := os.read(fd, size):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


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
