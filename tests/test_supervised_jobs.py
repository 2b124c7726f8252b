"""Jobs under `gpuwatch run`: real processes under a stand-in supervisor (tests/scenarios.py), the
fake driver, and a real daemon. When the supervisor is gone, what is left of its job is orphaned
at once, with or without history, and `gpuwatch reap --job run:ID` ends it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.model import GpuDevice, NvmlReading, NvmlStatus
from gpuwatch.poll import Poller
from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from gpuwatch.sources.processes import ProcessSource
from tests.daemonproc import WatchedNode, by_pid, running_daemon, value
from tests.realprocs import GIB, processes_by_pid, status_json
from tests.scenarios import (
    SupervisedJob,
    environ,
    free_pid,
    sigkill_supervisor,
    supervised_job,
    wait_not_running,
)

INTERVAL = 0.2
# Every grace long, so that nothing but the supervisor's absence can flag the job in time.
SLOW_RULES = """
[detectors]
leftover_grace = 600
min_age = 600
"""


@pytest.fixture
def watched(fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path
            ) -> Iterator[WatchedNode]:
    with running_daemon(cli_env, tmp_path, config=SLOW_RULES,
                        args=("--interval", str(INTERVAL))) as daemon:
        yield WatchedNode(fake_node, cli_env, daemon)


def new_run_id() -> str:
    return f"train-{uuid.uuid4().hex[:6]}"


def job_row(text: str, pid: int) -> str:
    """PID `pid`'s row in the process table of `gpuwatch status`."""
    rows = [line for line in text.splitlines() if re.match(rf"^[├└│ ─]*{pid}\s", line)]
    assert len(rows) == 1, f"PID {pid} has {len(rows)} rows in:\n{text}"
    return rows[0]


