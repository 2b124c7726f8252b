"""The process scenarios (tests/scenarios.py) behave as the detector tests rely on.

These pin the workloads themselves: parents, process groups, thread counts, states and
environments as /proc shows them after real signals. No detector is involved.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import pytest

from gpuwatch.simulate.demo import wait_for
from tests.scenarios import (
    LAUNCH_VARIABLE_PREFIXES,
    LAUNCH_VARIABLES,
    build_program,
    cmdline,
    comm,
    ctrl_c,
    environ,
    orphan_adopter,
    orphaned_worker_under_pid1,
    parent,
    plain_service,
    process_group,
    running,
    sigkill_launcher,
    state,
    status_field,
    threads,
    torchrun_job,
    unreaped_child,
    wait_launcher_gone,
    wait_not_running,
    zombie_leader,
)

ROLES = ("redis", "actor", "preprocessor")


def until(what: str, condition: Callable[[], bool], timeout: float = 10.0) -> None:
    wait_for(what, lambda: True if condition() else None, timeout)


def gone(pid: int) -> bool:
    """Exited and reaped: what a parent that reaps leaves of a child."""
    return state(pid) is None


# ---- the job: helpers and a finished trainer -----------------------------------------------------


def test_helpers_run_beside_the_workers_without_a_rank(tmp_path: Path) -> None:
    with torchrun_job(tmp_path, workers=2, helpers=ROLES, env={"SLURM_JOB_ID": "4242"}) as job:
        assert sorted(job.helpers) == sorted(ROLES)
        for role, pid in job.helpers.items():
            args = cmdline(pid)
            assert args[args.index("--helper") + 1] == role
            env = environ(pid)
            assert not {"LOCAL_RANK", "RANK", "WORLD_SIZE"} & set(env)
            assert env["SLURM_JOB_ID"] == "4242"  # the launcher's environment, otherwise
            assert parent(pid) == job.launcher
            assert process_group(pid) == job.group
        for rank, pid in enumerate(job.workers):
            env = environ(pid)
            assert (env["LOCAL_RANK"], env["RANK"]) == (str(rank), str(rank))
            assert env["TORCHELASTIC_RUN_ID"] == job.run_id
            assert parent(pid) == job.launcher
            assert process_group(pid) == job.group


def test_a_finished_trainer_leaves_its_helpers_and_the_launcher_waiting(tmp_path: Path) -> None:
    with torchrun_job(tmp_path, workers=2, helpers=("redis",), trainer_exit_after=0.2) as job:
        until("the workers to finish", lambda: all(gone(p) for p in job.workers))
        redis = job.helpers["redis"]
        assert running(job.launcher) and running(redis)
        assert parent(redis) == job.launcher


def test_a_launcher_that_waits_only_for_workers_leaves_helpers_behind(tmp_path: Path) -> None:
    with torchrun_job(tmp_path, workers=2, helpers=("redis", "actor"), trainer_exit_after=0.2,
                      launcher_waits_for="workers") as job:
        assert wait_launcher_gone(job) == 0
        assert not any(running(p) for p in job.workers)
        for pid in job.helpers.values():
            assert running(pid)
            assert parent(pid) == job.adopter == orphan_adopter()
            assert process_group(pid) == job.group  # still reachable through the job's group


def test_sigterm_to_the_launcher_is_forwarded_to_workers_and_helpers(tmp_path: Path) -> None:
    with torchrun_job(tmp_path, workers=2, helpers=("redis",)) as job:
        os.kill(job.launcher, signal.SIGTERM)
        assert wait_launcher_gone(job) == 0
        wait_not_running(job.pids)


# ---- Ctrl+C and the stubborn worker --------------------------------------------------------------


@pytest.mark.sigint
@pytest.mark.parametrize("via", [None, "subreaper", "shell"])
def test_ctrl_c_leaves_only_the_stubborn_worker(tmp_path: Path, via: Optional[str]) -> None:
    with torchrun_job(tmp_path, workers=3, helpers=("redis",), stubborn_rank=1,
                      sigint_grace=0.3, via=via) as job:
        stubborn = job.workers[1]
        ctrl_c(job)
        code = wait_launcher_gone(job)
        if via is None:
            assert code == 130
        others = [job.workers[0], job.workers[2], job.helpers["redis"]]
        until("the other workers and the helper to exit",
              lambda: not any(running(p) for p in others))
        assert running(stubborn)
        assert parent(stubborn) == job.adopter != job.launcher
        assert threads(stubborn) >= 2  # its main thread, joining the heartbeat thread
        if via == "shell":
            assert running(job.shell)  # Ctrl+C reached the foreground job, not the shell


# ---- SIGKILL on the launcher: who adopts the workers ---------------------------------------------


def test_sigkill_on_a_launcher_started_directly_orphans_its_workers(tmp_path: Path) -> None:
    with torchrun_job(tmp_path, workers=2) as job:
        sigkill_launcher(job)
        assert job.launcher_returncode == -signal.SIGKILL
        for pid in job.workers:
            assert running(pid) and parent(pid) == orphan_adopter()


def test_sigkill_on_the_launcher_under_a_subreaper_gives_the_workers_to_it(
    tmp_path: Path,
) -> None:
    with torchrun_job(tmp_path, workers=2, helpers=("redis",), via="subreaper") as job:
        assert job.subreaper is not None
        assert parent(job.launcher) == job.subreaper
        assert process_group(job.subreaper) != job.group  # out of Ctrl+C's reach
        sigkill_launcher(job)
        for pid in [*job.workers, job.helpers["redis"]]:
            assert running(pid) and parent(pid) == job.subreaper
        os.kill(job.workers[0], signal.SIGKILL)
        until("the subreaper to reap the adopted worker", lambda: gone(job.workers[0]))
        assert running(job.subreaper)


@pytest.mark.parametrize("via", ["shell", "subreaper-shell"])
def test_sigkill_on_a_launcher_run_from_a_shell_gives_the_workers_to_the_shell(
    tmp_path: Path, via: str
) -> None:
    with torchrun_job(tmp_path, workers=2, via=via) as job:
        assert job.shell is not None
        assert comm(job.shell) == "bash"
        assert parent(job.launcher) == job.shell
        assert process_group(job.shell) != job.group  # the launcher is the foreground job
        if via == "shell":
            nspid = status_field(job.shell, "NSpid")
            assert nspid is not None and nspid.split()[-1] == "1"  # its namespace's init
        sigkill_launcher(job)
        for pid in job.workers:
            assert running(pid) and parent(pid) == job.shell
        os.kill(job.workers[0], signal.SIGKILL)
        until("the shell to reap the adopted worker", lambda: gone(job.workers[0]))
        assert running(job.shell)


@pytest.mark.sigint
def test_cleanup_leaves_nothing_running(tmp_path: Path) -> None:
    with torchrun_job(tmp_path, workers=2, helpers=("redis",), stubborn_rank=0,
                      sigint_grace=0.2, via="subreaper") as job:
        ctrl_c(job)
        wait_launcher_gone(job)
        assert job.subreaper is not None
        started = [*job.pids, job.subreaper]
        assert running(job.workers[0])
    assert not any(running(p) for p in started)


# ---- zombies -------------------------------------------------------------------------------------


def test_zombie_leader_is_a_zombie_with_a_live_thread(tmp_path: Path) -> None:
    with zombie_leader(tmp_path) as pid:
        assert state(pid) == "Z"
        assert threads(pid) == 2
        tasks = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
        assert tasks[0] == pid and len(tasks) == 2
        with open(f"/proc/{pid}/task/{tasks[1]}/stat") as f:
            assert f.read().rpartition(")")[2].split()[0] in "RS"  # the heartbeat, alive
    assert not running(pid)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_zombie_leader_ends_on_a_signal(tmp_path: Path, sig: int) -> None:
    proc = subprocess.Popen([str(build_program("zombie_leader", tmp_path))],
                            stdout=subprocess.DEVNULL)
    try:
        until("the leader to exit", lambda: state(proc.pid) == "Z" and threads(proc.pid) == 2)
        proc.send_signal(sig)
        assert proc.wait(10) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()


def test_unreaped_child_is_a_zombie_of_a_live_parent(tmp_path: Path) -> None:
    with unreaped_child(tmp_path) as (parent_pid, child):
        assert state(child) == "Z"
        assert parent(child) == parent_pid
        assert running(parent_pid)
    assert gone(child) and not running(parent_pid)


# ---- orphans that are not part of a running job --------------------------------------------------


def test_orphans_of_this_test_run_go_to_pid_1() -> None:
    adopter = orphan_adopter()
    if adopter != 1:
        pytest.skip(f"this test run sits under a child subreaper (PID {adopter}), not PID 1")


def test_plain_service_has_no_launch_variables_and_is_a_child_of_init(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID",
                 "SLURM_JOB_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.setenv(name, "0")  # even when the tests run inside a job
    with plain_service(tmp_path) as pid:
        assert parent(pid) == orphan_adopter()
        assert comm(pid) == "jupyter-lab"
        args = cmdline(pid)
        assert Path(args[1]).name == "jupyter-lab" and args[2:] == ["--no-browser"]
        env = environ(pid)
        assert "PATH" in env
        assert not [k for k in env
                    if k in LAUNCH_VARIABLES or k.startswith(LAUNCH_VARIABLE_PREFIXES)]
    assert not running(pid)


def test_orphaned_worker_keeps_its_launch_environment_under_init(tmp_path: Path) -> None:
    with orphaned_worker_under_pid1(tmp_path, run_id="lost-run") as pid:
        assert parent(pid) == orphan_adopter()
        assert "--worker" in cmdline(pid)
        env = environ(pid)
        assert {k: env.get(k) for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE",
                                        "TORCHELASTIC_RUN_ID", "MASTER_ADDR")} == {
            "LOCAL_RANK": "3", "RANK": "3", "WORLD_SIZE": "4",
            "TORCHELASTIC_RUN_ID": "lost-run", "MASTER_ADDR": "127.0.0.1"}
    assert not running(pid)


# ---- the launcher's command line -----------------------------------------------------------------


@pytest.mark.parametrize("args", [
    ["--workers", "2", "--stubborn-rank", "2", "--ready", "x.json"],
    ["--helpers", "redis,redis", "--ready", "x.json"],
    ["--launcher-waits-for", "nobody", "--ready", "x.json"],
    ["subreaper", "--ready", "x.json", "--", "--workers", "2"],  # the launcher's --ready
])
def test_bad_launcher_options_are_refused(tmp_path: Path, args: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "gpuwatch.simulate.job", *args],
                            cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2, result.stderr
    assert not (tmp_path / "x.json").exists()
