"""The leak and stall detectors over step series built from fixture snapshots: exact control of
noise, sawtooth, copy-on-write plateaus and limits. tests/test_agent_end_to_end.py runs the same
questions with real processes, the real agent and the real daemon."""

from __future__ import annotations

import math
import random
from types import MappingProxyType
from typing import Optional

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors import assess
from gpuwatch.history import History
from gpuwatch.jobtree import job_roots
from gpuwatch.model import (
    AgentReading,
    BufferSize,
    GpuDevice,
    GpuProcessUsage,
    HostProcess,
    NodeReport,
    NodeSnapshot,
    NvmlStatus,
    StepPoint,
)

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
             advance: bool = True) -> NodeReport:
        t = at if at is not None else 1000.0 + step
        if advance:
            self.step_changed_at = t
        point = StepPoint(step, t, rss, None, None, MappingProxyType(buffers or {}))
        agent = AgentReading(pid=10, uid=1000, first_seen=self.first_seen, last_seen=t,
                             step=step, step_changed_at=self.step_changed_at, finished_at=None,
                             exit_report=None, points=(point,) if advance else (),
                             latest=point)
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
                            mem_available_bytes=self.mem_available)
        report = assess(snap, self.history, self.config)
        self.reports.append(report)
        return report


def leaks(report: NodeReport) -> list:
    return [f for f in report.findings if f.kind == "leak"]


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
    assert f.reason.startswith("RSS grows every step; buffer `fetch_buffer` explains it")
    assert f.details["culprit"] == "fetch_buffer"
    assert abs(f.details["growth_bytes_per_step"] - 4 * MIB) < 0.1 * 4 * MIB
    # The true step of exhaustion: where 4 MiB a step has eaten the 1.2 GiB that were free.
    true_oom_step = limit // (4 * MIB)
    assert abs(f.details["projected_oom_step"] - true_oom_step) <= 0.1 * true_oom_step
    assert f.details["limit_source"] == "node"
    assert abs(f.details["projected_oom_in_seconds"] - (true_oom_step - 39)) <= \
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
    assert f.details["limit_source"] == "GPU"
    used = GIB + 29 * 64 * MIB
    expected = 29 + (10 * GIB - used) // (64 * MIB)
    assert abs(f.details["projected_oom_step"] - expected) <= 1


def test_a_buffer_growing_in_items_alone_is_named() -> None:
    run = Run()
    for step in range(30):
        report = run.step(step, 3 * GIB, buffers={"pending": BufferSize(10 * step, None)})
    (f,) = leaks(report)
    assert f.reason == "buffer `pending` grows every step"
    assert f.details["culprit_items_per_step"] == 10.0


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
    assert f.details["unit"] == "second" and f.reason.startswith("RSS grows steadily (no agent)")
    assert math.isclose(f.details["growth_bytes_per_second"], MIB, rel_tol=0.01)


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
