"""Jobs started by real launchers, as they start them by default, judged by a real daemon.

Ray's tests need Ray (`pip install ray`; too large to be the suite's dependency): skipped
where `ray` is not on PATH.

torchrun (torch's own console script) and `accelerate launch` (torch.distributed.run's agent run
inside the `accelerate` program, as accelerate runs it) give their workers
TORCHELASTIC_RUN_ID=none, an id every such run shares, and title their own process `pt_elastic`.
Such a job is named by its launcher (`torchrun:<launcher PID>`), which `reap --job` takes, and a
reason names the launcher by the program people started as well as by its title.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from tests.daemonproc import WatchedNode, by_pid, running_daemon
from tests.realprocs import GIB, gpuwatch
from tests.scenarios import (
    REAL_WORKER_WITH_LOADER,
    comm,
    descendants,
    real_ray_job_actor,
    real_ray_node,
    real_torchrun,
    sigkill_launcher,
    wait_not_running,
)

DETECTORS = "[detectors]\nmin_age = 0\n"


@pytest.fixture
def watched(fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path
            ) -> Iterator[WatchedNode]:
    with running_daemon(cli_env, tmp_path / "daemon", config=DETECTORS,
                        args=("--interval", "0.2")) as daemon:
        yield WatchedNode(fake_node, cli_env, daemon)


def orphans_once_reaped(watched: WatchedNode, launcher: int, name: str, workers: list[int]
                        ) -> dict[int, dict[str, Any]]:
    """The orphan finding of each worker, naming its SIGKILLed launcher as exited: "exited after
    HH:MM:SSZ" (last seen alive) or, where a poll came between the kill and the reap, "exited
    before HH:MM:SSZ (not reaped yet)"; both are true."""
    said = f"parent {launcher} ({name}) exited "
    doc = watched.doc_when(f"orphan findings for {workers} naming {name}", lambda d: all(
        by_pid(d, "orphan").get(w, {}).get("reason", "").startswith(said) for w in workers))
    return {w: by_pid(doc, "orphan")[w] for w in workers}


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_a_job_launched_without_a_run_id_is_named_by_its_launcher_and_reaped_by_that_name(
        watched: WatchedNode, tmp_path: Path, launcher: str) -> None:
    with real_torchrun(tmp_path, launcher) as job:
        (worker,) = job.workers
        watched.node.hold(worker, device=0, used=4 * GIB)
        doc = watched.holding(worker)
        label = {"id": str(job.launcher), "source": "torchrun"}
        jobs = {p["pid"]: p["job"] for p in doc["processes"]}
        assert jobs[worker] == label and jobs[job.launcher] == label

        sigkill_launcher(job)
        orphan = orphans_once_reaped(watched, job.launcher, f"{launcher} (pt_elastic)",
                                     [worker])[worker]
        assert orphan["job"] == label

        reaped = gpuwatch(["reap", "--job", f"torchrun:{job.launcher}", "--yes", "--grace", "5"],
                          watched.env)
        assert reaped.returncode == 0, reaped.stdout + reaped.stderr
        assert "GPU memory released" in reaped.stdout, reaped.stdout
        wait_not_running([worker])


def test_a_job_of_accelerates_own_launch_is_named_by_its_launcher_and_reaped_by_that_name(
        watched: WatchedNode, tmp_path: Path) -> None:
    """accelerate itself (`accelerate launch --multi_gpu`, TORCHELASTIC_RUN_ID=none for its
    workers): both ranks and the launcher are `torchrun:<launcher PID>`; after the launcher is
    SIGKILLed the ranks are orphans naming it `accelerate (pt_elastic)`, and `reap --job` with
    that name frees their memory."""
    with real_torchrun(tmp_path, "accelerate (real)") as job:
        for device, worker in enumerate(job.workers):
            watched.node.hold(worker, device=device, used=4 * GIB)
        doc = watched.doc_when("both ranks holding", lambda d: set(job.workers) <= {
            p["pid"] for p in d["processes"] if p["holds_gpu"]})
        label = {"id": str(job.launcher), "source": "torchrun"}
        jobs = {p["pid"]: p["job"] for p in doc["processes"]}
        assert [jobs[pid] for pid in (job.launcher, *job.workers)] == [label] * 3, jobs

        sigkill_launcher(job)
        orphans = orphans_once_reaped(watched, job.launcher, "accelerate (pt_elastic)",
                                      job.workers)
        for orphan in orphans.values():
            assert orphan["job"] == label
        reaped = gpuwatch(["reap", "--job", f"torchrun:{job.launcher}", "--yes", "--grace", "5"],
                          watched.env)
        assert reaped.returncode == 0, reaped.stdout + reaped.stderr
        assert "GPU memory released" in reaped.stdout, reaped.stdout
        wait_not_running(job.workers)


def test_a_worker_with_a_data_loader_is_in_its_launchers_job_and_reaped_by_its_name(
        watched: WatchedNode, tmp_path: Path) -> None:
    """The worker forks its DataLoader's workers: they and the worker are all the job
    `torchrun:<launcher PID>`, not one named by the worker's PID, so that after the launcher is
    killed `reap --job` with the launcher's name finds the orphaned worker."""
    with real_torchrun(tmp_path, worker=REAL_WORKER_WITH_LOADER) as job:
        (worker,) = job.workers
        loaders = wait_for("the data loader's workers", lambda: (
            found if len(found := [pid for pid in descendants(worker)
                                   if comm(pid) == "pt_data_worker"]) == 2 else None), 120)
        watched.node.hold(worker, device=0, used=4 * GIB)
        label = {"id": str(job.launcher), "source": "torchrun"}
        doc = watched.doc_when("the data loader's workers read", lambda d: set(loaders) <= {
            p["pid"] for p in d["processes"]})
        jobs = {p["pid"]: p["job"] for p in doc["processes"]}
        assert [jobs[pid] for pid in (job.launcher, worker, *loaders)] == [label] * 4, jobs

        sigkill_launcher(job)
        orphan = watched.findings_of("orphan", [worker])[worker]
        assert orphan["job"] == label
        reaped = gpuwatch(["reap", "--job", f"torchrun:{job.launcher}", "--yes", "--grace", "5"],
                          watched.env)
        assert reaped.returncode == 0, reaped.stdout + reaped.stderr
        assert f"{worker} " in reaped.stdout, reaped.stdout
        wait_not_running([worker])


def test_a_ray_jobs_actor_is_ray_job_id_and_the_raylet_and_its_agents_belong_to_no_job(
        watched: WatchedNode, tmp_path: Path) -> None:
    """A job's actor in a worker Ray started for the job (it has a runtime environment) is
    `ray:<job id>`; the raylet, its agents and the idle workers Ray starts beforehand, with its
    nil job id (`ffffffff`), belong to none: they serve every job of the node."""
    with real_ray_node(tmp_path) as node, real_ray_job_actor(node) as (actor, job_id):
        watched.node.hold(actor, device=0, used=4 * GIB)
        doc = watched.holding(actor)
        jobs = {p["pid"]: p["job"] for p in doc["processes"]}
        raylet = node.raylet()
        assert raylet is not None
        agents = [pid for pid in descendants(raylet) if pid != actor and pid in jobs]
        assert jobs[actor] == {"id": job_id, "source": "ray"}, jobs
        assert agents and [jobs[pid] for pid in (raylet, *agents)] == [None] * (1 + len(agents))
