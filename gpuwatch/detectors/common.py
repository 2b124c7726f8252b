"""What the detectors share: the finding for a process, the words for evidence.

Every finding says its evidence twice (`Evidence`): in full (`reason`, for `gpuwatch status`
and the state socket, which only the daemon's group reads) and from identity and figures only
(`summary`, which /metrics serves: docs/security.md, rule 5). A summary is built from PIDs,
kernel names (`comm`: `named`, never `named_process`, which reads the command line), clock
times, sizes, counts and gpuwatch's own words; never from a command line, an environment value,
a path, or a name a program chose for a buffer or a thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple, Optional, Union

from gpuwatch.config import DetectorConfig
from gpuwatch.frozen import memo
from gpuwatch.launch_env import RUN_ID_KEY, WORKER_MARKER_KEYS, process_title, run_supervisor
from gpuwatch.model import COMM_CHARS, Finding, HostProcess, Job, Kind, NodeSnapshot
from gpuwatch.units import human_bytes, short_command
from gpuwatch.vocabulary import ProcState, Severity

# Guards the climb against a corrupt or cyclic parent chain.
_MAX_DEPTH = 64
# The supervisor and gpuwatch each add the boot time they read, in whole seconds, to the same
# clock ticks: a clock step between the two reads shifts one start time against the other by
# whole seconds, never by a fraction.
_BOOT_TIME_STEPS = 2


def protected_by(p: HostProcess, config: DetectorConfig) -> Optional[str]:
    """Why `p` is protected (never reported, never reaped), in words; None when it is not.
    Worked out once per record and settings (the leak and orphan detectors both ask of every
    process, and a record is the same object from poll to poll while its process is unchanged).

    Only from what its user cannot set (docs/security.md, rule 2): its real uid
    (`protected_users`), the system unit systemd started it in (`protected_units`), or, for a
    process of root's, the file it runs when that file is root's (`protected_executables` by
    path, `protected_names` by the file's name). Never its comm or command line: any process
    names itself `Xorg`. Nor root's file run by another user: anyone may run root's Xorg, with
    their own code in it (LD_PRELOAD, its modules), and keep it from every reap. The detectors
    and the reaper's refusal both ask here.
    """
    return memo(_protected_by, p, config)


def _protected_by(p: HostProcess, config: DetectorConfig) -> Optional[str]:
    if p.user is not None and p.user in config.protected_users:
        return f"its user {p.user} is in detectors.protected_users"
    if p.system_unit is not None and p.system_unit in config.protected_units:
        return f"it runs in the system unit {p.system_unit} (detectors.protected_units)"
    exe = p.exe
    if exe is None or not exe.root_controlled or p.uid != 0:
        return None
    if exe.path in config.protected_executables:
        return f"it runs {exe.path} (detectors.protected_executables)"
    if exe.path.rpartition("/")[2] in config.protected_names:
        return (f"it runs {exe.path}, root's {exe.path.rpartition('/')[2]} "
                "(detectors.protected_names)")
    return None


def is_protected(p: HostProcess, config: DetectorConfig) -> bool:
    return memo(_protected_by, p, config) is not None


class Evidence(NamedTuple):
    """A finding's evidence in words: `reason` in full, `summary` from identity and figures."""

    reason: str
    summary: str

    @staticmethod
    def public(words: str) -> Evidence:
        """Evidence whose full words are public already (no command line, environment value,
        path or chosen name in them): the summary is the reason."""
        return Evidence(words, words)

    @staticmethod
    def reason_only(words: str) -> Evidence:
        """Words that only the full reason says (a command line, a job's label)."""
        return Evidence(words, "")

    @staticmethod
    def join(*parts: Union[str, Evidence]) -> Evidence:
        """`parts` in a row: a string stands in both (public words), an Evidence gives its
        reason to the reason and its summary to the summary."""
        return Evidence("".join(p if isinstance(p, str) else p.reason for p in parts),
                        "".join(p if isinstance(p, str) else p.summary for p in parts))


def judged_in_state(snapshot: NodeSnapshot, state: ProcState, config: DetectorConfig
                    ) -> Iterator[HostProcess]:
    """The processes of `snapshot` in `state` that a detector may judge: not protected."""
    for p in snapshot.processes.values():
        if p.state == state and not is_protected(p, config):
            yield p


def finding(kind: Kind, severity: Severity, p: HostProcess, evidence: Evidence) -> Finding:
    return Finding(
        kind=kind,
        severity=severity,
        reason=evidence.reason,
        summary=evidence.summary,
        pid=p.pid,
        start_time=p.start_time,
        name=p.name,
        user=p.user,
        job=p.job,
        gpus=tuple(sorted({u.gpu_index for u in p.gpu_usage})),
        gpu_memory_bytes=p.gpu_memory_bytes if p.holds_gpu else None,
    )


def by_holding(p: HostProcess) -> Severity:
    """Critical for a process that holds GPU memory (what the finding costs the node), a
    warning otherwise."""
    return Severity.CRITICAL if p.holds_gpu else Severity.WARNING


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
    """'4121 (python)': with the kernel's name (`comm`, the name cut to COMM_CHARS), this is
    public (a summary's words)."""
    return f"{pid} ({(name or '?')[:COMM_CHARS]})"


def titled(pid: Optional[int], title: Optional[str]) -> str:
    """'4121 (torchrun (pt_elastic))': a process as a reason names it (never a summary)."""
    return f"{pid} ({title or '?'})"


def named_process(p: Optional[HostProcess], pid: Optional[int]) -> str:
    """'4121 (python)', '4121 (torchrun (pt_elastic))' for a launcher that titled itself
    (launch_env.process_title), '4121 (?)' for a process not read: a reason's words."""
    return titled(pid, process_title(p.name, p.cmdline) if p is not None else None)


def pid_named(pid: Optional[int], title: Optional[str], comm: Optional[str]) -> Evidence:
    """A process as evidence names it: `titled` in the reason, `named` (its kernel name) in the
    summary."""
    return Evidence(titled(pid, title), named(pid, comm))


def process_named(p: Optional[HostProcess], pid: Optional[int]) -> Evidence:
    """The process `p` on `pid` (None: not read) as evidence names it: `named_process` in the
    reason, `named` in the summary."""
    return Evidence(named_process(p, pid), named(pid, p.name if p is not None else None))


def supervisor_gone(p: HostProcess, snapshot: NodeSnapshot) -> Optional[Evidence]:
    """Why `p` is orphaned from its `gpuwatch run` supervisor, or None while that may still run.

    The supervisor is a child subreaper: while it runs it is an ancestor of every process of its
    job. So one found among the ancestors still runs, whatever its start time reads, and a new
    process on its freed PID can never become an ancestor. Only when none is, what runs on the
    PID now is compared by start time. Nothing is concluded where the ancestry is not known up to
    the top, or the PID could not be read.
    """
    ref = run_supervisor(p.launch_env)
    if ref is None:
        return None
    current = p
    for _ in range(_MAX_DEPTH):
        if current.pid == ref.pid or ref.pid in current.namespace_pids:
            return None  # the supervisor itself, or one of its job's processes under it
        if current.ppid == 0:
            break
        up = snapshot.processes.get(current.ppid) if current.ppid else None
        if up is None or not up.in_procfs:
            return None  # ancestry not known up to the top
        current = up
    else:
        return None
    if ref.pid not in snapshot.run_supervisors:
        return None  # its PID could not be read
    now = snapshot.run_supervisors[ref.pid]
    if now is not None and _same_start(now, ref.start_time, snapshot.clock_step):
        return None  # it runs, though not above this process
    run_id = p.launch_env.get(RUN_ID_KEY, "").strip()
    of_job = f" of job {Job(run_id, 'run')}" if run_id else ""
    # Inside a container the PID may be the container's: what runs on the host's says nothing.
    reused = (f" (PID {ref.pid} is another process now)"
              if now is not None and not p.namespace_pids else "")
    # The run id is the job's id, which the finding's job labels carry: the summary leaves it.
    return Evidence(f"its supervisor `gpuwatch run` (PID {ref.pid}){of_job} is gone{reused}",
                    f"its supervisor `gpuwatch run` (PID {ref.pid}) is gone{reused}")


def _same_start(seen: float, given: float, clock_step: float) -> bool:
    """`clock_step`: a supervisor started after the wall clock stepped read a boot time moved
    by the step (the kernel keeps boot time = wall clock - time since boot); the daemon read its
    own before."""
    offset = seen - given
    if abs(offset - round(offset)) >= 0.005:
        return False
    return any(abs(round(offset) - moved) <= _BOOT_TIME_STEPS for moved in (0, -round(clock_step)))
