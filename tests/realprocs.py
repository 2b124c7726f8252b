"""Real processes for tests: simulated jobs, short-lived children, and the CLI as a user runs it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gpuwatch.simulate.demo import read_json, wait_for

GIB = 1 << 30
MIB = 1 << 20

#: Python source that defines `empty_command_line()`: it makes the process that calls it read in
#: /proc as one in the middle of an exec, or one exiting, does. Between the kernel dropping the old
#: image and placing the new one's arguments and environment (or once an exiting process's memory
#: is gone), its command line and environment read empty; prctl(PR_SET_MM_MAP) moves their ends
#: to their starts (no privilege needed for one's own process). It returns 0, or the errno prctl
#: failed with (where it is refused, as some sandboxes do). Compose it with what the process does
#: before and after: `EMPTY_COMMAND_LINE + "errno = empty_command_line()\n..."`.
EMPTY_COMMAND_LINE = r"""
import ctypes, os
def empty_command_line():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sbrk.restype = ctypes.c_void_p
    libc.sbrk.argtypes = [ctypes.c_long]
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    class Map(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint64) for n in (
            "start_code", "end_code", "start_data", "end_data", "start_brk", "brk",
            "start_stack", "arg_start", "arg_end", "env_start", "env_end", "auxv")] + [
            ("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]
    with open("/proc/self/stat") as f:
        stat = f.read().rsplit(")", 1)[1].split()
    field = lambda n: int(stat[n - 3])
    m = Map(start_code=field(26), end_code=field(27), start_stack=field(28),
            start_data=field(45), end_data=field(46), start_brk=field(47), brk=libc.sbrk(0),
            arg_start=field(48), arg_end=field(48), env_start=field(50), env_end=field(50),
            exe_fd=0xFFFFFFFF)
    PR_SET_MM, PR_SET_MM_MAP = 35, 14
    if libc.prctl(PR_SET_MM, PR_SET_MM_MAP, ctypes.addressof(m), ctypes.sizeof(m), 0) != 0:
        return ctypes.get_errno()
    return 0
"""


@dataclass
class RunningJob:
    launcher: subprocess.Popen[bytes]
    workers: list[int]
    run_id: str

    @property
    def launcher_pid(self) -> int:
        return self.launcher.pid


@contextlib.contextmanager
def running_job(tmp_path: Path, workers: int = 2,
                env: Optional[Mapping[str, str]] = None) -> Iterator[RunningJob]:
    """A launcher and its workers (gpuwatch.simulate.job), killed as a group afterwards."""
    ready = tmp_path / f"job-{len(list(tmp_path.glob('job-*.json')))}.json"
    full_env = {**os.environ, **(env or {})}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch.simulate.job", "--workers", str(workers),
         "--ready", str(ready)], env=full_env, start_new_session=True)
    try:
        info = wait_for("job start", lambda: read_json(ready), 20, alive=launcher)
        yield RunningJob(launcher, [int(p) for p in info["workers"]], info["run_id"])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


@contextlib.contextmanager
def killed_after(argv: list[str], env: Mapping[str, str], **popen: Any
                 ) -> Iterator[subprocess.Popen[bytes]]:
    """`argv` running for the length of the block, then killed and collected however it ends."""
    proc = subprocess.Popen(argv, env=env, **popen)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def progress_step(progress: Path) -> Optional[int]:
    """The step a training program last wrote to its progress file; None before the first."""
    try:
        return int(progress.read_text())
    except (OSError, ValueError):
        return None


def terminate(proc: subprocess.Popen[Any], timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout`; waits either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def gpuwatch(args: list[str], env: Mapping[str, str], timeout: float = 60
             ) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would, in its own process (so LD_LIBRARY_PATH takes effect)."""
    return subprocess.run([sys.executable, "-m", "gpuwatch", *args], env=dict(env),
                          capture_output=True, text=True, timeout=timeout)


def status_json(env: Mapping[str, str]) -> tuple[int, dict[str, Any]]:
    """`gpuwatch status --json`'s exit code and document; the document reads back into the
    model's types and renders again byte for byte (gpuwatch.sinks.document.from_json)."""
    from gpuwatch.sinks.document import from_json, status_document

    result = gpuwatch(["status", "--json"], env)
    assert result.stdout, result.stderr
    doc = json.loads(result.stdout)
    assert json.dumps(status_document(from_json(doc))) == json.dumps(doc)
    return result.returncode, doc


def processes_by_pid(doc: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {p["pid"]: p for p in doc["processes"]}


def real_nvml_present() -> bool:
    """Whether this machine has NVIDIA's own libnvidia-ml.so.1, which a test of "no library"
    cannot hide."""
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def proc_without_children_files(root: Path, proc: str = "/proc") -> Path:
    """`root` made a /proc as a kernel built without CONFIG_PROC_CHILDREN shows it: a directory
    per process listed now, with links to that process's real files (stat, status, cmdline,
    environ, cgroup, ...) and a task directory holding no children file. The node-wide files a
    reader needs (stat for the boot time, loadavg, meminfo) are linked too."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("stat", "loadavg", "meminfo", "uptime"):
        os.symlink(f"{proc}/{name}", root / name)
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        pid = entry.name
        (root / pid / "task" / pid).mkdir(parents=True)
        for name in ("stat", "status", "cmdline", "environ", "cgroup", "comm", "wchan", "stack",
                     "statm", "fd", "ns"):
            os.symlink(f"{proc}/{pid}/{name}", root / pid / name)
            os.symlink(f"{proc}/{pid}/task/{pid}/{name}", root / pid / "task" / pid / name)
    return root


#: Every signal a thread can block (SIGKILL and SIGSTOP cannot be), among the standard ones.
BLOCKABLE_SIGNALS = set(range(1, 32)) - {signal.SIGKILL, signal.SIGSTOP}


def threads_of(pid: int) -> list[int]:
    """The thread IDs of `pid` (none once it has gone)."""
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return []


def blocked_signals(pid: int, tid: int) -> set[int]:
    """The signals thread `tid` of `pid` blocks (SigBlk in its status)."""
    with open(f"/proc/{pid}/task/{tid}/status") as f:
        mask = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
    return {s for s in range(1, 65) if mask >> (s - 1) & 1}
