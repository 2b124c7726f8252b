"""A simulated node for benchmarks: N fake GPUs and real processes holding memory on them."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuwatch.simulate.fakenvml import FakeNode, FakeProcess, build_fake_nvml

__all__ = ["FakeNode", "FakeProcess"]

GIB = 1 << 30
MIB = 1 << 20
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class BenchNode:
    node: FakeNode
    holders: list[subprocess.Popen[bytes]]
    tmp: Path


def idle_processes(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen(["sleep", "3600"]) for _ in range(n)]


@contextlib.contextmanager
def bench_node(gpus: int = 8, gpu_procs: int = 64) -> Iterator[BenchNode]:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        node = FakeNode(tmp / "state", build_fake_nvml(tmp / "lib"), gpus=gpus)
        holders = idle_processes(gpu_procs)
        try:
            for i, p in enumerate(holders):
                node.processes.append(
                    FakeProcess(device=i % gpus, pid=p.pid, used=GIB + i * MIB))
            node.write()
            yield BenchNode(node, holders, tmp)
        finally:
            stop(holders)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE_SIZE


def scrape(url: str) -> tuple[float, bytes]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as r:
        body = r.read()
    return time.perf_counter() - started, body


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


def polls_total(url: str) -> float:
    """The daemon's own count of polls, from its /metrics."""
    for line in scrape(url)[1].decode().splitlines():
        if line.startswith("gpuwatch_polls_total "):
            return float(line.split()[1])
    return 0.0
