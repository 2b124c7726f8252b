"""History stays bounded, forgets the dead, and never mixes a reused PID with its predecessor."""

from __future__ import annotations

from types import MappingProxyType

from gpuwatch.history import History
from gpuwatch.model import HostProcess, NodeSnapshot, NvmlStatus


def _snapshot(t: float, *procs: HostProcess) -> NodeSnapshot:
    return NodeSnapshot(taken_at=t, hostname="n", nvml=NvmlStatus(available=True), gpus=(),
                        processes=MappingProxyType({p.pid: p for p in procs}))


def _proc(pid: int, start: float, rss: int | None = 1000, ppid: int = 1) -> HostProcess:
    return HostProcess(pid=pid, ppid=ppid, start_time=start, rss_bytes=rss)


def test_samples_per_process_are_capped_at_the_newest() -> None:
    history = History(samples=5)
    for t in range(12):
        history.record(_snapshot(float(t), _proc(10, 1.0, rss=t)))
    h = history.get((10, 1.0))
    assert h is not None
    assert [s.rss_bytes for s in h.samples()] == [7, 8, 9, 10, 11]
    assert h.first_seen == 0.0 and h.last_seen == 11.0


def test_unknown_figures_stay_unknown() -> None:
    history = History()
    history.record(_snapshot(1.0, _proc(10, 1.0, rss=None)))
    assert next(history.get((10, 1.0)).samples()).rss_bytes is None  # type: ignore[union-attr]


def test_a_process_absent_from_a_poll_is_forgotten() -> None:
    history = History()
    history.record(_snapshot(1.0, _proc(10, 1.0), _proc(11, 1.0)))
    history.record(_snapshot(2.0, _proc(10, 1.0)))
    assert history.get((11, 1.0)) is None and len(history) == 1


def test_a_reused_pid_starts_a_fresh_history_with_its_own_parent() -> None:
    history = History()
    history.record(_snapshot(1.0, _proc(10, 1.0, ppid=500)))
    history.record(_snapshot(2.0, _proc(10, 1.5, ppid=600)))
    fresh = history.get((10, 1.5))
    assert fresh is not None and fresh.first_ppid == 600 and len(fresh) == 1
    assert history.get((10, 1.0)) is None


def test_the_number_of_processes_is_capped_dropping_the_least_recently_seen() -> None:
    history = History(max_processes=3)
    history.record(_snapshot(1.0, *(_proc(pid, 1.0) for pid in range(10, 16))))
    assert len(history) == 3


def test_resize_keeps_what_fits() -> None:
    history = History(samples=10)
    for t in range(10):
        history.record(_snapshot(float(t), _proc(10, 1.0, rss=t)))
    history.resize(samples=4, max_processes=10)
    assert [s.rss_bytes for s in history.get((10, 1.0)).samples()] == [6, 7, 8, 9]  # type: ignore[union-attr]
