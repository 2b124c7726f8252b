"""History stays bounded, forgets the dead, and never mixes a reused PID with its predecessor."""

from __future__ import annotations

import math
from dataclasses import replace
from types import MappingProxyType
from typing import Optional

from gpuwatch.evidence import Culprit, LeakEvidence
from gpuwatch.history import MAX_DISCOVERED, STEP_POINTS, FigureRing, History, StepSeries
from gpuwatch.ledger import FindingsLedger
from gpuwatch.model import (
    NO_DISCOVERY,
    BufferSize,
    DiscoveredSize,
    Finding,
    GpuProcessUsage,
    HostProcess,
    NodeSnapshot,
    NvmlStatus,
    StepPoint,
)
from gpuwatch.vocabulary import FoundBy, GrowthUnit, Kind, Series, Severity


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


def test_gpu_memory_with_one_device_unreadable_is_a_gap_not_a_drop() -> None:
    gib = 1 << 30
    both = (GpuProcessUsage(0, "GPU-0", 10, 4 * gib), GpuProcessUsage(1, "GPU-1", 10, 4 * gib))
    one_unknown = (both[0], replace(both[1], memory_bytes=None))
    history = History()
    for t, usage in enumerate((both, one_unknown, both)):
        history.record(_snapshot(float(t), replace(_proc(10, 1.0), gpu_usage=usage)))
    h = history.get((10, 1.0))
    assert h is not None
    assert [s.gpu_memory_bytes for s in h.samples()] == [8 * gib, None, 8 * gib]


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


def _leak(reason: str, culprit: Optional[str], kind: str = "leak") -> Finding:
    return Finding(Kind(kind), Severity.WARNING, reason, pid=10, start_time=1.0,
                   details=_named(culprit) if kind == "leak" else None)


def _named(culprit: Optional[str]) -> LeakEvidence:
    """A leak's evidence naming `culprit` (found by watching it), or none."""
    return LeakEvidence(Series.RSS, GrowthUnit.STEP, culprit=(
        Culprit(culprit, FoundBy.WATCHED) if culprit is not None else None))


def test_a_leak_opened_without_a_culprit_takes_the_reason_that_first_names_one_then_keeps_it(
        ) -> None:
    ledger = FindingsLedger()
    procs = {10: _proc(10, 1.0)}
    polls = [
        (_leak("RSS grows every step", None), "RSS grows every step"),
        # Figures that move stay out of the reason; a culprit not yet named changes nothing.
        (_leak("RSS grows every step; runs out against the node limit", None),
         "RSS grows every step"),
        (_leak("RSS grows every step; allocations at `leaky.py:42` explain it (traced)",
               "leaky.py:42"),
         "RSS grows every step; allocations at `leaky.py:42` explain it (traced)"),
        # Named once: whatever comes later is in the details only.
        (_leak("RSS grows every step; buffer `fetch_buffer` explains it (watched)",
               "fetch_buffer"),
         "RSS grows every step; allocations at `leaky.py:42` explain it (traced)"),
        (_leak("RSS grows every step", None),
         "RSS grows every step; allocations at `leaky.py:42` explain it (traced)"),
    ]
    for t, (f, expected) in enumerate(polls):
        (stamped,) = ledger.stamp([f], procs, 100.0 + t)
        assert (stamped.reason, stamped.since) == (expected, 100.0), t
        assert stamped.details == f.details
    assert ledger.open_since(f.identity) == 100.0


def test_a_leak_opened_with_its_culprit_and_other_findings_keep_their_first_reason() -> None:
    ledger = FindingsLedger()
    procs = {10: _proc(10, 1.0)}
    first = _leak("RSS grows every step; buffer `a` explains it (watched)", "a")
    ledger.stamp([first], procs, 100.0)
    (stamped,) = ledger.stamp(
        [_leak("RSS grows every step; `m.b` explains it (discovered)", "m.b")], procs, 101.0)
    assert stamped.reason == first.reason

    orphan = _leak("parent 4121 (torchrun) exited after 10:00:00Z", None, kind="orphan")
    ledger.stamp([orphan], procs, 102.0)
    (stamped,) = ledger.stamp([replace(orphan, reason="something else entirely",
                                       details=_named("x"))],
                              procs, 103.0)
    assert (stamped.reason, stamped.since) == (orphan.reason, 102.0)


