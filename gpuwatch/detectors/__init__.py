"""Detectors: pure functions from a snapshot and its history to findings.

Each module exposes `detect(snapshot, history, config) -> Iterable[Finding]` and reads nothing
but its arguments: no /proc, no clock, so every scenario can be replayed from fixtures. A finding
needs evidence of a training job (a GPU holder, a job with trainers, distributed-launch
variables, the `gpuwatch run` supervisor named in the environment), and its reason says which
evidence was used.
"""

from __future__ import annotations

from types import MappingProxyType

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors import (
    allocation,
    ghosts,
    leaks,
    leftovers,
    orphans,
    stalled,
    unkillable,
    zombies,
)
from gpuwatch.detectors.common import is_protected, protected_by
from gpuwatch.history import History
from gpuwatch.model import KINDS, Finding, NodeReport, NodeSnapshot
from gpuwatch.vocabulary import severity_rank

#: Each declares the kinds it reports (EMITS); between them, every kind of gpuwatch.model.KINDS
#: (tests/test_detectors.py ties the two, and runs each over scenarios to check its EMITS).
DETECTORS = (orphans, zombies, leftovers, ghosts, unkillable, leaks, stalled, allocation)

__all__ = ["DETECTORS", "KINDS", "assess", "detect", "is_protected", "protected_by"]


def assess(snapshot: NodeSnapshot, history: History, config: DetectorConfig) -> NodeReport:
    """Record the snapshot in the history, then run every detector over both."""
    history.record(snapshot)
    findings = history.findings.stamp(detect(snapshot, history, config), snapshot.processes,
                                      snapshot.taken_at, history.job_label)
    return NodeReport(snapshot, tuple(findings),
                      MappingProxyType(history.job_labels(snapshot.processes)))


def detect(snapshot: NodeSnapshot, history: History, config: DetectorConfig) -> list[Finding]:
    findings: list[Finding] = []
    for detector in DETECTORS:
        findings.extend(detector.detect(snapshot, history, config))
    findings.sort(key=lambda f: (severity_rank(f.severity), f.kind,
                                 -(f.gpu_memory_bytes or 0), f.pid or 0))
    return findings
