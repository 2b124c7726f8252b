"""A Python process that never imports torch is tested for leaks too: a pure-Python pipeline
run under `gpuwatch run` (no line of gpuwatch in it) forks a worker (a multiprocessing child)
that keeps what it loads in a module-level list. Once the worker has lived a few seconds, its
agent (loaded by the bootstrap's timer) reports on a timer (`tick` reports) and the daemon names
the list its discovery found; the same worker returning what it loads stays quiet."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Optional

from gpuwatch.agent.bootstrap.sitecustomize import TICK_AFTER
from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from tests.daemonproc import leak_now, running_daemon
from tests.realprocs import GIB
from tests.test_run import supervised

WAIT = 90.0
INTERVAL = 0.2

#: argv: PIDFILE KEEP. Forks one worker (multiprocessing, fork) that loads 1 MiB an item, five
#: items a second, and with KEEP "keep" keeps each in WORKER_CACHE; the parent waits for it.
#: Writes "<parent PID> <worker PID>" to PIDFILE once the worker runs. No torch anywhere.
PIPELINE = """\
import multiprocessing, os, sys, time
pidfile, keep = sys.argv[1], sys.argv[2] == "keep"
WORKER_CACHE = []

def work(ready):
    ready.set()
    while True:
        item = bytearray(1 << 20)
        item[::4096] = b"x" * 256
        if keep:
            WORKER_CACHE.append(item)
        time.sleep(0.2)

if __name__ == "__main__":
    fork = multiprocessing.get_context("fork")
    ready = fork.Event()
    worker = fork.Process(target=work, args=(ready,), daemon=True)
    worker.start()
    ready.wait()
    with open(pidfile + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {worker.pid}")
    os.rename(pidfile + ".tmp", pidfile)
    worker.join()
"""

#: The leak test by time over 8 s, for leaks of 1 MiB/s or more (the worker keeps 5 MiB/s).
CONFIG = ("[detectors]\nleak_warmup_steps = 10\nleak_warmup_seconds = 0\n"
          "leak_min_span_seconds = 8\nleak_min_bytes_per_second = 1048576\n")
#: How long the steady worker is watched reporting: 2.5 spans of the leak test.
QUIET_SECONDS = 20.0


def _pids(tmp_path: Path, alive: Any) -> tuple[int, int]:
    pidfile = tmp_path / "pipeline.pid"

    def written() -> Optional[tuple[int, int]]:
        try:
            parent, worker = (int(x) for x in pidfile.read_text().split())
        except (OSError, ValueError):
            return None
        return parent, worker

    return wait_for("the pipeline's and its worker's PIDs", written, WAIT, alive=alive)


def _pipeline(tmp_path: Path, keep: str) -> list[str]:
    script = tmp_path / "pipeline.py"
    script.write_text(PIPELINE)
    return [sys.executable, str(script), str(tmp_path / "pipeline.pid"), keep]


def test_a_pure_python_worker_keeping_what_it_loads_has_its_list_named(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_daemon(cli_env, tmp_path / "daemon", config=CONFIG,
                        args=("--interval", str(INTERVAL))) as d, \
            supervised(tmp_path, cli_env, _pipeline(tmp_path, "keep"), "--no-cgroup") as run:
        parent, worker = _pids(tmp_path, run.proc)
        fake_node.hold(parent, device=0, used=GIB)

        def named() -> Optional[dict[str, Any]]:
            found, _ = leak_now(cli_env, worker)
            return found if found is not None and found["details"].get("culprit") else None

        finding = wait_for("the worker's leak naming its list", named, 3 * WAIT, alive=d.proc)
        _, process = leak_now(cli_env, worker)
    details = finding["details"]
    assert details["culprit"] == "__main__.WORKER_CACHE", finding
    assert details["found_by"] == "discovered", finding
    assert details["unit"] == "second", finding
    assert "RSS grows steadily (not stepping)" in finding["reason"], finding
    assert process is not None and process["agent"] is not None, process
    assert process["agent"]["step"] is None, process


def test_a_pure_python_worker_that_keeps_nothing_reports_and_stays_quiet(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_daemon(cli_env, tmp_path / "daemon", config=CONFIG,
                        args=("--interval", str(INTERVAL))) as d, \
            supervised(tmp_path, cli_env, _pipeline(tmp_path, "return"), "--no-cgroup") as run:
        parent, worker = _pids(tmp_path, run.proc)
        fake_node.hold(parent, device=0, used=GIB)
        first: Optional[float] = None

        # Its agent reporting (after TICK_AFTER s of life) for 2.5 spans of the leak test, as
        # the daemon's clock goes (each tick refreshes last_seen): never a leak.
        def long_quiet() -> Optional[bool]:
            nonlocal first
            found, process = leak_now(cli_env, worker)
            assert found is None, found
            if process is None or process["agent"] is None:
                return None
            now = time.monotonic()
            first = now if first is None else first
            return True if now - first >= QUIET_SECONDS else None

        wait_for("the worker reporting quietly for a while", long_quiet,
                 WAIT + TICK_AFTER + QUIET_SECONDS, alive=d.proc)
