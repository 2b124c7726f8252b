"""unkillable: stuck in uninterruptible sleep (D), typically inside the driver.

Signals cannot end such a process, so reaping cannot free its memory: the node needs attention
(a driver reset or a reboot). Brief D states are normal I/O; only one that lasts longer than the
threshold, over consecutive polls, is reported.
"""

from __future__ import annotations

from collections.abc import Iterator

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors.common import finding, is_protected
from gpuwatch.history import History
from gpuwatch.model import Finding, NodeSnapshot
from gpuwatch.units import clock_time


def detect(snapshot: NodeSnapshot, history: History, config: DetectorConfig
           ) -> Iterator[Finding]:
    for p in snapshot.processes.values():
        if p.state != "disk-sleep" or is_protected(p, config):
            continue
        h = history.get(p.identity)
        if h is None or h.disk_sleep_since is None:
            continue
        if snapshot.taken_at - h.disk_sleep_since < config.unkillable_after:
            continue
        yield finding("unkillable", "critical", p,
                      f"in uninterruptible sleep (D) since {clock_time(h.disk_sleep_since)}; "
                      "signals cannot end it, the node needs attention")
