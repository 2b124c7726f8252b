"""The leak and stall detectors over step series built from fixture snapshots: exact control of
noise, sawtooth, copy-on-write plateaus and limits. tests/test_agent_end_to_end.py runs the same
questions with real processes, the real agent and the real daemon."""

from __future__ import annotations

import math
import random
from types import MappingProxyType
from typing import Any, Optional

import pytest

from gpuwatch.config import Config, DetectorConfig, HistoryConfig, sample_spacing
from gpuwatch.detectors import assess
from gpuwatch.evidence import (
    CopyOnWrite,
    Culprit,
    HungAtExit,
    LeakEvidence,
    OomProjection,
    TracedSite,
    TraceSummary,
)
from gpuwatch.history import History
from gpuwatch.jobs.tree import job_roots
from gpuwatch.model import (
    NO_DISCOVERY,
    AgentReading,
    BufferSize,
    Finding,
    GpuDevice,
    GpuProcessUsage,
    HostProcess,
    NodeReport,
    NodeSnapshot,
    NvmlStatus,
    StepPoint,
    TraceReport,
    TraceSite,
)
from gpuwatch.vocabulary import FoundBy, GrowthUnit, LimitSource, Series, TraceStatus
from tests.emitted_kinds import detectors_report_only_declared_kinds  # noqa: F401 (autouse)

MIB = 1 << 20
GIB = 1 << 30
CONFIG = DetectorConfig(host_memory_limit_bytes=0, stall_after=60.0)
INIT = HostProcess(pid=1, ppid=0, start_time=0.0, name="systemd", state="sleeping")


class Run:
    """A process stepping once a second, polled once per step."""

    def __init__(self, config: DetectorConfig = CONFIG, mem_available: int = 64 * GIB,
                 gpu_total: int = 80 * GIB) -> None:
        self.config = config
        self.history = History()
        self.mem_available = mem_available
        self.gpu_total = gpu_total
        self.first_seen = 1000.0
        self.step_changed_at = 1000.0
        self.reports: list[NodeReport] = []

    def step(self, step: int, rss: int, gpu: Optional[int] = None,
             buffers: Optional[dict[str, BufferSize]] = None, at: Optional[float] = None,
             advance: bool = True, discovered: Optional[dict[str, BufferSize]] = None,
             cuda: tuple[Optional[int], Optional[int]] = (None, None),
             trace: Optional[TraceReport] = None,
             traces_pending: Optional[dict[int, int]] = None,
             exit_report: Optional[dict[str, Any]] = None) -> NodeReport:
        t = at if at is not None else 1000.0 + step
        if advance:
            self.step_changed_at = t
        point = StepPoint(step, t, rss, cuda[0], cuda[1], MappingProxyType(buffers or {}),
                          discovered=NO_DISCOVERY if discovered is None
                          else MappingProxyType(discovered))
        agent = AgentReading(pid=10, uid=1000, first_seen=self.first_seen, last_seen=t,
                             step=step, step_changed_at=self.step_changed_at, finished_at=None,
                             exit_report=(MappingProxyType(exit_report)
                                          if exit_report is not None else None),
                             points=(point,) if advance else (),
                             latest=point, trace=trace, can_reply=True)
        usage = (GpuProcessUsage(0, "GPU-0", 10, gpu),) if gpu is not None else ()
        worker = HostProcess(pid=10, ppid=1, start_time=900.0, name="python", user="alice",
                             state="running", rss_bytes=rss, gpu_usage=usage)
        used = gpu or 0
        device = GpuDevice(index=0, memory_total_bytes=self.gpu_total, memory_used_bytes=used,
                           memory_free_bytes=self.gpu_total - used, processes=usage)
        procs = {1: INIT, 10: worker}
        snap = NodeSnapshot(taken_at=t, hostname="n", nvml=NvmlStatus(available=True),
                            gpus=(device,), processes=MappingProxyType(procs),
                            job_roots=MappingProxyType(job_roots(procs)),
                            agents=MappingProxyType({10: agent}),
                            mem_available_bytes=self.mem_available,
                            traces_pending=MappingProxyType(traces_pending or {}))
        report = assess(snap, self.history, self.config)
        self.reports.append(report)
        return report


def leaks(report: NodeReport) -> list:
    return [f for f in report.findings if f.kind == "leak"]


def evidence(f: Finding) -> LeakEvidence:
    assert isinstance(f.details, LeakEvidence), f.details
    return f.details


