"""`gpuwatch demo`: the daemon on a simulated node, for trying gpuwatch without a GPU.

The GPUs are simulated by the fake NVML driver (built here with the system C compiler); the job is
real: a launcher and its worker processes, registered with the fake driver as holding GPU memory.
The daemon is the real one, in its own process, loading the fake driver through LD_LIBRARY_PATH
exactly as it would load NVIDIA's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from gpuwatch.config import DEFAULT_PORT, split_listen
from gpuwatch.simulate.fakenvml import FakeNode, FakeNvmlBuildError, build_fake_nvml

T = TypeVar("T")
GIB = 1 << 30


class DemoError(RuntimeError):
    pass


def wait_for(what: str, probe: Callable[[], Optional[T]], timeout: float,
             alive: Optional[subprocess.Popen[bytes]] = None) -> T:
    """Poll `probe` until it returns something, failing clearly at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value is not None:
            return value
        if alive is not None and alive.poll() is not None:
            raise DemoError(f"{what}: the process exited with code {alive.returncode}")
        time.sleep(0.05)
    raise DemoError(f"{what}: not ready after {timeout:g} s")


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def free_listen(listen: str) -> str:
    """`listen` if its port is free, else the same host on a port the kernel picks."""
    host, port = split_listen(listen)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host or "0.0.0.0", port))
        except OSError:
            s.bind((host or "0.0.0.0", 0))
            return f"{host}:{s.getsockname()[1]}"
    return listen


@dataclass
class SimulatedNode:
    work_dir: Path
    node: FakeNode
    launcher: subprocess.Popen[bytes]
    workers: list[int]
    daemon: subprocess.Popen[bytes]
    metrics_url: str

    @property
    def runtime_dir(self) -> Path:
        return self.work_dir / "run"


@contextlib.contextmanager
def simulated_node(work_dir: Path, listen: str = f"127.0.0.1:{DEFAULT_PORT}", gpus: int = 2,
                   workers: int = 2, interval: float = 1.0,
                   daemon_output: Optional[Any] = None) -> Iterator[SimulatedNode]:
    """Start the fake GPUs, a real job holding memory on them, and a daemon watching them."""
    try:
        lib = build_fake_nvml()
    except FakeNvmlBuildError as exc:
        raise DemoError(str(exc)) from None
    node = FakeNode(work_dir / "nvml-state", lib, gpus=gpus)
    node.write()
    ready = work_dir / "job.json"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch.simulate.job", "--workers", str(workers),
         "--ready", str(ready)], start_new_session=True)
    daemon: Optional[subprocess.Popen[bytes]] = None
    try:
        job = wait_for("the simulated job", lambda: _read_json(ready), 20, alive=launcher)
        worker_pids = [int(pid) for pid in job["workers"]]
        for rank, pid in enumerate(worker_pids):
            node.hold(pid, device=rank % gpus, used=(12 + 2 * rank) * GIB)
        config = work_dir / "gpuwatch.toml"
        config.write_text("# the demo's own settings come from flags\n")
        runtime = work_dir / "run"
        env = node.env()
        env.setdefault("PYTHONUNBUFFERED", "1")
        daemon = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch", "daemon", "--config", str(config),
             "--listen", free_listen(listen), "--interval", str(interval),
             "--runtime-dir", str(runtime), "--state-dir", str(work_dir / "state")],
            env=env, stdout=daemon_output, stderr=daemon_output)
        info = wait_for("the daemon", lambda: _read_json(runtime / "daemon.json"), 30,
                        alive=daemon)
        yield SimulatedNode(work_dir, node, launcher, worker_pids, daemon, info["metrics_url"])
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.terminate()
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def run_demo(listen: str, workers: int, duration: Optional[float]) -> int:
    work_dir = Path(tempfile.mkdtemp(prefix="gpuwatch-demo-"))
    try:
        with simulated_node(work_dir, listen=listen, workers=workers) as sim:
            beside = Path(sys.executable).with_name("gpuwatch")  # the venv's own script
            gpuwatch = str(beside) if beside.exists() else f"{sys.executable} -m gpuwatch"
            pids = " ".join(map(str, sim.workers))
            print(f"""gpuwatch demo: no GPU needed. A simulated node: 2 GPUs behind a fake NVML
driver, and a real job on them (launcher {sim.launcher.pid}, workers {pids}),
watched by the real daemon (PID {sim.daemon.pid}).

  metrics  {sim.metrics_url}
  status   GPUWATCH_RUNTIME_DIR={sim.runtime_dir} {gpuwatch} status
  JSON     GPUWATCH_RUNTIME_DIR={sim.runtime_dir} {gpuwatch} status --json

Try: kill -9 {sim.launcher.pid}   (the launcher) and watch the workers in `status`.
Ctrl+C stops the demo, its job and its daemon.""", flush=True)
            deadline = None if duration is None else time.monotonic() + duration
            while deadline is None or time.monotonic() < deadline:
                if sim.daemon.poll() is not None:
                    print(f"gpuwatch demo: the daemon exited with code {sim.daemon.returncode}",
                          file=sys.stderr)
                    return 1
                time.sleep(0.2)
    except DemoError as exc:
        print(f"gpuwatch demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ngpuwatch demo: stopped")
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return 0