def test_a_leak_that_closes_opens_afresh_and_may_take_a_culprit_again() -> None:
    ledger = FindingsLedger()
    procs = {10: _proc(10, 1.0)}
    ledger.stamp([_leak("RSS grows every step; `m.a` explains it (discovered)", "m.a")],
                 procs, 100.0)
    ledger.stamp([], procs, 101.0)
    assert ledger.open_since(_leak("", None).identity) is None
    ledger.stamp([_leak("RSS grows every step", None)], procs, 102.0)
    (stamped,) = ledger.stamp(
        [_leak("RSS grows every step; `m.b` explains it (discovered)", "m.b")], procs, 103.0)
    assert (stamped.reason, stamped.since) == (
        "RSS grows every step; `m.b` explains it (discovered)", 102.0)


def _point(step: int, discovered: Optional[dict[str, BufferSize]] = None,
           reserved: Optional[int] = None) -> StepPoint:
    return StepPoint(step, 1000.0 + step, 1 << 30, None, reserved, MappingProxyType({}),
                     discovered=NO_DISCOVERY if discovered is None
                     else MappingProxyType(discovered))


def test_discovered_series_follow_the_newest_pass_and_are_capped_least_recent_first() -> None:
    steps = StepSeries(STEP_POINTS)
    steps.add(_point(0, {"m.steady": BufferSize(0, 0)}))
    for step in range(1, 51):  # 8 names a pass, 7 of them new each time: 351 names in all
        steps.add(_point(step, {"m.steady": BufferSize(step, step * 64),
                                **{f"m.new{step}.{i}": BufferSize(i, None) for i in range(7)}}))
        steps.add(_point(step, reserved=step << 20) if step % 2 else _point(step))
    assert len(steps.discovered_items) == len(steps.discovered_bytes) == MAX_DISCOVERED
    assert "m.steady" in steps.discovered_items and "m.new1.0" not in steps.discovered_items
    assert list(steps.discovered_items)[-7:] == [f"m.new50.{i}" for i in range(7)]
    # Points only at the passes' steps, each a measurement of its own.
    steady = steps.discovered_bytes["m.steady"]
    assert list(steady.xs) == [float(s) for s in range(51)]
    assert list(steady.ys) == [s * 64.0 for s in range(51)]
    assert math.isnan(steps.discovered_bytes["m.new50.3"].ys[-1])
    assert steps.discovered_latest == {"m.steady", *(f"m.new50.{i}" for i in range(7))}

    steps.add(_point(51))  # no pass: what grows is as the last pass said
    assert "m.steady" in steps.discovered_latest
    steps.add(_point(52, {}))  # a pass that found nothing growing
    assert steps.discovered_latest == frozenset()
    assert len(steps.discovered_items) == MAX_DISCOVERED  # the series stay, nothing is named


def test_a_discovered_figure_stands_at_the_step_the_agent_counted_it_at() -> None:
    """A pass spans steps and its report goes with a later one: the figure is placed at the
    step it says, where that lies after the series' last point and not after the report's
    step; elsewhere (no step, one ahead of the report, one behind the last point) at the
    report's step."""
    steps = StepSeries(STEP_POINTS)
    steps.add(_point(10, {"m.a": DiscoveredSize(4, None, 6), "m.b": BufferSize(4, None)}))
    steps.add(_point(20, {"m.a": DiscoveredSize(8, None, 25), "m.b": DiscoveredSize(8, None, 14)}))
    steps.add(_point(30, {"m.a": DiscoveredSize(9, None, 19), "m.b": DiscoveredSize(9, None, 12)}))
    assert list(steps.discovered_items["m.a"].xs) == [6.0, 20.0, 30.0]
    assert list(steps.discovered_items["m.b"].xs) == [10.0, 14.0, 30.0]
    assert list(steps.discovered_items["m.a"].ys) == [4.0, 8.0, 9.0]
    # A process that has not stepped keeps its figures by the time received.
    ticking = StepSeries(STEP_POINTS)
    ticking.add(_point(0, {"m.a": DiscoveredSize(1, None, 0)})._replace(ticked=True))
    assert list(ticking.discovered_items["m.a"].xs) == [1000.0]