def projection(f: Finding) -> OomProjection:
    oom = evidence(f).projection
    assert oom is not None
    return oom


def culprit(f: Finding) -> Culprit:
    c = evidence(f).culprit
    assert c is not None
    return c


def culprit_of(f: Finding) -> tuple[Optional[str], Optional[FoundBy]]:
    """The culprit's name and how it was found; (None, None) when the leak names none."""
    c = evidence(f).culprit
    return (c.name, c.found_by) if c is not None else (None, None)


def test_a_buffer_leaking_4_mib_a_step_is_named_within_10_steps_after_warm_up() -> None:
    rng = random.Random(7)
    base, limit = 2 * GIB, 1200 * MIB  # 1.2 GiB left: 300 steps of 4 MiB
    run = Run(mem_available=limit)
    flagged_at = None
    for step in range(40):
        items = step + 1
        noise = rng.gauss(0, 1.5 * MIB) + (30 * MIB if rng.random() < 0.1 else 0)  # GC spikes
        rss = base + items * 4 * MIB + int(noise)
        report = run.step(step, rss, buffers={
            "fetch_buffer": BufferSize(items, items * 4 * MIB),
            "queue_depth": BufferSize(rng.randint(0, 8), None)})
        run.mem_available = limit - items * 4 * MIB  # what the leak has eaten so far
        if leaks(report) and flagged_at is None:
            flagged_at = step
    assert flagged_at is not None and flagged_at <= CONFIG.leak_warmup_steps + 10
    (f,) = leaks(run.reports[-1])
    assert f.reason == ("RSS grows every step; buffer `fetch_buffer` explains it (watched); runs "
                        "out against the node limit")
    assert culprit_of(f) == ("fetch_buffer", "watched")
    assert evidence(f).trace is None
    assert abs((evidence(f).growth_bytes_per_step or 0) - 4 * MIB) < 0.1 * 4 * MIB
    # The true step of exhaustion: where 4 MiB a step has eaten the 1.2 GiB that were free.
    true_oom_step = limit // (4 * MIB)
    assert abs((projection(f).step or 0) - true_oom_step) <= 0.1 * true_oom_step
    assert projection(f).limit.source == LimitSource.NODE
    assert abs((projection(f).in_seconds or 0) - (true_oom_step - 39)) <= \
        0.1 * true_oom_step  # one step a second


def test_steady_workers_with_sawtooth_gc_noise_and_a_cow_plateau_raise_nothing_in_500_steps(
        ) -> None:
    rng = random.Random(11)
    runs = {"sawtooth": Run(), "gc": Run(), "cow": Run()}
    for step in range(500):
        # The allocator grows for a few steps, then returns memory (a trim, a cache flush).
        # A ramp longer than the detection window would look like a leak until it drops.
        sawtooth = 3 * GIB + (step % 5) * 40 * MIB
        gc = 3 * GIB + int(rng.gauss(0, 4 * MIB)) + (200 * MIB if step % 37 == 0 else 0)
        cow = 3 * GIB + min(step, 9) * 60 * MIB + int(rng.gauss(0, MIB))  # plateaus in warm-up
        for name, rss in (("sawtooth", sawtooth), ("gc", gc), ("cow", cow)):
            # A bounded cache at capacity: it evicts as much as it takes in.
            report = runs[name].step(step, rss, buffers={
                "cache": BufferSize(1000 + rng.randint(-5, 5), 512 * MIB)})
            assert leaks(report) == [], (name, step, report.findings)


@pytest.mark.parametrize("burst_at", [(36, 40), (40, 44), (44, 48), (40, 44, 48)])
def test_a_burst_of_memory_held_a_step_after_a_warm_up_ratchet_is_no_leak_but_a_leak_under_it_is(
        burst_at: tuple[int, ...]) -> None:
    """A process stepping four times a poll (one RSS point every 4 steps): the allocator's
    warm-up raises RSS 1.2 MiB a step for 28 steps, then it is flat, and two or three points in
    a row land on steps that hold 80 MiB of garbage (a seeded healthy program did this). The
    block medians rise block after block; the blocks' lowest points do not. The same burst over
    a leak of 8 MiB a step still makes a leak, at the step it does without the burst (44)."""
    healthy, leaking, plain = Run(), Run(), Run()
    for step in range(0, 73, 4):
        burst = 80 * MIB if step in burst_at else 0
        ratchet = 3 * GIB + min(step, 28) * 1229 * 1024
        assert leaks(healthy.step(step, ratchet + burst)) == [], step
        leaking.step(step, 3 * GIB + step * 8 * MIB + burst)
        plain.step(step, 3 * GIB + step * 8 * MIB)
    first = [next(i * 4 for i, r in enumerate(run.reports) if leaks(r))
             for run in (leaking, plain)]
    assert first == [44, 44], first


