"""Detection scenarios from the field: real process trees, real signals, the fake driver, and a
real daemon whose findings are read the way an SRE reads them (`gpuwatch status`).

tests/scenarios.md tabulates every scenario's expected findings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from gpuwatch.simulate.job import launch_env
from tests.daemonproc import WatchedNode, by_pid, running_daemon
from tests.realprocs import GIB, gpuwatch, processes_by_pid, status_json
from tests.scenarios import (
    GONE_TIMEOUT,
    clean_env,
    ctrl_c,
    descendants,
    free_pid,
    job_with_processes_in_d_state,
    launcher_as_container_init,
    notebook_server_like,
    orphaned_worker_under_pid1,
    parent,
    pid_namespaces,
    plain_service,
    process_on_pid,
    raylet_like,
    real_notebook_server,
    real_ray_actor,
    real_ray_node,
    running,
    shell_loop_as_container_init,
    sigkill_launcher,
    torchrun_job,
    unreaped_child,
    wait_not_running,
    zombie_leader,
)

INTERVAL = 0.2
#: How late a poll may start on a loaded machine (a full suite beside a CPU hog): the margin of
#: "found by the first poll after", not a speed the test measures.
LATE_POLL = 5.0
LEFTOVER_GRACE = 3.0
DETECTORS = f"""
[detectors]
leftover_grace = {LEFTOVER_GRACE}
zombie_grace = 0.5
ghost_grace = 0.5
min_age = 0
unkillable_after = 1
"""


@pytest.fixture
def watched(fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path
            ) -> Iterator[WatchedNode]:
    with running_daemon(cli_env, tmp_path, config=DETECTORS,
                        args=("--interval", str(INTERVAL))) as daemon:
        yield WatchedNode(fake_node, cli_env, daemon)


def findings(doc: dict[str, Any], kind: Optional[str] = None) -> list[dict[str, Any]]:
    return [f for f in doc["findings"] if kind is None or f["kind"] == kind]


# -- 1 ------------------------------------------------------------------------------------------
def test_1_sigkilled_launcher_leaves_four_orphans_found_within_one_poll(
        watched: WatchedNode, tmp_path: Path) -> None:
    with torchrun_job(tmp_path, workers=4) as job:
        for rank, pid in enumerate(job.workers):
            watched.node.hold(pid, device=rank % 2, used=(rank + 1) * GIB)
        healthy = watched.holding(*job.workers)
        assert findings(healthy) == []

        killed_at = time.time()
        sigkill_launcher(job)
        doc = watched.doc_when("four orphans", lambda d: len(findings(d, "orphan")) == 4)
        orphans = by_pid(doc, "orphan")
        assert set(orphans) == set(job.workers) and len(findings(doc)) == 4
        for rank, pid in enumerate(job.workers):
            f = orphans[pid]
            assert f["severity"] == "critical"
            assert f["gpu_memory_bytes"] == (rank + 1) * GIB and f["gpus"] == [rank % 2]
            assert f"parent {job.launcher} (" in f["reason"] and "exited" in f["reason"]
            assert f"now under {job.adopter} (" in f["reason"]
            assert f["start_time"] is not None
            # First seen by the first poll after the kill: within one poll interval, late as a
            # loaded machine may make it.
            assert f["since"] - killed_at <= INTERVAL + LATE_POLL
        text = watched.status_text()
        assert text.count("[orphan]") == 4 and f"parent {job.launcher} (" in text


# -- 2 ------------------------------------------------------------------------------------------
@pytest.mark.sigint
def test_2_ctrl_c_leaves_only_the_worker_kept_alive_by_a_thread_flagged(
        watched: WatchedNode, tmp_path: Path) -> None:
    with torchrun_job(tmp_path, workers=4, stubborn_rank=3) as job:
        for pid in job.workers:
            watched.node.hold(pid, device=0, used=2 * GIB)
        watched.holding(*job.workers)
        ctrl_c(job)
        stubborn = job.workers[3]
        wait_not_running([*job.workers[:3], job.launcher])
        doc = watched.doc_when("the stubborn worker flagged", lambda d: bool(findings(d)))
        assert [(f["kind"], f["pid"]) for f in findings(doc)] == [("orphan", stubborn)]
        assert findings(doc)[0]["gpu_memory_bytes"] == 2 * GIB
        assert [p["pid"] for p in doc["processes"] if p["holds_gpu"]] == [stubborn]
        assert "[orphan]" in watched.status_text()


# -- 3 ------------------------------------------------------------------------------------------
def test_3_main_thread_gone_with_a_thread_holding_gpu_memory_is_a_critical_zombie(
        watched: WatchedNode, tmp_path: Path) -> None:
    with zombie_leader(tmp_path) as pid:
        watched.node.hold(pid, device=1, used=4 * GIB)
        doc = watched.doc_when("a zombie finding", lambda d: bool(findings(d, "zombie")))
        (f,) = findings(doc)
        assert (f["kind"], f["pid"], f["severity"]) == ("zombie", pid, "critical")
        assert f["gpu_memory_bytes"] == 4 * GIB
        assert "main thread exited but other threads still run" in f["reason"]
        assert processes_by_pid(doc)[pid]["num_threads"] == 2
        assert "[zombie]" in watched.status_text()


# -- 4 ------------------------------------------------------------------------------------------
def test_4_an_unreaped_child_is_a_zombie_that_names_its_parent(
        watched: WatchedNode, tmp_path: Path) -> None:
    with unreaped_child(tmp_path) as (parent, child):
        watched.node.hold(parent, device=0, used=GIB)  # the parent is a GPU job's process
        doc = watched.doc_when("a zombie finding", lambda d: bool(findings(d, "zombie")))
        (f,) = findings(doc)
        assert (f["kind"], f["pid"], f["severity"]) == ("zombie", child, "warning")
        assert f["gpu_memory_bytes"] is None
        assert f"parent {parent} (" in f["reason"] and "has not reaped it" in f["reason"]


# -- 5 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("launcher_waits_for", ["helpers", "workers"])
def test_5_helpers_outliving_the_trainer_are_leftovers_after_the_grace_period_not_before(
        watched: WatchedNode, tmp_path: Path, launcher_waits_for: str) -> None:
    roles = ("redis", "actor", "preprocessor")
    with torchrun_job(tmp_path, workers=1, helpers=roles, trainer_exit_after=3.0,
                      launcher_waits_for=launcher_waits_for) as job:
        trainer = job.workers[0]
        watched.node.hold(trainer, device=0, used=6 * GIB)
        running = watched.holding(trainer)
        assert findings(running) == []

        wait_not_running([trainer])
        gone_at = time.time()
        if launcher_waits_for == "workers":
            wait_not_running([job.launcher])  # the launcher left its helpers behind
        within = watched.doc_when("a poll after the trainer exited",
                                  lambda d: d["taken_at"] > gone_at + INTERVAL)
        if within["taken_at"] < gone_at + LEFTOVER_GRACE - 0.5:
            assert findings(within) == []  # within the grace period: nothing yet

        doc = watched.doc_when("three leftovers", lambda d: len(findings(d, "leftover")) == 3)
        leftovers = by_pid(doc, "leftover")
        assert set(leftovers) == set(job.helpers.values()) and len(findings(doc)) == 3
        for role, pid in job.helpers.items():
            assert f"--helper {role}" in leftovers[pid]["reason"]
            assert f"its trainer {trainer} (" in leftovers[pid]["reason"]
        assert min(f["since"] for f in leftovers.values()) >= gone_at + LEFTOVER_GRACE - 1
        assert watched.status_text().count("[leftover]") == 3


# -- 5b, 5c, 5d: a service's GPU holder ends; its other children are no leftovers -----------------
def quiet_after_the_grace(watched: WatchedNode, ended: int, kept: list[int]) -> dict[str, Any]:
    """Wait until the daemon has seen `ended` gone and polled a while past the leftover grace
    after that (when a leftover would have opened); then check that none of `kept` is a finding
    of any kind nor in `reap --dry-run`'s plan, and that they all still run. The document."""
    seen = watched.doc_when(f"the daemon to see {ended} gone", lambda d: ended not in {
        p["pid"] for p in d["processes"] if p["holds_gpu"]})
    doc = watched.doc_when("polls past the leftover grace", lambda d: (
        d["taken_at"] >= seen["taken_at"] + LEFTOVER_GRACE + 5 * INTERVAL))
    assert [f for f in findings(doc) if f["pid"] in kept] == []
    plan = gpuwatch(["reap", "--dry-run", "--json"], watched.env)
    assert plan.stdout, plan.stderr
    assert [a for a in json.loads(plan.stdout)["actions"] if a["pid"] in kept] == []
    assert all(running(pid) for pid in kept)
    return doc


