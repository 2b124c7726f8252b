"""A simulated node for benchmarks: N fake GPUs and real processes holding memory on them."""

from __future__ import annotations

import compileall
import contextlib
import os
import resource
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cmdline import int_list, parse_args, write_figures
from harness import running

from gpuwatch.simulate.fakenvml import FakeNode, FakeProcess, build_fake_nvml
from gpuwatch.sources.proc_stat import STIME, UTIME, parse_stat

# The command line's helpers, where the benches first found them.
__all__ = ["FakeNode", "FakeProcess", "int_list", "parse_args", "write_figures"]

ROOT = Path(__file__).resolve().parent.parent


def _bytecode_as_installed() -> None:
    """gpuwatch's modules compiled ahead, as pip compiles an installed package's, and Python
    free to keep what it compiles: a user's gpuwatch runs from cached bytecode after its first
    run, and the peers it is timed against (installed by pip) have theirs. A shell that forbids
    writing bytecode (PYTHONDONTWRITEBYTECODE) would otherwise time gpuwatch's compilation of
    its own source, about 30 ms of every command-line run, against peers that compile nothing."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    # Quietly: a read-only checkout runs as before, compiling its source each time.
    compileall.compile_dir(str(ROOT / "gpuwatch"), quiet=2)


_bytecode_as_installed()

GIB = 1 << 30
MIB = 1 << 20
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class BenchNode:
    node: FakeNode
    holders: list[int]
    tmp: Path


def _spawn_tree(n: int, new_session: bool, command: Optional[list[str]] = None,
                count: int = 0) -> tuple[int, list[int]]:
    """A shell that starts `n` idle children (or `count` of `command`) and waits: a launcher
    with its own process tree; its PID and its children's.

    A shell that exits at once starts it, so it hangs from init (or the nearest subreaper), as a
    node's launchers do, not from the benchmark and whatever ran that: their command lines are
    not the node's (here a sandbox's tool, whose 1,365-byte command line cost a cold poll 0.3 ms
    to redact), and a daemon that has run a while has long read them.
    """
    child = shlex.join(command) if command is not None else "sleep 3600"
    n = count if command is not None else n
    launcher = (f"echo launcher $$; i=0; while [ $i -lt {n} ]; do {child} & echo $!; "
                "i=$((i+1)); done; echo started; wait")
    # The launcher leads its own process group, as a shell's job does (torchrun started from a
    # terminal): its ranks' group leader is their launcher, not whatever ran the benchmark.
    starter = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; subprocess.Popen(sys.argv[1:], "
                               "process_group=0)", "sh", "-c", launcher],
        stdout=subprocess.PIPE, start_new_session=new_session)
    assert starter.stdout is not None
    with starter.stdout:
        first = starter.stdout.readline().split()
        if first[:1] != [b"launcher"]:
            raise RuntimeError(f"the launcher shell did not start: {first!r}")
        pids = []
        for line in starter.stdout:
            if line == b"started\n":
                starter.wait()
                return int(first[1]), pids
            pids.append(int(line))
    raise RuntimeError("the launcher shell ended early")


def _stop_tree(launcher: int, pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    # The launcher's `wait` reaps the children as they die, then it exits. Killed first, it
    # would hand thousands of zombies to PID 1, which in some containers reaps them late.
    deadline = time.monotonic() + 60
    while running(launcher):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(launcher, 9)
            break
        time.sleep(0.02)


@contextlib.contextmanager
def bench_node(gpus: int = 8, gpu_procs: int = 64) -> Iterator[BenchNode]:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        node = FakeNode(tmp / "state", build_fake_nvml(tmp / "lib"), gpus=gpus)
        check_room_for(gpu_procs)
        launcher, holders = _spawn_tree(gpu_procs, new_session=False)
        try:
            for i, pid in enumerate(holders):
                node.processes.append(
                    FakeProcess(device=i % gpus, pid=pid, used=GIB + i * MIB))
            node.write()
            yield BenchNode(node, holders, tmp)
        finally:
            _stop_tree(launcher, holders)


@contextlib.contextmanager
def dataloader_node(gpus: int = 8, ranks: int = 8, workers: int = 16) -> Iterator[BenchNode]:
    """A training job as PyTorch runs one: a launcher, `ranks` ranks holding GPU memory, and
    under each rank `workers` dataloader workers holding none. A rank starts its workers again
    whenever all of them have exited, as a DataLoader does every epoch (kill them to churn)."""
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        node = FakeNode(tmp / "state", build_fake_nvml(tmp / "lib"), gpus=gpus)
        check_room_for(ranks * (workers + 1) * 2)
        rank = (f"while :; do j=0; while [ $j -lt {workers} ]; do sleep 3600 & j=$((j+1)); "
                "done; wait; done")
        launcher, holders = _spawn_tree(0, new_session=False, command=["sh", "-c", rank],
                                        count=ranks)
        try:
            for i, pid in enumerate(holders):
                node.processes.append(FakeProcess(device=i % gpus, pid=pid, used=GIB + i * MIB))
            node.write()
            deadline = time.monotonic() + 60
            while sum(len(children(pid)) for pid in holders) < ranks * workers:
                if time.monotonic() > deadline:
                    raise RuntimeError("the dataloader workers did not start")
                time.sleep(0.05)
            yield BenchNode(node, holders, tmp)
        finally:
            workers_now = [w for pid in holders for w in children(pid)]
            for pid in holders:  # the ranks first, so that none starts its workers again
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            _stop_tree(launcher, workers_now)


@contextlib.contextmanager
def churning_node(gpus: int = 8, gpu_procs: int = 64) -> Iterator[tuple[BenchNode, int]]:
    """A job whose one rank holds `gpu_procs` GPU processes (its children) and runs
    short-lived programs in a loop (about 150 new processes a second): the node and the rank,
    which SIGSTOP pauses and SIGCONT resumes."""
    with tempfile.TemporaryDirectory(prefix="gpuwatch-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        node = FakeNode(tmp / "fake-nvml.state", build_fake_nvml(tmp / "lib"), gpus=gpus)
        check_room_for(gpu_procs + 8)
        rank = (f"i=0; while [ $i -lt {gpu_procs} ]; do sleep 3600 & i=$((i+1)); done; "
                "while :; do /bin/true; /bin/sleep 0.01; done")
        launcher, (churner,) = _spawn_tree(0, new_session=False, command=["sh", "-c", rank],
                                           count=1)
        holders: list[int] = []
        try:
            deadline = time.monotonic() + 60
            while len(holders) < gpu_procs:
                if time.monotonic() > deadline:
                    raise RuntimeError("the rank did not start its GPU processes")
                holders = [pid for pid in children(churner) if _is_long_sleep(pid)]
                time.sleep(0.05)
            for i, pid in enumerate(holders):
                node.processes.append(FakeProcess(device=i % gpus, pid=pid, used=GIB + i * MIB))
            node.write()
            yield BenchNode(node, holders, tmp), churner
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(churner, 18)  # SIGCONT: a stopped rank would not die of SIGKILL late
            _stop_tree(launcher, [churner, *holders])


def _is_long_sleep(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read() == b"sleep\x003600\x00"
    except OSError:
        return False


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def idle_processes(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen(["sleep", "3600"]) for _ in range(n)]


def check_room_for(n: int) -> None:
    """Fail early, with the reason, when `n` more processes would not fit under the PID or
    per-user process limits (a fork failing half-way through leaves a mess to clean up)."""
    running = sum(1 for e in os.scandir("/proc") if e.name.isdigit())
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and running + n + 256 > soft:
        wanted = hard if hard == resource.RLIM_INFINITY else min(hard, running + n + 256)
        resource.setrlimit(resource.RLIMIT_NPROC, (wanted, hard))
        soft = wanted
    room = min(pid_max, soft if soft != resource.RLIM_INFINITY else pid_max) - running - 256
    if n > room:
        raise RuntimeError(f"{n} more processes do not fit: {running} running, pid_max "
                           f"{pid_max}, RLIMIT_NPROC {soft}")


@contextlib.contextmanager
def unrelated_host_processes(n: int, settle_for: float = 60.0) -> Iterator[None]:
    """`n` idle processes in another process tree than the GPU holders', as on a real host
    (waiting up to `settle_for` seconds for the machine to calm down after their start)."""
    check_room_for(n)
    launcher, pids = _spawn_tree(n, new_session=True)
    try:
        settle(settle_for)
        yield
    finally:
        _stop_tree(launcher, pids)


def settle(timeout: float = 60.0) -> None:
    """Wait until no more tasks are runnable than there are CPUs, for a second: thousands of
    children just forked are still exec'ing `sleep`, and a poll measured among them measures
    the machine's run queue, not gpuwatch."""
    cpus = os.cpu_count() or 1
    deadline = time.monotonic() + timeout
    calm = 0
    while calm < 5 and time.monotonic() < deadline:
        with open("/proc/loadavg") as f:
            runnable = int(f.read().split()[3].split("/")[0])
        calm = calm + 1 if runnable <= cpus + 1 else 0  # this process is one of them
        time.sleep(0.2)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = parse_stat(f.read())[1]
    return (int(fields[UTIME]) + int(fields[STIME])) / CLOCK_TICKS