def test_growth_that_levels_off_after_warm_up_is_no_longer_called_a_leak() -> None:
    run = Run()
    for step in range(120):
        run.step(step, 3 * GIB + min(step, 40) * 5 * MIB)
    assert any(leaks(r) for r in run.reports[20:40])  # while it grew, it was one
    assert leaks(run.reports[-1]) == []  # once it levelled off, it closes


def test_gpu_memory_growing_every_step_is_a_leak_projected_against_the_gpu() -> None:
    run = Run(gpu_total=10 * GIB)
    for step in range(30):
        report = run.step(step, 3 * GIB, gpu=GIB + step * 64 * MIB)
    (f,) = leaks(report)
    assert f.reason == "GPU memory grows every step; runs out against the GPU limit"
    assert projection(f).limit.source == LimitSource.GPU
    used = GIB + 29 * 64 * MIB
    expected = 29 + (10 * GIB - used) // (64 * MIB)
    assert abs((projection(f).step or 0) - expected) <= 1


def test_a_buffer_growing_in_items_alone_is_named() -> None:
    run = Run()
    for step in range(30):
        report = run.step(step, 3 * GIB, buffers={"pending": BufferSize(10 * step, None)})
    (f,) = leaks(report)
    assert f.reason == "buffer `pending` grows every step"
    assert culprit(f).items_per_step == 10.0
    assert culprit_of(f) == ("pending", "watched")


def test_without_an_agent_steady_growth_over_time_is_a_leak_per_second() -> None:
    config = DetectorConfig(leak_warmup_seconds=60, leak_min_span_seconds=300,
                            leak_min_bytes_per_second=10 * 1024)
    history = History()
    for i in range(200):
        t = 1000.0 + 2 * i
        worker = HostProcess(pid=10, ppid=1, start_time=900.0, name="python", state="running",
                             rss_bytes=GIB + i * 2 * MIB,
                             gpu_usage=(GpuProcessUsage(0, "GPU-0", 10, GIB),))
        procs = {1: INIT, 10: worker}
        snap = NodeSnapshot(taken_at=t, hostname="n", nvml=NvmlStatus(available=True), gpus=(),
                            processes=MappingProxyType(procs), mem_available_bytes=8 * GIB,
                            job_roots=MappingProxyType(job_roots(procs)))
        report = assess(snap, history, config)
    (f,) = leaks(report)
    assert evidence(f).unit == GrowthUnit.SECOND
    assert f.reason.startswith("RSS grows steadily (no agent)")
    assert math.isclose(evidence(f).growth_bytes_per_second or 0, MIB, rel_tol=0.01)


def _worker_job(t: float, worker_rss: int, cmdline: tuple[str, ...] = ()
                ) -> dict[int, HostProcess]:
    """A trainer holding GPU memory under init, and a data worker it forked (no GPU)."""
    trainer = HostProcess(pid=10, ppid=1, start_time=900.0, name="python", state="running",
                          rss_bytes=3 * GIB, gpu_usage=(GpuProcessUsage(0, "GPU-0", 10, GIB),))
    worker = HostProcess(pid=11, ppid=10, start_time=901.0, name="python", state="sleeping",
                         rss_bytes=worker_rss, cmdline=cmdline)
    return {1: INIT, 10: trainer, 11: worker}


def _snapshot(t: float, procs: dict[int, HostProcess]) -> NodeSnapshot:
    return NodeSnapshot(taken_at=t, hostname="n", nvml=NvmlStatus(available=True), gpus=(),
                        processes=MappingProxyType(procs), mem_available_bytes=64 * GIB,
                        job_roots=MappingProxyType(job_roots(procs)))


