"""Trace requests: who is asked to trace its allocations, how often, and what is counted.

TraceRequests runs over fixture reports with a recording sender and a settable clock; the last
test runs it inside the daemon's poll, with its counters in the daemon's registry.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Optional

import pytest

from gpuwatch.actions.trace_requests import RESULTS, TraceRequests
from gpuwatch.clock import SteadyClock
from gpuwatch.config import AgentConfig, load_config
from gpuwatch.daemon import Daemon
from gpuwatch.evidence import Culprit, LeakEvidence
from gpuwatch.jobs.tree import job_roots
from gpuwatch.model import (
    AgentReading,
    Finding,
    HostProcess,
    Kind,
    NodeReport,
    NodeSnapshot,
    NvmlStatus,
    StepPoint,
    TraceReport,
    TraceSite,
)
from gpuwatch.poll import Poller
from gpuwatch.sources.private_memory import PrivateMemorySource
from gpuwatch.vocabulary import FoundBy, GrowthUnit, Series, Severity, TraceStatus

MIB = 1 << 20
GIB = 1 << 30
# 20 steps, 900 s cooldown, 4 pending, tracing on, asked at once (trace_after has its own test),
# a faster search of 60 s.
CONFIG = AgentConfig(trace_steps=20)
INIT = HostProcess(pid=1, ppid=0, start_time=0.0, name="systemd", state="sleeping")


class Sender:
    """Records requests; answers `ok` (what AgentReceiver.request_trace returns)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.searches: list[tuple[int, int]] = []
        self.ok = True

    def request_trace(self, pid: int, steps: int) -> bool:
        self.calls.append((pid, steps))
        return self.ok

    def request_search(self, pid: int, seconds: int) -> bool:
        self.searches.append((pid, seconds))
        return self.ok


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


def agent(pid: int, can_reply: bool = True, trace: Optional[TraceReport] = None,
          uid: int = 1000) -> AgentReading:
    return AgentReading(pid=pid, uid=uid, first_seen=1000.0, last_seen=1000.0, step=30,
                        step_changed_at=1000.0, finished_at=None, exit_report=None, points=(),
                        latest=None, trace=trace, can_reply=can_reply)


def leak(pid: int, found_by: Optional[str] = None, series: str = "RSS",
         kind: str = "leak") -> Finding:
    name = {"watched": "fetch_buffer", "discovered": "m.d", "traced": "a.py:1"}.get(
        found_by or "")
    culprit = Culprit(name, FoundBy(found_by)) if name is not None and found_by else None
    buffer = series[len("buffer `"):-1] if series.startswith("buffer `") else None
    return Finding(Kind(kind), Severity.WARNING, f"{series} grows every step", pid=pid,
                   start_time=900.0, name="python", details=LeakEvidence(
                       Series.BUFFER if buffer is not None else Series(series), GrowthUnit.STEP,
                       buffer=buffer, culprit=culprit))


def done(received_at: float) -> TraceReport:
    return TraceReport(TraceStatus.DONE, "", 20, (TraceSite("leaky.py", 42, 20 * MIB, 20),),
                       (("train.py", 1), ("leaky.py", 42)), received_at, 50)


class Node:
    """The processes and agents each poll sees, and the findings the detectors would give."""

    def __init__(self, requests: TraceRequests) -> None:
        self.requests = requests
        self.taken_at = 0.0
        self.agents: dict[int, AgentReading] = {}
        self.findings: list[Finding] = []
        self.snapshots: list[NodeSnapshot] = []

    def poll(self) -> NodeReport:
        procs = {pid: HostProcess(pid=pid, ppid=1, start_time=900.0, name="python")
                 for pid in self.agents}
        snapshot = NodeSnapshot(taken_at=self.taken_at, hostname="n", nvml=NvmlStatus(True),
                                gpus=(), processes=MappingProxyType(procs),
                                agents=MappingProxyType(dict(self.agents)))
        snapshot = self.requests.before_assess(snapshot)
        self.snapshots.append(snapshot)
        report = NodeReport(snapshot, tuple(self.findings))
        self.requests.after_assess(report)
        return report


