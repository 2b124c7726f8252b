"""Being a subreaper: the orphans of this process's descendants become its children
(prctl(PR_SET_CHILD_SUBREAPER)), and it collects each one that exits. `gpuwatch run`'s
supervisor is one, as is the simulated job's service manager; the benchmarks collect their
children the same way. Imports nothing of gpuwatch."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator

#: prctl(2)'s option (linux/prctl.h).
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Make this process its descendants' subreaper; OSError when the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


def exited_children() -> Iterator[tuple[int, int]]:
    """(PID, wait status) of each child that has ended, collected without waiting for the
    others; ends when no child is left to collect now."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status