@pytest.mark.parametrize("interval", [0.1, 0.5, 1.0, 2.0, 5.0, 30.0])
def test_with_the_default_settings_a_worker_growing_steadily_is_a_leak_at_any_interval(
        interval: float) -> None:
    """The default span (600 s) is within what the default history (300 samples) keeps at
    every poll interval: at 1 s, 300 samples of every poll would span 299 s and the leak could
    never be called. A data worker holding no GPU memory is judged as its trainer is."""
    config = Config(history=HistoryConfig())
    detectors = config.detectors
    history = History(config.history.samples, sample_spacing=sample_spacing(config))
    start = 1000.0
    deadline = detectors.leak_warmup_seconds + 1.25 * detectors.leak_min_span_seconds + 60
    t, found = start, None
    while t - start <= deadline and found is None:
        procs = _worker_job(t, GIB + int((t - start) * MIB))
        report = assess(_snapshot(t, procs), history, detectors)
        found = next((f for f in leaks(report)), None)
        t += interval
    assert found is not None, f"no leak within {deadline:.0f} s at a {interval} s interval"
    assert found.pid == 11 and found.reason.startswith("RSS grows steadily (no agent)")
    assert math.isclose(evidence(found).growth_bytes_per_second or 0, MIB, rel_tol=0.05)
    # What that costs: a bounded number of samples, whatever the interval.
    h = history.get((11, 901.0))
    assert h is not None and len(h) <= config.history.samples


def test_a_process_outside_any_gpu_job_is_not_judged_however_it_grows() -> None:
    history = History(sample_spacing=0.0)
    config = DetectorConfig(leak_warmup_seconds=0, leak_min_span_seconds=20)
    for i in range(100):
        t = 1000.0 + i
        procs = _worker_job(t, GIB)
        # An editor under init, growing: no GPU job's member.
        procs[20] = HostProcess(pid=20, ppid=1, start_time=950.0, name="emacs",
                                state="sleeping", rss_bytes=GIB + i * 8 * MIB)
        report = assess(_snapshot(t, procs), history, config)
        assert leaks(report) == []


def _forked_job(t: float, uss: list[int], rss: list[int]) -> dict[int, HostProcess]:
    """A trainer holding GPU memory and the workers it forked (its command line), with their
    USS and RSS."""
    argv = ("python", "train.py")
    trainer = HostProcess(pid=10, ppid=1, start_time=900.0, name="python", state="running",
                          cmdline=argv, rss_bytes=3 * GIB, uss_bytes=3 * GIB,
                          gpu_usage=(GpuProcessUsage(0, "GPU-0", 10, GIB),))
    procs = {1: INIT, 10: trainer}
    for i, (u, r) in enumerate(zip(uss, rss)):
        procs[11 + i] = HostProcess(pid=11 + i, ppid=10, start_time=901.0, name="python",
                                    state="sleeping", cmdline=argv, rss_bytes=r, uss_bytes=u)
    return procs


COW_CONFIG = DetectorConfig(leak_warmup_seconds=0, leak_min_span_seconds=20)


def test_forked_workers_private_memory_growing_with_rss_flat_is_explained_as_copy_on_write(
        ) -> None:
    history = History()
    for i in range(60):
        t = 1000.0 + i
        procs = _forked_job(t, uss=[9 * MIB + i * MIB, 9 * MIB + i * 2 * MIB, 9 * MIB],
                            rss=[400 * MIB, 400 * MIB + (i % 2) * 4096, 400 * MIB])
        report = assess(_snapshot(t, procs), history, COW_CONFIG)
    (f,) = leaks(report)
    assert f.pid == 10  # the parent: it holds the data, the fix is there
    assert f.reason == (
        "private memory of 2 forked workers grows while their RSS stays flat: copy-on-write "
        "after fork: touch-once data in a Dataset; workers' private memory grows as they touch "
        "the parent's pages")
    d = f.details
    assert isinstance(d, CopyOnWrite)
    assert (d.workers, d.worker_pids) == (2, (11, 12))
    assert math.isclose(d.growth_bytes_per_second, 3 * MIB, rel_tol=0.05)
    # Over the window: 1 and 2 MiB a second, for most of the 60 s.
    assert 120 * MIB <= d.private_growth_bytes <= 3 * 60 * MIB
    assert d.uss_bytes_to > d.uss_bytes_from >= 9 * MIB


def test_a_forked_worker_whose_rss_grows_with_its_uss_is_its_own_leak_not_copy_on_write() -> None:
    history = History()
    for i in range(60):
        t = 1000.0 + i
        grown = 9 * MIB + i * MIB
        procs = _forked_job(t, uss=[grown, 9 * MIB], rss=[400 * MIB + i * MIB, 400 * MIB])
        report = assess(_snapshot(t, procs), history, COW_CONFIG)
    (f,) = leaks(report)
    assert f.pid == 11 and f.reason.startswith("RSS grows steadily (no agent)")


