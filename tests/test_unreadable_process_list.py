"""A GPU's process list that cannot be read says nothing about who holds its memory: its holders
are unknown (`?` in the table, null in JSON, no sample in the metrics), never 0, never "no
process holds GPU memory", and no detector or release check takes it for a release."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any, Optional

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors import assess
from gpuwatch.history import History
from gpuwatch.jobs.tree import job_roots
from gpuwatch.model import (
    GpuDevice,
    GpuProcessUsage,
    HostProcess,
    NodeReport,
    NodeSnapshot,
    NvmlCallError,
    NvmlStatus,
)
from gpuwatch.simulate import fakenvml
from gpuwatch.simulate.fakenvml import FakeNode
from gpuwatch.sinks.document import from_json, status_document
from gpuwatch.sinks.status_view import render_status
from tests.daemonproc import pids_with_series, running_daemon, value
from tests.emitted_kinds import detectors_report_only_declared_kinds  # noqa: F401 (autouse)
from tests.realprocs import GIB, gpuwatch, processes_by_pid, running_job, status_json

LIST_CALLS = "nvmlDeviceGetComputeRunningProcesses*"


def test_a_holder_on_a_gpu_whose_list_fails_is_unknown_until_the_list_is_back(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    config = "[detectors]\nghost_grace = 0\n"
    with running_job(tmp_path, workers=2) as job, \
            running_daemon(cli_env, tmp_path, config=config) as d:
        held, leaving = job.workers
        fake_node.hold(held, device=0, used=GIB)
        fake_node.hold(leaving, device=0, used=2 * GIB)
        d.wait_for_metrics("both holders' series", lambda s: {held, leaving} <= pids_with_series(
            s, "gpuwatch_process_gpu_memory_bytes") or None)

        fake_node.fail(LIST_CALLS, fakenvml.UNKNOWN, device=0)
        samples = d.wait_for_metrics("the holders' GPU memory series to go", lambda s: s if (
            not {held, leaving} & pids_with_series(s, "gpuwatch_process_gpu_memory_bytes"))
            else None)
        # Still processes that matter, with their other series; no GPU memory sample, not 0.
        assert {held, leaving} <= pids_with_series(
            samples, "gpuwatch_process_resident_memory_bytes")
        assert value(samples, "gpuwatch_gpu_unattributed_memory_bytes", gpu="0") is None
        assert value(samples, "gpuwatch_gpu_read_ok", gpu="0") == 0

        code, doc = status_json(cli_env)
        assert code == 4  # NVML answered, a call failed
        gpu0 = doc["gpus"][0]
        assert gpu0["holders_unknown"] and gpu0["unattributed_memory_bytes"] is None
        assert not doc["gpus"][1]["holders_unknown"]
        procs = processes_by_pid(doc)
        for pid in (held, leaving):
            p = procs[pid]
            assert p["holds_gpu"] is None and p["gpu_memory_bytes"] is None, p
            assert [(u["index"], u["memory_bytes"]) for u in p["gpus"]] == [(0, None)]
        table = gpuwatch(["status"], cli_env).stdout
        assert "no process holds GPU memory" not in table
        worker_lines = [line for line in table.splitlines() if f"{held}  " in line]
        assert worker_lines and "0:?" in worker_lines[0], table
        gpu_line = next(line for line in table.splitlines() if line.lstrip().startswith("0  "))
        assert "  ?  nvmlDeviceGetComputeRunningProcesses: Unknown Error" in gpu_line, table

        # A holder that exits while the list is unreadable holds nothing any more (its launcher
        # has not reaped it: a zombie of no thread), and is no ghost (ghost_grace 0).
        os.kill(leaving, signal.SIGKILL)
        doc = d_doc_when(cli_env, d, "the exited holder to drop out", lambda doc: (
            processes_by_pid(doc).get(leaving, {"holds_gpu": False})["holds_gpu"] is False))
        assert not [f for f in doc["findings"] if f["kind"] == "ghost"], doc["findings"]
        assert processes_by_pid(doc)[held]["holds_gpu"] is None

        # Its launcher killed meanwhile: the holder is an orphan holding GPU memory (critical),
        # not one that released it; the figure at stake is unknown.
        os.kill(job.launcher_pid, signal.SIGKILL)
        job.launcher.wait()
        doc = d_doc_when(cli_env, d, "the orphan", lambda doc: any(
            f["kind"] == "orphan" and f["pid"] == held for f in doc["findings"]))
        orphan = next(f for f in doc["findings"] if f["pid"] == held)
        assert orphan["severity"] == "critical" and orphan["gpu_memory_bytes"] is None

        fake_node.clear_failures()
        doc = d_doc_when(cli_env, d, "the list back", lambda doc: not doc["gpus"][0]["errors"])
        p = processes_by_pid(doc)[held]
        assert p["holds_gpu"] is True and p["gpu_memory_bytes"] == GIB
        assert doc["gpus"][0]["holders_unknown"] is False


def d_doc_when(env: dict[str, str], d: Any, what: str, predicate: Any) -> dict[str, Any]:
    from gpuwatch.simulate.demo import wait_for

    def probe() -> Optional[dict[str, Any]]:
        _, doc = status_json(env)
        return doc if doc["source"] == "daemon" and predicate(doc) else None
    return wait_for(what, probe, 20, alive=d.proc)


def test_one_poll_that_cannot_read_a_list_says_so_instead_of_no_holder(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_job(tmp_path, workers=1) as job:
        fake_node.hold(job.workers[0], device=1, used=GIB)
        fake_node.fail(LIST_CALLS, fakenvml.TIMEOUT, device=1)
        result = gpuwatch(["status", "--poll"], cli_env)
        assert result.returncode == 4, result.stderr
        assert "process list unreadable on GPU 1" in result.stdout
        assert "no process holds GPU memory" not in result.stdout
        doc = json.loads(gpuwatch(["status", "--poll", "--json"], cli_env).stdout)
        assert [g["holders_unknown"] for g in doc["gpus"]] == [False, True]
        # Nothing says the worker holds nothing: it is not listed as a non-holder either.
        assert all(p["holds_gpu"] is not False for p in doc["processes"]
                   if p["pid"] == job.workers[0])


def test_a_process_list_call_the_driver_lacks_is_a_failed_call_not_a_failed_poll(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    # pynvml raises NVMLLibraryMismatchError, not an NVMLError, for this one.
    with running_job(tmp_path, workers=1) as job:
        fake_node.hold(job.workers[0], device=0, used=GIB)
        fake_node.fail(LIST_CALLS, fakenvml.FUNCTION_NOT_FOUND, device=0)
        result = gpuwatch(["status", "--poll", "--json"], cli_env)
        assert result.returncode == 4, result.stderr
        doc = json.loads(result.stdout)
        (gpu0, gpu1) = doc["gpus"]
        assert gpu0["holders_unknown"] and not gpu1["holders_unknown"]
        assert [e["code"] for e in gpu0["errors"]] == [fakenvml.FUNCTION_NOT_FOUND]


def test_the_release_check_does_not_take_an_unreadable_list_for_a_release(
        fake_node: FakeNode) -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        fake_node.hold(child.pid, device=0, used=GIB)
        fake_node.fail(LIST_CALLS, fakenvml.UNKNOWN, device=0)
        code = ("import json, sys; from gpuwatch.actions.release import holders, nvml_after; "
                "r = nvml_after({int(sys.argv[1])}, wait=0.3); "
                "print(json.dumps([r.status.available, r.status.error, sorted(holders(r))]))")
        done = subprocess.run([sys.executable, "-c", code, str(child.pid)],
                              env=fake_node.env(), capture_output=True, text=True, timeout=60)
        available, error, _ = json.loads(done.stdout)
        assert (available, error) == (False, "process list unreadable on GPU 0"), done.stderr
        fake_node.clear_failures()
        done = subprocess.run([sys.executable, "-c", code, str(child.pid)],
                              env=fake_node.env(), capture_output=True, text=True, timeout=60)
        assert json.loads(done.stdout) == [True, None, [child.pid]]
    finally:
        child.kill()
        child.wait()


# -- detectors and the document, on snapshots -------------------------------------------------
CONFIG = DetectorConfig(ghost_min_bytes=GIB, ghost_grace=5.0)
FAILED = (NvmlCallError("nvmlDeviceGetComputeRunningProcesses", 999, "Unknown Error"),)
INIT = HostProcess(pid=1, ppid=0, start_time=0.0, name="systemd", user="root")


def snap(t: float, gpu: GpuDevice, *procs: HostProcess) -> NodeSnapshot:
    by_pid = {p.pid: p for p in (INIT, *procs)}
    return NodeSnapshot(taken_at=t, hostname="n", nvml=NvmlStatus(available=True), gpus=(gpu,),
                        processes=MappingProxyType(by_pid),
                        job_roots=MappingProxyType(job_roots(by_pid)))


def ghost_kinds(report: NodeReport) -> list[int]:
    """The ghosts' PIDs, 0 for a device ghost."""
    return sorted(f.pid or 0 for f in report.findings if f.kind == "ghost")


