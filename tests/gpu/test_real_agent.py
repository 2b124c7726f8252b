"""The agent's CUDA allocator figures from a real PyTorch process: what the daemon serves against
what the process's own torch.cuda.memory_allocated() says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.gpujobs import (
    GONE_TIMEOUT,
    PROGRAM,
    START_TIMEOUT,
    LineReader,
    Started,
    processes_of,
    tail,
    watching,
)

pytestmark = pytest.mark.gpu

PHASES = 3


def test_the_daemon_serves_the_allocator_figures_torch_reports_at_each_pause(
        started: Started, tmp_path: Path) -> None:
    with watching(started, tmp_path) as w:
        log = tmp_path / "agent-worker.log"
        with open(log, "wb") as err:
            proc = started.popen(
                [sys.executable, str(PROGRAM), "agent-worker", "--phases", str(PHASES),
                 "--steps-per-phase", "10", "--mib-per-step", "16"],
                w.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        started.describe("the agent worker's stderr", lambda: tail(log))
        assert proc.stdin is not None and proc.stdout is not None
        lines = LineReader(proc.stdout, proc)
        started.describe("the agent worker's stdout", lambda: "\n".join(lines.seen))

        allocated_before = 0
        for phase in range(PHASES):
            paused = lines.next_json(f"the worker's pause after phase {phase}", START_TIMEOUT)
            assert paused["phase"] == phase
            step = paused["step"]

            def at_pause(doc: dict[str, Any], step: int = step) -> bool:
                agent = processes_of(doc).get(proc.pid, {}).get("agent")
                return agent is not None and agent["step"] == step

            # The first document at the paused step: every report of that step was built after
            # the step's last allocation, so it must carry the printed figures already.
            doc = w.doc_when(f"the daemon to have the worker's step {step}", at_pause)
            agent = processes_of(doc)[proc.pid]["agent"]
            assert agent["cuda_allocated_bytes"] == paused["allocated"], (agent, paused)
            assert agent["cuda_reserved_bytes"] == paused["reserved"], (agent, paused)
            assert agent["buffers"]["held"]["items"] == paused["tensors"], agent["buffers"]
            assert paused["allocated"] > allocated_before
            allocated_before = paused["allocated"]
            # NVML's figure for the process covers what its allocator reserved, and its context.
            # A poll reads NVML before it takes the agents' reports, so the document that first
            # has this step may still have NVML's figure from just before its last allocation.
            def covers(doc: dict[str, Any], reserved: int = paused["reserved"]) -> bool:
                held = processes_of(doc).get(proc.pid, {}).get("gpu_memory_bytes")
                return held is not None and held >= reserved

            w.doc_when("NVML's figure for the worker to cover what its allocator reserved",
                       covers)

            proc.stdin.write("\n")
            proc.stdin.flush()

        proc.stdin.close()
        assert proc.wait(GONE_TIMEOUT) == 0