def test_a_stalled_step_is_flagged_after_the_threshold_and_cleared_when_steps_resume() -> None:
    run = Run()
    for step in range(5):
        run.step(step, 3 * GIB, gpu=GIB)
    t = 1004.0
    for dt in (30.0, 59.0):
        report = run.step(4, 3 * GIB, gpu=GIB, at=t + dt, advance=False)
        assert [f.kind for f in report.findings] == []
    report = run.step(4, 3 * GIB, gpu=GIB, at=t + 61.0, advance=False)
    (f,) = report.findings
    assert (f.kind, f.pid) == ("stalled", 10)
    assert f.reason == "step 4 has not advanced since 00:16:44Z while holding GPU memory"
    assert run.step(5, 3 * GIB, gpu=GIB, at=t + 62.0).findings == ()


def test_a_step_stall_that_turns_out_hung_at_exit_says_what_holds_it_from_then_on() -> None:
    run = Run()
    for step in range(5):
        run.step(step, 3 * GIB, gpu=GIB)
    (stall,) = run.step(4, 3 * GIB, gpu=GIB, at=1065.0, advance=False).findings
    assert stall.severity == "warning" and stall.details is None
    pools = (MappingProxyType({"workers": 1, "threads": ("reward_buffer_0",)}),)
    hung = {"threads": ("heartbeat",), "executors": 2, "thread_pools": pools,
            "process_group": True}
    for at in (1066.0, 1067.0):
        (f,) = run.step(4, 3 * GIB, gpu=GIB, at=at, advance=False, exit_report=hung).findings
        assert (f.kind, f.since, f.severity) == ("stalled", stall.since, "critical")
        assert f.reason == (
            "hung at exit: the interpreter began to exit, but a ThreadPoolExecutor with 1 live "
            "worker thread ('reward_buffer_0') was never shut down; a ProcessPoolExecutor was "
            "never shut down; non-daemon thread 'heartbeat' is still running; the "
            "torch.distributed process group was never destroyed")
        assert f.details == HungAtExit()


def test_a_process_hung_at_exit_without_gpu_memory_is_a_warning_from_the_first_poll() -> None:
    run = Run()
    run.step(0, GIB)
    (f,) = run.step(0, GIB, at=1001.0, advance=False, exit_report={"executors": 2}).findings
    assert (f.kind, f.severity, f.gpu_memory_bytes) == ("stalled", "warning", None)
    assert f.reason == "hung at exit: the interpreter began to exit, but 2 executors were never " \
        "shut down"


FETCH = "areal.infra.rpc.rtensor._fetch_buffer"


def test_a_discovered_container_is_named_by_its_qualified_name_while_the_agent_names_it() -> None:
    rng = random.Random(3)
    run = Run()
    for step in range(40):
        rss = 2 * GIB + step * 4 * MIB + int(rng.gauss(0, MIB))
        # A discovery pass every other step; a bounded cache that fills up is among the growers
        # the agent names too.
        discovered = {FETCH: BufferSize(4 * step, step * 4 * MIB),
                      "mymod.Registry.lru": BufferSize(min(step, 16), min(step, 16) * 256 << 10)
                      } if step % 2 == 0 else None
        report = run.step(step, rss, discovered=discovered)
    (f,) = leaks(report)
    assert f.reason == (f"RSS grows every step; `{FETCH}` explains it (discovered); runs out "
                        "against the node limit")
    assert culprit_of(f) == (FETCH, "discovered")
    assert abs((culprit(f).bytes_per_step or 0) - 4 * MIB) < 0.05 * 4 * MIB
    assert culprit(f).items_per_step == 4.0
    assert evidence(f).trace is None
    culprits = {culprit_of(f)[0] for r in run.reports for f in leaks(r)}
    assert culprits == {FETCH}  # named as soon as the leak was, never the cache

    # The next pass no longer names it (it stopped growing, or others grow faster): it is not
    # the culprit any more, though the reason, once given, stays.
    report = run.step(40, 2 * GIB + 40 * 4 * MIB,
                      discovered={"mymod.Registry.lru": BufferSize(16, 4 * MIB)})
    (f,) = leaks(report)
    assert culprit_of(f) == (None, None)
    assert f.reason.startswith(f"RSS grows every step; `{FETCH}` explains it (discovered)")


