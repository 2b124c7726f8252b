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


def test_demo_tells_its_story_of_orphans_and_leftovers_and_cleans_up_on_ctrl_c(
        tmp_path: Path) -> None:
    out = tmp_path / "demo.out"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    with open(out, "wb") as sink:
        demo = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch", "demo", "--listen", "127.0.0.1:0",
             "--workers", "3", "--pace", "1"], stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        url = wait_for("the demo's metrics address",
                       lambda: (re.findall(r"metrics\s+(http://\S+/metrics)", out.read_text())
                                or [None])[0], 60, alive=demo)
        text = out.read_text()
        job_a = re.search(r"job A: launcher (\d+), workers ([\d ]+),", text)
        job_b = re.search(r"job B: launcher (\d+), trainer (\d+),", text)
        assert job_a and job_b, text
        workers = [int(p) for p in job_a.group(2).split()]
        assert len(workers) == 3

        def scraped() -> str:
            with urllib.request.urlopen(url, timeout=10) as r:
                return str(r.read().decode())

        def findings(kind: str) -> set[int]:
            return {int(p) for p in re.findall(
                rf'^gpuwatch_finding{{[^}}]*kind="{kind}"[^}}]*pid="(\d+)"', scraped(), re.M)}

        # Job A's dataloader helper too: its job still trains when the launcher dies.
        wait_for("job A's workers and helper as orphans", lambda: (
            len(findings("orphan")) == 4 and set(workers) <= findings("orphan")) or None,
            60, alive=demo)
        wait_for("job B's three helpers as leftovers", lambda: len(findings("leftover")) == 3
                 or None, 60, alive=demo)
        leaking = int(re.search(r"job C: trainer (\d+)", text).group(1))
        wait_for("job C's leak", lambda: findings("leak") == {leaking} or None, 60, alive=demo)
        assert re.search(r'gpuwatch_leak_growth_bytes_per_step\{[^}]*culprit="fetch_buffer"',
                         scraped())
        # The end of the story: a dry run, then the orphans reaped and their memory released.
        wait_for("the demo's reap", lambda: out.read_text().count("GPU memory released") >= 3
                 or None, 60, alive=demo)
        text = out.read_text()
        assert "$ gpuwatch reap --dry-run" in text and "would free up to" in text
        for pid in workers:
            wait_for(f"orphan {pid} to be gone", lambda pid=pid: not _alive(pid) or None, 10)
        runtime = re.search(r"GPUWATCH_RUNTIME_DIR=(\S+)", text).group(1)
        status = subprocess.run([sys.executable, "-m", "gpuwatch", "status"], text=True,
                                capture_output=True, timeout=60,
                                env={**env, "GPUWATCH_RUNTIME_DIR": runtime})
        assert "from the running daemon" in status.stdout, status.stdout + status.stderr
        assert status.stdout.count("[leftover]") == 3  # reaped only the orphans, as asked
        assert "buffer `fetch_buffer` explains it" in status.stdout

        demo.send_signal(signal.SIGINT)
        assert demo.wait(30) == 0
        for pid in (int(job_a.group(1)), *workers, int(job_b.group(1)), leaking):
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
