"""One memory budget for everything agent reports make the daemon keep, shared fairly by user.

Any local user may report to agent.sock, and what reports create stays in the daemon's memory:
the receiver's state per reporting process (its slot, the buffer and discovered names it
interned, its newest point, trace and exit reports), the step points waiting for the next poll,
and the history's step series behind the leak test. Each part tells this ledger what it adds
and what it frees, in bytes estimated from what it stores (the `*_BYTES` constants next to each
structure, measured with tracemalloc), charged to the UID the kernel gave with the report.

The rule (docs/agent-protocol.md, "Daemon side bounds"):
- while the total stays within `max_bytes`, anything is granted (one user alone may use it
  all), but for room the last reclaim made for users under their share;
- past it, a user holding at least its share (`max_bytes` / users holding state) is refused
  (`user_share`, or `memory_budget` when it is the only user);
- a user under its share is still granted, up to `ceiling` (a quarter above the budget; past
  that it is refused as `memory_budget` and what it asked for is remembered), and at the next
  poll `reclaim()` takes back from the users above their share what brings the total within the
  budget with room for what was remembered: the largest first, down to their share at most, the
  history's step series first (those of processes without an open finding, the least recently
  reporting first), then the receiver's slots (the least recently reporting first). A user
  under its share never loses anything to another user's growth, and what it was refused fits
  when it asks again after that poll.

Counters of what was refused and evicted, by what and why, are kept here for the exporter.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Callable, Optional, TypeVar

#: Bytes of agent state kept by default: room for about 300 reporting processes with 8 watched
#: buffers each (~200 KiB a process at most), and for a few with 64.
DEFAULT_MEMORY_BUDGET = 64 << 20

PARTS = ("receiver", "pending", "history")
#: What the history can be refused: a process's step history, or one buffer's or discovered
#: container's series (the receiver's refusals are rejected reports, counted by reason there).
REFUSED_WHAT = ("history", "series")
#: What reclaiming can take: a reporting process's slot (with everything the receiver kept for
#: it), or a process's step history.
EVICTED_WHAT = ("process", "history")
#: Why: another user needed the room, or the user alone filled the budget.
BUDGET_REASONS = ("user_share", "memory_budget")

#: A reclaimer frees up to `nbytes` of `uid`'s state and answers how much it freed.
Reclaimer = Callable[[int, int, str], int]
#: Once this much of what was charged has been given back, ask the C allocator to return the
#: free pages it keeps (series are arrays of over 512 bytes: malloc's, not Python's arenas).
TRIM_AFTER_BYTES = 16 << 20


T = TypeVar("T")

def malloc_trim() -> Optional[Callable[[int], int]]:
    """glibc's malloc_trim (which hands the allocator's free pages back), or None."""
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc
        return None


#: After a poll, the allocator's free pages are handed back once the process's resident memory
#: is this much over what it was after the last time (PollTrim).
TRIM_SLACK_BYTES = 512 << 10


class PollTrim:
    """glibc's malloc_trim after a poll, once the process's resident memory has grown
    TRIM_SLACK_BYTES over what it was after the last trim; whether it trimmed.

    A poll's passing allocations (the snapshot being built, the bodies and the document being
    joined) are freed into the allocator, which keeps them resident: without a trim, a poll's
    peak, not its need, is the daemon's RSS. But a trim walks every free chunk, work that buys
    nothing where a poll's passing allocations are fewer bytes than the slack, as at 64 GPU
    processes: those polls skip it (about 0.1 ms of a 2.8 ms poll, measured). At 1,024 they
    are about 4 MiB, and nearly every poll still trims (docs/design-notes.md, "A trim after a
    poll only where it gives memory back")."""

    def __init__(self, trim: Optional[Callable[[int], int]] = None,
                 slack: int = TRIM_SLACK_BYTES, statm: str = "/proc/self/statm") -> None:
        self._trim = trim if trim is not None else malloc_trim()
        self._slack = slack
        self._page = os.sysconf("SC_PAGE_SIZE")
        try:
            self._statm: Optional[int] = os.open(statm, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._statm = None
        #: Resident bytes after the last trim (None: none yet).
        self._after: Optional[int] = None

    def _resident(self) -> Optional[int]:
        if self._statm is None:
            return None
        try:
            return int(os.pread(self._statm, 128, 0).split()[1]) * self._page
        except (OSError, ValueError, IndexError):
            return None

    def __call__(self) -> bool:
        if self._trim is None:
            return False
        resident = self._resident()
        if resident is not None and self._after is not None and (
                resident < self._after + self._slack):
            return False
        self._trim(0)
        self._after = self._resident()
        return True


#: glibc's mallopt parameters (malloc.h): the most malloc arenas; the size from which a block
#: is mapped on its own (returned to the system as it is freed), and the free top of the heap
#: beyond which free() trims it. Either set fixes both, where glibc would raise them as blocks
#: of up to 32 MiB come and go.
_M_ARENA_MAX = -8
_M_MMAP_THRESHOLD = -3
_M_TRIM_THRESHOLD = -1
#: Blocks from this size are mapped on their own: a /metrics body or a gzip buffer is back to
#: the system when freed, whenever that is.
MMAP_THRESHOLD = 128 << 10


def limit_malloc_arenas(arenas: int = 1) -> bool:
    """Ask glibc for at most `arenas` malloc arenas (mallopt M_ARENA_MAX), before any thread
    starts: by default each thread that allocates while another does gets an arena of its own,
    and each arena keeps its own free pages, which malloc_trim after a poll cannot pool. It also
    fixes the mmap threshold at MMAP_THRESHOLD (and the trim threshold at twice it), which glibc
    would raise to the largest block freed. Whether the arenas were limited: elsewhere than
    glibc, or refused, nothing changes (never an error)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    try:
        limited = bool(mallopt(_M_ARENA_MAX, arenas))
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        mallopt(_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD)
        return limited
    except (OSError, ctypes.ArgumentError):
        return False


class AgentBudget:
    """Thread-safe: the agent socket's thread and the poll thread both charge it."""

    def __init__(self, max_bytes: int = DEFAULT_MEMORY_BUDGET) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._by_uid: dict[int, int] = {}
        self._by_part = dict.fromkeys(PARTS, 0)
        self._total = 0
        self._refused = {(what, why): 0 for what in REFUSED_WHAT for why in BUDGET_REASONS}
        self._evicted = {(what, why): 0 for what in EVICTED_WHAT for why in BUDGET_REASONS}
        self._reclaimers: list[tuple[int, Reclaimer]] = []
        #: Bytes users under their share were refused since the last reclaim (the ceiling),
        #: and what the last reclaim freed for them: users above their share may not take it.
        self._wanted: dict[int, int] = {}
        self._reserved = 0
        self._waiting: set[int] = set()
        #: The highest total since the allocator was last asked to give pages back.
        self._high_water = 0
        self._trim = malloc_trim()

    @property
    def ceiling(self) -> int:
        """What users under their share may take the total to before a poll reclaims."""
        return self.max_bytes + self.max_bytes // 4

    # -- charging ------------------------------------------------------------------------------
    def grant(self, uid: int, part: str, nbytes: int, force: bool = False) -> Optional[str]:
        """Charge `nbytes` to `uid` if the rule allows it: None, else the reason it does not.
        `force` charges whatever the total (what one process keeps at least: its newest
        point)."""
        with self._lock:
            # The common case first, cheaply: it fits, and touches no room kept for others.
            if (nbytes > 0 and not force
                    and self._total + nbytes > self.max_bytes - self._reserved):
                reason = self._refusal(uid, nbytes)
                if reason is not None:
                    return reason
            self._by_uid[uid] = self._by_uid.get(uid, 0) + nbytes
            self._by_part[part] += nbytes
            self._total += nbytes
        return None

    def _refusal(self, uid: int, nbytes: int) -> Optional[str]:
        after = self._total + nbytes
        if self._waiting:  # users refused at the last poll count as holders until they fit
            users = len(self._by_uid.keys() | self._waiting | {uid})
        else:
            users = len(self._by_uid) + (uid not in self._by_uid)
        under = self._by_uid.get(uid, 0) + nbytes <= self.max_bytes // users
        if under:
            if after <= self.max_bytes:
                self._granted_room(uid, nbytes)
                return None
        elif after <= self.max_bytes - self._reserved:
            return None
        if users == 1:
            return "memory_budget"
        if not under:
            return "user_share"
        if after <= self.ceiling:
            self._granted_room(uid, nbytes)
            return None
        # Under its share, yet over the ceiling: what it asked for is taken back from the users
        # above their share at the next poll, and kept for the users under theirs until then.
        self._wanted[uid] = min(self.max_bytes, self._wanted.get(uid, 0) + nbytes)
        return "memory_budget"

    def _granted_room(self, uid: int, nbytes: int) -> None:
        if self._reserved:
            self._reserved = max(0, self._reserved - nbytes)
            if not self._reserved:
                self._waiting.clear()
        self._waiting.discard(uid)

    def release(self, uid: int, part: str, nbytes: int) -> None:
        if nbytes:
            with self._lock:
                self._add(uid, part, -nbytes)

    def _add(self, uid: int, part: str, nbytes: int) -> None:
        used = self._by_uid.get(uid, 0) + nbytes
        if used > 0:
            self._by_uid[uid] = used
        else:
            self._by_uid.pop(uid, None)
        self._by_part[part] += nbytes
        self._total += nbytes

    # -- counters ------------------------------------------------------------------------------
    def refused(self, what: str, reason: str) -> None:
        with self._lock:
            self._refused[(what, reason)] += 1

    def free(self, what: str, reason: str, nbytes: int, candidates: Iterable[T],
             drop: Callable[[T], int]) -> int:
        """A reclaimer's loop: `drop` each of `candidates` in turn (it returns the bytes it
        gave back) until `nbytes` are freed; the evictions counted under `what`. The bytes
        freed."""
        freed = evicted = 0
        for candidate in candidates:
            if freed >= nbytes:
                break
            freed += drop(candidate)
            evicted += 1
        if evicted:
            self.evicted(what, reason, evicted)
        return freed

    def evicted(self, what: str, reason: str, n: int = 1) -> None:
        with self._lock:
            self._evicted[(what, reason)] += n

    # -- what the exporter reads ---------------------------------------------------------------
    @property
    def total(self) -> int:
        return self._total

    def used(self, uid: int) -> int:
        return self._by_uid.get(uid, 0)

    def stats(self) -> BudgetStats:
        with self._lock:
            return BudgetStats(self.max_bytes, MappingProxyType(dict(self._by_part)),
                               len(self._by_uid), MappingProxyType(dict(self._refused)),
                               MappingProxyType(dict(self._evicted)))

    # -- reclaiming ----------------------------------------------------------------------------
    def add_reclaimer(self, reclaimer: Reclaimer, order: int) -> None:
        """Reclaimers run in ascending `order` for each user that must give back."""
        self._reclaimers.append((order, reclaimer))
        self._reclaimers.sort(key=lambda entry: entry[0])

    def excess(self) -> list[tuple[int, int, str]]:
        """(uid, bytes, reason) to take back to bring the total within the budget, with room
        for what users under their share were refused since the last reclaim: from users above
        their share, the largest first, none below its share."""
        with self._lock:
            wanted = sum(self._wanted.values())
            over = self._total + wanted - self.max_bytes
            if over <= 0 or not self._by_uid:
                return []
            users = len(self._by_uid.keys() | self._wanted.keys())
            share = self.max_bytes // users
            reason = "user_share" if users > 1 else "memory_budget"
            plan = []
            for uid, used in sorted(self._by_uid.items(), key=lambda kv: -kv[1]):
                if over <= 0 or used <= share:
                    break
                give = min(used - share, over)
                plan.append((uid, give, reason))
                over -= give
            return plan

    def give_pages_back(self) -> bool:
        """After TRIM_AFTER_BYTES were freed since the last time, return the allocator's free
        pages to the system (malloc_trim): without it a flood that ended leaves its peak
        resident. Called by the poll thread; whether it trimmed. Pending points, which come
        and go at every poll, do not count."""
        kept = self._total - self._by_part["pending"]  # pending points come and go each poll
        self._high_water = max(self._high_water, kept)
        if self._high_water - kept < TRIM_AFTER_BYTES:
            return False
        self._high_water = kept
        if self._trim is not None:
            self._trim(0)
        return True

    def reclaim(self) -> int:
        """Take back what `excess()` says (called by the poll thread, once per poll); the bytes
        freed. No lock is held while reclaimers run: they charge this ledger themselves."""
        freed_total = 0
        plan = self.excess()
        with self._lock:
            self._reserved = sum(self._wanted.values())
            self._waiting = set(self._wanted)
            self._wanted.clear()
        for uid, nbytes, reason in plan:
            freed = 0
            for _, reclaimer in self._reclaimers:
                if freed >= nbytes:
                    break
                freed += reclaimer(uid, nbytes - freed, reason)
            freed_total += freed
        return freed_total


class BudgetStats:
    """A consistent reading of the ledger, for /metrics."""

    __slots__ = ("by_part", "evicted", "max_bytes", "refused", "users")

    def __init__(self, max_bytes: int, by_part: Mapping[str, int], users: int,
                 refused: Mapping[tuple[str, str], int],
                 evicted: Mapping[tuple[str, str], int]) -> None:
        self.max_bytes = max_bytes
        self.by_part = by_part
        self.users = users
        self.refused = refused
        self.evicted = evicted

    @property
    def total(self) -> int:
        return sum(self.by_part.values())


def fair_shares(demands: Mapping[Optional[int], int], room: int) -> dict[Optional[int], int]:
    """Max-min fair shares of `room` among users asking for `demands`: each gets what it asks
    up to a level, the level as high as the room allows, and what is left below a whole level
    goes one each to the users asking most (then to the lowest UID: the same answer every
    poll)."""
    shares = {uid: 0 for uid in demands}
    waiting = sorted(demands, key=lambda uid: (demands[uid], _uid_order(uid)))
    while waiting and room > 0:
        level = room // len(waiting)
        if level == 0:
            for uid in sorted(waiting, key=lambda uid: (-demands[uid], _uid_order(uid)))[:room]:
                shares[uid] += 1
            break
        uid = waiting[0]
        if demands[uid] <= level:  # asks less than an even share: gets all it asks
            shares[uid] = demands[uid]
            room -= demands[uid]
            waiting.pop(0)
            continue
        for uid in waiting:  # every user left asks more than the level: each gets it
            shares[uid] = level
        room -= level * len(waiting)
        for uid in sorted(waiting, key=lambda uid: (-demands[uid], _uid_order(uid)))[:room]:
            shares[uid] += 1
        break
    return shares


def _uid_order(uid: Optional[int]) -> int:
    return -1 if uid is None else uid