def test_a_bounded_cache_that_grew_as_fast_as_the_leak_and_plateaued_is_never_named() -> None:
    run = Run()
    for step in range(60):
        # The cache fills within the warm-up as fast as RSS grows, then evicts as it takes in;
        # RSS goes on growing through something no pass finds.
        cache = min(step, 10)
        report = run.step(step, 2 * GIB + step * 4 * MIB,
                          discovered={"mymod.cache": BufferSize(100 * cache, cache * 4 * MIB)})
    assert all(culprit_of(f) == (None, None)
               for r in run.reports for f in leaks(r))
    (f,) = leaks(report)
    assert f.reason == "RSS grows every step; runs out against the node limit"


def test_a_discovered_container_needs_four_passes_and_half_the_growth() -> None:
    run = Run()
    for step in range(30):
        passes = step >= 24 and step % 2 == 0  # three passes by step 28, four at step 30
        discovered = {FETCH: BufferSize(step, step * 4 * MIB),
                      "mymod.small": BufferSize(step, step * MIB)} if passes else None
        report = run.step(step, 2 * GIB + step * 4 * MIB, discovered=discovered)
        if leaks(report):
            assert evidence(leaks(report)[0]).culprit is None, step
    assert leaks(run.reports[-1])  # open, with no culprit yet
    report = run.step(30, 2 * GIB + 30 * 4 * MIB,
                      discovered={FETCH: BufferSize(30, 30 * 4 * MIB),
                                  "mymod.small": BufferSize(30, 30 * MIB)})
    (f,) = leaks(report)
    assert culprit(f).name == FETCH  # "mymod.small" grows by a quarter of the leak only
    # Named four steps after the leak opened: the reason takes it.
    assert f.reason.startswith(f"RSS grows every step; `{FETCH}` explains it (discovered)")


def test_unsized_discovered_containers_are_judged_by_their_item_counts() -> None:
    run = Run()
    for step in range(30):
        discovered = {"mymod.pending": BufferSize(10 * step, None),
                      "mymod.queue": BufferSize(3 + step % 2, None)}
        report = run.step(step, 2 * GIB + step * 4 * MIB, discovered=discovered)
    (f,) = leaks(report)
    assert culprit_of(f) == ("mymod.pending", "discovered")
    assert culprit(f).items_per_step == 10.0
    assert culprit(f).bytes_per_step is None


def _trace(received_at: float, step: int, top_bytes: int, steps: int = 5) -> TraceReport:
    return TraceReport(
        "done", "", steps,
        (TraceSite("data/loader.py", 88, 4096, 10), TraceSite("leaky.py", 42, top_bytes, steps)),
        (("train.py", 120), ("model/step.py", 57), ("leaky.py", 42)), received_at, step)


def test_an_allocation_site_a_trace_found_is_named_once_the_answer_comes() -> None:
    run = Run()
    # A trace from before the leak: it says nothing about it, however large its top site.
    early = _trace(1002.5, 2, 500 * MIB)
    opened = None
    for step in range(20):
        report = run.step(step, 2 * GIB + step * 3 * MIB, trace=early)
        if leaks(report) and opened is None:
            opened = step
    assert opened is not None
    (f,) = leaks(report)
    assert f.reason == "RSS grows every step; runs out against the node limit"
    assert culprit_of(f) == (None, None)
    assert evidence(f).trace is None

    # The daemon asked for 5 steps; until the answer comes the finding says so.
    for step in range(20, 26):
        report = run.step(step, 2 * GIB + step * 3 * MIB, trace=early,
                          traces_pending={10: 5})
        (f,) = leaks(report)
        assert evidence(f).trace == TraceSummary(TraceStatus.REQUESTED, steps=5)
        assert evidence(f).found_by is None

    answer = _trace(1025.5, 25, 15 * MIB)
    report = run.step(26, 2 * GIB + 26 * 3 * MIB, trace=answer)
    (f,) = leaks(report)
    assert f.reason == ("RSS grows every step; allocations at `leaky.py:42` explain it (traced); "
                        "runs out against the node limit")
    assert culprit_of(f) == ("leaky.py:42", "traced")
    assert culprit(f).bytes_per_step == 3 * MIB
    assert evidence(f).trace == TraceSummary(
        TraceStatus.DONE, "", 5,
        (TracedSite("leaky.py:42", 3 * MIB, 1.0), TracedSite("data/loader.py:88", 819, 2.0)),
        ("train.py:120", "model/step.py:57", "leaky.py:42"))
    assert f.since == 1000.0 + opened  # the same finding, its reason now complete

    # The answer stays the leak's culprit while it is open.
    for step in range(27, 200):
        report = run.step(step, 2 * GIB + step * 3 * MIB, trace=answer)
    (f,) = leaks(report)
    assert evidence(f).found_by == FoundBy.TRACED


