"""Real PyTorch jobs on the real driver, watched by the real daemon: a launcher killed, a Ctrl+C
that leaves a worker behind, and `gpuwatch reap` freeing what they hold."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuwatch.simulate.demo import DemoError, wait_for
from tests.daemonproc import by_pid
from tests.gpu.gpujobs import (
    GONE_TIMEOUT,
    MIB,
    GpuJob,
    Started,
    Watched,
    ctrl_c,
    nvml_processes,
    processes_of,
    sigkill_launcher,
    smi_apps,
    start_job,
    wait_nvml_released,
    wait_smi_released,
    watching,
)
from tests.scenarios import running, wait_not_running

pytestmark = pytest.mark.gpu

#: A distinct amount per rank, 512 MiB apart: more than CUDA contexts on one GPU differ by.
WORKER_MIB = [1024, 1536, 2048]
SIGINT_GRACE = 8.0
REAP_GRACE = "5"
EXIT_INTERRUPTED = 130


def rank_pid(job: GpuJob, rank: int) -> int:
    (pid,) = [pid for pid, r in job.reports.items() if int(r["rank"]) == rank]
    return pid


def orphans_holding_what_nvml_reports(w: Watched, pids: Iterable[int]
                                      ) -> tuple[dict[int, dict[str, Any]], dict[int, Any]]:
    """({pid: orphan finding}, NVML's {pid: bytes}) once the daemon names each of `pids` an
    orphan whose GPU memory is exactly what NVML reports for that PID. The two are read a poll
    apart, so they are compared until they agree (an idle process's figure does not move)."""
    wanted = set(pids)
    last: list[Any] = [None]

    def probe() -> Optional[tuple[dict[int, dict[str, Any]], dict[int, Any]]]:
        found = by_pid(w.doc(), "orphan")
        if not wanted <= found.keys():
            last[0] = f"orphan findings for {sorted(found)}"
            return None
        nvml = nvml_processes()
        figures = {pid: (found[pid]["gpu_memory_bytes"], nvml.get(pid)) for pid in wanted}
        last[0] = f"(daemon's finding, NVML) by PID: {figures}"
        if all(ours == theirs and ours is not None for ours, theirs in figures.values()):
            return {pid: found[pid] for pid in wanted}, nvml
        return None

    try:
        return wait_for(f"orphan findings for {sorted(wanted)} with NVML's memory", probe, 30,
                        alive=w.daemon.proc)
    except DemoError as exc:
        raise AssertionError(f"{exc}; last seen: {last[0]}") from exc


def test_a_sigkilled_launcher_leaves_every_worker_an_orphan_holding_what_nvml_reports(
        started: Started, tmp_path: Path) -> None:
    with watching(started, tmp_path) as w:
        job = start_job(started, tmp_path, WORKER_MIB)
        w.holding(*job.workers)
        sigkill_launcher(job)
        orphans, nvml = orphans_holding_what_nvml_reports(w, job.workers)

        for pid in job.workers:
            f, report = orphans[pid], job.reports[pid]
            assert f["severity"] == "critical", f
            assert f"parent {job.launcher.pid} (" in f["reason"], f["reason"]
            # NVML's figure is the allocation plus the CUDA context.
            assert nvml[pid] >= report["mib"] * MIB, (nvml[pid], report)
        by_rank = [nvml[rank_pid(job, rank)] for rank in range(len(WORKER_MIB))]
        assert by_rank == sorted(by_rank) and len(set(by_rank)) == len(by_rank), by_rank

        doc = w.doc()
        processes = processes_of(doc)
        assert job.launcher.pid not in processes
        for pid in job.workers:
            assert processes[pid]["gpu_memory_bytes"] == orphans[pid]["gpu_memory_bytes"]
            assert processes[pid]["ppid"] != job.launcher.pid


def test_ctrl_c_leaves_the_worker_with_a_heartbeat_thread_an_orphan_holding_its_memory(
        started: Started, tmp_path: Path) -> None:
    with watching(started, tmp_path) as w:
        job = start_job(started, tmp_path, WORKER_MIB, stubborn_rank=1,
                        sigint_grace=SIGINT_GRACE)
        stubborn = rank_pid(job, 1)
        others = [pid for pid in job.workers if pid != stubborn]
        w.holding(*job.workers)

        ctrl_c(job)
        assert job.launcher.wait(SIGINT_GRACE + GONE_TIMEOUT) == EXIT_INTERRUPTED
        wait_not_running(others, GONE_TIMEOUT, "the other workers to exit on Ctrl+C")
        assert running(stubborn), "the worker with a live heartbeat thread exited"

        orphans, nvml = orphans_holding_what_nvml_reports(w, [stubborn])
        assert nvml[stubborn] >= WORKER_MIB[1] * MIB
        assert f"parent {job.launcher.pid} (" in orphans[stubborn]["reason"]
        # What exited took its memory with it, and leaves no orphan or ghost behind (a zombie
        # finding may stay where the PID 1 of a container never reaps what it adopts).
        wait_nvml_released(others)
        w.doc_when("no orphan or ghost finding for the workers that exited",
                   lambda d: not set(others) & {f["pid"] for f in d["findings"]
                                                if f["kind"] in ("orphan", "ghost")})


def reap(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`gpuwatch reap ARGS` as a script runs it: stdin is no terminal."""
    return subprocess.run([sys.executable, "-m", "gpuwatch", "reap", *args], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180)


def test_reap_ends_the_orphans_and_the_driver_frees_their_memory(
        started: Started, tmp_path: Path) -> None:
    with watching(started, tmp_path) as w:
        job = start_job(started, tmp_path, WORKER_MIB[:2], stubborn_rank=1)
        stubborn = rank_pid(job, 1)
        w.holding(*job.workers)
        sigkill_launcher(job)
        orphans, _ = orphans_holding_what_nvml_reports(w, job.workers)
        assert set(job.workers) <= smi_apps().keys()

        # Only these PIDs: the machine may hold other people's orphans.
        pids = [arg for pid in job.workers for arg in ("--pid", str(pid))]
        result = reap(["--yes", "--grace", REAP_GRACE, "--kind", "orphan", "--json", *pids],
                      w.env)
        started.describe("gpuwatch reap --json", lambda: result.stdout + result.stderr)
        assert result.returncode == 0, result.stdout + result.stderr
        out = json.loads(result.stdout)
        assert out["dry_run"] is False and out["source"] == "daemon"
        actions = {a["pid"]: a for a in out["actions"]}
        assert set(actions) == set(job.workers), out["actions"]
        for pid, a in actions.items():
            assert a["kind"] == "orphan"
            assert a["gpu_memory_bytes"] == orphans[pid]["gpu_memory_bytes"]
        # Its heartbeat thread holds the exit after SIGTERM: only SIGKILL ends it.
        assert actions[stubborn]["result"] == "killed", actions[stubborn]
        for pid in job.workers:
            assert actions[pid]["result"] in ("exited", "killed"), actions[pid]

        wait_smi_released(job.workers)
        assert not any(running(pid) for pid in job.workers)
        w.doc_when("the daemon to drop the orphans",
                   lambda d: not set(job.workers) & set(by_pid(d, "orphan")))
