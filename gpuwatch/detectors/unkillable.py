"""unkillable: stuck in uninterruptible sleep (D), typically inside the driver.

Signals cannot end such a process, so reaping cannot free its memory. Brief D states are normal
I/O; only one that lasts longer than the threshold, over consecutive polls, is reported.

Critical only when the GPU is at stake: the process holds GPU memory, or it waits in the NVIDIA
driver (its wait channel or kernel stack names nvidia or nvidia-uvm): then the node needs a GPU
reset or a reboot before the next job. A job member stuck elsewhere (a checkpoint write to a hung
NFS server) is a warning: worth knowing, no reason to drain the node.
"""

from __future__ import annotations

from collections.abc import Iterator

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors.common import Evidence, finding, judged_in_state
from gpuwatch.history import History
from gpuwatch.model import Finding, HostProcess, Kind, NodeSnapshot
from gpuwatch.units import clock_time
from gpuwatch.vocabulary import ProcState, Severity

#: The kinds of finding this detector reports (a test runs it over scenarios and checks).
EMITS = frozenset({Kind.UNKILLABLE})


def detect(snapshot: NodeSnapshot, history: History, config: DetectorConfig
           ) -> Iterator[Finding]:
    for p in judged_in_state(snapshot, ProcState.DISK_SLEEP, config):
        h = history.get(p.identity)
        if h is None or h.disk_sleep_since is None:
            continue
        if snapshot.taken_at - h.disk_sleep_since < config.unkillable_after:
            continue
        since = ("in uninterruptible sleep (D) since "
                 f"{clock_time(snapshot.wall(h.disk_sleep_since))}")
        # The summary names the kernel function only from the wait channel, which `ps -o wchan`
        # shows anyone; a frame of the kernel stack (root's to read) stays in the reason.
        public = p.wchan or "the kernel"
        if p.waits_in_gpu_driver:
            severity = Severity.CRITICAL
            where = f"waits in the NVIDIA driver ({_where(p)})"
            said = f"waits in the NVIDIA driver{f' ({p.wchan})' if p.wchan else ''}"
        elif p.holds_gpu:
            severity = Severity.CRITICAL
            where = f"holds GPU memory while waiting in {_where(p)}"
            said = f"holds GPU memory while waiting in {public}"
        else:
            severity = Severity.WARNING
            where = f"waits in {_where(p)}, not in the GPU driver, and holds no GPU memory"
            said = f"waits in {public}, not in the GPU driver, and holds no GPU memory"
        yield finding(Kind.UNKILLABLE, severity, p,
                      Evidence(f"{since}; {where}; signals cannot end it",
                               f"{since}; {said}; signals cannot end it"))


def _where(p: HostProcess) -> str:
    if p.wchan:
        return p.wchan
    driver = [frame for frame in p.kernel_stack if "nvidia" in frame.lower()]
    return (driver or list(p.kernel_stack) or ["an unknown kernel function"])[0]