def cpu_seconds_exact(pid: int) -> float:
    """CPU time of a process's live threads so far, in nanoseconds' precision
    (/proc/PID/task/*/schedstat), where cpu_seconds counts clock ticks (10 ms)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE_SIZE


def scrape(url: str, gzipped: bool = False) -> tuple[float, bytes]:
    """(seconds, body as sent: compressed where `gzipped` asked for it and it was)."""
    headers = {"Accept-Encoding": "gzip"} if gzipped else {}
    started = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
        body = r.read()
    return time.perf_counter() - started, body


def raw_get(port: int, path: str = "/metrics") -> tuple[float, bytes]:
    """GET over a bare socket on 127.0.0.1: (seconds to the last byte, the whole response)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        started = time.perf_counter()
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        parts = []
        while chunk := s.recv(1 << 20):
            parts.append(chunk)
        return time.perf_counter() - started, b"".join(parts)


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            scrape(url)
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer in {timeout} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def polls_total(url: str, tries: int = 3) -> float:
    """The daemon's own count of polls, from its /metrics. A scrape that times out is tried
    again: this only steers a bench, and a shared machine can stall a process for seconds."""
    for attempt in range(tries):
        try:
            body = scrape(url)[1]
            break
        except OSError as exc:  # a timeout, raised bare or inside a URLError
            if attempt == tries - 1:
                raise
            print(f"note: a scrape of {url} failed ({exc}); trying again", flush=True)
    for line in body.decode().splitlines():
        if line.startswith("gpuwatch_polls_total "):
            return float(line.split()[1])
    return 0.0


def cli_env(b: BenchNode) -> dict[str, str]:
    """The fake node's environment for gpuwatch's own commands: no config file, no system
    runtime or state directory, so no real daemon is ever asked."""
    env = b.node.env()
    env.update(GPUWATCH_CONFIG="/dev/null", GPUWATCH_RUNTIME_DIR=str(b.tmp / "run"),
               GPUWATCH_STATE_DIR=str(b.tmp / "gpuwatch-state"))
    env.pop("NOTIFY_SOCKET", None)
    return env


def start_daemon(b: BenchNode, port: int, interval: float) -> subprocess.Popen[bytes]:
    """`gpuwatch daemon` on the fake node, /metrics on 127.0.0.1:`port`."""
    return subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "daemon", "--listen", f"127.0.0.1:{port}",
         "--interval", str(interval), "--log-level", "warning"], env=cli_env(b))


def console_script(name: str) -> str:
    """A peer tool from this virtualenv (the same nvidia-ml-py as gpuwatch), else from PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    return shutil.which(name) or name
