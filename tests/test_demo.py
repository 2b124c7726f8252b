"""`gpuwatch demo`: the simulated node that `make run` starts on a machine without a GPU."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

import pytest

from gpuwatch.simulate.demo import wait_for
from gpuwatch.sources.processes import ProcessSource


@pytest.fixture(scope="module")
def demo_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The demo's environment, with one fake NVML build shared by the demos of this module."""
    cache = tmp_path_factory.mktemp("demo-cache")
    return {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONUNBUFFERED": "1"}


@pytest.mark.sigint
def test_demo_tells_its_story_of_orphans_and_leftovers_and_cleans_up_on_ctrl_c(
        tmp_path: Path, demo_env: dict[str, str]) -> None:
    out = tmp_path / "demo.out"
    env = demo_env
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
        job_c = re.search(r"job C: launcher (\d+), trainer (\d+),", text)
        assert job_a and job_b and job_c, text
        workers = [int(p) for p in job_a.group(2).split()]
        assert len(workers) == 3
        launchers = [int(m.group(1)) for m in (job_a, job_b, job_c)]
        started = _identities([*launchers, *workers, int(job_b.group(2)), int(job_c.group(2))])
        # Each job is rooted at its launcher, named as a real one is, with its workers below.
        assert [_comm(p) for p in launchers] == ["torchrun"] * 3
        assert {_parent(p) for p in workers} == {launchers[0]}
        assert _parent(int(job_c.group(2))) == launchers[2]

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
        leaking = int(job_c.group(2))
        wait_for("job C's leak", lambda: findings("leak") == {leaking} or None, 60, alive=demo)
        assert re.search(r'gpuwatch_leak_growth_bytes_per_step\{[^}]*culprit="fetch_buffer"',
                         scraped())
        # The end of the story: a dry run, then the orphans reaped and their memory released.
        wait_for("the demo's reap", lambda: out.read_text().count("GPU memory released") >= 3
                 or None, 60, alive=demo)
        text = wait_for("the story's end", lambda: out.read_text() if "story done:" in
                        out.read_text() else None, 60, alive=demo)
        assert "$ gpuwatch reap --dry-run" in text and "would free up to" in text
        done = " ".join(text[text.index("gpuwatch demo: story done:"):].split("\n\n")[0]
                        .split())
        assert "3 leftovers of job B, job A's orphans reaped" in done, done
        assert "Ctrl+C stops the demo and everything it started" in done, done
        # The banner's environment is all another shell needs: doctor there finds the fake
        # driver and the demo's daemon, as status does.
        (export,) = re.findall(r"^  export (.+)$", text, re.M)
        shell = {k: v for k, v in env.items()
                 if k != "LD_LIBRARY_PATH" and not k.startswith("GPUWATCH_")}
        shell.update(item.split("=", 1) for item in shlex.split(export))
        doctor = subprocess.run(
            [sys.executable, "-m", "gpuwatch", "doctor", "--json", "--check", "nvml",
             "--check", "daemon", "--check", "metrics"],
            text=True, capture_output=True, timeout=60, env=shell)
        checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
        assert checks["nvml"]["status"] == "ok" and "2 GPUs" in checks["nvml"]["summary"], \
            checks
        assert checks["daemon"]["status"] == "ok" and checks["metrics"]["status"] == "ok", \
            checks
        for pid in workers:
            wait_for(f"orphan {pid} to be gone", lambda pid=pid: not _alive(pid) or None, 10)
        runtime = re.search(r"GPUWATCH_RUNTIME_DIR=(\S+)", text).group(1)
        status = subprocess.run([sys.executable, "-m", "gpuwatch", "status"], text=True,
                                capture_output=True, timeout=60,
                                env={**env, "GPUWATCH_RUNTIME_DIR": runtime})
        assert "from the running daemon" in status.stdout, status.stdout + status.stderr
        assert status.stdout.count("[leftover]") == 3  # reaped only the orphans, as asked
        assert "buffer `fetch_buffer` explains it" in status.stdout
        assert "torchrun" in status.stdout
        # Job B's helpers carry no job variables of their own, yet their leftovers name job B,
        # in the metrics and for `reap --job`, the id written either way.
        doc = json.loads(subprocess.run(
            [sys.executable, "-m", "gpuwatch", "status", "--json"], text=True,
            capture_output=True, timeout=60, env={**env, "GPUWATCH_RUNTIME_DIR": runtime}).stdout)
        jobs = {f["job"]["id"] for f in doc["findings"] if f["kind"] == "leftover"}
        (job_b_id,) = jobs
        leftover_series = [line for line in scraped().splitlines()
                           if line.startswith("gpuwatch_finding{") and 'kind="leftover"' in line]
        assert len(leftover_series) == 3
        assert all(f'job_id="{job_b_id}"' in line for line in leftover_series), leftover_series
        for wanted in (job_b_id, f"torchelastic:{job_b_id}"):
            plan = subprocess.run(
                [sys.executable, "-m", "gpuwatch", "reap", "--dry-run", "--job", wanted],
                text=True, capture_output=True, timeout=60,
                env={**env, "GPUWATCH_RUNTIME_DIR": runtime})
            assert plan.returncode == 0 and plan.stdout.count("leftover") >= 3, plan.stdout
        # The launcher it killed was waited on: the demo raised no finding against itself.
        assert not findings("zombie")

        demo.send_signal(signal.SIGINT)
        assert demo.wait(30) == 130
        assert _still_running(started) == []
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


# ---- however it ends, it ends everything it started ------------------------------------------

PACE = 0.5  # job A's launcher is killed 4 paces into the story


@pytest.mark.parametrize("how", [
    pytest.param("SIGINT", marks=pytest.mark.sigint), "SIGTERM", "SIGHUP", "duration"])
def test_demo_ends_everything_it_started_however_it_ends(
        tmp_path: Path, demo_env: dict[str, str], how: str) -> None:
    out = tmp_path / "demo.out"
    duration = ["--duration", str(4 * PACE + 2)] if how == "duration" else []
    with open(out, "wb") as sink:
        # A session of its own, as a terminal gives a command, so that a signal to its process
        # group reaches the demo and its daemon and nothing else.
        demo = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch", "demo", "--listen", "127.0.0.1:0",
             "--pace", str(PACE), *duration], stdout=sink, stderr=subprocess.STDOUT,
            env=demo_env, start_new_session=True)
    started: dict[int, int] = {}
    try:
        def story_reached_the_orphans() -> Optional[str]:
            started.update(_identities(sorted(ProcessSource().descendants(demo.pid))))
            text = out.read_text()
            return text if "killed job A's launcher" in text else None

        text = wait_for("job A's launcher killed by the story", story_reached_the_orphans, 60,
                        alive=demo)
        printed = [int(p) for line in re.findall(r"^ {2}job [ABC]: (.*?); run ", text, re.M)
                   for p in re.findall(r"\b\d+\b", line)]
        printed.append(int(re.search(r"real daemon \(PID (\d+)\)", text).group(1)))
        assert len(printed) == 12
        assert set(printed) - set(started) == set(), "every PID it printed was seen running"
        port = int(re.search(r"metrics\s+http://127\.0\.0\.1:(\d+)/", text).group(1))
        work_dir = Path(re.search(r"GPUWATCH_RUNTIME_DIR=(\S+)/run ", text).group(1))
        job_a = re.search(r"job A: launcher (\d+), workers ([\d ]+),", text)
        assert job_a is not None
        orphans = [int(p) for p in job_a.group(2).split()]
        # The hardest case: these are no longer the demo's descendants.
        assert all(_parent(p) not in (None, int(job_a.group(1))) for p in orphans)
        assert len(started) >= 12  # the daemon, 3 launchers, 2 + 1 + 1 workers, 1 + 3 helpers

        if how == "SIGTERM":
            os.kill(demo.pid, signal.SIGTERM)  # `kill PID`
        elif how != "duration":
            os.killpg(demo.pid, getattr(signal, how))  # as a terminal sends Ctrl+C or hangup
        code = demo.wait(60)
        assert code == (0 if how == "duration" else 128 + getattr(signal, how)), \
            out.read_text()
        assert _still_running(started) == []
        assert not work_dir.exists()
        assert _port_is_free(port)
    finally:
        _kill_all(demo, started, out)