def _labels(*procs: HostProcess) -> dict[int, Optional[str]]:
    from gpuwatch.jobs.tree import job_roots

    snapshot = replace(_snapshot(100.0, *procs), job_roots=MappingProxyType(
        job_roots({p.pid: p for p in procs})))
    history = History()
    history.record(snapshot)
    return {p.pid: str(label) if (label := history.job_label(p)) else None for p in procs}


def test_a_raylet_serving_two_ray_jobs_belongs_to_neither_and_each_worker_to_its_own() -> None:
    from gpuwatch.model import Job

    raylet = HostProcess(pid=10, ppid=1, start_time=1.0, name="raylet", cmdline=("raylet",))
    workers = [HostProcess(pid=10 + i, ppid=10, start_time=2.0, name="ray::IDLE",
                           job=Job(f"0{i}000000", "ray")) for i in (1, 2)]
    idle = HostProcess(pid=13, ppid=10, start_time=2.0, name="ray::IDLE")
    assert _labels(raylet, *workers, idle) == {10: None, 11: "ray:01000000",
                                               12: "ray:02000000", 13: None}


def test_a_ray_worker_read_before_its_raylet_does_not_name_the_raylets_tree() -> None:
    from gpuwatch.model import Job

    raylet = HostProcess(pid=10, ppid=1, start_time=1.0, name="raylet", cmdline=("raylet",))
    worker = HostProcess(pid=11, ppid=10, start_time=2.0, name="ray::Holder",
                         job=Job("01000000", "ray"))
    agent = HostProcess(pid=12, ppid=10, start_time=2.0, name="ray::DashboardAgent")
    assert _labels(worker, raylet, agent) == {10: None, 11: "ray:01000000", 12: None}


def test_a_tree_whose_workers_carry_torchruns_default_run_id_is_named_by_its_launcher() -> None:
    env = MappingProxyType({"TORCHELASTIC_RUN_ID": "none", "LOCAL_RANK": "0"})
    launcher = HostProcess(pid=20, ppid=1, start_time=1.0, name="pt_elastic",
                           cmdline=("python3", "/usr/bin/torchrun", "train.py"))
    worker = HostProcess(pid=21, ppid=20, start_time=2.0, name="python", launch_env=env)
    helper = HostProcess(pid=22, ppid=20, start_time=2.0, name="redis-server")
    assert _labels(launcher, worker, helper) == {20: "torchrun:20", 21: "torchrun:20",
                                                 22: "torchrun:20"}
    # First seen under PID 1 (its launcher gone before anyone looked): no launcher to name.
    assert _labels(replace(worker, ppid=1)) == {21: None}


def test_a_rank_with_data_loader_workers_and_a_helper_of_its_own_stays_in_its_launchers_job(
        ) -> None:
    """torchrun's rank forks its data loader's workers and starts a helper: all of it is the
    job `torchrun:<launcher PID>`, not a job of the rank's own (reap --job takes that name)."""
    env = MappingProxyType({"TORCHELASTIC_RUN_ID": "none", "LOCAL_RANK": "0"})
    shell = HostProcess(pid=19, ppid=1, start_time=0.5, name="bash", sid=19)
    launcher = HostProcess(pid=20, ppid=19, start_time=1.0, name="pt_elastic", sid=19,
                           cmdline=("python3", "/usr/bin/torchrun", "train.py"))
    rank = HostProcess(pid=21, ppid=20, start_time=2.0, name="python", sid=21, launch_env=env,
                       cmdline=("python3", "-u", "train.py"))
    loader = HostProcess(pid=22, ppid=21, start_time=3.0, name="pt_data_worker", sid=21,
                         launch_env=env, cmdline=rank.cmdline)
    helper = HostProcess(pid=23, ppid=21, start_time=3.0, name="redis-server", sid=21,
                         launch_env=env, cmdline=("redis-server",))
    assert _labels(shell, launcher, rank, loader, helper) == {
        19: None, 20: "torchrun:20", 21: "torchrun:20", 22: "torchrun:20", 23: "torchrun:20"}


