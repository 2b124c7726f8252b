"""Reading the small files the kernel makes (/proc, /sys/fs/cgroup): one descriptor, no file
object, no pathlib, since the poll reads hundreds of them and the kernel's own work is most of
what each costs."""

from __future__ import annotations

import os
from typing import Optional

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


def read_or_none(path: str) -> Optional[bytes]:
    """The whole file; None when it is missing or cannot be read."""
    try:
        return read_file(path)
    except OSError:
        return None
