"""`JobKey`: which job tree a process was first seen in, as the history keeps it."""

from __future__ import annotations

from typing import NamedTuple, Optional

from gpuwatch.model import NodeSnapshot


class JobKey(NamedTuple):
    """A job tree's identity: its root's (the launcher's) PID and start time, so that a PID
    reused later starts another tree. Printed as `<PID>:<start time>` (the start time empty
    where /proc had none)."""

    root_pid: int
    root_start: Optional[float]

    def __str__(self) -> str:
        return f"{self.root_pid}:{self.root_start if self.root_start is not None else ''}"

    @classmethod
    def of(cls, pid: int, snapshot: NodeSnapshot) -> Optional[JobKey]:
        """The tree the snapshot puts `pid` in (NodeSnapshot.job_roots), or None."""
        root = snapshot.job_roots.get(pid)
        if root is None:
            return None
        root_proc = snapshot.processes.get(root)
        return cls(root, root_proc.start_time if root_proc is not None else None)