def test_workers_a_trainer_forks_after_it_was_first_seen_are_in_the_trainers_job() -> None:
    """A trainer first seen on its own, under a parent that is no boundary (a wrapper script,
    a notebook server's kernel): its data loader's workers, forked later, make it the root of
    a tree of their own in the snapshot, yet they belong to the job the trainer was seen in,
    which has had a trainer (so their memory is judged with it)."""
    from gpuwatch.jobs.tree import job_roots

    holds = (GpuProcessUsage(0, "GPU-0", 32, 1 << 30),)
    shell = HostProcess(pid=30, ppid=1, start_time=0.5, name="bash", sid=30)
    script = HostProcess(pid=31, ppid=30, start_time=1.0, name="bash", sid=30,
                         cmdline=("bash", "run.sh"))
    trainer = HostProcess(pid=32, ppid=31, start_time=2.0, name="python", sid=30,
                          cmdline=("python", "train.py"), gpu_usage=holds)
    worker = HostProcess(pid=33, ppid=32, start_time=3.0, name="pt_data_worker", sid=30,
                         cmdline=trainer.cmdline)
    history = History()
    for t, procs in ((1.0, (shell, script, trainer)), (2.0, (shell, script, trainer, worker))):
        by_pid = {p.pid: p for p in procs}
        history.record(replace(_snapshot(t, *procs),
                               job_roots=MappingProxyType(job_roots(by_pid))))
    job = history.job_of(worker)
    assert job is not None and job is history.job_of(trainer) and job.had_trainer


