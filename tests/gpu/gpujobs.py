"""Real GPUs for the `gpu` tests: what nvidia-smi and NVML say, PyTorch jobs on the GPUs, the
daemon watching them, and a cleanup that leaves the GPUs as it found them.

Nothing here imports torch or loads NVML into the test process: PyTorch runs only in the job's
processes, and NVML is read by nvidia-smi or by a short child (so a fake NVML library loaded by
another test of the same session can never answer for the real driver).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Optional

from gpuwatch.simulate.demo import DemoError, read_json, wait_for
from gpuwatch.simulate.fakenvml import STATE_ENV
from tests.daemonproc import DaemonReader, RunningDaemon, running_daemon
from tests.realprocs import gpuwatch
from tests.scenarios import clean_env, parent, wait_not_running

REPO = Path(__file__).resolve().parents[2]
PROGRAM = Path(__file__).resolve().parent / "programs" / "gpu_job.py"
MIB = 1 << 20
#: Several processes initialising CUDA at once, on a GPU whose driver is not kept loaded
#: (persistence mode off), can take a minute; a hang must still end the test.
START_TIMEOUT = 180.0
#: A CUDA process's exit, and the driver releasing its memory, take seconds, not minutes.
GONE_TIMEOUT = 60.0
#: Put into the environment of everything a test starts, so that cleanup finds every process
#: of the test, also one that left the process group it was started in.
MARKER_VARIABLE = "GPUWATCH_GPU_TEST"

INTERVAL = 0.25
DETECTORS = """
[detectors]
min_age = 0
zombie_grace = 0.5
ghost_grace = 0.5
leftover_grace = 1
"""


# ---- the environment ---------------------------------------------------------------------------


def _is_fake_nvml(directory: str) -> bool:
    """Whether `directory` holds the fake libnvidia-ml.so.1 (it reads its state file by name)."""
    try:
        return STATE_ENV.encode() in (Path(directory) / "libnvidia-ml.so.1").read_bytes()
    except OSError:
        return False


def real_env(base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """`base` (default: this process's environment) for the real driver: no fake NVML library
    on the library path, no launcher or batch variable inherited from whatever runs the tests,
    the repository importable (gpuwatch need not be installed), and CUDA numbering GPUs in
    NVML's order."""
    env = clean_env(base)
    env.pop(STATE_ENV, None)
    env.pop("NOTIFY_SOCKET", None)
    libs = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d and not _is_fake_nvml(d)]
    if libs:
        env["LD_LIBRARY_PATH"] = ":".join(libs)
    else:
        env.pop("LD_LIBRARY_PATH", None)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *paths])
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def tail(path: Path, chars: int = 8000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"(cannot read {path}: {exc})"


# ---- nvidia-smi --------------------------------------------------------------------------------


class SmiError(AssertionError):
    pass


def nvidia_smi(*args: str, timeout: float = 60) -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise SmiError("nvidia-smi is not on PATH")
    done = subprocess.run([smi, *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SmiError(f"`nvidia-smi {' '.join(args)}` exited with {done.returncode}: "
                       f"{(done.stdout + done.stderr).strip()}")
    return done.stdout


def _rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.split(",")] for line in text.splitlines()
            if line.strip()]


def _mib(cell: str) -> Optional[int]:
    """A MiB figure, or None for "[N/A]", "[Not Supported]" and the like."""
    return int(cell) if cell.isdigit() else None


def smi_apps() -> dict[int, Optional[int]]:
    """{PID: MiB} of every compute process nvidia-smi lists, summed over its GPUs (None where a
    figure is not available)."""
    held: dict[int, Optional[int]] = {}
    text = nvidia_smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    for row in _rows(text):
        if len(row) != 2 or not row[0].isdigit():
            continue  # "No running processes found" on some versions
        pid, mib = int(row[0]), _mib(row[1])
        before = held.get(pid, 0)
        held[pid] = None if mib is None or before is None else before + mib
    return held


@dataclass(frozen=True)
class SmiGpu:
    index: int
    uuid: str
    name: str
    driver_version: str
    total_mib: Optional[int]
    used_mib: Optional[int]


def smi_gpus() -> dict[str, SmiGpu]:
    """nvidia-smi's GPUs, by UUID."""
    text = nvidia_smi("--query-gpu=index,uuid,name,driver_version,memory.total,memory.used",
                      "--format=csv,noheader,nounits")
    gpus = {}
    for row in _rows(text):
        if len(row) != 6 or not row[0].isdigit():
            raise SmiError(f"unexpected nvidia-smi --query-gpu line: {row}")
        gpus[row[1]] = SmiGpu(int(row[0]), row[1], row[2], row[3], _mib(row[4]), _mib(row[5]))
    return gpus


def smi_report() -> str:
    """nvidia-smi's own view, for a failing test's report; never raises."""
    parts = []
    for args in ((), ("--query-compute-apps=pid,process_name,gpu_uuid,used_memory",
                      "--format=csv")):
        try:
            parts.append(nvidia_smi(*args, timeout=30))
        except (SmiError, OSError, subprocess.TimeoutExpired) as exc:
            parts.append(f"({exc})")
    return "\n".join(parts)


# ---- NVML, read by a child -----------------------------------------------------------------------

_NVML_PROCESSES = r"""
import json, pynvml
pynvml.nvmlInit()
try:
    held = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            used = p.usedGpuMemory
            before = held.get(p.pid, 0)
            held[p.pid] = None if used is None or before is None else before + used
finally:
    pynvml.nvmlShutdown()
print(json.dumps(held))
"""


class NvmlError(AssertionError):
    pass


def nvml_processes() -> dict[int, Optional[int]]:
    """{PID: bytes} of every compute process the driver's NVML lists (nvidia-ml-py, as gpuwatch
    reads it), summed over its GPUs; None where NVML has no figure."""
    done = subprocess.run([sys.executable, "-c", _NVML_PROCESSES], env=real_env(),
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise NvmlError(f"reading NVML through nvidia-ml-py failed: {last}")
    return {int(pid): used for pid, used in json.loads(done.stdout).items()}


def wait_nvml_lists(pids: Iterable[int], timeout: float = 30) -> dict[int, Optional[int]]:
    """NVML's processes, once it lists every one of `pids`."""
    wanted = set(pids)

    def probe() -> Optional[dict[int, Optional[int]]]:
        held = nvml_processes()
        return held if wanted <= held.keys() else None

    return wait_for(f"NVML to list {sorted(wanted)}", probe, timeout)


def wait_nvml_released(pids: Iterable[int], timeout: float = GONE_TIMEOUT) -> None:
    """Until NVML lists none of `pids`: their GPU memory is free again."""
    gone = set(pids)
    wait_for(f"NVML to list none of {sorted(gone)}",
             lambda: True if not gone & nvml_processes().keys() else None, timeout)


def wait_smi_released(pids: Iterable[int], timeout: float = GONE_TIMEOUT) -> None:
    gone = set(pids)
    wait_for(f"nvidia-smi --query-compute-apps to list none of {sorted(gone)}",
             lambda: True if not gone & smi_apps().keys() else None, timeout)


# ---- what a test starts, and its cleanup ---------------------------------------------------------


def _marked(marker: str) -> set[int]:
    """Every process whose environment carries `marker` (a zombie's reads empty)."""
    needle = f"{MARKER_VARIABLE}={marker}".encode()
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.add(int(entry.name))
        except OSError:
            continue
    return found


class Started:
    """Every process a test starts, killed at its end however it ends: process groups first,
    then each PID (also those found by the marker in their environment), then a wait until none
    runs and, where `check_nvml`, until NVML lists none of them, so that the next test starts on
    GPUs as empty as this one found them."""

    def __init__(self, check_nvml: bool = True) -> None:
        self.marker = uuid.uuid4().hex
        self.check_nvml = check_nvml
        self.procs: list[subprocess.Popen[Any]] = []
        self.pids: set[int] = set()
        self.groups: set[int] = set()
        #: (title, what to print) for a failing test's report
        self.diagnostics: list[tuple[str, Callable[[], str]]] = []

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        return {**base, MARKER_VARIABLE: self.marker}

    def popen(self, argv: Sequence[str], env: Mapping[str, str], **kwargs: Any
              ) -> subprocess.Popen[Any]:
        """A child in a session (and group) of its own unless `start_new_session=False`."""
        kwargs.setdefault("start_new_session", True)
        proc: subprocess.Popen[Any] = subprocess.Popen(list(argv), env=self.env(env), **kwargs)
        self.procs.append(proc)
        if kwargs["start_new_session"]:
            self.groups.add(proc.pid)
        return proc

    def add(self, *pids: int) -> None:
        self.pids.update(pids)

    def describe(self, title: str, text: Callable[[], str]) -> None:
        self.diagnostics.append((title, text))

    def cleanup(self) -> None:
        everything = self.pids | {p.pid for p in self.procs} | _marked(self.marker)
        for group in self.groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        for pid in everything | _marked(self.marker):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        stuck = []
        for proc in self.procs:
            try:
                proc.wait(GONE_TIMEOUT)
            except subprocess.TimeoutExpired:
                stuck.append(proc.pid)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        if stuck:
            raise AssertionError(f"SIGKILLed children {stuck} did not exit in {GONE_TIMEOUT:g} s "
                                 f"(stuck in the driver?)\n{smi_report()}")
        wait_not_running(everything, GONE_TIMEOUT, "every process the test started to end")
        if self.check_nvml:
            try:
                wait_nvml_released(everything)
            except DemoError as exc:
                raise AssertionError(f"{exc}: their GPU memory is still held\n"
                                     f"{smi_report()}") from exc


class LineReader:
    """The lines a child prints, read by a thread: a test waits for the next one with a
    deadline, and a child that dies instead is reported at once."""

    def __init__(self, stream: IO[str], proc: subprocess.Popen[Any]) -> None:
        self._lines: queue.Queue[Optional[str]] = queue.Queue()
        self._proc = proc
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True,
                         name=f"lines-{proc.pid}").start()

    def _read(self, stream: IO[str]) -> None:
        with contextlib.suppress(ValueError, OSError):  # closed by the cleanup
            for line in stream:
                self._lines.put(line)
        self._lines.put(None)

    def next_json(self, what: str, timeout: float) -> dict[str, Any]:
        """The next line that is a JSON object (libraries may print other lines)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{what}: nothing after {timeout:g} s; printed so far: "
                                     f"{self.seen}") from None
            if line is None:
                code = self._proc.wait(GONE_TIMEOUT)
                raise AssertionError(f"{what}: the process exited with {code}; printed: "
                                     f"{self.seen}")
            self.seen.append(line.rstrip("\n"))
            if line.startswith("{"):
                value = json.loads(line)
                if isinstance(value, dict):
                    return value


# ---- a PyTorch job -----------------------------------------------------------------------------


@dataclass
class GpuJob:
    launcher: subprocess.Popen[bytes]
    run_id: str
    workers: list[int]
    #: each worker's own report: rank, device, mib, allocated and reserved bytes, by PID
    reports: dict[int, dict[str, Any]]
    log: Path

    @property
    def group(self) -> int:
        """The launcher's process group, which its workers share: what a Ctrl+C reaches."""
        return self.launcher.pid


def start_job(started: Started, tmp_path: Path, mib: Sequence[int],
              stubborn_rank: Optional[int] = None, sigint_grace: float = 8.0,
              cpu: bool = False) -> GpuJob:
    """tests/gpu/programs/gpu_job.py's launcher with one worker per entry of `mib`, as a group
    leader; returns once every worker holds its memory."""
    name = f"job-{uuid.uuid4().hex[:8]}"
    ready, log = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
    argv = [sys.executable, str(PROGRAM), "launch", "--mib", ",".join(map(str, mib)),
            "--ready", str(ready), "--sigint-grace", repr(sigint_grace)]
    if stubborn_rank is not None:
        argv += ["--stubborn-rank", str(stubborn_rank)]
    if cpu:
        argv.append("--cpu")
    with open(log, "wb") as out:
        launcher = started.popen(argv, real_env(), stdout=out, stderr=subprocess.STDOUT)
    started.describe(f"{name}: the launcher's and workers' output", lambda: tail(log))
    try:
        info = wait_for("the job's workers to hold their memory", lambda: read_json(ready),
                        START_TIMEOUT, alive=launcher)
    except DemoError as exc:
        raise AssertionError(f"{exc}\n{tail(log)}") from exc
    workers = [int(p) for p in info["workers"]]
    started.add(*workers)
    return GpuJob(launcher, str(info["run_id"]), workers,
                  {int(r["pid"]): r for r in info["reports"]}, log)


def sigkill_launcher(job: GpuJob) -> None:
    """SIGKILL the launcher alone, as the OOM killer or `kill -9` does; returns once it is reaped
    and its workers have been reparented."""
    os.kill(job.launcher.pid, signal.SIGKILL)
    job.launcher.wait(GONE_TIMEOUT)
    wait_for("the workers to be reparented",
             lambda: True if all(parent(p) != job.launcher.pid for p in job.workers) else None,
             GONE_TIMEOUT)


def ctrl_c(job: GpuJob) -> None:
    """SIGINT to the job's process group, as a terminal sends it on Ctrl+C."""
    os.killpg(job.group, signal.SIGINT)


# ---- the daemon ----------------------------------------------------------------------------------


@dataclass
class Watched(DaemonReader):
    """A real daemon on the real driver, and the environment the CLI talks to it with."""

    env: dict[str, str]
    daemon: RunningDaemon

    def doc_text(self) -> str:
        result = gpuwatch(["status", "--json"], self.env)
        return f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"


def processes_of(doc: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {p["pid"]: p for p in doc["processes"]}


@contextlib.contextmanager
def watching(started: Started, tmp_path: Path) -> Iterator[Watched]:
    """`gpuwatch daemon` on this node's GPUs, polling every INTERVAL with short graces, its
    sockets, state and configuration in directories of its own."""
    # Under /tmp, not tmp_path: a Unix socket's path must stay under 108 bytes.
    runtime = Path(tempfile.mkdtemp(prefix="gpuwatch-gpu-", dir="/tmp"))
    env = real_env()
    env.update({"GPUWATCH_RUNTIME_DIR": str(runtime),
                "GPUWATCH_STATE_DIR": str(tmp_path / "state"),
                "GPUWATCH_CONFIG": "/dev/null"})
    try:
        with running_daemon(env, tmp_path, config=DETECTORS,
                            args=("--interval", str(INTERVAL))) as daemon:
            watched = Watched(env, daemon)
            started.describe("the daemon's status document (`gpuwatch status --json`)",
                             watched.doc_text)
            started.describe("the daemon's log", lambda: tail(daemon.log_path))
            yield watched
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
