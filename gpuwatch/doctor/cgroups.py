"""The cgroups check: the hierarchy, and the job cgroups (Slurm, pods, containers) among the
processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gpuwatch.doctor.base import OK, WARN, Check, Context, pid_dirs
from gpuwatch.sources.jobs import parse_cgroup
from gpuwatch.units import plural

_V1_CONTROLLERS = ("memory", "cpu", "cpuacct", "pids", "devices", "freezer", "blkio", "cpuset")
_KUBELETS = frozenset({"kubelet", "k3s-server", "k3s-agent", "rke2-agent", "rke2-server"})


def cgroup_layout(sys_cgroup: Path) -> str:
    """"v2", "hybrid" (v1 controllers plus systemd's unified tree), "v1" or "none"."""
    if (sys_cgroup / "cgroup.controllers").exists():
        return "v2"
    v1 = any((sys_cgroup / c).is_dir() for c in _V1_CONTROLLERS)
    if v1 and (sys_cgroup / "unified").is_dir():
        return "hybrid"
    return "v1" if v1 else "none"


@dataclass
class _Attribution:
    processes: int = 0
    slurm_jobs: set[str] = field(default_factory=set)
    pods: set[str] = field(default_factory=set)
    containers: set[str] = field(default_factory=set)
    names: set[str] = field(default_factory=set)


def _scan_attribution(proc: Path) -> _Attribution:
    seen = _Attribution()
    for entry in pid_dirs(proc):
        try:
            text = (proc / entry.name / "cgroup").read_text(errors="replace")
            comm = (proc / entry.name / "comm").read_text(errors="replace").strip()
        except OSError:
            continue  # exited, or hidden by hidepid (the proc-mount check says so)
        seen.processes += 1
        seen.names.add(comm)
        info = parse_cgroup(text)
        if info.slurm_job_id:
            seen.slurm_jobs.add(info.slurm_job_id)
        if info.pod_uid:
            seen.pods.add(info.pod_uid)
        elif info.container_id:
            seen.containers.add(info.container_id)
    return seen


def check_cgroups(ctx: Context) -> list[Check]:
    layout = cgroup_layout(ctx.sys_cgroup)
    seen = _scan_attribution(ctx.proc)
    kind = {"v2": "cgroup v2 (unified)",
            "hybrid": "cgroup hybrid (v1 controllers, jobs read from the v1 paths)",
            "v1": "cgroup v1", "none": f"no cgroup hierarchy under {ctx.sys_cgroup}"}[layout]
    sources = []
    if seen.slurm_jobs:
        sources.append(f"Slurm ({plural(len(seen.slurm_jobs), 'job')})")
    if seen.pods:
        sources.append(f"Kubernetes ({plural(len(seen.pods), 'pod')})")
    if seen.containers:
        sources.append(f"containers ({len(seen.containers)})")
    among = plural(seen.processes, "process")
    found = (f"job cgroups among {among}: {', '.join(sources)}" if sources
             else f"no Slurm, pod or container cgroup among {among} (jobs then come from launch "
                  "environments and systemd units)")
    if layout == "none":
        return [Check("cgroups", WARN, f"{kind}; {found}",
                      fix="mount the cgroup filesystem; in a container, mount the host's "
                          "/sys/fs/cgroup read-only")]
    if "slurmstepd" in seen.names and not seen.slurm_jobs:
        return [Check("cgroups", WARN,
                      f"{kind}; Slurm steps run (slurmstepd), but no process is in a Slurm job "
                      "cgroup: jobs are named only from SLURM_JOB_ID in environments, which "
                      "needs root to read",
                      fix="set ProctrackType=proctrack/cgroup and TaskPlugin=task/cgroup in "
                          "slurm.conf (and cgroup.conf), then restart slurmd")]
    if seen.names & _KUBELETS and not seen.pods:
        return [Check("cgroups", WARN,
                      f"{kind}; the kubelet runs, but no process is in a pod cgroup: this "
                      "process sees a cgroup namespace or /proc of its own",
                      fix="run gpuwatch with `hostPID: true` and the host's /sys/fs/cgroup "
                          "mounted, in the host's cgroup namespace")]
    return [Check("cgroups", OK, f"{kind}; {found}")]