def test_an_unreadable_list_neither_opens_nor_closes_a_ghost() -> None:
    dead = GpuProcessUsage(0, "GPU-0", 4000, 2 * GIB)
    gone = HostProcess(pid=4000, in_procfs=False, gpu_usage=(dead,))
    carried = HostProcess(pid=4000, in_procfs=False, gpu_usage=(
        GpuProcessUsage(0, "GPU-0", 4000, None),))
    excess = GpuDevice(index=0, memory_used_bytes=5 * GIB, processes=(dead,))
    blind = GpuDevice(index=0, memory_used_bytes=5 * GIB, processes=carried.gpu_usage,
                      errors=FAILED)

    # Blind from the start: no ghost opens, however long it lasts.
    history = History()
    for t in (0.0, 10.0, 20.0):
        assert ghost_kinds(assess(snap(t, blind, carried), history, CONFIG)) == []

    # Open before: both ghosts stay open while blind, the device one with its figure unknown,
    # and stay open when the list is back (no new grace).
    history = History()
    for t in (0.0, 3.0, 6.0):
        report = assess(snap(t, excess, gone), history, CONFIG)
    assert ghost_kinds(report) == [0, 4000]
    opened = {f.pid: f.since for f in report.findings}
    for t in (8.0, 10.0):
        report = assess(snap(t, blind, carried), history, CONFIG)
        assert ghost_kinds(report) == [0, 4000]
        device = next(f for f in report.findings if f.pid is None)
        assert device.gpu_memory_bytes is None
    report = assess(snap(11.0, excess, gone), history, CONFIG)
    assert ghost_kinds(report) == [0, 4000]
    assert {f.pid: f.since for f in report.findings} == opened
    device = next(f for f in report.findings if f.pid is None)
    assert device.gpu_memory_bytes == 3 * GIB