def counts(requests: TraceRequests) -> dict[str, int]:
    return {k: v for k, v in requests.counts.items() if v}


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def sender() -> Sender:
    return Sender()


def node_of(sender: Sender, clock: Clock, config: AgentConfig = CONFIG) -> Node:
    return Node(TraceRequests(sender, config, clock=clock))


def test_a_host_memory_leak_without_a_culprit_gets_one_request_while_it_waits(
        sender: Sender, clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    node = node_of(sender, clock)
    node.agents[10] = agent(10)
    node.findings = [leak(10)]
    with caplog.at_level(logging.INFO, logger="gpuwatch.actions.trace_requests"):
        node.poll()
    assert sender.calls == [(10, 20)]
    assert counts(node.requests) == {"sent": 1}
    assert node.requests.pending == {10: 20}
    # And a faster search, at the same poll: the leak was raised without a culprit.
    assert sender.searches == [(10, 60)]
    assert node.requests.search_counts == {"sent": 1, "failed": 0}
    assert [r.getMessage() for r in caplog.records] == [
        "asked PID 10 (python) to search for growing containers at a higher share of its time "
        "for 60 s: its memory grows every step and nothing it reports explains it",
        "asked PID 10 (python) to trace its allocations for 20 steps: its RSS grows every step "
        "and nothing it reports explains it"]
    for _ in range(5):
        clock.now += 2
        node.poll()
        # The leak detector sees the request as pending: "tracing requested".
        assert node.snapshots[-1].traces_pending == {10: 20}
    assert sender.calls == [(10, 20)]
    assert sender.searches == [(10, 60)]


def test_only_culprit_less_rss_leaks_of_processes_that_can_be_answered_are_asked(
        sender: Sender, clock: Clock) -> None:
    node = node_of(sender, clock)
    node.agents = {11: agent(11), 12: agent(12), 13: agent(13), 14: agent(14, can_reply=False),
                   15: agent(15), 16: agent(16)}
    node.findings = [
        leak(11, found_by="watched"), leak(12, found_by="discovered"),
        leak(13, series="GPU memory"),  # Python's allocations cannot explain a GPU's memory
        leak(14),  # its reports come from a socket with no address to answer to
        leak(17),  # no agent at all
        leak(15, kind="orphan"),
        leak(16, series="buffer `pending`", found_by="watched"),
    ]
    for _ in range(3):
        node.poll()
        clock.now += 1000
    assert sender.calls == []
    assert counts(node.requests) == {}
    # A container of CUDA tensors can explain a GPU-memory leak: that one gets a faster search,
    # once per cooldown (900 s).
    assert sender.searches == [(13, 60)] * 3


def test_a_faster_search_is_asked_once_per_cooldown_and_never_when_search_seconds_is_0(
        sender: Sender, clock: Clock) -> None:
    node = node_of(sender, clock, AgentConfig(tracing=False))
    node.agents[10] = agent(10)
    node.findings = [leak(10, series="GPU memory")]
    for _ in range(10):
        node.poll()
        clock.now += 60
    assert sender.searches == [(10, 60)]
    clock.now += 900
    sender.ok = False  # its queue full: counted, asked again only after the cooldown
    node.poll()
    node.poll()
    assert sender.searches == [(10, 60)] * 2
    assert node.requests.search_counts == {"sent": 1, "failed": 1}

    quiet = Sender()
    node = node_of(quiet, clock, AgentConfig(trace_steps=20, search_seconds=0))
    node.agents[10] = agent(10)
    node.findings = [leak(10)]
    node.poll()
    assert quiet.searches == [] and quiet.calls == [(10, 20)]


def test_the_answer_settles_a_request_and_the_cooldown_holds_off_the_next(
        sender: Sender, clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    node = node_of(sender, clock)
    node.agents[10] = agent(10, trace=done(900.0))  # an answer to an earlier request
    node.findings = [leak(10)]
    node.poll()
    assert node.requests.pending == {10: 20}
    clock.now += 30
    node.poll()
    assert node.requests.pending == {10: 20}  # the old answer is not this one's

    node.agents[10] = agent(10, trace=done(5040.0))
    clock.now += 10
    with caplog.at_level(logging.INFO, logger="gpuwatch.actions.trace_requests"):
        node.poll()
    assert node.requests.pending == {}
    assert node.snapshots[-1].traces_pending == {}
    assert "PID 10 (python) traced 20 steps: top allocation site leaky.py:42, +1.0 MiB/step" in [
        r.getMessage() for r in caplog.records]
    # The leak still has no culprit (the trace explained too little): asked again only once
    # the cooldown has passed since the last request.
    clock.now = 5000.0 + 899
    node.poll()
    assert sender.calls == [(10, 20)]
    clock.now = 5000.0 + 900
    node.poll()
    assert sender.calls == [(10, 20), (10, 20)]
    assert counts(node.requests) == {"sent": 2}


def test_a_refusal_is_an_answer_too(sender: Sender, clock: Clock,
                                    caplog: pytest.LogCaptureFixture) -> None:
    node = node_of(sender, clock)
    node.agents[10] = agent(10)
    node.findings = [leak(10)]
    node.poll()
    node.agents[10] = agent(10, trace=TraceReport(
        TraceStatus.REFUSED, "GPUWATCH_AGENT_TRACING=0", None, (), (), 5001.0, 31))
    with caplog.at_level(logging.INFO, logger="gpuwatch.actions.trace_requests"):
        node.poll()
    assert node.requests.pending == {}
    assert "PID 10 (python) answered its trace request: refused (GPUWATCH_AGENT_TRACING=0)" in [
        r.getMessage() for r in caplog.records]


def test_an_unanswered_request_stops_being_pending_after_the_cooldown(
        sender: Sender, clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    node = node_of(sender, clock, replace(CONFIG, trace_cooldown=60.0))
    node.agents[10] = agent(10)
    node.findings = [leak(10)]
    node.poll()
    clock.now += 59
    node.poll()
    assert node.requests.pending == {10: 20} and len(sender.calls) == 1
    clock.now += 1
    with caplog.at_level(logging.INFO, logger="gpuwatch.actions.trace_requests"):
        node.poll()
    assert "PID 10 (python) did not answer its trace request in 60 s" in [
        r.getMessage() for r in caplog.records]
    # Due again at the same time: asked anew.
    assert len(sender.calls) == 2 and node.requests.pending == {10: 20}


def test_with_tracing_off_nothing_is_sent_and_each_process_counts_once_per_cooldown(
        sender: Sender, clock: Clock) -> None:
    node = node_of(sender, clock, replace(CONFIG, tracing=False))
    node.agents = {10: agent(10), 11: agent(11)}
    node.findings = [leak(10), leak(11)]
    for _ in range(10):
        node.poll()
        clock.now += 2
    assert sender.calls == []
    assert counts(node.requests) == {"disabled": 2}
    assert node.requests.pending == {}
    clock.now += 900
    node.poll()
    assert counts(node.requests) == {"disabled": 4}


def test_at_most_max_pending_requests_wait_and_one_held_back_is_counted_once(
        sender: Sender, clock: Clock) -> None:
    node = node_of(sender, clock, replace(CONFIG, trace_max_pending=2))
    node.agents = {pid: agent(pid) for pid in (10, 11, 12)}
    node.findings = [leak(pid) for pid in (10, 11, 12)]
    for _ in range(5):
        node.poll()
        clock.now += 2
    assert sender.calls == [(10, 20), (11, 20)]
    assert counts(node.requests) == {"sent": 2, "rate_limited": 1}
    assert node.requests.pending == {10: 20, 11: 20}

    node.agents[10] = agent(10, trace=done(clock.now))  # 10 answers: a slot frees
    node.poll()
    assert sender.calls == [(10, 20), (11, 20), (12, 20)]
    assert counts(node.requests) == {"sent": 3, "rate_limited": 1}
    assert node.requests.pending == {11: 20, 12: 20}


def test_one_user_s_unanswered_requests_give_way_to_another_user_s_up_to_its_share(
        sender: Sender, clock: Clock) -> None:
    """mallory's four leaking processes never answer and would hold every pending request for
    a cooldown; alice's leak takes the place of mallory's oldest, and a second user under its
    share the next; a user at its share waits."""
    node = node_of(sender, clock)  # 4 pending
    mallory = (20, 21, 22, 23)
    node.agents = {pid: agent(pid, uid=2000) for pid in mallory}
    node.findings = [leak(pid) for pid in mallory]
    node.poll()
    assert set(node.requests.pending) == set(mallory)
    clock.now += 2
    node.agents[10] = agent(10, uid=1000)
    node.findings.append(leak(10))
    node.poll()
    assert sender.calls[-1] == (10, 20)
    assert set(node.requests.pending) == {10, 21, 22, 23}  # mallory's oldest gave way
    clock.now += 2
    node.agents.update({11: agent(11, uid=1000), 30: agent(30, uid=3000)})
    node.findings += [leak(11), leak(30)]
    node.poll()
    # 11: alice holds 1 of her share of 2 (two users); then bob's 30: 1 of three users' 4.
    assert set(node.requests.pending) == {10, 11, 30, 23}
    clock.now += 2
    node.agents[12] = agent(12, uid=1000)
    node.findings.append(leak(12))
    node.poll()  # alice holds more than her share (4 // 3): 12 waits
    assert set(node.requests.pending) == {10, 11, 30, 23}
    assert counts(node.requests) == {"sent": 7, "rate_limited": 1}


def test_a_failed_send_is_counted_and_tried_again_after_the_cooldown(
        sender: Sender, clock: Clock) -> None:
    sender.ok = False
    node = node_of(sender, clock)
    node.agents[10] = agent(10)
    node.findings = [leak(10)]
    for _ in range(10):
        node.poll()
        clock.now += 2
    assert counts(node.requests) == {"failed": 1}
    assert node.requests.pending == {}
    clock.now += 900
    sender.ok = True
    node.poll()
    assert counts(node.requests) == {"failed": 1, "sent": 1}


def test_a_process_that_goes_away_takes_its_request_and_cooldown_with_it(
        sender: Sender, clock: Clock) -> None:
    node = node_of(sender, clock)
    node.agents[10] = agent(10)
    node.findings = [leak(10)]
    node.poll()
    del node.agents[10]
    node.findings = []
    node.poll()
    assert node.requests.pending == {}
    # Its PID reused by another leaking process: that one is asked at once.
    node.agents[10] = agent(10)
    node.findings = [leak(10)]
    node.poll()
    assert sender.calls == [(10, 20), (10, 20)]


def test_a_reloaded_configuration_applies_to_the_next_request(
        sender: Sender, clock: Clock) -> None:
    node = node_of(sender, clock)
    node.requests.config = replace(CONFIG, trace_steps=5)
    node.agents[10] = agent(10)
    node.findings = [leak(10)]
    node.poll()
    assert sender.calls == [(10, 5)] and node.requests.pending == {10: 5}


# -- in the daemon -------------------------------------------------------------------------------


class LeakingNode(Poller):
    """One instrumented process whose RSS grows 4 MiB a step, a step a poll."""

    truncated: Mapping[str, int] = MappingProxyType({})  # no /proc read: nothing cut

    def __init__(self) -> None:  # no NVML, no /proc: only what poll() makes up
        self.agents = None
        self.clock = SteadyClock()
        self.private_memory = PrivateMemorySource()  # paced by the daemon; never asked here
        self.pods = None  # the daemon gives it its pod source; poll() below never asks it
        self.step = 0

    def poll(self, watch: Iterable[int] = ()) -> NodeSnapshot:
        t = 1000.0 + self.step
        rss = 2 * GIB + self.step * 4 * MIB
        point = StepPoint(self.step, t, rss, None, None, MappingProxyType({}))
        reading = AgentReading(pid=10, uid=1000, first_seen=1000.0, last_seen=t,
                               step=self.step, step_changed_at=t, finished_at=None,
                               exit_report=None, points=(point,), latest=point, can_reply=True)
        worker = HostProcess(pid=10, ppid=1, start_time=900.0, name="python", user="alice",
                             state="running", rss_bytes=rss)
        procs = {1: INIT, 10: worker}
        self.step += 1
        return NodeSnapshot(taken_at=t, hostname="n", nvml=NvmlStatus(available=True), gpus=(),
                            processes=MappingProxyType(procs),
                            job_roots=MappingProxyType(job_roots(procs)),
                            agents=MappingProxyType({10: reading}),
                            mem_available_bytes=64 * GIB)


def test_the_daemon_asks_after_assess_and_counts_requests_and_reports_in_its_registry(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = load_config(environ={"GPUWATCH_CONFIG": "/dev/null"}, overrides={
        "daemon.runtime_dir": tmp_path / "run", "daemon.state_dir": tmp_path / "state",
        "agent.trace_after": 0.0, "agent.trace_steps": 20})
    daemon = Daemon(config, poller=LeakingNode())
    sender = Sender()
    daemon.trace_requests.sender = sender
    registry = daemon.registry
    # Every series exists before anything happened, so that increase() sees the first one.
    for result in RESULTS:
        assert registry.get_sample_value("gpuwatch_agent_trace_requests_total",
                                         {"result": result}) == 0
    for status in ("done", "refused", "failed"):
        assert registry.get_sample_value("gpuwatch_agent_trace_reports_total",
                                         {"status": status}) == 0

    with caplog.at_level(logging.INFO):
        while not sender.calls:
            assert daemon.history.polls < 40, "no request after 40 polls"
            daemon.poll_once()
    assert sender.calls == [(10, 20)]
    assert daemon.latest is not None
    (f,) = [f for f in daemon.latest.findings if f.kind == "leak"]
    assert isinstance(f.details, LeakEvidence) and f.details.found_by is None
    assert registry.get_sample_value("gpuwatch_agent_trace_requests_total",
                                     {"result": "sent"}) == 1
    assert any("asked PID 10 (python)" in r.getMessage() for r in caplog.records)

    # The next poll shows the request in the finding.
    daemon.poll_once()
    (f,) = [f for f in daemon.latest.findings if f.kind == "leak"]
    assert isinstance(f.details, LeakEvidence) and f.details.trace is not None
    assert f.details.trace.status == TraceStatus.REQUESTED

    # Trace reports the receiver accepted are counted by status.
    daemon.agents.handle(b'{"v": 1, "kind": "trace", "trace": {"status": "refused", '
                         b'"why": "busy"}}', 10, 1000)
    daemon.poll_once()
    daemon.poll_once()
    assert registry.get_sample_value("gpuwatch_agent_trace_reports_total",
                                     {"status": "refused"}) == 1
    assert registry.get_sample_value("gpuwatch_agent_trace_requests_total",
                                     {"result": "sent"}) == 1


def test_a_leak_is_left_to_discovery_for_trace_after_seconds_before_its_process_is_asked(
        sender: Sender, clock: Clock) -> None:
    node = node_of(sender, clock, AgentConfig(trace_steps=20, trace_after=60.0))
    node.agents[10] = agent(10)
    node.findings = [replace(leak(10), since=1000.0)]
    for taken_at in (1000.0, 1030.0, 1059.0):
        node.taken_at = taken_at
        node.poll()
    assert sender.calls == []
    node.taken_at = 1060.0
    node.poll()
    assert sender.calls == [(10, 20)]
