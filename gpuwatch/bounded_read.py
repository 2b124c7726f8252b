"""Reading at most so many bytes of a file another user may make as large as they like (a
command line, an environment, a configuration file): never the whole of it. Imports nothing of
gpuwatch, so the config and the sources share it."""

from __future__ import annotations

import os


def read_at_most(fd: int, limit: int) -> bytes:
    """The first `limit` + 1 bytes of the open file `fd` (fewer at its end): one more than
    `limit` says that it holds more. Reads until then, since a /proc file may answer a read
    with less than asked; raises OSError as os.read does."""
    parts = []
    size = 0
    while size <= limit:
        chunk = os.read(fd, limit + 1 - size)
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)