def test_a_trace_that_explains_too_little_or_was_refused_is_shown_but_names_nothing() -> None:
    for trace, shown in (
            (_trace(1019.5, 19, MIB), {"status": TraceStatus.DONE, "steps": 5}),
            (TraceReport(TraceStatus.REFUSED, "GPUWATCH_AGENT_TRACING=0", None, (), (), 1019.5,
                         19),
             {"status": TraceStatus.REFUSED, "why": "GPUWATCH_AGENT_TRACING=0", "sites": ()})):
        run = Run()
        for step in range(24):
            report = run.step(step, 2 * GIB + step * 3 * MIB, trace=trace if step >= 20 else None)
        (f,) = leaks(report)
        assert culprit_of(f) == (None, None)
        assert f.reason == "RSS grows every step; runs out against the node limit"
        assert {k: getattr(evidence(f).trace, k) for k in shown} == shown


def test_gpu_memory_the_caching_allocator_keeps_reserved_is_no_leak() -> None:
    """NVML and torch's reserved figure grow by 64 MiB a step while what tensors hold stays
    flat: the caching allocator, not a leak."""
    rng = random.Random(5)
    run = Run(gpu_total=80 * GIB)
    for step in range(80):
        pool = GIB + step * 64 * MIB
        allocated = GIB - 256 * MIB + int(rng.gauss(0, 8 * MIB))
        report = run.step(step, 3 * GIB, gpu=pool + 512 * MIB, cuda=(allocated, pool))
        assert leaks(report) == [], step