def _history_bytes(processes: int, polls: int, samples: int = 300) -> tuple[int, int]:
    """Bytes the history of `processes` processes holds (tracemalloc) after their first poll,
    and after `polls` more, every one a sample."""
    import gc
    import tracemalloc
    history = History(samples=samples, max_processes=processes)
    procs = [_proc(100 + i, 1.0, rss=1 << 30) for i in range(processes)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        history.record(_snapshot(1.0, *procs))
        first = tracemalloc.get_traced_memory()[0] - before
        for t in range(polls):
            history.record(_snapshot(2.0 + t, *procs))
        gc.collect()
        full = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return first, full


def test_a_process_s_samples_take_their_memory_at_its_first_sight_not_as_they_fill() -> None:
    first, full = _history_bytes(200, 400)
    # The samples are there from the first poll: filling 300 of them takes nothing more (a
    # few bytes a process of what was allocated meanwhile, never its samples' 4.8 KB).
    assert full - first < 200 * 200, (first, full)


def test_samples_cost_8_bytes_a_process_their_times_kept_once() -> None:
    _, full = _history_bytes(200, 400)
    # RSS and GPU memory, 4 bytes each (32-bit floats); the times once for every process
    # (2.4 KB in all); each process's record (about 1 KB).
    assert full < 200 * (300 * 8 + 1200) + 300 * 8 + 8192, full


def test_figures_in_pages_or_mib_are_kept_exactly_in_half_a_double() -> None:
    ring = FigureRing(8)
    page, mib = 4096, 1 << 20
    kept = [0, page, 123_457 * page, (1 << 24) * page,  # every RSS up to 64 GiB
            141 * 1024 * mib, ((1 << 24) - 1) * mib]      # NVML's MiB up to 16 TiB
    for value in kept:
        ring.append(float(value))
    ring.append(math.nan)
    assert ring.compact
    assert [int(v) for v in ring.values()[:-1]] == kept
    assert math.isnan(ring.values()[-1])


def test_every_nth_figure_is_values_every_nth_filling_full_and_wrapped_at_every_stride() -> None:
    for capacity in (1, 2, 7, 30):
        ring = FigureRing(capacity)
        for n in range(3 * capacity + 2):
            for stride in range(1, capacity + 2):
                assert list(ring.every(stride)) == list(ring.values()[::stride]), (
                    capacity, n, stride)
            ring.append(float(n * 4096))


def test_a_rise_read_in_place_is_the_one_values_gives_filling_full_and_wrapped() -> None:
    for capacity in (1, 2, 7, 30):
        ring = FigureRing(capacity)
        for n in range(3 * capacity + 2):
            values = ring.values()
            assert [ring.rise(i) for i in range(len(ring))] == [v - values[0] for v in values], (
                capacity, n)
            ring.append(float(n * n * 4096))


def test_the_time_based_leak_pre_check_reads_the_rise_to_a_sample_with_unknowns_as_nan() -> None:
    mib = 1 << 20
    history = History(samples=8)
    usage = (GpuProcessUsage(0, "GPU-0", 10, 100 * mib),)
    for t in range(13):  # past the capacity: the rings wrap
        rss = None if t == 10 else (1 << 30) + t * mib
        history.record(_snapshot(float(t), replace(_proc(10, 1.0, rss=rss), gpu_usage=usage)))
    h = history.get((10, 1.0))
    assert h is not None and len(h) == 8
    for i in range(8):
        rss_rise, gpu_rise = h.rises(i)
        assert gpu_rise == 0.0
        if i == 5:  # the poll at t=10: RSS unknown
            assert math.isnan(rss_rise)
        else:
            assert rss_rise == i * mib == h.rss[i] - h.rss[0]


def test_a_figure_a_32_bit_float_would_round_turns_the_ring_into_exact_doubles() -> None:
    ring = FigureRing(4)
    for value in (5 * 4096, (1 << 36) + 4096, 2**62 + 4096, float(2**64), 1e300):
        ring.append(float(value))
    # Nothing rounded, nothing overflowed: the ring holds doubles now, its older figures too.
    assert not ring.compact
    assert list(ring.values()) == [float((1 << 36) + 4096), float(2**62 + 4096),
                                   float(2**64), 1e300]


def test_an_rss_over_64_gib_keeps_its_every_page_in_the_history() -> None:
    history = History(samples=5)
    huge = (1 << 36) + 3 * 4096  # 64 GiB and 3 pages: 25 significant bits of pages
    history.record(_snapshot(1.0, _proc(10, 1.0, rss=4096)))
    history.record(_snapshot(2.0, _proc(10, 1.0, rss=huge)))
    history.record(_snapshot(3.0, _proc(10, 1.0, rss=huge + 4096)))
    h = history.get((10, 1.0))
    assert h is not None
    assert [s.rss_bytes for s in h.samples()] == [4096, huge, huge + 4096]


def test_a_process_first_seen_between_two_samples_has_its_first_at_the_next() -> None:
    history = History(samples=10, sample_spacing=3.0)
    history.record(_snapshot(0.0, _proc(10, 1.0, rss=1)))
    history.record(_snapshot(1.0, _proc(10, 1.0, rss=2), _proc(11, 1.0, rss=20)))
    history.record(_snapshot(3.0, _proc(10, 1.0, rss=3), _proc(11, 1.0, rss=30)))
    old, new = history.get((10, 1.0)), history.get((11, 1.0))
    assert old is not None and new is not None
    assert [(s.taken_at, s.rss_bytes) for s in old.samples()] == [(0.0, 1), (3.0, 3)]
    assert [(s.taken_at, s.rss_bytes) for s in new.samples()] == [(3.0, 30)]
    assert new.first_seen == 1.0
