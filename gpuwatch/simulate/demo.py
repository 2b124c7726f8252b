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


def read_json(path: Path) -> Optional[dict[str, Any]]:
    """The JSON object in `path`, or None while it is not (completely) written yet."""
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
class SimulatedJob:
    launcher: subprocess.Popen[bytes]
    workers: list[int]
    helpers: dict[str, int]


@dataclass
class SimulatedNode:
    work_dir: Path
    node: FakeNode
    #: Job A trains on; the story kills its launcher, orphaning its workers.
    training: SimulatedJob
    #: Job B's trainer finishes early and leaves its helpers running: leftovers.
    finishing: SimulatedJob
    #: A training loop instrumented with gpuwatch.agent whose fetch cache never lets go.
    leaking: subprocess.Popen[bytes]
    daemon: subprocess.Popen[bytes]
    metrics_url: str

    @property
    def runtime_dir(self) -> Path:
        return self.work_dir / "run"


def _start_job(work_dir: Path, name: str, *args: str) -> SimulatedJob:
    ready = work_dir / f"{name}.json"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch.simulate.job", "--ready", str(ready), *args],
        start_new_session=True)
    try:
        info = wait_for(f"simulated job {name}", lambda: read_json(ready), 20, alive=launcher)
    except DemoError:
        _stop_job(launcher)
        raise
    return SimulatedJob(launcher, [int(p) for p in info["workers"]],
                        {role: int(pid) for role, pid in info.get("helpers", {}).items()})