def test_5b_a_killed_ray_actor_leaves_the_raylet_and_its_agents_unflagged(
        watched: WatchedNode, tmp_path: Path) -> None:
    """A detached actor `ray.kill`ed: the raylet and its dashboard and runtime-env agents are a
    cluster's services, not leftovers of the actor (reaping them took the raylet down)."""
    with raylet_like(tmp_path) as ray:
        dashboard, runtime_env, actor = ray.children()
        watched.node.hold(actor, device=0, used=4 * GIB)
        watched.holding(actor)
        os.kill(actor, signal.SIGKILL)
        wait_not_running([actor])
        quiet_after_the_grace(watched, actor, [ray.service, dashboard, runtime_env])


def test_5c_a_restarted_notebook_kernel_leaves_the_server_and_its_other_kernels_unflagged(
        watched: WatchedNode, tmp_path: Path) -> None:
    """Three kernels under a notebook server, one on the GPU, which is restarted (killed, a new
    kernel started): the other two kernels hold notebooks' state and are not leftovers."""
    with notebook_server_like(tmp_path, kernels=3) as server:
        gpu_kernel, *others = server.children()
        watched.node.hold(gpu_kernel, device=0, used=6 * GIB)
        watched.holding(gpu_kernel)
        os.kill(gpu_kernel, signal.SIGKILL)
        wait_for("the kernel restarted", lambda: server.restarts() == 1 or None, 30)
        restarted = server.children()[0]
        quiet_after_the_grace(watched, gpu_kernel, [server.service, *others, restarted])


