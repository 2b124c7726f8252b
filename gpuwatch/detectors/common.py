"""What the detectors share: the finding for a process, the words for evidence."""

from __future__ import annotations

from typing import Optional

from gpuwatch.config import DetectorConfig
from gpuwatch.model import Finding, HostProcess
from gpuwatch.sources.jobs import WORKER_MARKER_KEYS
from gpuwatch.units import human_bytes, short_command


def is_protected(p: HostProcess, config: DetectorConfig) -> bool:
    return (p.name or "") in config.protected_names or (p.user or "") in config.protected_users


def finding(kind: str, severity: str, p: HostProcess, reason: str) -> Finding:
    return Finding(
        kind=kind,
        severity=severity,
        reason=reason,
        pid=p.pid,
        start_time=p.start_time,
        name=p.name,
        user=p.user,
        job=p.job,
        gpus=tuple(sorted({u.gpu_index for u in p.gpu_usage})),
        gpu_memory_bytes=p.gpu_memory_bytes if p.holds_gpu else None,
    )


def gpu_words(p: HostProcess) -> str:
    """'4.0 GiB on GPU 0' / '6.0 GiB on GPUs 0,1' / '' for a process without GPU memory."""
    if not p.holds_gpu:
        return ""
    gpus = sorted({u.gpu_index for u in p.gpu_usage})
    where = f"GPU {gpus[0]}" if len(gpus) == 1 else "GPUs " + ",".join(map(str, gpus))
    return f"{human_bytes(p.gpu_memory_bytes)} on {where}"


def worker_evidence(p: HostProcess) -> Optional[str]:
    """'TORCHELASTIC_RUN_ID, LOCAL_RANK=3' when the environment marks a distributed worker."""
    keys = sorted(k for k in p.launch_env if k in WORKER_MARKER_KEYS)
    if not keys:
        return None
    # Rank values identify the worker; ids and addresses only need naming.
    shown = [f"{k}={p.launch_env[k]}" if "RANK" in k or k.endswith(("PROCID", "LOCALID"))
             else k for k in keys]
    return ", ".join(shown)


def command(p: HostProcess, limit: int = 80) -> str:
    """The command line for a sentence (units.short_command), cut at `limit` characters."""
    text = short_command(p.name, p.cmdline)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def named(pid: Optional[int], name: Optional[str]) -> str:
    return f"{pid} ({name or '?'})"
