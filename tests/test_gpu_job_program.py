"""The program the `gpu` suite runs on real GPUs (tests/gpu/programs/gpu_job.py), here in its
--cpu mode: host memory instead of CUDA memory, so that its launcher, its workers' process group
and variables, its Ctrl+C behaviour and the agent worker's pauses are checked on every run, with
no GPU and no PyTorch."""

from __future__ import annotations

import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.gpujobs import (
    GONE_TIMEOUT,
    MIB,
    PROGRAM,
    LineReader,
    Started,
    ctrl_c,
    real_env,
    start_job,
)
from tests.scenarios import environ, parent, process_group, running, wait_not_running

MIB_PER_RANK = [8, 16, 24]


def test_the_programs_compile(tmp_path: Path) -> None:
    for program in PROGRAM.parent.glob("*.py"):
        py_compile.compile(str(program), cfile=str(tmp_path / f"{program.stem}.pyc"),
                           doraise=True)


@pytest.mark.sigint
def test_the_launcher_starts_its_workers_as_torchrun_does_and_ctrl_c_leaves_the_stubborn_one(
        tmp_path: Path) -> None:
    started = Started(check_nvml=False)
    try:
        job = start_job(started, tmp_path, MIB_PER_RANK, stubborn_rank=2, sigint_grace=1.0,
                        cpu=True)
        assert len(job.workers) == len(MIB_PER_RANK)
        for pid in job.workers:
            report = job.reports[pid]
            rank = int(report["rank"])
            assert report["allocated"] == MIB_PER_RANK[rank] * MIB and report["device"] is None
            assert parent(pid) == job.launcher.pid
            assert process_group(pid) == job.group == process_group(job.launcher.pid)
            env = environ(pid)
            assert env["LOCAL_RANK"] == env["RANK"] == str(rank)
            assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == str(len(MIB_PER_RANK))
            assert env["TORCHELASTIC_RUN_ID"] == job.run_id
            assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"].isdigit()
            assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"

        ctrl_c(job)
        assert job.launcher.wait(GONE_TIMEOUT) == 130
        stubborn = next(p for p, r in job.reports.items() if r["stubborn"])
        wait_not_running([p for p in job.workers if p != stubborn], GONE_TIMEOUT)
        assert running(stubborn)
    finally:
        started.cleanup()


def test_the_agent_worker_pauses_after_each_phase_until_told_to_go_on(tmp_path: Path) -> None:
    started = Started(check_nvml=False)
    try:
        # No daemon listens there: the agent's reports go nowhere, as the agent allows.
        env = {**real_env(), "GPUWATCH_RUNTIME_DIR": str(tmp_path)}
        proc = started.popen([sys.executable, str(PROGRAM), "agent-worker", "--phases", "2",
                              "--steps-per-phase", "3", "--mib-per-step", "1", "--cpu"],
                             env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        lines = LineReader(proc.stdout, proc)
        first = lines.next_json("phase 0", GONE_TIMEOUT)
        assert (first["phase"], first["step"], first["tensors"]) == (0, 3, 3)
        assert first["allocated"] == 3 * MIB + 4096 * (1 + 2 + 3)
        proc.stdin.write("\n")
        proc.stdin.flush()
        second = lines.next_json("phase 1", GONE_TIMEOUT)
        assert (second["phase"], second["step"], second["tensors"]) == (1, 6, 6)
        assert second["allocated"] == first["allocated"] + 3 * 2 * MIB + 4096 * (4 + 5 + 6)
        proc.stdin.close()
        assert proc.wait(GONE_TIMEOUT) == 0
    finally:
        started.cleanup()
