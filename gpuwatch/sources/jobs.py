"""Which job a process belongs to, read from its cgroup and its launch environment.

Pure parsing: the caller reads /proc/PID/cgroup and /proc/PID/environ and hands the contents over,
so every format here can be pinned by fixtures (tests/fixtures/cgroup) without a live node.

The cgroup is the stronger evidence: schedulers and runtimes place the process there themselves,
and a process cannot leave without privileges. The environment is inherited and can be set by
anyone, but it is the only place a torchrun run id or an MPI rank is written down.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from gpuwatch.launch_env import (
    LAUNCH_ENV_KEYS,
    RAY_JOB_ID_KEY,
    RAY_JOB_SOURCE,
    RUN_ID_KEY,
    TORCHELASTIC_DEFAULT_RUN_ID,
    TORCHELASTIC_RUN_ID_KEY,
)
from gpuwatch.model import Job


@dataclass(frozen=True)
class CgroupInfo:
    """What a process's /proc/PID/cgroup says about where it runs.

    `version` is 2 on a unified (cgroup v2) host and 1 on a legacy v1 host. It is 0 for a hybrid
    host (v1 controllers plus systemd's controller-less unified hierarchy, e.g. Ubuntu 20.04,
    RHEL 8 with the unified tree mounted), and also when the text held no valid line at all:
    neither case is a single hierarchy one can read limits from.

    `path` is the unified path on a v2 host. On v1 and hybrid hosts it is the v1 path that
    carries the attribution (Slurm's cgroup plugin and the cgroupfs drivers only write the v1
    controller hierarchies; systemd's unified tree there just says "slurmd.service"), with the
    memory controller preferred, then cpu, pids, devices, freezer and name=systemd.
    """

    path: Optional[str] = None
    version: int = 0
    slurm_job_id: Optional[str] = None
    #: "0", "1", ..., "batch", "extern", "interactive".
    slurm_step: Optional[str] = None
    #: Only cgroup v1 puts the uid in the path (/slurm/uid_1000/job_...); v2 does not.
    slurm_uid: Optional[int] = None
    #: Always dashed 8-4-4-4-12 (the systemd driver writes underscores). A static (mirror) pod's
    #: UID is a 32-hex hash without dashes and is kept as it is: that is its real UID.
    pod_uid: Optional[str] = None
    #: "guaranteed" | "burstable" | "besteffort"; None when the QoS level is not in the path.
    qos_class: Optional[str] = None
    #: Full 64-hex id of the outermost container: the one the node's runtime knows and can act on
    #: (a docker-in-docker inner container is invisible to the host runtime).
    container_id: Optional[str] = None
    #: "docker" | "containerd" | "cri-o" | "podman"; None where the path does not say (the
    #: cgroupfs driver names a Kubernetes container by its bare id whatever the runtime).
    container_runtime: Optional[str] = None
    #: Innermost .service or .scope unit, e.g. "train.service", "session-3.scope".
    systemd_unit: Optional[str] = None


# -- /proc/PID/cgroup -------------------------------------------------------------------------

_HIERARCHY_ID = re.compile(r"[0-9]+")
# The kernel appends this to a cgroup v2 path whose cgroup was removed (a zombie's, typically).
_DELETED_SUFFIX = " (deleted)"

# Slurm's cgroup root: v1 "slurm" (or "slurm_<node>" built with --enable-multiple-slurmd);
# v2 the "slurmstepd.scope" systemd scope (or "<node>_slurmstepd.scope").
_SLURM_ROOT = re.compile(r"slurm(?:_[^/]+)?|(?:[^/]+_)?slurmstepd\.scope")
_SLURM_UID = re.compile(r"uid_([0-9]+)")
_SLURM_JOB = re.compile(r"job_([0-9]+)")
_SLURM_STEP = re.compile(r"step_([0-9A-Za-z_.+]+)")

# Kubelet's systemd driver escapes the pod UID's dashes as underscores (a dash means nesting in a
# slice name); guaranteed pods sit directly under kubepods.slice with no QoS slice.
_POD_SLICE = re.compile(r"kubepods(?:-(burstable|besteffort))?-pod([0-9a-fA-F_]+)\.slice")
# Kubelet's cgroupfs driver: /kubepods[/burstable|/besteffort]/pod<uid>/...
_POD_DIR = re.compile(r"pod([0-9a-fA-F-]+)")
_CGROUPFS_POD_PARENTS = {"kubepods": "guaranteed", "burstable": "burstable",
                         "besteffort": "besteffort"}
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_STATIC_POD_UID = re.compile(r"[0-9a-f]{32}")

# Container scopes as the runtimes' systemd cgroup drivers name them.
_CONTAINER_SCOPE = re.compile(r"(cri-containerd|docker|crio|libpod|nerdctl)-([0-9a-f]{64})\.scope")
# cgroupfs drivers: a bare id (runc for docker and containerd), or CRI-O's / podman's prefix.
_CONTAINER_DIR = re.compile(r"(?:(crio|libpod)-)?([0-9a-f]{64})")
_RUNTIMES = {"cri-containerd": "containerd", "nerdctl": "containerd", "docker": "docker",
             "crio": "cri-o", "libpod": "podman"}

_UNIT = re.compile(r"[^/]+\.(?:service|scope)")

# How informative a v1 controller's path usually is: memory is the controller every job and
# container manager places processes in; name=systemd only mirrors systemd's units.
_CONTROLLER_RANK = {"memory": 0, "cpu": 1, "cpuacct": 1, "pids": 2, "devices": 3, "freezer": 4,
                    "name=systemd": 5}
_OTHER_RANK = 6


@dataclass(frozen=True)
class _PathFacts:
    slurm: Optional[tuple[str, Optional[str], Optional[int]]] = None  # job, step, uid
    pod: Optional[tuple[str, Optional[str]]] = None  # uid, qos
    container: Optional[tuple[str, Optional[str]]] = None  # id, runtime
    unit: Optional[str] = None

    @property
    def attributes(self) -> bool:
        return self.slurm is not None or self.pod is not None or self.container is not None


def parse_cgroup(text: str) -> CgroupInfo:
    """Parse /proc/PID/cgroup text: "hierarchy-ID:controller-list:path" per line.

    Lines that do not have that form are ignored, so a garbled or partial read gives less
    information, never an exception.
    """
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", "replace")
    if not isinstance(text, str):
        return CgroupInfo()
    unified: Optional[str] = None
    v1: list[tuple[int, int, str]] = []  # rank, position in the file, path
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not _HIERARCHY_ID.fullmatch(parts[0]):
            continue
        hierarchy, controllers, path = parts
        if path.endswith(_DELETED_SUFFIX):
            path = path[: -len(_DELETED_SUFFIX)]
        if not path.startswith("/"):
            continue
        if hierarchy == "0" and not controllers:
            if unified is None:
                unified = path
        elif controllers:
            rank = min((_CONTROLLER_RANK.get(c, _OTHER_RANK) for c in controllers.split(",")),
                       default=_OTHER_RANK)
            v1.append((rank, len(v1), path))

    if not v1:
        if unified is None:
            return CgroupInfo()
        return _info(unified, 2, [unified], [unified], {unified: _facts(unified)})

    # v1 or hybrid. The unified line of a hybrid host is systemd's own process tracking: the best
    # source for the unit, the last for everything else.
    ordered = [path for _, _, path in sorted(v1)]
    if unified is not None:
        ordered.append(unified)
    facts = {path: _facts(path) for path in ordered}
    systemd_paths = [p for r, _, p in sorted(v1) if r == _CONTROLLER_RANK["name=systemd"]]
    unit_order = ([unified] if unified is not None else []) + systemd_paths + ordered

    chosen = (next((p for p in ordered if facts[p].slurm is not None), None)
              or next((p for p in ordered if facts[p].attributes), None)
              or next((p for p in ordered if facts[p].unit is not None), None)
              or next((p for p in ordered if p != "/"), None)
              or ordered[0])
    return _info(chosen, 0 if unified is not None else 1, ordered, unit_order, facts)


def _info(path: str, version: int, ordered: list[str], unit_order: list[str],
          facts: dict[str, _PathFacts]) -> CgroupInfo:
    """Each attribute from the first path (in preference order) that has it."""
    slurm = next((facts[p].slurm for p in ordered if facts[p].slurm is not None), None)
    pod = next((facts[p].pod for p in ordered if facts[p].pod is not None), None)
    container = next((facts[p].container for p in ordered if facts[p].container is not None),
                     None)
    unit = next((facts[p].unit for p in unit_order if facts[p].unit is not None), None)
    return CgroupInfo(
        path=path,
        version=version,
        slurm_job_id=slurm[0] if slurm else None,
        slurm_step=slurm[1] if slurm else None,
        slurm_uid=slurm[2] if slurm else None,
        pod_uid=pod[0] if pod else None,
        qos_class=pod[1] if pod else None,
        container_id=container[0] if container else None,
        container_runtime=container[1] if container else None,
        systemd_unit=unit,
    )


def _facts(path: str) -> _PathFacts:
    # ".." appears when the reader sits in another cgroup namespace (gpuwatch as a DaemonSet with
    # a private cgroupns sees "/../../kubepods-besteffort.slice/..."): the names that follow are
    # still the real ones, so match by component, never by an anchored prefix.
    segments = [s for s in path.split("/") if s and s != ".."]
    return _PathFacts(slurm=_slurm(segments), pod=_pod(segments),
                      container=_container(segments), unit=_unit(segments))


def _slurm(segments: list[str]) -> Optional[tuple[str, Optional[str], Optional[int]]]:
    for i, segment in enumerate(segments):
        if not _SLURM_ROOT.fullmatch(segment):
            continue
        # The job directory follows the root directly (v2) or after uid_<n> (v1); demanding the
        # root keeps an unrelated "job_7" directory from reading as a Slurm job.
        rest = segments[i + 1:]
        uid: Optional[int] = None
        if rest and _SLURM_UID.fullmatch(rest[0]):
            uid = int(rest[0][4:])
            rest = rest[1:]
        job = _SLURM_JOB.fullmatch(rest[0]) if rest else None
        if job is None:
            continue
        step = _SLURM_STEP.fullmatch(rest[1]) if len(rest) > 1 else None
        return job.group(1), step.group(1) if step else None, uid
    return None


def _pod(segments: list[str]) -> Optional[tuple[str, Optional[str]]]:
    for i, segment in enumerate(segments):
        match = _POD_SLICE.fullmatch(segment)
        if match:
            uid = _pod_uid(match.group(2).replace("_", "-"))
            if uid is not None:
                return uid, match.group(1) or "guaranteed"
            continue
        match = _POD_DIR.fullmatch(segment)
        if match and i > 0 and segments[i - 1] in _CGROUPFS_POD_PARENTS:
            uid = _pod_uid(match.group(1))
            if uid is not None:
                return uid, _CGROUPFS_POD_PARENTS[segments[i - 1]]
    return None


def _pod_uid(candidate: str) -> Optional[str]:
    candidate = candidate.lower()
    if _UUID.fullmatch(candidate) or _STATIC_POD_UID.fullmatch(candidate):
        return candidate
    return None


def _container(segments: list[str]) -> Optional[tuple[str, Optional[str]]]:
    for i, segment in enumerate(segments):  # outermost first
        match = _CONTAINER_SCOPE.fullmatch(segment)
        if match:
            return match.group(2), _RUNTIMES[match.group(1)]
        match = _CONTAINER_DIR.fullmatch(segment)
        if match:
            if match.group(1):
                return match.group(2), _RUNTIMES[match.group(1)]
            runtime = "docker" if i > 0 and segments[i - 1] == "docker" else None
            return match.group(2), runtime
    return None


def _unit(segments: list[str]) -> Optional[str]:
    for segment in reversed(segments):
        if _UNIT.fullmatch(segment) and not segment.startswith("."):
            return segment
    return None


# -- /proc/PID/environ --------------------------------------------------------------------------

_WANTED_KEYS = frozenset(LAUNCH_ENV_KEYS)
# Longer than any real value (eight MIG UUIDs in CUDA_VISIBLE_DEVICES are ~330 characters), short
# enough that a process cannot push megabytes into every snapshot through one variable.
_MAX_VALUE_CHARS = 1024


def parse_environ(raw: bytes) -> dict[str, str]:
    """The LAUNCH_ENV_KEYS present in /proc/PID/environ (NUL-separated KEY=VALUE).

    Entries without "=" (a read cut inside a name, or a process that scribbled over its
    environment block, as setproctitle can) are skipped. When a name occurs twice the first wins,
    as it does for getenv() and for Python's os.environ.
    """
    if not isinstance(raw, (bytes, bytearray, memoryview)) or not raw:
        return {}
    found: dict[str, str] = {}
    for entry in bytes(raw).split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if not sep:
            continue
        try:
            key = name.decode("ascii")
        except UnicodeDecodeError:
            continue
        if key in _WANTED_KEYS and key not in found:
            found[key] = value.decode("utf-8", "replace")[:_MAX_VALUE_CHARS]
    return found


# -- attribution -----------------------------------------------------------------------------

_SLURM_JOB_ID_VALUE = re.compile(r"[0-9]+")
# Ray's job ids are hex (`01000000`); anything else in the variable is not one.
_RAY_JOB_ID_VALUE = re.compile(r"[0-9a-fA-F]{2,64}")
# Ray's nil id (`ffffffff`): no job. `ray start` leaves it to the raylet, its agents and the
# workers of detached actors, which belong to no one job of the node.
_RAY_NIL_JOB_ID = re.compile(r"[fF]+")

# Units that are never a job. Their processes are either node infrastructure, or were started by a
# launcher serving many unrelated users and stayed in its cgroup by inheritance (sshd without
# pam_systemd keeps every login's processes in sshd.service, cron the same for every crontab):
# naming them as the job would lump unrelated work together.
_NOT_JOB_UNIT_PREFIXES = (
    "session-",  # logind login sessions
    "app-",  # desktop and `systemd-run --user` app launchers' scopes (XDG naming)
    "vte-spawn-",  # GNOME terminal tabs
    "tmux-spawn-",
    "systemd-",
    "dbus-",  # D-Bus activated services
    "snap.",
    "machine-",  # systemd-machined VMs and containers
    "docker-",
    "cri-containerd-",
    "crio-",
    "libpod-",
    "nerdctl-",
    "org.gnome.",
    "org.kde.",
    "plasma-",
    "gnome-",
)
_NOT_JOB_UNITS = frozenset({
    # login and scheduling daemons whose children inherit their cgroup
    "ssh", "sshd", "cron", "crond", "cronie", "atd", "anacron",
    "getty", "serial-getty", "autovt", "container-getty", "console-getty",
    "gdm", "gdm3", "lightdm", "sddm", "xdm", "display-manager", "xrdp", "xrdp-sesman",
    "jupyterhub",
    # the per-user systemd manager and its runtime directory
    "user", "user-runtime-dir", "init",
    # container, cluster and batch infrastructure
    "containerd", "docker", "crio", "podman", "kubelet", "k3s", "k3s-agent", "rke2-server",
    "rke2-agent", "slurmd", "slurmctld", "slurmdbd", "slurmrestd", "slurmstepd", "munge",
    # GPU node daemons that hold device handles themselves
    "nvidia-persistenced", "nvidia-fabricmanager", "nvidia-dcgm", "dcgm", "dcgm-exporter",
    "nvidia-dcgm-exporter", "nvidia-powerd", "nvidia-imex", "nvidia-mig-manager", "gpuwatch",
    "dbus", "dbus-broker", "polkit",
})


def attribute_job(cgroup: Optional[CgroupInfo], launch_env: Mapping[str, str]) -> Optional[Job]:
    """The job a process belongs to, from the strongest evidence available.

    1. Slurm, from the cgroup (placed there by slurmstepd), then from SLURM_JOB_ID/SLURM_JOBID.
       Slurm is the outermost unit of work on an HPC node: a torchrun, a container or a systemd
       unit started inside an allocation is part of that job. The environment counts too since a
       process that left the job's cgroup (setsid, a daemon started from the job) still belongs
       to, and should die with, the job.
    2. `gpuwatch run` (GPUWATCH_RUN_ID), unless a scheduler's cgroup names the job. It comes
       before every other variable, SLURM_JOB_ID from the environment included: the user put it
       around the command on purpose, and it names the whole job, launcher and helpers too. A
       pod's or a container's cgroup still wins over it, as Slurm's does: that is the id the
       scheduler cleans up by.
    3. TorchElastic run id (TORCHELASTIC_RUN_ID, unless torchrun's default "none"): it names one
       distributed run across nodes and containers, which is finer than the pod that hosts a
       rank of it and the same on every node. (A tree with the default "none" is named by its
       launcher, from the tree: gpuwatch.history.)
    4. Kubernetes pod UID: the unit the kubelet creates and deletes; its containers are parts.
    5. Container, by the 12-hex short id every runtime CLI shows.
    6. Ray job (RAY_JOB_ID, set by the raylet in each worker it starts for a job): one raylet
       serves many jobs, so the worker's own id is the only one that names its job. A pod's or
       a container's cgroup wins, as over `gpuwatch run`: that is the id the scheduler cleans
       up by.
    7. A systemd unit someone started as a job: `systemd-run --unit=train ...` (train.service),
       a transient run-u87.service, or a named unit, system or per-user. Login sessions, desktop
       app scopes, the user manager, and the daemons in _NOT_JOB_UNITS are not jobs: their
       processes share the unit by inheritance, not by being one piece of work.
    """
    env: Mapping[str, str] = launch_env if isinstance(launch_env, Mapping) else {}
    if cgroup is not None and cgroup.slurm_job_id:
        return Job(cgroup.slurm_job_id, "slurm")
    supervised = _env_value(env, RUN_ID_KEY)
    if supervised:
        if cgroup is not None and cgroup.pod_uid:
            return Job(cgroup.pod_uid, "kubernetes")
        if cgroup is not None and cgroup.container_id:
            return Job(cgroup.container_id[:12], "container")
        return Job(supervised, "run")
    for key in ("SLURM_JOB_ID", "SLURM_JOBID"):
        value = _env_value(env, key)
        if _SLURM_JOB_ID_VALUE.fullmatch(value):
            return Job(value, "slurm")
    run_id = _env_value(env, TORCHELASTIC_RUN_ID_KEY)
    if run_id and run_id != TORCHELASTIC_DEFAULT_RUN_ID:
        return Job(run_id, "torchelastic")
    if cgroup is not None and cgroup.pod_uid:
        return Job(cgroup.pod_uid, "kubernetes")
    if cgroup is not None and cgroup.container_id:
        return Job(cgroup.container_id[:12], "container")
    ray_job = _env_value(env, RAY_JOB_ID_KEY)
    if _RAY_JOB_ID_VALUE.fullmatch(ray_job) and not _RAY_NIL_JOB_ID.fullmatch(ray_job):
        return Job(ray_job, RAY_JOB_SOURCE)
    if cgroup is None:
        return None
    if cgroup.systemd_unit and _unit_is_job(cgroup.systemd_unit, cgroup.path):
        return Job(cgroup.systemd_unit, "systemd")
    return None


def _env_value(env: Mapping[str, str], key: str) -> str:
    value = env.get(key)
    return value.strip() if isinstance(value, str) else ""


def _unit_is_job(unit: str, path: Optional[str]) -> bool:
    if unit.startswith(_NOT_JOB_UNIT_PREFIXES):
        return False
    name = unit.rsplit(".", 1)[0]
    template = name.split("@", 1)[0]  # user@1000, getty@tty1, sshd@<connection>
    if template in _NOT_JOB_UNITS or name.endswith("_slurmstepd"):
        return False
    if path:
        # A desktop session's own services (gnome-shell, the compositor) live in the user
        # manager's session.slice; what the user starts goes to app.slice.
        segments = path.split("/")
        if unit in segments:
            at = segments.index(unit)
            if at > 0 and segments[at - 1] == "session.slice":
                return False
    return True
