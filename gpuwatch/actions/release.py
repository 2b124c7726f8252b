"""Whether GPU memory was released: NVML read again after processes were ended.

A real driver tears a CUDA context down just after its process exits, not at the exit itself, so
the check reads NVML until none of the ended processes is listed, or a few seconds have passed.

A GPU whose process list cannot be read lists nobody, and that is no evidence of a release: the
check waits for it to be readable, and gives up as it does without NVML (`status.available`
False, with the reason) when it stays unreadable.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Optional

from gpuwatch.model import NvmlReading
from gpuwatch.sources.nvml import NvmlSource
from gpuwatch.sources.processes import ProcessSource
from gpuwatch.vocabulary import ReapOutcome

if TYPE_CHECKING:
    from gpuwatch.actions.reap_plan import Result

#: How long the driver gets to release an ended process's memory before it counts as held.
RELEASE_WAIT = 3.0
_TICK = 0.1


def nvml_after(ended: Collection[int], wait: float = RELEASE_WAIT) -> NvmlReading:
    """NVML's reading once none of the PIDs `ended` is listed on any GPU, or after `wait`
    seconds; at once when NVML is unavailable (`status.available` says so). When a GPU's
    process list still cannot be read at the end, the reading's status is not available either,
    with that as its reason: who holds memory there is unknown, so no release can be told."""
    nvml = NvmlSource()
    deadline = time.monotonic() + wait
    try:
        while True:
            reading = nvml.read()
            if not reading.status.available:
                return reading
            blind = unreadable(reading)
            done = not blind and not (holders(reading) & set(ended))
            if done or time.monotonic() >= deadline:
                break
            time.sleep(_TICK)
    finally:
        nvml.close()
    if blind:
        gpus = ", ".join(str(i) for i in blind)
        reading = replace(reading, status=replace(
            reading.status, available=False,
            error=f"process list unreadable on GPU {gpus}"))
    return reading


def holders(reading: NvmlReading) -> set[int]:
    """The PIDs NVML lists on any GPU."""
    return {u.pid for g in reading.gpus for u in g.processes}


def unreadable(reading: NvmlReading) -> list[int]:
    """The GPUs whose holders are unknown (a process list, or the GPU itself, could not be
    read)."""
    return [g.index for g in reading.gpus if g.holders_unknown]


def still_held(results: Iterable[Result], reading: NvmlReading,
               procs: Optional[ProcessSource] = None) -> list[int]:
    """The PIDs of the plan whose GPU memory is still held after acting, by NVML's `reading`
    (`nvml_after`): what the next job on these GPUs would find taken.

    A process that ended (`FREED`) holds nothing of its own: its memory counts as held only while
    the driver still lists its PID and no other process has that PID now (a newcomer's memory is
    not the plan's). A PID found reused before any signal (`identity-changed`) means the process
    planned for had exited already: nothing of it is held. A process not ended (still running,
    unkillable, refused, failed) holds memory when NVML lists it or the process signalled for it
    (a zombie's parent). Where NVML cannot say (`status.available` False), an ended process
    counts as freed and any other as holding: unknown is not free.
    """
    from gpuwatch.actions.reap_plan import FREED

    source = procs or ProcessSource()
    listed = holders(reading) if reading.status.available else None
    held: list[int] = []
    for r in results:
        a = r.action
        pid = a.pid if a.pid is not None else a.target
        if pid is None or r.result == ReapOutcome.IDENTITY_CHANGED:
            continue
        if r.result in FREED:
            if listed is not None and pid in listed and not _reused(source, pid, a.start_time):
                held.append(pid)
        elif listed is None:
            held.append(pid)
        else:
            held += [q for q in (a.pid, a.target) if q is not None and q in listed]
    return sorted(set(held))


def _reused(source: ProcessSource, pid: int, start_time: Optional[float]) -> bool:
    """Whether `pid` belongs to another process than the one that started at `start_time`."""
    now = source.stat(pid)
    return now is not None and start_time is not None and now.start_time != start_time
