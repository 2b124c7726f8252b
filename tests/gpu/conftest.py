"""The `gpu` suite: real NVIDIA GPUs, the driver's own NVML, real PyTorch processes, the real
daemon and CLI.

Every test here depends on `gpu_node`, which looks once per session and skips the whole suite,
with one reason, where any of it is missing: the NVIDIA driver (nvidia-smi), a GPU, nvidia-ml-py
that initialises NVML, PyTorch with CUDA, or an NVML that lists this machine's CUDA processes
under the PIDs its /proc shows. It looks in that order and stops at the first thing missing, so
on a machine without a driver nothing is started and torch is never imported.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Union

import pytest

from gpuwatch.simulate.demo import DemoError
from tests.gpu.gpujobs import (
    START_TIMEOUT,
    LineReader,
    NvmlError,
    SmiError,
    SmiGpu,
    Started,
    nvml_processes,
    real_env,
    smi_gpus,
    smi_report,
    wait_nvml_lists,
)

# Allocates a little CUDA memory, says so, and holds it until its stdin closes.
_TORCH_PROBE = r"""
import json, os, sys
try:
    import torch
except ImportError as exc:
    print(json.dumps({"error": f"PyTorch is not installed for {sys.executable} ({exc})"}))
    sys.exit(0)
if not torch.cuda.is_available():
    print(json.dumps({"error": f"PyTorch {torch.__version__} sees no CUDA device "
                               f"(built for CUDA {torch.version.cuda})"}))
    sys.exit(0)
held = torch.ones(1 << 20, device="cuda")
torch.cuda.synchronize()
print(json.dumps({"pid": os.getpid(), "devices": torch.cuda.device_count(),
                  "torch": torch.__version__, "cuda": torch.version.cuda}), flush=True)
sys.stdin.read()
"""


@dataclass(frozen=True)
class GpuNode:
    gpus: dict[str, SmiGpu]
    driver_version: str
    cuda_devices: int
    torch_version: str
    cuda_version: str


def _look() -> Union[GpuNode, str]:
    """The node, or why the suite cannot run here."""
    if shutil.which("nvidia-smi") is None:
        return "no NVIDIA driver here: nvidia-smi is not on PATH"
    try:
        gpus = smi_gpus()
    except (SmiError, OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi finds no usable GPU: {exc}"
    if not gpus:
        return "nvidia-smi lists no GPU"
    try:
        nvml_processes()
    except (NvmlError, OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-ml-py cannot read NVML for {sys.executable}: {exc}"
    started = Started()
    try:
        proc = started.popen([sys.executable, "-c", _TORCH_PROBE], real_env(),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        try:
            said = LineReader(proc.stdout, proc).next_json("PyTorch's CUDA probe",
                                                           START_TIMEOUT)
        except AssertionError as exc:
            return f"a PyTorch process could not use CUDA: {exc}"
        if "error" in said:
            return str(said["error"])
        pid = int(said["pid"])
        try:
            wait_nvml_lists([pid], timeout=30)
        except DemoError:
            listed = sorted(nvml_processes())
            return (f"NVML does not list a CUDA process started here under its PID ({pid}; "
                    f"it lists {listed}): the driver and this /proc are in different PID "
                    "namespaces, where gpuwatch cannot tell which process holds what")
        return GpuNode(gpus=gpus, driver_version=next(iter(gpus.values())).driver_version,
                       cuda_devices=int(said["devices"]), torch_version=str(said["torch"]),
                       cuda_version=str(said["cuda"]))
    finally:
        started.cleanup()


@pytest.fixture(scope="session")
def gpu_node() -> GpuNode:
    found = _look()
    if isinstance(found, str):
        pytest.skip(found)
    return found


@pytest.fixture(autouse=True)
def _needs_a_gpu(gpu_node: GpuNode) -> None:
    del gpu_node  # requested for its skip


@pytest.fixture
def started() -> Iterator[Started]:
    """What the test starts; all of it killed, and its GPU memory released, at the end."""
    s = Started()
    yield s
    s.cleanup()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[Any]:
    """A failing test's report also shows nvidia-smi's view and what the test's fixtures
    registered (the daemon's status document and log, the job's output)."""
    del call
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    report.sections.append(("nvidia-smi", smi_report()))
    started = getattr(item, "funcargs", {}).get("started")
    if isinstance(started, Started):
        for title, text in started.diagnostics:
            try:
                body = text()
            except Exception as exc:
                body = f"({type(exc).__name__}: {exc})"
            report.sections.append((title, body))