def test_a_sigkilled_demo_takes_its_daemon_and_its_jobs_with_it(
        tmp_path: Path, demo_env: dict[str, str]) -> None:
    out = tmp_path / "demo.out"
    with open(out, "wb") as sink:
        demo = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch", "demo", "--listen", "127.0.0.1:0",
             "--pace", "60"], stdout=sink, stderr=subprocess.STDOUT, env=demo_env,
            start_new_session=True)
    started: dict[int, int] = {}
    try:
        text = wait_for("the demo's story to start",
                        lambda: (t if "Ctrl+C stops the demo" in (t := out.read_text())
                                 else None), 60, alive=demo)
        started.update(_identities(sorted(ProcessSource().descendants(demo.pid))))
        assert len(started) >= 12
        port = int(re.search(r"metrics\s+http://127\.0\.0\.1:(\d+)/", text).group(1))
        work_dir = Path(re.search(r"GPUWATCH_RUNTIME_DIR=(\S+)/run ", text).group(1))
        demo.kill()
        assert demo.wait(10) == -signal.SIGKILL
        # Nothing ran in the demo after that: the kernel's death signals did it all (the
        # launchers forwarded theirs to their workers and helpers).
        wait_for("everything it started to end", lambda: _still_running(started) == [] or None,
                 20)
        assert _port_is_free(port)
        assert work_dir.exists()  # as its docstring says: left for whoever killed it
    finally:
        _kill_all(demo, started, out)


def _stat(pid: int) -> Optional[list[str]]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _identities(pids: list[int]) -> dict[int, int]:
    """PID -> start time (clock ticks after boot): what tells a process from a later one given
    the same PID."""
    found = {}
    for pid in pids:
        stat = _stat(pid)
        if stat is not None:
            found[pid] = int(stat[19])
    return found


def _still_running(started: dict[int, int]) -> list[int]:
    running = []
    for pid, ticks in started.items():
        stat = _stat(pid)
        if stat is not None and int(stat[19]) == ticks and stat[0] not in ("Z", "X"):
            running.append(pid)
    return sorted(running)


def _kill_all(demo: subprocess.Popen[bytes], started: dict[int, int], out: Path) -> None:
    """Whatever a failing test (or a SIGKILLed demo) leaves behind: its processes, by identity,
    and its temporary directory."""
    if demo.poll() is None:
        demo.kill()
        demo.wait()
    for pid in _still_running(started):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _still_running(started) and time.monotonic() < deadline:
        time.sleep(0.05)
    work_dir = re.search(r"GPUWATCH_RUNTIME_DIR=(\S+)/run ", out.read_text())
    if work_dir is not None:
        shutil.rmtree(work_dir.group(1), ignore_errors=True)


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As a new daemon binds it: a connection of the old one in TIME_WAIT does not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _parent(pid: int) -> Optional[int]:
    stat = _stat(pid)
    return int(stat[1]) if stat is not None else None


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
