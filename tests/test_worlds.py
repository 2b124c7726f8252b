"""Parallel workers in worlds of their own (tests/worlds.py, tests/worker_init.py): under
`pytest -n N` as root, each worker is PID 1000 of a PID namespace of its own, with its own /proc,
under an init that reaps its orphans and passes signals on; the tests that need the host's kernel
threads run on one more worker on the host; a test that leaves a process behind still fails,
named with its worker. Shown on the init itself and on child pytest runs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwatch.simulate.demo import wait_for
from tests import worlds
from tests.scenarios import running

REPO = Path(__file__).resolve().parent.parent


def _worlds_or_skip() -> str:
    why = worlds.unavailable()
    if why is not None:
        pytest.skip(f"no worlds of their own for workers here: {why}")
    return str(worlds.INIT)


def _in_world(program: str) -> subprocess.Popen[str]:
    """`program` (Python) as the worker of a world, started as tests/worlds.py starts one."""
    init = _worlds_or_skip()
    return subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "--",
                             sys.executable, "-I", init, sys.executable, "-c", program],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


ORPHAN_MAKER = """\
import json, os, subprocess, time
# A grandchild whose parent exits at once: an orphan, reparented to PID 1.
out = subprocess.run(["sh", "-c", "sleep 3 >/dev/null 2>&1 & echo $!"], capture_output=True,
                     text=True)
orphan = int(out.stdout)
with open(f"/proc/{orphan}/stat") as f:
    ppid = int(f.read().rpartition(")")[2].split()[1])
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
deadline = time.monotonic() + 30
while os.path.exists(f"/proc/{orphan}") and time.monotonic() < deadline:
    time.sleep(0.05)  # a zombie keeps its /proc entry until its parent, PID 1, reaps it
print(json.dumps({"me": os.getpid(), "orphans_parent": ppid, "pids": pids,
                  "orphan_left": os.path.exists(f"/proc/{orphan}")}))
"""


def test_a_worker_is_pid_1000_of_its_own_pid_namespace_whose_init_reaps_its_orphans() -> None:
    world = _in_world(ORPHAN_MAKER)
    out, err = world.communicate(timeout=120)
    assert world.returncode == 0, err
    seen = json.loads(out)
    # PID 2, kthreadd's on a host (gpuwatch refuses to signal its children), is nobody's; this
    # world's processes only, not the host's.
    assert seen["me"] == 1000 and all(p == 1 or 1000 <= p < 1100 for p in seen["pids"]), seen
    assert seen["orphans_parent"] == 1, seen
    assert seen["orphan_left"] is False, seen


def test_a_signal_sent_to_the_init_reaches_the_worker_and_its_status_comes_back() -> None:
    world = _in_world("import signal, sys, time\n"
                      "signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))\n"
                      "print('ready', flush=True)\n"
                      "time.sleep(60)\n")
    assert world.stdout is not None
    assert world.stdout.readline() == "ready\n"
    (init,) = _children(world.pid)
    os.kill(init, signal.SIGTERM)
    assert world.wait(60) == 42
    world.communicate()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_what_a_worker_leaves_running_ends_with_it() -> None:
    world = _in_world("import subprocess, sys\n"
                      "subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
                      "print('ready', flush=True)\n"
                      "sys.stdin.read()\n")
    assert world.stdout is not None
    assert world.stdout.readline() == "ready\n"
    (init,) = _children(world.pid)
    (worker,) = _children(init)
    (sleep,) = _children(worker)
    out, err = world.communicate(timeout=60)  # stdin closed: the worker ends, leaving its sleep
    assert world.returncode == 0, out + err
    wait_for("the worker's leftover sleep to end with its world",
             lambda: True if not running(sleep) else None, 30)


TWO_WORKERS = '''
import os
from pathlib import Path


def _seen(name):
    own = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    Path(os.environ["SEEN"], name).write_text(f"{os.environ['PYTEST_XDIST_WORKER']} {own}")


def test_one():
    _seen("one")


def test_two():
    _seen("two")
'''


def _child_run(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_child.py").write_text(body)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "-n", "2", "--rootdir", str(tmp_path), *args, str(tmp_path / "test_child.py")],
        cwd=REPO, env={**os.environ, "SEEN": str(tmp_path)}, capture_output=True, text=True,
        timeout=300)


def test_two_workers_of_a_run_see_their_own_processes_only(tmp_path: Path) -> None:
    _worlds_or_skip()
    done = _child_run(tmp_path, TWO_WORKERS, "-v")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "workers: each in a PID namespace of its own" in out, out
    seen = {}
    for name in ("one", "two"):
        worker, pids = (tmp_path / name).read_text().split(" ", 1)
        seen[name] = (worker, json.loads(pids))
        # Each world numbers its own processes: none of the host's, nor the other worker's.
        assert all(p == 1 or 1000 <= p < 1100 for p in seen[name][1]), seen
        assert 1000 in seen[name][1], seen


HOST_AND_WORLD = '''
import os


def test_kernel_threads_read_with_their_name_and_no_command_line():
    print("ran on", os.environ["PYTEST_XDIST_WORKER"])


def test_in_a_world():
    print("ran on", os.environ["PYTEST_XDIST_WORKER"])
'''


def test_the_host_pids_tests_run_on_the_host_worker_and_nothing_else_does(
        tmp_path: Path) -> None:
    _worlds_or_skip()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_process_source.py").write_text(HOST_AND_WORLD)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "-n", "2", "-v", "--rootdir", str(tmp_path), "tests/test_process_source.py"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
        text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    # On the host it runs; where this run is itself in a world, the host worker is not on the
    # host, and the test says so.
    outcome = "SKIPPED" if worlds.in_own_world() else "PASSED"
    assert re.search(rf"\[{worlds.HOST_WORKER}\].* {outcome} tests/test_process_source.py::"
                     "test_kernel_threads_read_with_their_name_and_no_command_line", out), out
    assert re.search(r"\[gw[01]\].* PASSED tests/test_process_source.py::test_in_a_world",
                     out), out


LEAKY = '''
import subprocess


def test_leaks_a_reparented_grandchild():
    subprocess.run(["sh", "-c", "sleep 600 >/dev/null 2>&1 &"], check=True)


def test_ends_what_it_starts():
    subprocess.run(["true"], check=True)
'''


def test_a_test_that_leaves_a_process_running_under_n_fails_named_with_its_worker(
        tmp_path: Path) -> None:
    started = time.monotonic()
    done = _child_run(tmp_path, LEAKY)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert re.search(r"test_child.py::test_leaks_a_reparented_grandchild \(worker gw[01]\) "
                     r"left 1 process running \(now killed\):", out), out
    assert "): sleep 600" in out, out
    assert time.monotonic() - started < 300


def test_each_host_pids_entry_names_a_test_of_the_suite() -> None:
    for entry in worlds.HOST_PIDS:
        path, _, name = entry.partition("::")
        assert f"def {name}(" in (REPO / path).read_text(), entry
