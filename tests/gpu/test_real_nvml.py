"""gpuwatch's reading of the real driver against the driver's own tool: `gpuwatch status --json
--poll` and nvidia-smi, with a PyTorch process holding a known amount of CUDA memory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest

from tests.gpu.conftest import GpuNode
from tests.gpu.gpujobs import (
    MIB,
    SmiGpu,
    Started,
    real_env,
    smi_apps,
    smi_gpus,
    start_job,
    wait_nvml_lists,
)
from tests.realprocs import gpuwatch

pytestmark = pytest.mark.gpu

HELD_MIB = 1536
#: What a CUDA context costs on top of the allocations (a few hundred MiB with lazy module
#: loading, more without): a bound, so that a figure off by a unit still fails.
CONTEXT_MIB = 4096
#: nvidia-smi rounds to whole MiB; two readings apart by a poll can differ by a page or two.
TOLERANCE_MIB = 2


def _within(value_mib: float, readings: list[Optional[int]]) -> bool:
    known = [r for r in readings if r is not None]
    return bool(known) and min(known) - TOLERANCE_MIB <= value_mib <= max(known) + TOLERANCE_MIB


def test_status_lists_the_pids_and_memory_nvidia_smi_lists(
        gpu_node: GpuNode, started: Started, tmp_path: Path) -> None:
    job = start_job(started, tmp_path, [HELD_MIB])
    (worker,) = job.workers
    wait_nvml_lists([worker])
    env = real_env()
    env.update({"GPUWATCH_RUNTIME_DIR": str(tmp_path / "run"),
                "GPUWATCH_STATE_DIR": str(tmp_path / "state"), "GPUWATCH_CONFIG": "/dev/null"})

    # nvidia-smi before and after gpuwatch: whatever else runs on this GPU may come and go
    # between two readings, so only what both of nvidia-smi's readings agree on is compared.
    apps_before, gpus_before = smi_apps(), smi_gpus()
    result = gpuwatch(["status", "--json", "--poll"], env)
    apps_after, gpus_after = smi_apps(), smi_gpus()
    started.describe("gpuwatch status --json --poll", lambda: result.stdout + result.stderr)

    assert result.stdout, result.stderr
    doc = json.loads(result.stdout)
    assert result.returncode == 0, (result.returncode, doc["errors"],
                                    [g["errors"] for g in doc["gpus"]])
    assert doc["source"] == "poll"
    assert doc["nvml"]["available"] is True
    # The real driver answered, not a fake library left on the library path.
    assert doc["nvml"]["driver_version"] == gpu_node.driver_version
    assert doc["nvml"]["device_count"] == len(gpus_before)

    # -- processes: the same PIDs with the same memory, at nvidia-smi's MiB granularity ------
    # nvidia-smi's compute query leaves out graphics-only processes (a display server).
    held = {p["pid"]: p for p in doc["processes"]
            if any("compute" in u["type"] for u in p["gpus"])}
    stable = {pid: mib for pid, mib in apps_before.items() if apps_after.get(pid, -1) == mib}
    assert worker in stable, f"nvidia-smi does not list the worker {worker}: {apps_before}"
    for pid, mib in stable.items():
        assert pid in held, f"nvidia-smi lists PID {pid} ({mib} MiB); gpuwatch does not"
        gw = held[pid]["gpu_memory_bytes"]
        if mib is None:
            continue
        assert gw is not None, f"PID {pid}: nvidia-smi says {mib} MiB, gpuwatch has no figure"
        assert abs(gw / MIB - mib) < 1, f"PID {pid}: gpuwatch {gw / MIB:.2f} MiB, nvidia-smi {mib}"
    for pid in held:
        assert pid in apps_before or pid in apps_after, \
            f"gpuwatch lists PID {pid}, which nvidia-smi never listed: {apps_before}"

    # The worker holds what it allocated plus its CUDA context, and is seen as the job's.
    mine = held[worker]
    assert HELD_MIB * MIB <= mine["gpu_memory_bytes"] <= (HELD_MIB + CONTEXT_MIB) * MIB
    assert mine["ppid"] == job.launcher.pid
    assert mine["launch_env"].get("TORCHELASTIC_RUN_ID") == job.run_id
    assert mine["launch_env"].get("LOCAL_RANK") == "0"
    assert [u["uuid"] for u in mine["gpus"]] and all(
        u["uuid"] in gpus_before for u in mine["gpus"])

    # -- GPUs: the same devices, totals and use -----------------------------------------------
    by_uuid = {g["uuid"]: g for g in doc["gpus"]}
    assert set(by_uuid) == set(gpus_before) == set(gpus_after)
    for uuid, g in by_uuid.items():
        before: SmiGpu = gpus_before[uuid]
        after: SmiGpu = gpus_after[uuid]
        assert g["index"] == before.index
        assert g["name"] == before.name
        assert not g["lost"] and not g["errors"], g["errors"]
        total = g["memory_total_bytes"]
        assert total is not None and before.total_mib is not None
        assert abs(total / MIB - before.total_mib) <= 1, (total / MIB, before.total_mib)
        used, reserved = g["memory_used_bytes"], g["memory_reserved_bytes"]
        assert used is not None
        readings = [before.used_mib, after.used_mib]
        # nvidia-smi counts the driver's reservation as used where NVML's v2 memory call
        # reports it apart (older nvidia-smi); either is the same memory.
        agrees = _within(used / MIB, readings) or (
            reserved is not None and _within((used + reserved) / MIB, readings))
        assert agrees, (f"GPU {uuid}: gpuwatch used {used / MIB:.1f} MiB (reserved "
                        f"{(reserved or 0) / MIB:.1f}), nvidia-smi {readings}")
        listed = [p for p in doc["processes"] if any(u["uuid"] == uuid for u in p["gpus"])]
        assert g["process_count"] == len(listed)