def test_5b_real_ray_a_killed_detached_actor_leaves_the_raylet_and_its_agents_unflagged(
        watched: WatchedNode, tmp_path: Path) -> None:
    """5b with Ray itself (skipped where it is not installed): `ray start --head`, a detached
    actor holding GPU memory, `ray.kill`ed; nothing of the node is flagged or planned, and the
    raylet still has its agents."""
    with real_ray_node(tmp_path) as node, real_ray_actor(node) as (actor, driver):
        raylet = node.raylet()
        assert raylet is not None and parent(actor) == raylet
        watched.node.hold(actor, device=0, used=4 * GIB)
        watched.holding(actor)
        assert driver.stdin is not None and driver.stdout is not None
        driver.stdin.write("kill\n")
        driver.stdin.flush()
        assert driver.stdout.readline().strip() == "killed"
        wait_not_running([actor])
        kept = [pid for pid in [node.start, *descendants(node.start)] if running(pid)]
        assert raylet in kept
        quiet_after_the_grace(watched, actor, kept)


def test_5c_real_jupyter_a_restarted_kernel_leaves_the_server_and_its_other_kernels_unflagged(
        watched: WatchedNode, tmp_path: Path) -> None:
    """5c with jupyter_server and ipykernel themselves (skipped where not installed): three
    kernels started through the server's API, the one on the GPU restarted through it."""
    with real_notebook_server(tmp_path) as server:
        ids = [server.start_kernel() for _ in range(3)]
        pids = wait_for("three kernels", lambda: (
            found if set(ids) <= set(found := server.kernel_pids()) else None), 60)
        gpu_kernel = pids[ids[0]]
        watched.node.hold(gpu_kernel, device=0, used=6 * GIB)
        watched.holding(gpu_kernel)
        server.restart_kernel(ids[0])
        restarted = wait_for("the kernel restarted", lambda: (
            pid if (pid := server.kernel_pids().get(ids[0])) not in (None, gpu_kernel)
            else None), 60)
        wait_not_running([gpu_kernel])
        quiet_after_the_grace(watched, gpu_kernel,
                              [server.server, pids[ids[1]], pids[ids[2]], restarted])