def reap(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuwatch", "reap", *args], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=90)


def assert_orphaned_from_supervisor(orphans: dict[int, dict[str, Any]], job: SupervisedJob,
                                    holder: int) -> None:
    for pid in (job.launcher, *job.workers, *job.helpers.values()):
        f = orphans[pid]
        assert f["job"] == {"id": job.run_id, "source": "run"}, f
        assert f["reason"] == (f"its supervisor `gpuwatch run` (PID {job.named_pid}) of job "
                               f"run:{job.run_id} is gone"), f
        assert f["severity"] == ("critical" if pid == holder else "warning"), f
        assert (f["gpu_memory_bytes"] is not None) == (pid == holder), f


def test_the_job_of_a_killed_supervisor_is_orphaned_at_the_next_poll_and_reaped_by_its_id(
        watched: WatchedNode, tmp_path: Path) -> None:
    with supervised_job(tmp_path, new_run_id()) as job:
        (worker,) = job.workers
        helper = job.helpers["redis"]
        watched.node.hold(worker, device=0, used=2 * GIB)
        healthy = watched.doc_when("the job and its helper seen", lambda d: {
            job.launcher, worker, helper} <= set(processes_by_pid(d)) and worker in {
            p["pid"] for p in d["processes"] if p["holds_gpu"]})
        assert healthy["findings"] == []
        procs = processes_by_pid(healthy)
        for pid in (job.launcher, worker, helper):
            assert procs[pid]["job"] == {"id": job.run_id, "source": "run"}
            assert procs[pid]["launch_env"]["GPUWATCH_RUN_SUPERVISOR"].startswith(
                f"{job.supervisor}:")
        assert procs[worker]["launch_env"]["TORCHELASTIC_RUN_ID"] == f"{job.run_id}-elastic"

        killed_at = time.time()
        sigkill_supervisor(job)
        orphans = watched.findings_of("orphan", [job.launcher, worker, helper])
        assert_orphaned_from_supervisor(orphans, job, holder=worker)
        # No grace: the first poll after the kill opens them (the rules with a grace are slowed
        # to 600 s here), however late a loaded machine starts it.
        assert all(f["since"] - killed_at < INTERVAL + 5.0 for f in orphans.values()), orphans

        text = watched.status_text()
        for pid in (job.launcher, worker, helper):
            row = job_row(text, pid)
            assert f" run:{job.run_id} " in row and "[orphan]" in row, row

        plan = reap(["--dry-run", "--job", job.run_id], watched.env)
        assert plan.returncode == 0, plan.stdout + plan.stderr
        assert all(str(pid) in plan.stdout for pid in (job.launcher, worker, helper))
        result = reap(["--yes", "--job", f"run:{job.run_id}", "--grace", "5"], watched.env)
        assert result.returncode == 0, result.stdout + result.stderr
        wait_not_running([job.launcher, worker, helper])
        watched.doc_when("the orphan findings closed", lambda d: d["findings"] == [])


def test_a_daemon_started_after_the_supervisor_died_flags_its_job_at_its_first_poll(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with supervised_job(tmp_path, new_run_id()) as job:
        (worker,) = job.workers
        helper = job.helpers["redis"]
        fake_node.hold(worker, device=1, used=GIB)
        sigkill_supervisor(job)

        # One look, no daemon: no history at all.
        _, doc = status_json({**cli_env, "GPUWATCH_RUNTIME_DIR": str(tmp_path / "nobody")})
        assert doc["source"] == "poll"
        assert_orphaned_from_supervisor(by_pid(doc, "orphan"), job, holder=worker)

        # A daemon whose next poll is far away: what it serves is its first poll's.
        with running_daemon(cli_env, tmp_path / "late", config=SLOW_RULES,
                            args=("--interval", "60")) as daemon:
            daemon.wait_for_metrics("the first poll", lambda s: True if (
                value(s, "gpuwatch_polls_total") or 0) >= 1 else None)
            node = WatchedNode(fake_node, cli_env, daemon)
            doc = node.doc()
            assert value(daemon.scrape(), "gpuwatch_polls_total") == 1
            orphans = by_pid(doc, "orphan")
            assert set(orphans) == {job.launcher, worker, helper}, doc["findings"]
            assert_orphaned_from_supervisor(orphans, job, holder=worker)


def test_a_supervisor_inside_a_container_is_known_to_run_and_then_known_gone(
        watched: WatchedNode, tmp_path: Path) -> None:
    """`gpuwatch run` as a container's command writes down its PID in the container's PID
    namespace; on the host that PID is another process (here a kernel thread)."""
    with supervised_job(tmp_path, new_run_id(), in_pid_namespace=True) as job:
        (worker,) = job.workers
        helper = job.helpers["redis"]
        assert job.named_pid != job.supervisor
        watched.node.hold(worker, device=0, used=GIB)
        watched.doc_when("the job and its helper seen", lambda d: {
            job.launcher, worker, helper} <= set(processes_by_pid(d)) and worker in {
            p["pid"] for p in d["processes"] if p["holds_gpu"]})
        polls = value(watched.daemon.scrape(), "gpuwatch_polls_total") or 0
        watched.daemon.wait_for_metrics("three more polls", lambda s: True if (
            value(s, "gpuwatch_polls_total") or 0) >= polls + 3 else None)
        assert watched.doc()["findings"] == []

        sigkill_supervisor(job)
        orphans = watched.findings_of("orphan", [job.launcher, worker, helper])
        assert_orphaned_from_supervisor(orphans, job, holder=worker)


class _NoGpus:
    """An NVML that answers with one GPU and no process on it."""

    def read(self) -> NvmlReading:
        return NvmlReading(status=NvmlStatus(available=True), gpus=(GpuDevice(index=0),))

    def close(self) -> None:
        pass


def test_the_poll_reads_every_supervisor_that_a_process_it_reads_names() -> None:
    """One stat line for a supervisor outside the tree; none for one read as an ancestor."""
    source = ProcessSource()
    own = source.stat(os.getpid())
    unrelated = subprocess.Popen(["sleep", "60"])
    exited = subprocess.Popen(["true"])
    missing = free_pid()
    named = {"self": f"{os.getpid()}:{own.start_time!r}" if own else "",
             "unrelated": f"{unrelated.pid}:1.0", "exited": f"{exited.pid}:1.0",
             "missing": f"{missing}:1.0"}
    children = [subprocess.Popen(["sleep", "60"], env={**os.environ, "GPUWATCH_RUN_ID": "t",
                                                       "GPUWATCH_RUN_SUPERVISOR": value})
                for value in named.values()]
    try:
        wait_for("the exited child to be a zombie",
                 lambda: True if (s := source.stat(exited.pid)) and s.state == "zombie"
                 else None, 10)
        wait_for("the children's environments", lambda: True if all(
            "GPUWATCH_RUN_SUPERVISOR" in environ(c.pid) for c in children) else None, 10)
        poller = Poller(nvml=_NoGpus(), processes=source, hostname="n")  # type: ignore[arg-type]
        snap = poller.poll(watch=[c.pid for c in children])
        assert unrelated.pid not in snap.processes and missing not in snap.processes
        unrelated_stat = source.stat(unrelated.pid)
        assert unrelated_stat is not None
        expected = {os.getpid(): snap.processes[os.getpid()].start_time,
                    unrelated.pid: unrelated_stat.start_time, exited.pid: None, missing: None}
        # Anything else is named by an ancestor of this test run (run under `gpuwatch run`).
        assert {pid: snap.run_supervisors.get(pid, "unread") for pid in expected} == expected
    finally:
        for proc in [*children, unrelated, exited]:
            proc.kill()
            proc.wait()
