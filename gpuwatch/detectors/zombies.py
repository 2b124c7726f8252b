"""zombie: a defunct thread-group leader.

Critical when threads of it still run and the process holds GPU memory: its main thread exited,
but a thread (NCCL's heartbeat, a thread pool) keeps the process and its CUDA context alive, and
nothing short of killing it frees the memory. A plain defunct process is a parent's bug: the
reason names the parent that fails to reap it. Only processes the poll watches (GPU holders and
their jobs) are judged, and only after they stayed defunct for the grace period.
"""

from __future__ import annotations

from collections.abc import Iterator

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors.common import Evidence, by_holding, finding, judged_in_state, process_named
from gpuwatch.history import History
from gpuwatch.model import Finding, Kind, NodeSnapshot
from gpuwatch.vocabulary import ProcState, Severity

#: The kinds of finding this detector reports (a test runs it over scenarios and checks).
EMITS = frozenset({Kind.ZOMBIE})


def detect(snapshot: NodeSnapshot, history: History, config: DetectorConfig
           ) -> Iterator[Finding]:
    for p in judged_in_state(snapshot, ProcState.ZOMBIE, config):
        h = history.get(p.identity)
        since = h.zombie_since if h is not None and h.zombie_since is not None else \
            snapshot.taken_at
        if snapshot.taken_at - since < config.zombie_grace:
            continue
        threads = p.num_threads or 0
        if threads > 1:
            severity = by_holding(p)
            holding = " and hold its GPU memory" if p.holds_gpu else ""
            # No thread count: it changes while the finding is open (num_threads has it).
            evidence = Evidence.public(f"main thread exited but other threads still run{holding};"
                                       " only killing the process frees it")
        else:
            parent = snapshot.processes.get(p.ppid) if p.ppid else None
            severity = Severity.WARNING
            evidence = Evidence.join("defunct; parent ", process_named(parent, p.ppid),
                                     " has not reaped it")
        yield finding(Kind.ZOMBIE, severity, p, evidence)