@pytest.mark.parametrize("driver_env", ["plain", "ranked"])
def test_5d_the_daemon_beside_a_finished_driver_under_one_harness_is_no_leftover(
        watched: WatchedNode, driver_env: str) -> None:
    """A test harness (this test process) started the daemon and a driver that held GPU memory
    and exited: the harness is their common parent, which makes neither one job. A driver
    started with a launcher's variables ("ranked") is evidence of a job; the daemon is still
    none of its leftovers: it never reports itself."""
    env = clean_env() if driver_env == "plain" else launch_env(0, 1, "harness-run", clean_env())
    driver = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                              stdin=subprocess.PIPE, env=env)
    try:
        watched.node.hold(driver.pid, device=0, used=2 * GIB)
        watched.holding(driver.pid)
        assert driver.stdin is not None
        driver.stdin.close()  # the driver's work is done: it exits 0
        assert driver.wait(GONE_TIMEOUT) == 0
        quiet_after_the_grace(watched, driver.pid, [watched.daemon.proc.pid])
    finally:
        driver.kill()
        driver.wait()


# -- 6 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("via", ["subreaper", "shell"])
def test_6_workers_reparented_to_a_subreaper_or_the_launching_shell_are_still_orphans(
        watched: WatchedNode, tmp_path: Path, via: str) -> None:
    if via == "shell" and pid_namespaces() is not None:
        pytest.skip(f"no PID namespaces here: {pid_namespaces()}")
    with torchrun_job(tmp_path, workers=2, via=via) as job:
        for pid in job.workers:
            watched.node.hold(pid, device=0, used=GIB)
        watched.holding(*job.workers)
        sigkill_launcher(job)
        assert job.adopter != 1
        doc = watched.doc_when("two orphans", lambda d: len(findings(d, "orphan")) == 2)
        for f in findings(doc, "orphan"):
            assert f"now under {job.adopter} (" in f["reason"]


