"""The job-tree pieces the poll, the history and the views share (gpuwatch.jobs): a tree's key
and the walk down a tree."""

from __future__ import annotations

from types import MappingProxyType

from gpuwatch.jobs.key import JobKey
from gpuwatch.jobs.tree import descendants, job_root, job_roots
from gpuwatch.model import HostProcess, NodeSnapshot, NvmlStatus


def _snapshot(procs: dict[int, HostProcess], roots: dict[int, int]) -> NodeSnapshot:
    return NodeSnapshot(taken_at=0.0, hostname="n", nvml=NvmlStatus(available=True), gpus=(),
                        processes=MappingProxyType(procs), job_roots=MappingProxyType(roots))


def test_a_tree_is_keyed_by_its_launchers_pid_and_start_time_so_a_reused_pid_is_another_tree(
        ) -> None:
    launcher = HostProcess(pid=40, ppid=1, start_time=1700000000.5)
    worker = HostProcess(pid=41, ppid=40, start_time=1700000001.0)
    key = JobKey.of(41, _snapshot({40: launcher, 41: worker}, {41: 40, 40: 40}))
    assert key == JobKey(40, 1700000000.5) and key.root_pid == 40
    assert str(key) == "40:1700000000.5"
    reused = HostProcess(pid=40, ppid=1, start_time=1700000900.0)
    assert JobKey.of(41, _snapshot({40: reused, 41: worker}, {41: 40})) != key
    # A root the snapshot did not read: keyed by its PID alone, printed with an empty start.
    assert str(JobKey.of(41, _snapshot({41: worker}, {41: 40}))) == "40:"
    assert JobKey.of(41, _snapshot({41: worker}, {})) is None


def test_the_walk_down_a_tree_finds_each_descendant_once_and_never_a_root() -> None:
    children = {1: [2, 3], 2: [4], 3: [4, 1], 4: [5], 9: [10]}
    asked: list[int] = []

    def children_of(pid: int) -> list[int]:
        asked.append(pid)
        return children.get(pid, [])

    assert descendants([1], children_of) == {2, 3, 4, 5}
    assert sorted(asked) == [1, 2, 3, 4, 5], "each process's children asked for once"
    assert descendants([1, 4], lambda pid: children.get(pid, [])) == {2, 3, 5}
    assert descendants([], children_of) == set()


def test_job_roots_take_the_roots_a_poll_worked_out_for_its_seeds_and_work_out_the_rest(
        ) -> None:
    """A poll works out its seeds' roots to know which trees to walk; the snapshot's job_roots
    start from those rather than climbing from each seed again."""
    shell = HostProcess(pid=30, ppid=1, sid=30, name="bash")
    launcher = HostProcess(pid=40, ppid=30, sid=30, name="torchrun", cmdline=("torchrun", "t.py"))
    rank = HostProcess(pid=41, ppid=40, sid=30, name="python", cmdline=("python", "t.py"))
    worker = HostProcess(pid=42, ppid=41, sid=30, name="python", cmdline=("python", "t.py"))
    procs = {p.pid: p for p in (shell, launcher, rank, worker)}
    afresh = job_roots(procs)
    assert afresh == {30: 30, 40: 40, 41: 40, 42: 40}
    assert job_roots(procs, {41: job_root(41, procs)}) == afresh
    # What it is given is taken as it is: it is never worked out again.
    assert job_roots(procs, {42: 42})[42] == 42
