"""Which processes get per-process series when exporter.max_process_series binds: GPU holders
first, then the rest, each tier shared by user (max-min fairness), so that one user's flood of
reporting processes never takes another user's series (docs/security.md, rule 4)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Optional

from gpuwatch.agent_budget import fair_shares
from gpuwatch.model import (
    AgentReading,
    Finding,
    GpuProcessUsage,
    HostProcess,
    NodeReport,
    NodeSnapshot,
    NvmlStatus,
)
from gpuwatch.sinks.exported_processes import dropped_by_cap
from gpuwatch.sinks.exporter import ReportCollector

GIB = 1 << 30
ALICE, MALLORY, BOB = 1001, 1002, 1003


def _proc(pid: int, uid: int, gpu: int = 0) -> HostProcess:
    usage = (GpuProcessUsage(0, "GPU-0", pid, gpu),) if gpu else ()
    return HostProcess(pid=pid, ppid=1, start_time=100.0 + pid, name="python", user=str(uid),
                       uid=uid, state="sleeping", rss_bytes=64 << 20, gpu_usage=usage)


def _agent(pid: int, uid: int) -> AgentReading:
    return AgentReading(pid=pid, uid=uid, first_seen=1.0, last_seen=2.0, step=7,
                        step_changed_at=2.0, finished_at=None, exit_report=None, points=(),
                        latest=None)


def _leak(p: HostProcess) -> Finding:
    return Finding(kind="leak", severity="critical", reason="buffer `x` grows every step",
                   pid=p.pid, start_time=p.start_time, name=p.name, user=p.user)


def _report(procs: list[HostProcess], reporters: Optional[set[int]] = None,
            flagged: Optional[set[int]] = None) -> NodeReport:
    by_pid = {p.pid: p for p in procs}
    agents = {pid: _agent(pid, by_pid[pid].uid or 0) for pid in (reporters or set())}
    findings = tuple(_leak(by_pid[pid]) for pid in sorted(flagged or set()))
    snapshot = NodeSnapshot(taken_at=2.0, hostname="n", nvml=NvmlStatus(available=True),
                            gpus=(), processes=MappingProxyType(by_pid),
                            agents=MappingProxyType(agents))
    return NodeReport(snapshot, findings)


def _gpu_series_pids(report: NodeReport, cap: int) -> set[int]:
    collector = ReportCollector(lambda: report, max_process_series=cap)
    (family,) = [f for f in collector.collect() if f.name == "gpuwatch_process_gpu_memory_bytes"]
    return {int(s.labels["pid"]) for s in family.samples}


def _rss_series_pids(report: NodeReport, cap: int) -> set[int]:
    collector = ReportCollector(lambda: report, max_process_series=cap)
    (family,) = [f for f in collector.collect()
                 if f.name == "gpuwatch_process_resident_memory_bytes"]
    return {int(s.labels["pid"]) for s in family.samples}


def test_a_flood_of_one_user_s_flagged_reporters_leaves_another_user_s_gpu_holders_their_series(
        ) -> None:
    alice = [_proc(10, ALICE, gpu=4 * GIB), _proc(11, ALICE, gpu=2 * GIB)]
    flood = [_proc(1000 + i, MALLORY) for i in range(1000)]
    pids = {p.pid for p in flood}
    report = _report(alice + flood, reporters=pids, flagged=pids)
    assert _gpu_series_pids(report, cap=10) == {10, 11}
    assert len(_rss_series_pids(report, cap=10)) == 10
    assert dropped_by_cap(report, 10) == {"max_process_series": 0, "user_share": 992}


def test_beyond_gpu_holders_the_room_is_shared_evenly_by_user() -> None:
    # alice: one GPU holder and 3 reporters; bob: 2 reporters; mallory: 100 flagged reporters.
    alice = [_proc(10, ALICE, gpu=GIB)] + [_proc(20 + i, ALICE) for i in range(3)]
    bob = [_proc(30, BOB), _proc(31, BOB)]
    flood = [_proc(1000 + i, MALLORY) for i in range(100)]
    mallory = {p.pid for p in flood}
    report = _report(alice + bob + flood, reporters={20, 21, 22, 30, 31} | mallory,
                     flagged=mallory)
    kept = _rss_series_pids(report, cap=10)
    # 9 left after the holder: bob's 2 fit (under a third each), then alice and mallory 3.5:
    # alice her 3, mallory the other 4.
    assert {10, 20, 21, 22, 30, 31} <= kept
    assert len(kept & mallory) == 4
    assert dropped_by_cap(report, 10) == {"max_process_series": 0, "user_share": 96}


def test_gpu_holders_come_first_and_are_shared_by_user_too() -> None:
    alice = [_proc(10, ALICE, gpu=GIB), _proc(11, ALICE)]  # 11: a leftover helper, flagged
    mallory = [_proc(100 + i, MALLORY, gpu=GIB) for i in range(20)]
    report = _report(alice + mallory, flagged={11})
    kept = _rss_series_pids(report, cap=8)
    assert 10 in kept and 11 not in kept  # holders first, whoever has findings
    assert len(kept) == 8
    # Both users left short: the cap is too small for the node, not one user over its share.
    assert dropped_by_cap(report, 8) == {"max_process_series": 14, "user_share": 0}


def test_one_user_alone_keeps_its_first_processes_and_the_drops_say_the_cap() -> None:
    procs = [_proc(10 + i, ALICE, gpu=(i + 1) * GIB) for i in range(5)]
    report = _report(procs)
    assert _gpu_series_pids(report, cap=3) == {14, 13, 12}  # the most GPU memory first
    assert dropped_by_cap(report, 3) == {"max_process_series": 2, "user_share": 0}
    assert dropped_by_cap(report, 5) == {"max_process_series": 0, "user_share": 0}


def test_fair_shares_give_each_user_up_to_an_even_level_and_the_rest_to_those_asking_more(
        ) -> None:
    assert fair_shares({1: 2, 2: 1000}, 10) == {1: 2, 2: 8}
    assert fair_shares({1: 5, 2: 5, 3: 5}, 7) == {1: 3, 2: 2, 3: 2}
    assert fair_shares({1: 1, 2: 4, 3: 9}, 9) == {1: 1, 2: 4, 3: 4}
    assert fair_shares({1: 3, None: 3}, 100) == {1: 3, None: 3}
    assert fair_shares({1: 3, 2: 3}, 0) == {1: 0, 2: 0}
    assert fair_shares({}, 5) == {}


def test_one_user_s_thousands_of_findings_take_no_series_of_another_users_finding() -> None:
    # mallory's reporters each raise a fake leak against themselves; alice's GPU holder has one
    # finding. Under the cap, alice's finding keeps its series, mallory's get what is left,
    # and the count by kind still counts every finding.
    alice = _proc(10, ALICE, gpu=GIB)
    flood = [_proc(100 + i, MALLORY) for i in range(200)]
    report = _report([alice, *flood], reporters={p.pid for p in flood},
                     flagged={alice.pid, *(p.pid for p in flood)})
    families = {f.name: f for f in ReportCollector(lambda: report, max_process_series=8)
                .collect()}
    for name in ("gpuwatch_finding", "gpuwatch_finding_info"):
        pids = [int(s.labels["pid"]) for s in families[name].samples]
        assert alice.pid in pids, name
        assert len(pids) <= 8, (name, len(pids))
    leaks = [int(s.labels["pid"]) for s in families["gpuwatch_leak_growth_bytes_per_step"].samples]
    assert len(leaks) <= 8
    (count,) = [s for s in families["gpuwatch_findings"].samples if s.labels["kind"] == "leak"]
    assert count.value == 201