def _stop_job(launcher: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()


@contextlib.contextmanager
def simulated_node(work_dir: Path, listen: str = f"127.0.0.1:{DEFAULT_PORT}", gpus: int = 2,
                   workers: int = 2, interval: float = 1.0, pace: float = 5.0,
                   daemon_output: Optional[Any] = None,
                   detectors: str = "") -> Iterator[SimulatedNode]:
    """Start the fake GPUs, two real jobs holding memory on them, and a daemon watching them.

    `pace` is the story's unit of time: job B's trainer finishes after 3 units, and its helpers
    become leftovers 2 units later (the daemon's leftover grace); the leaking trainer takes five
    steps a unit. `detectors` adds lines to the daemon's [detectors] section.
    """
    try:
        lib = build_fake_nvml()
    except FakeNvmlBuildError as exc:
        raise DemoError(str(exc)) from None
    node = FakeNode(work_dir / "nvml-state", lib, gpus=gpus)
    node.write()
    jobs: list[SimulatedJob] = []
    daemon: Optional[subprocess.Popen[bytes]] = None
    leaking: Optional[subprocess.Popen[bytes]] = None
    try:
        training = _start_job(work_dir, "job-a", "--workers", str(workers),
                              "--helpers", "dataloader")
        jobs.append(training)
        finishing = _start_job(work_dir, "job-b", "--workers", "1", "--helpers",
                               "redis,actor,preprocessor", "--trainer-exit-after",
                               str(3 * pace))
        jobs.append(finishing)
        for rank, pid in enumerate(training.workers):
            node.hold(pid, device=rank % gpus, used=(12 + 2 * rank) * GIB)
        node.hold(finishing.workers[0], device=gpus - 1, used=20 * GIB)
        config = work_dir / "gpuwatch.toml"
        config.write_text(f"[detectors]\nleftover_grace = {2 * pace}\n{detectors}\n")
        runtime = work_dir / "run"
        env = node.env()
        env.setdefault("PYTHONUNBUFFERED", "1")
        daemon = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch", "daemon", "--config", str(config),
             "--listen", free_listen(listen), "--interval", str(interval),
             "--runtime-dir", str(runtime), "--state-dir", str(work_dir / "state")],
            env=env, stdout=daemon_output, stderr=daemon_output)
        info = wait_for("the daemon", lambda: read_json(runtime / "daemon.json"), 30,
                        alive=daemon)
        # 2 MiB a step for 300 steps: visible, and bounded if the demo is left running.
        leaking = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch.simulate.trainer", "--pattern", "leak",
             "--leak-mib", "2", "--noise-mib", "1", "--steps", "300", "--linger", "86400",
             "--step-seconds", str(pace / 5)], env={**env, "GPUWATCH_RUNTIME_DIR": str(runtime)},
            start_new_session=True)
        node.hold(leaking.pid, device=0, used=6 * GIB)
        yield SimulatedNode(work_dir, node, training, finishing, leaking, daemon,
                            info["metrics_url"])
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.terminate()
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        for job in jobs:
            _stop_job(job.launcher)
        if leaking is not None:
            leaking.kill()
            leaking.wait()
        # Orphaned workers left the launcher's process group's reach only if it was killed
        # alone; they still carry its process group id.
        for job in jobs:
            for pid in (*job.workers, *job.helpers.values()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _reap(gpuwatch: str, sim: SimulatedNode) -> None:
    """The end of the story: what an SRE (or a Slurm epilog) would run on the node."""
    env = {**sim.node.env(), "GPUWATCH_RUNTIME_DIR": str(sim.runtime_dir),
           "GPUWATCH_STATE_DIR": str(sim.work_dir / "state")}
    for args in (["reap", "--dry-run"], ["reap", "--yes", "--kind", "orphan", "--grace", "2"]):
        print(f"\n$ gpuwatch {' '.join(args)}", flush=True)
        subprocess.run([*gpuwatch.split(), *args], env=env)


def run_demo(listen: str, workers: int, duration: Optional[float], pace: float = 5.0) -> int:
    work_dir = Path(tempfile.mkdtemp(prefix="gpuwatch-demo-"))
    try:
        with simulated_node(work_dir, listen=listen, workers=workers, pace=pace) as sim:
            beside = Path(sys.executable).with_name("gpuwatch")  # the venv's own script
            gpuwatch = str(beside) if beside.exists() else f"{sys.executable} -m gpuwatch"
            a, b = sim.training, sim.finishing
            print(f"""gpuwatch demo: no GPU needed. A simulated node: 2 GPUs behind a fake NVML
driver, two real jobs on them, watched by the real daemon (PID {sim.daemon.pid}).
  job A: launcher {a.launcher.pid}, workers {' '.join(map(str, a.workers))}, a dataloader helper
  job B: launcher {b.launcher.pid}, trainer {b.workers[0]}, helpers redis, actor, preprocessor
  job C: trainer {sim.leaking.pid}, instrumented with gpuwatch.agent; its fetch_buffer keeps
         every batch (2 MiB a step)

  metrics  {sim.metrics_url}
  status   GPUWATCH_RUNTIME_DIR={sim.runtime_dir} {gpuwatch} status
  JSON     GPUWATCH_RUNTIME_DIR={sim.runtime_dir} {gpuwatch} status --json

What happens:
  after {3 * pace:g} s  job B's trainer finishes; {2 * pace:g} s later its helpers are leftovers
  after {4 * pace:g} s  job A's launcher is killed (kill -9): its workers become orphans
  after ~{4 * pace:g} s  job C's leak is named, with the buffer and the step it runs out at
  after {6 * pace:g} s  `gpuwatch reap --dry-run`, then `gpuwatch reap --yes --kind orphan`
Ctrl+C stops the demo, its jobs and its daemon.""", flush=True)
            started = time.monotonic()
            killed = reaped = False
            deadline = None if duration is None else started + duration
            while deadline is None or time.monotonic() < deadline:
                if sim.daemon.poll() is not None:
                    print(f"gpuwatch demo: the daemon exited with code {sim.daemon.returncode}",
                          file=sys.stderr)
                    return 1
                if not killed and time.monotonic() - started >= 4 * pace:
                    killed = True
                    os.kill(a.launcher.pid, signal.SIGKILL)
                    print(f"gpuwatch demo: killed job A's launcher {a.launcher.pid}", flush=True)
                if not reaped and time.monotonic() - started >= 6 * pace:
                    reaped = True
                    _reap(gpuwatch, sim)
                time.sleep(0.1)
    except DemoError as exc:
        print(f"gpuwatch demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ngpuwatch demo: stopped")
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return 0
