"""Private memory: what a process alone holds, from /proc/PID/smaps_rollup.

RSS counts every page a process has mapped, shared or not, so it cannot see copy-on-write after
a fork: a data loader's workers start out sharing their trainer's pages (their RSS already counts
them) and each page one of them writes to is copied for it, which grows the node's memory while
every RSS stays where it was. USS (Private_Clean + Private_Dirty: the pages no other process
maps) and PSS (each page divided among the processes that map it) show it.

smaps_rollup walks the process's page tables, so it costs far more than the stat line, in
proportion to the process's RSS (about 13 ms a GiB, against 10 us for a whole stat line:
bench/private_memory.py). So it is read only for the processes a caller names (the poll: forked
workers of GPU jobs, where it decides), not again for one identity before `every` seconds,
and in one call for at most `max_rss_walked` bytes of RSS in all (at least one process), those
read longest ago first: a node of many large workers has each read less often, never a slow
poll. Between reads the figures read last are given. A read takes at most `_ROLLUP_BYTES`; a
process that exits meanwhile is counted (`vanished`); one whose file this user may not read
(another user's process, for a daemon without CAP_SYS_PTRACE) is counted (`unreadable`) and
reported as a SourceError once per identity.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import NamedTuple, Optional

from gpuwatch.model import HostProcess, SourceError
from gpuwatch.vocabulary import ProcState

#: smaps_rollup is about 20 lines of at most 40 bytes; a file this long is not one.
_ROLLUP_BYTES = 4096
#: Processes looked at in one call, at most: a bound on what a fork bomb under a launcher costs.
MAX_READS = 1024
#: RSS walked in one call, at most (beyond the first process): about 13 ms of CPU
#: (bench/private_memory.py).
MAX_RSS_WALKED = 1 << 30
#: Identities remembered (their last figures, or that they are unreadable); beyond, the oldest
#: are forgotten and read again.
_REMEMBERED = 8192

Identity = tuple[int, Optional[float]]


class PrivateMemory(NamedTuple):
    #: Private_Clean + Private_Dirty: pages no other process maps.
    uss_bytes: int
    #: Proportional set size; None where the kernel does not say.
    pss_bytes: Optional[int]


def parse_rollup(raw: bytes) -> Optional[PrivateMemory]:
    """USS and PSS from the text of /proc/PID/smaps_rollup; None when it has no private lines."""
    found: dict[bytes, int] = {}
    for line in raw.splitlines():
        key, _, rest = line.partition(b":")
        if key in (b"Private_Clean", b"Private_Dirty", b"Pss"):
            parts = rest.split()
            if parts and parts[0].isdigit():
                found[key] = int(parts[0]) * 1024  # in kB, always
    if b"Private_Clean" not in found or b"Private_Dirty" not in found:
        return None
    return PrivateMemory(found[b"Private_Clean"] + found[b"Private_Dirty"], found.get(b"Pss"))


class PrivateMemorySource:
    def __init__(self, procfs: str = "/proc", every: float = 0.0,
                 max_rss_walked: int = MAX_RSS_WALKED) -> None:
        self._procfs = procfs
        #: Least seconds between two reads of one identity.
        self.every = every
        self.max_rss_walked = max_rss_walked
        #: Whether the kernel has smaps_rollup (Linux 4.14 and later).
        self.supported = os.path.exists(f"{procfs}/self/smaps_rollup")
        self._last: dict[Identity, tuple[float, PrivateMemory]] = {}
        self._unreadable: set[Identity] = set()
        self.reads = 0
        self.vanished = 0
        self.unreadable = 0

    def read(self, processes: Iterable[HostProcess], now: float
             ) -> tuple[dict[int, PrivateMemory], list[SourceError]]:
        """The private memory of each of `processes` that could be read, by PID, and the
        problems met (a file not readable, once per identity)."""
        found: dict[int, PrivateMemory] = {}
        errors: list[SourceError] = []
        if not self.supported:
            return found, errors
        seen: set[Identity] = set()
        due: list[tuple[float, HostProcess]] = []
        for p in processes:
            if len(seen) >= MAX_READS:
                break
            if not p.in_procfs or p.state in (ProcState.ZOMBIE, ProcState.DEAD):
                continue
            identity = p.identity
            seen.add(identity)
            if identity in self._unreadable:
                continue
            last = self._last.get(identity)
            if last is not None:
                found[p.pid] = last[1]
                if now - last[0] < 0.99 * self.every:
                    continue
            due.append((last[0] if last is not None else -math.inf, p))
        walked = 0
        for _, p in sorted(due, key=lambda d: (d[0], d[1].pid)):
            if walked and walked + (p.rss_bytes or 0) > self.max_rss_walked:
                break
            walked += p.rss_bytes or 0
            figures = self._read_one(p, errors)
            if figures is not None:
                found[p.pid] = figures
                self._last[p.identity] = (now, figures)
            else:
                found.pop(p.pid, None)
        # What is not asked for any more is forgotten: the processes exited or left their job.
        for identity in self._last.keys() - seen:
            del self._last[identity]
        if len(self._unreadable) > _REMEMBERED:
            self._unreadable &= seen
        return found, errors

    def _read_one(self, p: HostProcess, errors: list[SourceError]) -> Optional[PrivateMemory]:
        self.reads += 1
        try:
            fd = os.open(f"{self._procfs}/{p.pid}/smaps_rollup", os.O_RDONLY)
            try:
                raw = os.read(fd, _ROLLUP_BYTES)
            finally:
                os.close(fd)
        except (FileNotFoundError, ProcessLookupError):
            self.vanished += 1  # exited since its stat line was read
            return None
        except PermissionError:
            self.unreadable += 1
            self._unreadable.add(p.identity)
            errors.append(SourceError(
                "procfs", f"PID {p.pid}: private memory (smaps_rollup) not readable "
                "(another user's process; run as root)"))
            return None
        except OSError as exc:
            self.unreadable += 1
            self._unreadable.add(p.identity)
            errors.append(SourceError("procfs", f"PID {p.pid}: smaps_rollup: {exc.strerror}"))
            return None
        # A kernel thread or an exiting process has an empty rollup: nothing to say.
        return parse_rollup(raw) if raw else None
