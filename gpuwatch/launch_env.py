"""The launch environment's vocabulary: the variables `gpuwatch run` and distributed launchers
set for the processes of a job, and what they say.

Shared by the process source (which reads them from /proc/PID/environ), the detectors (which
judge by them), the supervisor (which sets them) and the views: kept here, below all of them,
so that a detector needs nothing of a source to know what a worker is. Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple, Optional

#: `gpuwatch run`'s grace: how long the job's processes have after a stop signal, or after COMMAND
#: ended, before they are ended.
DEFAULT_GRACE = 10.0
#: The job ended but GPU memory it held is still held, or appeared unattributed on its GPUs: a
#: scheduler's wrapper drains the node on it.
EXIT_GPU_HELD = 70
#: As a shell: the command was not found, or could not be run.
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126

#: Set by `gpuwatch run` for its whole job; names the job as `run:<id>`.
RUN_ID_KEY = "GPUWATCH_RUN_ID"
#: Set by `gpuwatch run` for its whole job: "<PID>:<start time>" of the supervisor, the start time
#: as ProcessSource computes it (seconds since the epoch, two decimals), so that a PID reused by
#: another process is told apart from the supervisor.
RUN_SUPERVISOR_KEY = "GPUWATCH_RUN_SUPERVISOR"

#: Variables that only a launcher sets for the processes it starts as ranks of a distributed
#: program. Allocation-wide ones are absent on purpose: every process in a Slurm allocation has
#: SLURM_JOB_ID, every Ray worker RAY_JOB_ID, every CUDA container NVIDIA_VISIBLE_DEVICES, and
#: every process under `gpuwatch run` (its redis and its editor too) both GPUWATCH_RUN_ variables.
WORKER_MARKER_KEYS: frozenset[str] = frozenset({
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "GROUP_RANK",
    "ROLE_RANK",
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMI_RANK",
    "PMIX_RANK",
    "MPI_LOCALRANKID",
    "MV2_COMM_WORLD_RANK",
    "HOROVOD_RANK",
    "JAX_COORDINATOR_ADDRESS",
})

#: Of those, the ones only a launcher's own agent sets for each rank it starts (torchrun, Open
#: MPI's orted, a PMI or PMIx process manager, MVAPICH): a process with one was started by such a
#: launcher, not by a shell loop or an entrypoint script that sets RANK and LOCAL_RANK itself.
LAUNCHER_SET_KEYS: frozenset[str] = frozenset({
    "TORCHELASTIC_RUN_ID",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "PMIX_RANK",
    "MPI_LOCALRANKID",
    "MV2_COMM_WORLD_RANK",
})


class SupervisorRef(NamedTuple):
    """The `gpuwatch run` supervisor a process names in GPUWATCH_RUN_SUPERVISOR."""

    pid: int
    start_time: float


def run_supervisor(launch_env: Mapping[str, str]) -> Optional[SupervisorRef]:
    """The supervisor named by GPUWATCH_RUN_SUPERVISOR ("4242:1767000000.25"), or None when the
    variable is absent or is not a PID and a start time."""
    # Most processes: asked for each, at every poll and by several detectors, so no ABC check.
    if not launch_env or RUN_SUPERVISOR_KEY not in launch_env:
        return None
    value = _env_value(launch_env, RUN_SUPERVISOR_KEY)
    pid_text, sep, start_text = value.partition(":")
    if not sep or not (pid_text.isascii() and pid_text.isdigit()):
        return None
    try:
        start = float(start_text)
    except ValueError:
        return None
    pid = int(pid_text)
    if not 0 < pid < 1 << 32 or not math.isfinite(start) or start <= 0:
        return None
    return SupervisorRef(pid, start)


def _env_value(env: Mapping[str, str], key: str) -> str:
    value = env.get(key)
    return value.strip() if isinstance(value, str) else ""
