"""The reaper: free GPU memory held by processes of dead jobs, safely.

It plans from a status document (the daemon's view, or one poll), so `reap --dry-run` shows
exactly what the daemon sees. Safety, in order of precedence:
- only findings of reapable kinds are candidates; what signals cannot end (unkillable) or where
  there is no process (a ghost) is reported, never signalled;
- never PID 1, the daemon itself, kernel threads, protected names or users; another user's process
  only as root and only where the policy allows it;
- the identity (PID and start time) is checked right before every signal, so a PID reused by a
  new process is never signalled (gpuwatch.actions.signals, the one signalling path);
- SIGTERM, a grace period, then SIGKILL; a zombie is reaped through its parent;
- every planned and executed action goes to an append-only audit log (reap.jsonl).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from gpuwatch.actions.signals import SAME, SETTLE, ProcessRef, Signaller
from gpuwatch.config import Config

AUDIT_NAME = "reap.jsonl"
#: What a reap may act on by default; unkillable and ghost findings can only be reported.
REAPABLE_KINDS = frozenset({"orphan", "leftover", "zombie"})

#: What carrying out an action can end in (a dry run's results are all "planned").
OUTCOMES = ("exited", "killed", "reaped", "gone", "identity-changed", "refused", "unkillable",
            "still-running", "failed")

TERMINATE = "terminate"
VIA_PARENT = "reap-via-parent"
REPORT = "report"
REFUSE = "refuse"



@dataclass(frozen=True)
class Filters:
    kinds: frozenset[str] = REAPABLE_KINDS
    job: Optional[str] = None
    pids: frozenset[int] = frozenset()
    user: Optional[str] = None
    older_than: float = 0.0


@dataclass(frozen=True)
class Action:
    kind: str
    action: str
    reason: str
    pid: Optional[int]
    start_time: Optional[float]
    name: Optional[str] = None
    user: Optional[str] = None
    job: Optional[dict[str, str]] = None
    gpu_memory_bytes: Optional[int] = None
    gpus: tuple[int, ...] = ()
    #: The process that gets the signal: the finding's, or a zombie's parent.
    target: Optional[int] = None
    target_start_time: Optional[float] = None
    signals: tuple[str, ...] = ()
    refused: Optional[str] = None

    def as_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_time": self.start_time, "name": self.name,
                "user": self.user, "job": self.job, "kind": self.kind, "action": self.action,
                "target": self.target, "signals": list(self.signals),
                "gpu_memory_bytes": self.gpu_memory_bytes, "gpus": list(self.gpus),
                "reason": self.reason, "refused": self.refused}


@dataclass(frozen=True)
class Result:
    action: Action
    #: "planned", or one of OUTCOMES
    result: str
    detail: str = ""

    @property
    def freed(self) -> bool:
        return self.result in ("exited", "killed", "reaped", "gone")

    def as_json(self) -> dict[str, Any]:
        return {**self.action.as_json(), "result": self.result, "detail": self.detail}


class Reaper:
    def __init__(self, config: Config, audit_path: Path, daemon_pid: Optional[int] = None,
                 actor: str = "cli", euid: Optional[int] = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.audit_path = audit_path
        self.daemon_pid = daemon_pid
        self.actor = actor
        self.euid = os.geteuid() if euid is None else euid
        self._clock = clock
        self._signals = Signaller()

    # -- planning ------------------------------------------------------------------------------
    def plan(self, doc: dict[str, Any], filters: Filters = Filters(), dry_run: bool = False,
             grace: Optional[float] = None) -> list[Action]:
        """`grace` (default: the config's) is only what the plan says; execute() takes its own."""
        processes = {p["pid"]: p for p in doc["processes"]}
        chosen = [f for f in doc["findings"] if self._selected(f, doc, filters)]
        candidates = {f["pid"] for f in chosen if f["pid"] is not None}
        wait = self.config.reaper.grace if grace is None else grace
        actions = [self._action(f, processes, candidates, wait) for f in chosen]
        # Zombies last: terminating their parents first is what may reap them.
        actions.sort(key=lambda a: a.action == VIA_PARENT)
        self._audit([Result(a, "planned") for a in actions], phase="planned", dry_run=dry_run)
        return actions

    def _selected(self, f: dict[str, Any], doc: dict[str, Any], filters: Filters) -> bool:
        if f["kind"] not in filters.kinds:
            return False
        if filters.pids and f["pid"] not in filters.pids:
            return False
        if filters.user is not None and f["user"] != filters.user:
            return False
        if filters.job is not None and not _job_matches(f["job"], filters.job):
            return False
        return doc["taken_at"] - f["since"] >= filters.older_than

    def _action(self, f: dict[str, Any], processes: dict[int, dict[str, Any]],
                candidates: set[int], grace: float) -> Action:
        pid = f["pid"]
        proc = processes.get(pid) if pid is not None else None
        base = {"kind": f["kind"], "reason": f["reason"], "pid": pid,
                "start_time": f["start_time"], "name": f["name"], "user": f["user"],
                "job": f["job"], "gpu_memory_bytes": f["gpu_memory_bytes"],
                "gpus": tuple(f["gpus"])}
        if f["kind"] == "unkillable":
            return Action(action=REPORT, **base,
                          refused="in uninterruptible sleep: signals cannot end it")
        if pid is None or proc is None or not proc["in_procfs"]:
            return Action(action=REPORT, **base,
                          refused="no process to signal: only the driver can release it")
        refusal = self._refusal(proc)
        if refusal is not None:
            return Action(action=REFUSE, **base, refused=refusal)
        if f["kind"] == "zombie" and (proc["num_threads"] or 0) <= 1:
            parent = processes.get(proc["ppid"])
            if parent is None:
                return Action(action=REFUSE, **base, refused="its parent is not known")
            if parent["pid"] in candidates:
                signals: tuple[str, ...] = (f"none: its parent {parent['pid']} is reaped too",)
            else:
                refusal = self._refusal(parent)
                if refusal is not None and parent["pid"] != 1:
                    return Action(action=REFUSE, **base, refused=f"its parent is {refusal}")
                signals = (f"SIGCHLD to its parent {parent['pid']}",)
            return Action(action=VIA_PARENT, **base, target=parent["pid"],
                          target_start_time=parent["start_time"], signals=signals)
        return Action(action=TERMINATE, **base, target=pid, target_start_time=f["start_time"],
                      signals=("SIGTERM", f"SIGKILL after {grace:g} s"))

    def _refusal(self, proc: dict[str, Any]) -> Optional[str]:
        pid, name, user = proc["pid"], proc["name"] or "", proc["user"] or ""
        if pid <= 1:
            return "PID 1"
        if pid == self.daemon_pid or pid == os.getpid():
            return "the gpuwatch daemon itself" if pid == self.daemon_pid else "gpuwatch itself"
        if pid == 2 or proc["ppid"] == 2:
            return "a kernel thread"
        if name in self.config.detectors.protected_names:
            return f"a protected name ({name})"
        if user in self.config.detectors.protected_users:
            return f"a protected user's process ({user})"
        if proc["uid"] is not None and proc["uid"] != self.euid:
            if self.euid != 0:
                return f"another user's process ({user}): only root may signal it"
            if not self.config.reaper.allow_other_users:
                return f"another user's process ({user}): reaper.allow_other_users is off"
        return None

    # -- acting --------------------------------------------------------------------------------
    def execute(self, actions: Iterable[Action], grace: Optional[float] = None
                ) -> list[Result]:
        wait = self.config.reaper.grace if grace is None else grace
        results = []
        for a in actions:
            if a.action == REFUSE:
                r = Result(a, "refused", a.refused or "")
            elif a.action == REPORT:
                r = Result(a, "unkillable" if a.kind == "unkillable" else "failed",
                           a.refused or "")
            elif a.action == VIA_PARENT:
                r = self._reap_via_parent(a)
            else:
                r = self._terminate(a, wait)
            results.append(r)
        self._audit(results, phase="executed", dry_run=False)
        return results

    def _terminate(self, a: Action, grace: float) -> Result:
        assert a.target is not None
        ending = self._signals.terminate(ProcessRef(a.target, a.target_start_time), grace)
        return Result(a, ending.result, ending.detail)

    def _reap_via_parent(self, a: Action) -> Result:
        assert a.pid is not None and a.target is not None
        zombie = ProcessRef(a.pid, a.start_time)
        if self._signals.wait_collected(zombie, 0.5):
            return Result(a, "reaped", "its parent reaped it")
        parent = ProcessRef(a.target, a.target_start_time)
        told = False
        if a.target != 1:
            try:
                told = self._signals.send(parent, signal.SIGCHLD) == SAME
            except OSError as exc:
                return Result(a, "failed", f"cannot signal its parent: {exc.strerror}")
        if self._signals.wait_collected(zombie, SETTLE):
            return Result(a, "reaped", "reaped after its parent was told (SIGCHLD)"
                          if told else "reaped by its new parent")
        return Result(a, "failed", f"its parent {a.target} does not reap it: end the parent, "
                                   "or wait for it to exit")

    # -- audit ---------------------------------------------------------------------------------
    def _audit(self, results: list[Result], phase: str, dry_run: bool) -> None:
        if not results:
            return
        self.audit_path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        now = self._clock()
        lines = "".join(json.dumps({"ts": round(now, 3), "actor": self.actor, "uid": self.euid,
                                    "phase": phase, "dry_run": dry_run, **r.as_json()}) + "\n"
                        for r in results)
        # One append per batch, O_APPEND: concurrent writers never interleave inside a line.
        fd = os.open(self.audit_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                     0o640)
        try:
            os.write(fd, lines.encode())
        finally:
            os.close(fd)


def _job_matches(job: Optional[dict[str, str]], wanted: str) -> bool:
    """`--job 41234` (the id a scheduler hands its epilog) or `--job slurm:41234` (as `status`
    shows it)."""
    if not job:
        return False
    return wanted in (job["id"], f"{job['source']}:{job['id']}")


def read_audit_counts(path: Path, offset: int) -> tuple[dict[tuple[str, str], int], int]:
    """Executed results in the audit log after byte `offset`: ({(kind, result): n}, new offset).

    A log that shrank (rotated) is read from the start again. Lines that do not parse are
    skipped: the log is append-only, and a torn last line is completed on the next read.
    """
    try:
        size = path.stat().st_size
    except OSError:
        return {}, 0
    if size < offset:
        offset = 0
    counts: dict[tuple[str, str], int] = {}
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    complete = data.rfind(b"\n") + 1
    for line in data[:complete].splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("phase") == "executed":
            key = (str(entry.get("kind")), str(entry.get("result")))
            counts[key] = counts.get(key, 0) + 1
    return counts, offset + complete