def test_the_document_marks_carried_holders_unknown_and_listed_ones_known() -> None:
    carried = GpuProcessUsage(0, "GPU-0", 10, None)
    listed_na = GpuProcessUsage(1, "GPU-1", 11, None)  # listed, NVML gives no figure
    listed = GpuProcessUsage(1, "GPU-1", 12, GIB)
    gpus = (GpuDevice(index=0, memory_used_bytes=GIB, processes=(carried,), errors=FAILED),
            GpuDevice(index=1, memory_used_bytes=3 * GIB, processes=(listed_na, listed)))
    procs = {p.pid: p for p in (
        INIT,
        HostProcess(pid=10, ppid=1, start_time=5.0, name="python", gpu_usage=(carried,)),
        HostProcess(pid=11, ppid=1, start_time=5.0, name="python", gpu_usage=(listed_na,)),
        HostProcess(pid=12, ppid=1, start_time=5.0, name="python",
                    gpu_usage=(listed, GpuProcessUsage(0, "GPU-0", 12, None))),
        HostProcess(pid=13, ppid=1, start_time=5.0, name="python"),
    )}
    snapshot = NodeSnapshot(taken_at=10.0, hostname="n", nvml=NvmlStatus(available=True),
                            gpus=gpus, processes=MappingProxyType(procs))
    doc = status_document(NodeReport(snapshot))
    by_pid = processes_by_pid(doc)
    assert [(by_pid[pid]["holds_gpu"], by_pid[pid]["gpu_memory_bytes"])
            for pid in (10, 11, 12, 13)] == [(None, None), (True, None), (True, None), (False, 0)]
    assert [g["holders_unknown"] for g in doc["gpus"]] == [True, False]
    table = render_status(from_json(doc), width=0)
    assert "0:?" in table and "1:1.0 GiB 0:?" in table
