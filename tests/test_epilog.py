"""The Slurm epilog and prolog of contrib/slurm (the epilog is also the README's recipe, word for
word), run by `sh` against a real daemon on the simulated node: the scripts a scheduler runs after
and before every job must free exactly what jobs left behind, and keep jobs off a node whose GPU
memory cannot be freed.

The job's id reaches gpuwatch the two ways Slurm gives it: the job's environment
(`SLURM_JOB_ID`), and the cgroup Slurm's cgroup plugin puts the job in. `scontrol` is Slurm's and
cannot be real here: a stand-in records how the epilog called it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from tests.daemonproc import WatchedNode, by_pid, running_daemon
from tests.realprocs import GIB
from tests.scenarios import (
    hung_at_exit,
    process_on_pid,
    running,
    sigkill_launcher,
    slurm_job_cgroup,
    torchrun_job,
    unique_job_id,
    unreaped_child,
    wait_not_running,
)

ROOT = Path(__file__).resolve().parent.parent
DETECTORS = """
[detectors]
leftover_grace = 1
zombie_grace = 0.5
min_age = 0
"""


EPILOG = ROOT / "contrib" / "slurm" / "epilog.sh"
PROLOG = ROOT / "contrib" / "slurm" / "prolog.sh"


def readme_epilog() -> str:
    """The shell script under "In a Slurm epilog" in the README, as a user copies it."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### In a Slurm epilog"):]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match is not None, "no sh block under 'In a Slurm epilog'"
    return match.group(1)


def test_the_readme_recipe_is_the_shipped_epilog_word_for_word() -> None:
    assert readme_epilog() == EPILOG.read_text()
    assert "contrib/slurm" in (ROOT / "README.md").read_text()
    for script in (EPILOG, PROLOG):
        assert script.stat().st_mode & 0o111, f"{script.name} is not executable"
        assert script.read_text().startswith("#!/bin/sh\n")


@pytest.fixture
def watched(fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path
            ) -> Iterator[WatchedNode]:
    with running_daemon(cli_env, tmp_path, config=DETECTORS,
                        args=("--interval", "0.2")) as daemon:
        yield WatchedNode(fake_node, cli_env, daemon)


