"""The launch environment's vocabulary: the variables `gpuwatch run` and distributed launchers
set for the processes of a job, and what they say.

Shared by the process source (which reads them from /proc/PID/environ), the detectors (which
judge by them), the supervisor (which sets them) and the views: kept here, below all of them,
so that a detector needs nothing of a source to know what a worker is. Standard library only,
and nothing of gpuwatch: the agent may import it as it imports gpuwatch.protocol (.importlinter).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
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
#: Set by `gpuwatch run` for its whole job (with AGENT_BOOTSTRAP_DIR first on PYTHONPATH): "auto"
#: or "1" has every Python process of the job load the agent at start; "0" or unset, none does.
AGENT_KEY = "GPUWATCH_AGENT"
#: The directory whose sitecustomize.py loads the agent at start (gpuwatch.agent.bootstrap).
AGENT_BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent",
                                   "bootstrap")
#: Set by torchrun's elastic agent for the workers it starts: names the job as `torchelastic`.
TORCHELASTIC_RUN_ID_KEY = "TORCHELASTIC_RUN_ID"
#: The run id torchrun gives its workers without `--rdzv-id` (the default static rendezvous, and
#: `accelerate launch`, which runs torchrun's agent in its own process): shared by every such run
#: on every node, so it names no job. Such a tree is named by its launcher instead, as
#: `torchrun:<launcher PID>` (TORCHRUN_JOB_SOURCE).
TORCHELASTIC_DEFAULT_RUN_ID = "none"
TORCHRUN_JOB_SOURCE = "torchrun"
#: Set by the raylet in every worker it starts for a Ray job: names the worker's job `ray:<id>`.
RAY_JOB_ID_KEY = "RAY_JOB_ID"
RAY_JOB_SOURCE = "ray"
#: Titles launchers give their own process (its kernel name, /proc/PID/comm), and the program
#: each stands for when the command line does not say: torch.distributed.run names its main
#: thread, and so the process, `pt_elastic` (torchrun, `python -m torch.distributed.run`,
#: `accelerate launch`).
LAUNCHER_TITLES: Mapping[str, str] = {"pt_elastic": "torchrun"}
# The launcher modules a title stands for, by the name people know them by.
_TITLED_MODULES = {"torch.distributed.run": "torchrun", "torch.distributed.launch": "torchrun"}
# A launcher's program name in a sentence, at most (a command line is the user's to choose).
_PROGRAM_CHARS = 64

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


#: Distributed-launch variables kept as evidence of what a process is. Everything else in an
#: environment is dropped unread: environments hold tokens and passwords.
LAUNCH_ENV_KEYS: tuple[str, ...] = (
    # torchrun / torchelastic, set per worker by the elastic agent.
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    # Lightning's and several launchers' node index.
    "NODE_RANK",
    # Slurm: the job (both spellings are set), the array it belongs to, the task's place in the
    # step, and the GPUs it was allocated (a process using others is worth flagging).
    "SLURM_JOB_ID",
    "SLURM_JOBID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_JOB_GPUS",
    "SLURM_STEP_GPUS",
    # MPI ranks: Open MPI, PMI-1/2 (MPICH, Intel MPI, Slurm's pmi2), PMIx, Intel MPI, MVAPICH2.
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "PMIX_RANK",
    "MPI_LOCALRANKID",
    "MV2_COMM_WORLD_RANK",
    "MV2_COMM_WORLD_LOCAL_RANK",
    # Horovod's own launcher (under mpirun it relies on the MPI variables above).
    "HOROVOD_RANK",
    "HOROVOD_LOCAL_RANK",
    "HOROVOD_SIZE",
    # jax.distributed.initialize() reads this one itself. JAX_PROCESS_ID / JAX_NUM_PROCESSES are
    # only conventions of user scripts (JAX takes ranks from Slurm, Open MPI or its arguments),
    # so they are not kept.
    "JAX_COORDINATOR_ADDRESS",
    # The raylet sets it in every worker it starts: which Ray job a GPU-holding worker serves.
    "RAY_JOB_ID",
    # Which GPUs the process was handed, by its launcher or by the container toolkit / device
    # plugin: compared with what NVML says it uses.
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    # No pod-name variable: Kubernetes sets none by default (POD_NAME and the like are whatever a
    # manifest chose via the downward API), and the cgroup already names the pod by UID.
    # `gpuwatch run`: the job's name, and which supervisor it runs under (see RUN_SUPERVISOR_KEY).
    "GPUWATCH_RUN_ID",
    "GPUWATCH_RUN_SUPERVISOR",
)


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


def process_title(name: Optional[str], cmdline: Sequence[str]) -> Optional[str]:
    """How a sentence names a process: its kernel name, and for a launcher that titled itself
    (LAUNCHER_TITLES) the program it runs as well, so that people find it under the name they
    started it by: "torchrun (pt_elastic)", "accelerate (pt_elastic)"."""
    if name is None or name not in LAUNCHER_TITLES:
        return name
    return f"{_launcher_program(cmdline) or LAUNCHER_TITLES[name]} ({name})"


def _launcher_program(cmdline: Sequence[str]) -> Optional[str]:
    """`torchrun` of `python3 /usr/bin/torchrun ...`, `accelerate` of `accelerate launch ...`,
    the module of `python -m torch.distributed.run ...`."""
    args = list(cmdline[:4])
    if not args:
        return None
    program = _base(args[0])
    if program.startswith("python"):  # the script or module it runs, after its options
        for i, arg in enumerate(args[1:], 1):
            if arg == "-m":
                module = args[i + 1] if i + 1 < len(args) else ""
                program = _TITLED_MODULES.get(module, module)
                break
            if not arg.startswith("-"):
                program = _base(arg)
                break
    program = program[:_PROGRAM_CHARS]
    return program if program and program.isprintable() else None


def _base(program: str) -> str:
    return program.rsplit("/", 1)[-1]
