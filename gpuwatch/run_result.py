"""What `gpuwatch run` reports of a job: its processes as the supervisor saw them, how each
ended, and whether the job's GPU memory was released. The supervisor (gpuwatch.actions.supervisor)
fills it in, the run view (gpuwatch.sinks.run_view) renders it and `--json FILE` writes it
(`RunResult.as_json`): a record of the model, so that the view needs nothing of the actions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class ProcessIdentity:
    """A process of the job, not just a PID: `start_time` as gpuwatch reads it (seconds since
    the epoch), None only where it could not be read."""

    pid: int
    start_time: Optional[float]


@dataclass
class Member:
    """A process of the job, as the supervisor saw it."""

    ref: ProcessIdentity
    command: str
    #: Signals the supervisor sent it, in order.
    signals: list[str] = field(default_factory=list)
    #: How it ended: "exited", "exited after SIGINT", "ended on SIGTERM", "killed (SIGKILL)";
    #: None while it runs.
    ended: Optional[str] = None
    rss_bytes: Optional[int] = None
    #: GPU memory NVML listed for it when the job was ending (None: none, or NVML unavailable).
    gpu_memory_bytes: Optional[int] = None
    gpus: tuple[int, ...] = ()
    leftover: bool = False

    def as_json(self) -> dict[str, Any]:
        return {"pid": self.ref.pid, "start_time": self.ref.start_time,
                "command": self.command, "signals": list(self.signals), "ended": self.ended,
                "rss_bytes": self.rss_bytes, "gpu_memory_bytes": self.gpu_memory_bytes,
                "gpus": list(self.gpus), "leftover": self.leftover}


@dataclass
class GpuCheck:
    """What NVML said once the job had ended."""

    nvml: bool
    detail: str = ""
    #: GPU memory the job's processes held when it was ending.
    held_bytes: int = 0
    #: Processes of the job NVML still lists after they ended, with their memory.
    still_held: dict[int, Optional[int]] = field(default_factory=dict)
    #: Unattributed memory that appeared on the job's GPUs during the run, by GPU index.
    unattributed_growth: dict[int, int] = field(default_factory=dict)

    @property
    def released(self) -> bool:
        return not self.still_held and not self.unattributed_growth

    def as_json(self) -> dict[str, Any]:
        return {"nvml": self.nvml, "detail": self.detail, "held_bytes": self.held_bytes,
                "released": self.released if self.nvml else None,
                "still_held": [{"pid": pid, "memory_bytes": mem}
                               for pid, mem in sorted(self.still_held.items())],
                "unattributed_growth_bytes": {str(k): v
                                              for k, v in sorted(self.unattributed_growth.items())}}


@dataclass
class RunResult:
    """The summary of a run: printed at the end, and written by --json."""

    job_id: str
    command: list[str]
    started_at: float
    ended_at: float = 0.0
    #: "exit" (COMMAND ended by itself), or the stop signal that ended the run ("SIGINT", ...)
    ended_by: str = "exit"
    command_status: Optional[int] = None  # COMMAND's exit code, or -N for signal N
    exit_code: int = 0
    #: False when the command could not be started at all (not found, not executable).
    started: bool = False
    cgroup: Optional[str] = None
    cgroup_reason: str = ""
    members: list[Member] = field(default_factory=list)
    gpu: GpuCheck = field(default_factory=lambda: GpuCheck(nvml=False))

    def as_json(self) -> dict[str, Any]:
        return {"schema": 1, "job": {"id": self.job_id, "source": "run"},
                "command": self.command, "started_at": round(self.started_at, 3),
                "ended_at": round(self.ended_at, 3),
                "duration_seconds": round(self.ended_at - self.started_at, 3),
                "ended_by": self.ended_by, "command_status": self.command_status,
                "exit_code": self.exit_code,
                "cgroup": self.cgroup, "cgroup_reason": self.cgroup_reason or None,
                "processes": [m.as_json() for m in self.members],
                "gpu": self.gpu.as_json()}