def test_gpu_memory_allocated_by_tensors_growing_every_step_is_a_leak() -> None:
    run = Run(gpu_total=80 * GIB)
    for step in range(30):
        allocated = GIB + step * 64 * MIB
        # The pool grows in large chunks, NVML with it: its own figure would be a staircase.
        pool = GIB + (step // 8 + 1) * 8 * 64 * MIB
        report = run.step(step, 3 * GIB, gpu=pool + 512 * MIB, cuda=(allocated, pool))
    (f,) = leaks(report)
    assert f.reason == "GPU memory grows every step; runs out against the GPU limit"
    assert evidence(f).series == Series.GPU_MEMORY
    assert evidence(f).growth_bytes_per_step == 64 * MIB
    assert culprit_of(f) == (None, None)


def test_a_leak_of_a_process_stepping_faster_than_the_polls_is_named_as_rss_with_its_buffer(
        ) -> None:
    """RSS is the kernel's, a point a poll; the buffer comes every step. With 4 steps a poll the
    buffer shows growing polls before RSS can, and the leak must still open as what runs out:
    "RSS grows every step; buffer `fetch_buffer` explains it", never as the buffer alone (a
    reason is kept while the finding is open)."""
    history = History()
    first: Optional[NodeReport] = None
    step = 0
    for poll in range(40):
        t = 1000.0 + poll
        points = []
        for _ in range(4):
            step += 1
            points.append(StepPoint(step, t - 1 + step % 4 / 4, None, None, None,
                                    MappingProxyType({"fetch_buffer": BufferSize(
                                        step, step * 4 * MIB)})))
        rss = 2 * GIB + step * 4 * MIB
        agent = AgentReading(pid=10, uid=1000, first_seen=1000.0, last_seen=t, step=step,
                             step_changed_at=t, finished_at=None, exit_report=None,
                             points=tuple(points), latest=points[-1], can_reply=True)
        worker = HostProcess(pid=10, ppid=1, start_time=900.0, name="python", user="alice",
                             state="running", rss_bytes=rss)
        procs = {1: INIT, 10: worker}
        snap = NodeSnapshot(taken_at=t, hostname="n", nvml=NvmlStatus(available=True), gpus=(),
                            processes=MappingProxyType(procs),
                            job_roots=MappingProxyType(job_roots(procs)),
                            agents=MappingProxyType({10: agent}),
                            mem_available_bytes=64 * GIB)
        report = assess(snap, history, CONFIG)
        if leaks(report):
            first = report
            break
    assert first is not None, "no leak named in 40 polls"
    (leak,) = leaks(first)
    assert leak.reason.startswith("RSS grows every step; buffer `fetch_buffer` explains it")
    assert evidence(leak).series == Series.RSS


# -- summaries: the evidence from identity and figures only (docs/security.md, rule 5) -----------
#: Text a program chose (a buffer's name, a thread's, a source path): never in a summary.
MARK = "s3cr3t-7f0c"


def test_a_leak_s_summary_names_the_kind_of_culprit_never_the_buffer_or_the_traced_path() -> None:
    run = Run()
    for step in range(40):
        report = run.step(step, 2 * GIB + step * 4 * MIB, buffers={
            f"fetch_{MARK}": BufferSize(step, step * 4 * MIB)})
    (f,) = leaks(report)
    assert f"buffer `fetch_{MARK}` explains it (watched)" in f.reason
    assert f.summary == ("RSS grows every step; a watched buffer explains it (watched); runs out "
                         "against the node limit")

    alone = Run()
    for step in range(30):
        report = alone.step(step, 3 * GIB, buffers={f"pending_{MARK}": BufferSize(10 * step, None)})
    (f,) = leaks(report)
    assert f.reason == f"buffer `pending_{MARK}` grows every step"
    assert f.summary == "a watched buffer grows every step"

    traced = Run()
    site = TraceSite(f"/home/alice/{MARK}/leaky.py", 42, 15 * MIB, 5)
    answer = TraceReport("done", "", 5, (site,), ((f"/home/alice/{MARK}/train.py", 1),),
                         1025.5, 25)
    for step in range(27):
        report = traced.step(step, 2 * GIB + step * 3 * MIB,
                             trace=answer if step == 26 else None)
    (f,) = leaks(report)
    assert f"allocations at `/home/alice/{MARK}/leaky.py:42` explain it (traced)" in f.reason
    assert f.summary == ("RSS grows every step; an allocation site explains it (traced); runs out "
                         "against the node limit")


def test_a_stall_s_summary_says_what_holds_the_exit_by_kind_and_count_never_thread_names(
        ) -> None:
    run = Run()
    for step in range(5):
        run.step(step, 3 * GIB, gpu=GIB)
    (stall,) = run.step(4, 3 * GIB, gpu=GIB, at=1065.0, advance=False).findings
    # A step and a clock time: public as they are.
    assert stall.summary == stall.reason == \
        "step 4 has not advanced since 00:16:44Z while holding GPU memory"
    pools = (MappingProxyType({"workers": 3, "threads": (f"reward_{MARK}_0",)}),)
    hung = {"threads": (f"heartbeat_{MARK}", "saver"), "executors": 2, "thread_pools": pools,
            "process_group": True}
    (f,) = run.step(4, 3 * GIB, gpu=GIB, at=1066.0, advance=False, exit_report=hung).findings
    assert f"'reward_{MARK}_0'" in f.reason and f"'heartbeat_{MARK}'" in f.reason
    assert f.summary == (
        "hung at exit: the interpreter began to exit, but a ThreadPoolExecutor was never shut "
        "down; a ProcessPoolExecutor was never shut down; 2 non-daemon threads are still "
        "running; the torch.distributed process group was never destroyed")
    (f,) = Run().step(0, GIB, exit_report={"executors": 2}).findings
    assert f.summary == f.reason == \
        "hung at exit: the interpreter began to exit, but 2 executors were never shut down"


def test_the_leak_test_by_time_runs_once_per_sample_not_at_every_poll(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether a series grows depends on its samples alone: at polls that take no sample
    (closer than sample_spacing to the last), a test that found no growth is not run again;
    at the next sample it is, and the growth is found as it was."""
    from gpuwatch.history.samples import ProcessHistory

    tested: list[float] = []
    real = ProcessHistory.rises

    def counting(self: ProcessHistory, i: int) -> tuple[float, float]:
        if found is None:  # (a growth found is tested again at every poll: it is reported)
            tested.append(now)
        return real(self, i)

    monkeypatch.setattr(ProcessHistory, "rises", counting)
    config = DetectorConfig(leak_warmup_seconds=0, leak_min_span_seconds=30,
                            leak_min_bytes_per_second=10 * 1024)
    history = History(300, sample_spacing=3.0)
    sampled_at, found = [], None
    for i in range(120):
        now = 1000.0 + i
        rss = GIB + i * MIB
        taken = history._clock.taken
        report = assess(_snapshot(now, _worker_job(now, rss)), history, config)
        if history._clock.taken != taken:
            sampled_at.append(now)
        found = found or next((f for f in leaks(report)), None)
    assert tested and set(tested) <= set(sampled_at)
    assert found is not None and found.pid == 11