class Epilog:
    """A script of contrib/slurm (the epilog unless told), run as shipped, with `gpuwatch` and a
    recording `scontrol` on PATH."""

    def __init__(self, tmp_path: Path, env: dict[str, str], script: Path = EPILOG) -> None:
        self.script = script
        bin_dir = tmp_path / f"bin-{script.stem}"
        bin_dir.mkdir()
        self.calls = tmp_path / f"scontrol-{script.stem}.calls"
        scontrol = bin_dir / "scontrol"
        scontrol.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> "{self.calls}"\n')
        scontrol.chmod(0o755)
        installed = Path(sys.executable).with_name("gpuwatch")
        if not installed.exists():  # the package run from a checkout: the same CLI
            installed = bin_dir / "gpuwatch"
            installed.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m gpuwatch "$@"\n')
            installed.chmod(0o755)
        self.env = {**env, "PATH": f"{bin_dir}:{installed.parent}:{os.environ['PATH']}"}

    def run(self, job_id: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["sh", str(self.script)], env={**self.env, "SLURM_JOB_ID": job_id},
                              capture_output=True, text=True, timeout=120)

    def scontrol_calls(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []


def test_the_epilog_ends_the_helpers_a_finished_job_left_and_nothing_else(
        watched: WatchedNode, tmp_path: Path) -> None:
    epilog = Epilog(tmp_path, watched.env)
    roles = ("redis", "actor", "preprocessor")
    with torchrun_job(tmp_path, workers=1, helpers=roles, trainer_exit_after=2.0,
                      env={"SLURM_JOB_ID": "4242"}) as job, \
            torchrun_job(tmp_path, workers=1, env={"SLURM_JOB_ID": "4300"}) as other:
        (trainer,) = job.workers
        watched.node.hold(trainer, device=0, used=6 * GIB)
        watched.node.hold(other.workers[0], device=1, used=8 * GIB)
        watched.holding(trainer, other.workers[0])
        wait_not_running([trainer])
        leftovers = watched.findings_of("leftover", job.helpers.values())
        assert all(f["job"] == {"id": "4242", "source": "slurm"} for f in leftovers.values())

        done = epilog.run("4242")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "exited" in done.stdout and "would free" not in done.stdout
        wait_not_running(list(job.helpers.values()))
        assert epilog.scontrol_calls() == []
        # The other job on the node was never the epilog's to end.
        assert other.workers[0] in {p["pid"] for p in watched.doc()["processes"]
                                    if p["holds_gpu"]}

        # The daemon's view follows at its next poll, which the epilog does not wait for.
        helpers = set(job.helpers.values())
        watched.doc_when("the daemon to see the helpers gone",
                         lambda d: not helpers & set(by_pid(d, "leftover")))
        again = epilog.run("4242")
        assert again.returncode == 0
        assert "nothing to do" in again.stdout.lower(), again.stdout


def test_the_epilog_frees_the_gpu_memory_of_a_job_orphaned_by_sigkill(
        watched: WatchedNode, tmp_path: Path) -> None:
    epilog = Epilog(tmp_path, watched.env)
    with torchrun_job(tmp_path, workers=2, env={"SLURM_JOB_ID": "5151"}) as job:
        for rank, pid in enumerate(job.workers):
            watched.node.hold(pid, device=rank, used=(4 + rank) * GIB)
        watched.holding(*job.workers)
        sigkill_launcher(job)
        watched.findings_of("orphan", job.workers)
        used_before = _used(watched)

        done = epilog.run("5151")
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.count("GPU memory released") == 2, done.stdout
        wait_not_running(job.workers)
        # The daemon's view follows at its next poll, which the epilog does not wait for.
        watched.doc_when("the daemon to see the memory freed",
                         lambda d: used_before - _doc_used(d) == 9 * GIB)
        assert epilog.scontrol_calls() == []


def test_the_epilog_ends_a_rank_of_the_job_hung_at_interpreter_exit(
        watched: WatchedNode, tmp_path: Path) -> None:
    epilog = Epilog(tmp_path, watched.env)
    with hung_at_exit({**watched.env, "SLURM_JOB_ID": "7373"}) as rank, \
            hung_at_exit({**watched.env, "SLURM_JOB_ID": "7400"}) as other:
        watched.node.hold(rank.pid, device=0, used=8 * GIB)
        watched.node.hold(other.pid, device=1, used=8 * GIB)
        stalled = watched.findings_of("stalled", [rank.pid, other.pid])
        assert stalled[rank.pid]["job"] == {"id": "7373", "source": "slurm"}

        done = epilog.run("7373")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "GPU memory released" in done.stdout, done.stdout
        wait_not_running([rank.pid])
        assert epilog.scontrol_calls() == []
        assert running(other.pid)  # another job's: not the epilog's to end


def test_the_epilog_finds_the_job_by_its_slurm_cgroup_without_any_job_variable(
        watched: WatchedNode, tmp_path: Path) -> None:
    epilog = Epilog(tmp_path, watched.env)
    job_id = unique_job_id("6262")
    with slurm_job_cgroup(job_id) as cgroup, \
            torchrun_job(tmp_path, workers=2, cgroup=cgroup) as job:
        for rank, pid in enumerate(job.workers):
            watched.node.hold(pid, device=rank, used=2 * GIB)
        doc = watched.holding(*job.workers)
        assert {p["job"]["id"] for p in doc["processes"] if p["pid"] in job.workers} == \
            {job_id}
        sigkill_launcher(job)
        orphans = watched.findings_of("orphan", job.workers)
        assert all(f["job"] == {"id": job_id, "source": "slurm"} for f in orphans.values())

        done = epilog.run(job_id)
        assert done.returncode == 0, done.stdout + done.stderr
        wait_not_running(job.workers)
        assert epilog.scontrol_calls() == []


def test_the_epilog_drains_the_node_when_gpu_memory_cannot_be_freed(
        watched: WatchedNode, tmp_path: Path) -> None:
    """A zombie whose parent (a process of the job, holding GPU memory) never reaps it: the
    reaper cannot end it, exits 4, and the recipe drains the node."""
    epilog = Epilog(tmp_path, watched.env)
    with unreaped_child(tmp_path, env={"SLURM_JOB_ID": "7373"}) as (parent, child):
        watched.node.hold(parent, device=0, used=GIB)
        zombie = watched.findings_of("zombie", [child])[child]
        assert zombie["job"] == {"id": "7373", "source": "slurm"}

        done = epilog.run("7373")
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"GPU memory still held by PID {parent}" in done.stdout, done.stdout
        (call,) = epilog.scontrol_calls()
        hostname = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout
        assert call == (f"update nodename={hostname.strip()} state=drain "
                        "reason=gpuwatch: GPU memory not freed")


def test_the_epilog_does_not_drain_a_clean_node_when_an_orphan_s_pid_was_reused(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    """The daemon's findings name an orphan that has exited since, its memory freed, and whose
    PID the next process (holding GPU memory of its own) took before the epilog ran. The reaper
    sends nothing to the newcomer (`identity-changed`); nothing the plan named holds GPU memory,
    so the node stays in service."""
    epilog = Epilog(tmp_path, cli_env)
    with torchrun_job(tmp_path, workers=1, env={"SLURM_JOB_ID": "8484"}) as job:
        (worker,) = job.workers
        fake_node.hold(worker, device=0, used=4 * GIB)
        sigkill_launcher(job)
        # A daemon that polls seldom: its findings stay those of before the PID changed hands.
        with running_daemon(cli_env, tmp_path, config=DETECTORS,
                            args=("--interval", "600")) as daemon:
            watched = WatchedNode(fake_node, cli_env, daemon)
            watched.findings_of("orphan", [worker])
            os.kill(worker, signal.SIGKILL)
            # Free once reaped: its adopter may reap lazily (PID 1 here does).
            wait_for(f"PID {worker} to be released",
                     lambda: True if not Path(f"/proc/{worker}").exists() else None, 60)
            fake_node.release(worker)  # the driver frees what the orphan held
            with process_on_pid(worker, [sys.executable, "-c",
                                         "import time; time.sleep(600)"]) as newcomer:
                fake_node.hold(worker, device=0, used=2 * GIB)  # the newcomer's own memory

                done = epilog.run("8484")
                assert done.returncode == 0, done.stdout + done.stderr
                assert "identity-changed" in done.stdout, done.stdout
                assert "no GPU memory the plan named is still held" in done.stdout
                assert epilog.scontrol_calls() == []
                assert newcomer.poll() is None and running(worker)


def test_the_prolog_frees_what_an_earlier_job_left_and_spares_the_running_job(
        watched: WatchedNode, tmp_path: Path) -> None:
    prolog = Epilog(tmp_path, watched.env, PROLOG)
    with torchrun_job(tmp_path, workers=2, env={"SLURM_JOB_ID": "5151"}) as gone, \
            torchrun_job(tmp_path, workers=1, env={"SLURM_JOB_ID": "4300"}) as other:
        for rank, pid in enumerate(gone.workers):
            watched.node.hold(pid, device=rank, used=3 * GIB)
        watched.node.hold(other.workers[0], device=1, used=8 * GIB)
        watched.holding(*gone.workers, other.workers[0])
        clean = prolog.run("9900")
        assert clean.returncode == 0, clean.stdout + clean.stderr
        assert "nothing to do" in clean.stdout.lower(), clean.stdout

        sigkill_launcher(gone)
        watched.findings_of("orphan", gone.workers)
        done = prolog.run("9901")
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.count("GPU memory released") == 2, done.stdout
        wait_not_running(gone.workers)
        assert running(other.workers[0])
        assert prolog.scontrol_calls() == []


def test_the_prolog_keeps_the_job_off_a_node_whose_gpu_memory_cannot_be_freed(
        watched: WatchedNode, tmp_path: Path) -> None:
    """Exit 1: Slurm drains the node and requeues the job."""
    prolog = Epilog(tmp_path, watched.env, PROLOG)
    with unreaped_child(tmp_path, env={"SLURM_JOB_ID": "7373"}) as (parent, child):
        watched.node.hold(parent, device=0, used=GIB)
        watched.findings_of("zombie", [child])

        done = prolog.run("7400")
        assert done.returncode == 1, done.stdout + done.stderr
        assert f"GPU memory still held by PID {parent}" in done.stdout, done.stdout
        assert "GPU memory of earlier jobs not freed" in done.stderr
        assert prolog.scontrol_calls() == []


def _used(watched: WatchedNode) -> int:
    return _doc_used(watched.doc())


def _doc_used(doc: dict[str, Any]) -> int:
    return sum(g["memory_used_bytes"] or 0 for g in doc["gpus"])