# -- 7 ------------------------------------------------------------------------------------------
def test_7_started_after_the_orphaning_a_ranked_worker_under_pid_1_is_an_orphan_a_service_not(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with orphaned_worker_under_pid1(tmp_path, local_rank=3) as worker, \
            plain_service(tmp_path, name="jupyter-lab") as service:
        fake_node.hold(worker, device=0, used=8 * GIB)
        fake_node.hold(service, device=1, used=8 * GIB)
        # The daemon starts only now: it never saw the worker's launcher.
        with running_daemon(cli_env, tmp_path, config=DETECTORS,
                            args=("--interval", str(INTERVAL))) as daemon:
            watched = WatchedNode(fake_node, cli_env, daemon)
            doc = watched.holding(worker, service)
            doc = watched.doc_when("an orphan", lambda d: bool(findings(d, "orphan")))
            assert [(f["kind"], f["pid"]) for f in findings(doc)] == [("orphan", worker)]
            reason = findings(doc)[0]["reason"]
            assert reason.startswith("reparented to PID 1; environment has")
            assert "LOCAL_RANK=3" in reason and "TORCHELASTIC_RUN_ID" in reason
        # And one look without any daemon says the same.
        _, one_shot = status_json(cli_env)
        assert one_shot["source"] == "poll"
        assert [(f["kind"], f["pid"]) for f in findings(one_shot)] == [("orphan", worker)]


# -- 7b -----------------------------------------------------------------------------------------
def one_look(env: dict[str, str]) -> dict[str, Any]:
    """`gpuwatch status --poll --json`: one poll, no daemon, no history."""
    result = gpuwatch(["status", "--poll", "--json"], env)
    assert result.stdout, result.stderr
    doc: dict[str, Any] = json.loads(result.stdout)
    assert doc["source"] == "poll"
    return doc


def dry_run_plan(env: dict[str, str]) -> tuple[int, list[dict[str, Any]]]:
    """`gpuwatch reap --dry-run --poll --json`: its exit status and its actions."""
    result = gpuwatch(["reap", "--dry-run", "--poll", "--json"], env)
    assert result.stdout, f"exit {result.returncode}: {result.stderr}"
    return result.returncode, json.loads(result.stdout)["actions"]


@pytest.mark.parametrize("via", ["container", "entrypoint"])
def test_7b_without_history_workers_adopted_by_a_container_init_or_any_subreaper_are_orphans(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path, via: str) -> None:
    """`container`: `unshare --pid --fork --mount-proc bash -c 'LAUNCHER; sleep 600'`, the
    workers go to the shell, PID 1 of their namespace. `entrypoint`: a child subreaper named
    `entrypoint-x` started the launcher; the workers go to it. Neither is a name gpuwatch knows,
    and nothing here has seen the launcher."""
    with torchrun_job(tmp_path, workers=2, via=via) as job:
        for rank, pid in enumerate(job.workers):
            fake_node.hold(pid, device=rank, used=8 * GIB)
        healthy = one_look(cli_env)
        assert set(job.workers) <= {p["pid"] for p in healthy["processes"] if p["holds_gpu"]}
        assert findings(healthy) == []
        assert dry_run_plan(cli_env) == (3, [])

        sigkill_launcher(job)
        assert {parent(w) for w in job.workers} == {job.adopter} and job.adopter != 1
        doc = one_look(cli_env)
        orphans = by_pid(doc, "orphan")
        assert set(orphans) == set(job.workers) and len(findings(doc)) == 2
        for f in orphans.values():
            assert f["severity"] == "critical" and f["gpu_memory_bytes"] == 8 * GIB
            assert f["reason"].startswith(f"reparented to {job.adopter} (")
            assert "LOCAL_RANK=" in f["reason"] and "TORCHELASTIC_RUN_ID" in f["reason"]
            if via == "container":
                assert "PID 1 of its PID namespace" in f["reason"]
            else:
                assert f"{job.adopter} (entrypoint-x)" in f["reason"]
                assert f"its process group, {job.launcher}, has exited" in f["reason"]

        code, actions = dry_run_plan(cli_env)
        assert code == 0
        assert {(a["pid"], a["kind"], a["action"], a["result"]) for a in actions} == {
            (pid, "orphan", "terminate", "planned") for pid in job.workers}
        assert all(a["refused"] is None for a in actions)


def test_7c_workers_under_a_launcher_that_is_its_container_init_are_no_orphans(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    """`docker run IMAGE torchrun ...`: the workers' parent is PID 1 of their namespace, and it
    is their launcher, alive."""
    with launcher_as_container_init(tmp_path, workers=2) as job:
        for rank, pid in enumerate(job.workers):
            fake_node.hold(pid, device=rank, used=GIB)
        doc = one_look(cli_env)
        assert set(job.workers) <= {p["pid"] for p in doc["processes"] if p["holds_gpu"]}
        assert {parent(w) for w in job.workers} == {job.launcher}
        assert findings(doc) == []
        assert dry_run_plan(cli_env) == (3, [])


def test_7d_ranks_a_container_init_started_itself_are_no_orphans_though_it_is_an_init(
        fake_node: FakeNode, cli_env: dict[str, str]) -> None:
    """A shell loop as the container's command: from one look it may be the ranks' launcher (no
    variable says another process started them), so it is taken to be."""
    with shell_loop_as_container_init(ranks=2) as job:
        for rank, pid in enumerate(job.workers):
            fake_node.hold(pid, device=rank, used=GIB)
        doc = one_look(cli_env)
        held = {p["pid"]: p for p in doc["processes"] if p["holds_gpu"]}
        assert set(job.workers) <= set(held)
        assert all(held[w]["ppid"] == job.launcher for w in job.workers)
        assert all("LOCAL_RANK" in held[w]["launch_env"] for w in job.workers)
        assert findings(doc) == []
        assert dry_run_plan(cli_env) == (3, [])


# -- 8 ------------------------------------------------------------------------------------------
def test_8_a_pid_missing_from_proc_and_memory_nobody_accounts_for_are_ghosts(
        watched: WatchedNode) -> None:
    missing = free_pid()
    watched.node.hold(missing, device=0, used=2 * GIB, ghost=True)
    watched.node.devices[1].unattributed = 3 * GIB
    watched.node.write()
    doc = watched.doc_when("two ghosts", lambda d: len(findings(d, "ghost")) == 2)
    process_ghost, device_ghost = sorted(findings(doc, "ghost"), key=lambda f: f["pid"] is None)
    assert process_ghost["pid"] == missing and process_ghost["gpu_memory_bytes"] == 2 * GIB
    assert device_ghost["pid"] is None and device_ghost["gpus"] == [1]
    assert device_ghost["gpu_memory_bytes"] == 3 * GIB
    text = watched.status_text()
    assert "ghost" in text and "no listed process accounts for" in text


# -- 9 ------------------------------------------------------------------------------------------
def test_9_a_finding_does_not_carry_over_to_a_new_process_that_reuses_the_pid(
        watched: WatchedNode, tmp_path: Path) -> None:
    with torchrun_job(tmp_path, workers=1) as job:
        old, doc = watched.orphan(job, used=GIB)
        old_start = by_pid(doc, "orphan")[old]["start_time"]
        os.kill(old, 9)
        # Free once reaped: its adopter may reap lazily (PID 1 here does).
        wait_for(f"PID {old} to be released", lambda: not Path(f"/proc/{old}").exists() or None,
                 60)
        with process_on_pid(old, [sys.executable, "-c", "import time; time.sleep(600)"]) \
                as reused:
            watched.node.hold(reused.pid, device=0, used=GIB)
            doc = watched.doc_when("the new process", lambda d: any(
                p["pid"] == old and p["start_time"] != old_start and p["holds_gpu"]
                for p in d["processes"]))
            assert findings(doc) == []


# -- 10 -----------------------------------------------------------------------------------------
def test_10_stuck_in_the_kernel_is_critical_only_with_the_gpu_at_stake(
        watched: WatchedNode, tmp_path: Path) -> None:
    """Real processes in D state (a vfork parent waits in the kernel): the one holding GPU memory
    is critical, the one that holds none and waits outside the NVIDIA driver only a warning."""
    with job_with_processes_in_d_state(tmp_path) as (worker, holding, elsewhere):
        watched.node.hold(worker, device=0, used=GIB)
        watched.node.hold(holding, device=1, used=2 * GIB)
        doc = watched.doc_when("two unkillable findings",
                               lambda d: len(findings(d, "unkillable")) == 2)
        found = by_pid(doc, "unkillable")
        procs = processes_by_pid(doc)
        for pid in (holding, elsewhere):
            assert procs[pid]["state"] == "disk-sleep"
            assert procs[pid]["wchan"] or procs[pid]["kernel_stack"], procs[pid]
        where = procs[elsewhere]["wchan"] or procs[elsewhere]["kernel_stack"][0]
        assert found[holding]["severity"] == "critical"
        assert found[holding]["gpu_memory_bytes"] == 2 * GIB
        assert "holds GPU memory while waiting in" in found[holding]["reason"]
        assert found[elsewhere]["severity"] == "warning"
        assert f"waits in {where}, not in the GPU driver, and holds no GPU memory" in \
            found[elsewhere]["reason"]
        assert set(by_pid(doc, "orphan")) == set()


# -- no false alarms -------------------------------------------------------------------------------
def test_a_healthy_job_and_a_service_under_pid_1_raise_nothing_over_many_polls(
        watched: WatchedNode, tmp_path: Path) -> None:
    with torchrun_job(tmp_path, workers=4, helpers=("redis",)) as job, \
            plain_service(tmp_path, name="nvidia-smi-like-service") as service:
        for rank, pid in enumerate(job.workers):
            watched.node.hold(pid, device=rank % 2, used=GIB)
        watched.node.hold(service, device=0, used=GIB)
        first = watched.holding(*job.workers, service)
        seen = watched.doc_when("ten more polls", lambda d: d["taken_at"] > first["taken_at"]
                                + 10 * INTERVAL)
        assert findings(first) == [] and findings(seen) == []


def test_a_young_ranked_process_under_pid_1_is_within_its_grace_period(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with orphaned_worker_under_pid1(tmp_path) as worker:
        fake_node.hold(worker, device=0, used=GIB)
        config = DETECTORS.replace("min_age = 0", "min_age = 600")
        with running_daemon(cli_env, tmp_path, config=config,
                            args=("--interval", str(INTERVAL))) as daemon:
            watched = WatchedNode(fake_node, cli_env, daemon)
            first = watched.holding(worker)
            later = watched.doc_when("more polls", lambda d: d["taken_at"] > first["taken_at"]
                                     + 5 * INTERVAL)
            assert findings(first) == [] and findings(later) == []
