"""A cgroup of the job's own, where gpuwatch may make one: membership that no fork, setsid or
reparenting can leave.

`gpuwatch run` owns its job's process tree as a child subreaper; a cgroup adds membership the
kernel keeps whatever the tree does. Two ways, the first that works:

- **cgroup v2**: a child of the supervisor's own cgroup in the unified hierarchy
  (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on a hybrid host), where the supervisor may
  write: as root, or in a subtree delegated to its user (a systemd user service with
  `Delegate=yes`, a container given its own cgroup namespace). `cgroup.kill` (Linux 5.14+) ends
  every member at once.
- **cgroup v1**: a child under `gpuwatch/` in the `pids` hierarchy, as root on a v1 host.

Where neither works (no root, no delegation: a plain login session), the job runs without one
and the supervisor owns it through the tree alone; `reason` says why. A transient systemd scope
(`systemd-run --scope`) is not used: it needs a systemd manager to talk to, and where there is one
with a delegated subtree the v2 way covers it.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Optional

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_V1_HIERARCHY = "pids"
#: Where cgroup v1 job cgroups go, in the pids hierarchy.
_V1_PARENT = "gpuwatch"
#: How every job cgroup's name starts: gpuwatch-run-<job id>-<supervisor PID>.
JOB_CGROUP_PREFIX = "gpuwatch-run-"
# /proc/PID/cgroup, read at most (a line per hierarchy; paths are bounded by PATH_MAX).
_PROC_CGROUP_BYTES = 64 << 10


class CgroupUnavailable(Exception):
    """No cgroup could be made for the job; the message says why, for the summary."""


class JobCgroup:
    """One job's cgroup: made before the job starts, joined by its first process, listed and
    emptied at the end, removed when empty."""

    def __init__(self, path: Path, mode: str) -> None:
        self.path = path
        #: "cgroup v2" or "cgroup v1"
        self.mode = mode

    @classmethod
    def create(cls, name: str, root: Path = _CGROUP_ROOT,
               proc_self_cgroup: str = "/proc/self/cgroup") -> JobCgroup:
        """Make the job's cgroup, v2 first; raises CgroupUnavailable with every reason."""
        try:
            lines = Path(proc_self_cgroup).read_text().splitlines()
        except OSError as exc:
            raise CgroupUnavailable(f"cannot read {proc_self_cgroup}: {exc.strerror}") from None
        reasons = []
        for mode, parent in _candidates(lines, root):
            path = parent / name
            try:
                if mode == "cgroup v1":
                    parent.mkdir(exist_ok=True)  # gpuwatch/ holds every job's, made once
                path.mkdir()
            except FileExistsError:
                reasons.append(f"{path} exists already")
                continue
            except OSError as exc:
                reasons.append(f"{mode}: cannot create {path}: {exc.strerror}")
                continue
            return cls(path, mode)
        if not reasons:
            reasons.append(f"no cgroup hierarchy under {root}")
        raise CgroupUnavailable("; ".join(reasons))

    def join(self, pid: int) -> None:
        """Move `pid` (the job's first process, before it starts anything) into the cgroup."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> set[int]:
        """Every process in the cgroup and the cgroups below it (the job may make its own) that
        this PID namespace can see. cgroup v2 lists a member outside it as PID 0, which is no
        process to signal: kill(0) would signal the caller's own process group."""
        found: set[int] = set()
        for procs in [self.path / "cgroup.procs", *self.path.glob("**/cgroup.procs")]:
            with contextlib.suppress(OSError, ValueError):
                found.update(int(line) for line in procs.read_text().split())
        found.discard(0)
        return found

    def kill(self) -> bool:
        """SIGKILL every member at once where the kernel can (cgroup v2's cgroup.kill)."""
        try:
            (self.path / "cgroup.kill").write_text("1")
        except OSError:
            return False
        return True

    def remove(self, timeout: float = 5.0) -> bool:
        """Remove the cgroup (and any below it) once empty: its last member may take a moment
        to leave after it exits."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                for below, _, _ in os.walk(self.path, topdown=False):
                    os.rmdir(below)
                return True
            except FileNotFoundError:
                return True
            except PermissionError:
                return False  # not ours to remove: waiting changes nothing
            except OSError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.05)


def _candidates(lines: list[str], root: Path) -> list[tuple[str, Path]]:
    """Where the job's cgroup could go, best first: under the supervisor's own v2 cgroup, then
    under gpuwatch/ in the v1 pids hierarchy."""
    out = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            for mount in (root, root / "unified"):
                if (mount / "cgroup.controllers").exists():
                    out.append(("cgroup v2", mount / path.lstrip("/")))
                    break
    for line in lines:
        _, _, rest = line.partition(":")
        controllers, _, _ = rest.partition(":")
        if _V1_HIERARCHY in controllers.split(","):
            v1 = root / _V1_HIERARCHY
            if (v1 / "cgroup.procs").exists() and not (v1 / "cgroup.controllers").exists():
                out.append(("cgroup v1", v1 / _V1_PARENT))
    return out


def job_cgroups_of(pid: int, root: Path = _CGROUP_ROOT, proc: Path = Path("/proc")
                   ) -> list[JobCgroup]:
    """The `gpuwatch run` job cgroups `pid` is in, from /proc/PID/cgroup: its v2 one, and its v1
    one in the pids hierarchy, where JobCgroup.create puts them (a cgroup the job made below
    its own counts as its job's). None where it is in none, or has exited."""
    try:
        with open(proc / str(pid) / "cgroup", "rb") as f:
            text = f.read(_PROC_CGROUP_BYTES).decode(errors="replace")
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        parts = path.split("/")[1:]
        if not path.startswith("/") or any(part in ("", ".", "..") for part in parts):
            continue
        at = next((i for i, part in enumerate(parts) if part.startswith(JOB_CGROUP_PREFIX)),
                  None)
        if at is None:
            continue
        if hierarchy == "0" and controllers == "":
            mount = next((m for m in (root, root / "unified")
                          if (m / "cgroup.controllers").exists()), None)
            mode = "cgroup v2"
        elif _V1_HIERARCHY in controllers.split(",") and at == 1 and parts[0] == _V1_PARENT:
            mount, mode = root / _V1_HIERARCHY, "cgroup v1"
        else:
            continue
        if mount is not None:
            found.append(JobCgroup(mount.joinpath(*parts[:at + 1]), mode))
    return found


def supported_here() -> Optional[str]:
    """Why no job cgroup can be made here, or None where one can (for tests and docs)."""
    name = f"gpuwatch-probe-{os.getpid()}"
    try:
        JobCgroup.create(name).remove()
    except CgroupUnavailable as exc:
        return str(exc)
    return None
