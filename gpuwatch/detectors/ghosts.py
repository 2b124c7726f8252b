"""ghost: GPU memory that no live host process accounts for.

Two shapes: NVML lists a PID that /proc does not have (it exited with its context not torn down,
or lives in another PID namespace, or the driver's list is stale), and device memory in use
beyond what the listed processes hold by more than the configured threshold (memory of a dead
context, or of processes NVML cannot attribute). Either must last `ghost_grace` seconds: NVML's
memory figure, its process lists and /proc are read one after the other, so a process exiting in
between looks like a ghost for a poll.

What cannot be read neither opens nor closes a ghost: while a GPU's process lists (or a figure
the excess is computed from) are unreadable, a ghost open before stays open, with its figure
unknown, and none opens. Once open, a device ghost stays open while the excess stays over the
threshold; the grace is for opening only.
"""

from __future__ import annotations

from collections.abc import Iterator

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors.common import Evidence, finding
from gpuwatch.history import History
from gpuwatch.model import Finding, Kind, NodeSnapshot
from gpuwatch.units import human_bytes
from gpuwatch.vocabulary import Severity

#: The kinds of finding this detector reports (a test runs it over scenarios and checks).
EMITS = frozenset({Kind.GHOST})


def detect(snapshot: NodeSnapshot, history: History, config: DetectorConfig
           ) -> Iterator[Finding]:
    now, grace, ledger = snapshot.taken_at, config.ghost_grace, history.findings
    blind = {g.index for g in snapshot.gpus if g.holders_unknown}
    for p in snapshot.processes.values():
        if not p.in_procfs and p.holds_gpu:
            # Only carried over from a GPU's last good read: NVML does not list it now.
            unlisted = all(u.gpu_index in blind and u.memory_bytes is None for u in p.gpu_usage)
            if unlisted:
                if ledger.open_since(Finding.identity_of(Kind.GHOST, p.pid, p.start_time)) is None:
                    continue
            else:
                since = history.unlisted_since(p.pid)
                if since is None or now - since < grace:
                    continue
            yield finding(Kind.GHOST, Severity.WARNING, p, Evidence.public(
                "NVML lists this PID on the GPU but /proc has no such process "
                "(exited without releasing its memory, or another PID namespace)"))
    for g in snapshot.gpus:
        unattributed = g.unattributed_memory_bytes
        was_open = ledger.open_since(Finding.identity_of(Kind.GHOST, None, None, (g.index,)))
        if unattributed is None:
            held = was_open is not None  # unknown: not released
        else:
            held = unattributed >= config.ghost_min_bytes and (
                was_open is not None
                or history.unattributed_held(g.index, config.ghost_min_bytes, grace, now))
        if held:
            words = (f"GPU {g.index} has memory in use that no listed process accounts for "
                     f"(over {human_bytes(config.ghost_min_bytes)})")
            yield Finding(
                kind=Kind.GHOST, severity=Severity.WARNING, gpus=(g.index,),
                gpu_memory_bytes=unattributed, reason=words, summary=words)
