"""The suite's guard (tests/conftest.py, tests/process_guard.py): a test that leaves a process
running fails at teardown, named, with the process's command line, and the process is killed, so
the tests after it run clean. Shown on a child pytest with tests that leak as tests do: a
grandchild reparented to PID 1, and a child started with an environment of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import process_guard
from tests.scenarios import running

REPO = Path(__file__).resolve().parent.parent

LEAKY = '''
import os
import subprocess


def test_leaks_a_reparented_grandchild():
    subprocess.run(["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $! > leaked-1"], check=True,
                   cwd=os.environ["LEAKS"])


def test_leaks_a_child_with_an_environment_of_its_own():
    p = subprocess.Popen(["sleep", "601"], env={"PATH": os.environ["PATH"]})
    with open(os.path.join(os.environ["LEAKS"], "leaked-2"), "w") as f:
        f.write(str(p.pid))


def test_ends_what_it_starts():
    subprocess.run(["true"], check=True)
'''


def test_a_test_that_leaves_a_process_running_fails_named_and_the_process_is_killed(
        tmp_path: Path) -> None:
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    # Its leaks sleep for ten minutes: the guard need not give them 15 s each to end on their own.
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q",
         "--rootdir", str(tmp_path), str(tmp_path / "test_leaky.py")],
        cwd=REPO, env={**os.environ, "LEAKS": str(tmp_path), "GPUWATCH_TEST_EXIT_DEADLINE": "2"},
        capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "3 passed, 2 errors" in out, out
    assert ("test_leaky.py::test_leaks_a_reparented_grandchild left 1 process running "
            "(now killed):") in out
    assert "): sleep 600" in out and "): sleep 601" in out, out
    assert ("test_leaky.py::test_leaks_a_child_with_an_environment_of_its_own left 1 "
            "process running (now killed):") in out
    assert "test_ends_what_it_starts" not in out.split("short test summary")[1], out
    for name in ("leaked-1", "leaked-2"):
        assert not running(int((tmp_path / name).read_text())), name


def test_a_leftover_caught_in_execve_with_no_environment_yet_is_still_found(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A process in the middle of execve(2) shows an empty /proc/PID/environ for a moment; the
    # kernel gives no way to hold one there, so the guard's reads show the leftover so twice.
    tag = os.environ[process_guard.TAG_KEY].rsplit(":", 1)[-1]
    before = process_guard.started_by_this_run(tag)
    pid = int(subprocess.run(["sh", "-c", "sleep 602 >/dev/null 2>&1 & echo $!"], check=True,
                             capture_output=True, text=True).stdout)
    try:
        read = process_guard._read
        empty = {f"/proc/{pid}/environ": 2}

        def caught_in_execve(path: str) -> bytes:
            if empty.get(path, 0) > 0:
                empty[path] -= 1
                return b""
            return read(path)

        monkeypatch.setattr(process_guard, "_read", caught_in_execve)
        left = process_guard.left_behind(tag, before, deadline=0.5)
        assert [p.pid for p in left] == [pid], left
        assert empty == {f"/proc/{pid}/environ": 0}
    finally:
        monkeypatch.undo()
        process_guard.end([p for p in process_guard.started_by_this_run(tag).values()
                           if p.pid == pid])
    assert not running(pid)
