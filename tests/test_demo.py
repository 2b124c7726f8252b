"""`gpuwatch demo`: the simulated node that `make run` starts on a machine without a GPU."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from gpuwatch.simulate.demo import wait_for


def test_demo_runs_the_daemon_on_a_real_job_and_cleans_up_on_ctrl_c(tmp_path: Path) -> None:
    out = tmp_path / "demo.out"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    with open(out, "wb") as sink:
        demo = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch", "demo", "--listen", "127.0.0.1:0",
             "--workers", "3"], stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        url = wait_for("the demo's metrics address",
                       lambda: (re.findall(r"metrics\s+(http://\S+/metrics)", out.read_text())
                                or [None])[0], 60, alive=demo)
        text = out.read_text()
        workers = [int(p) for p in re.search(r"workers ([\d ]+)\)", text).group(1).split()]
        launcher = int(re.search(r"launcher (\d+)", text).group(1))
        assert len(workers) == 3

        def scraped_pids() -> set[int] | None:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = r.read().decode()
            pids = {int(p) for p in re.findall(
                r'^gpuwatch_process_gpu_memory_bytes\{[^}]*pid="(\d+)"', body, re.M)}
            return pids if pids == set(workers) else None

        wait_for("every worker's GPU memory series", scraped_pids, 30, alive=demo)
        runtime = re.search(r"GPUWATCH_RUNTIME_DIR=(\S+)", text).group(1)
        status = subprocess.run([sys.executable, "-m", "gpuwatch", "status"], text=True,
                                capture_output=True, timeout=60,
                                env={**env, "GPUWATCH_RUNTIME_DIR": runtime})
        assert "from the running daemon" in status.stdout, status.stdout + status.stderr

        demo.send_signal(signal.SIGINT)
        assert demo.wait(30) == 0
        for pid in (launcher, *workers):
            wait_for(f"PID {pid} to be gone", lambda pid=pid: not _alive(pid) or None, 10)
        assert not Path(runtime).exists()
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()


def test_demo_without_a_c_compiler_says_what_to_install(tmp_path: Path) -> None:
    no_tools = tmp_path / "bin"
    no_tools.mkdir()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": str(no_tools)}
    env.pop("CC", None)
    result = subprocess.run([sys.executable, "-m", "gpuwatch", "demo", "--duration", "1"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 1
    assert "no C compiler" in result.stderr and "gcc" in result.stderr


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
