"""The test suite must not depend on the shell that starts it.

A `cmd &` in a script (and nohup's users, and some CI runners) starts pytest with SIGINT ignored,
and every process it starts inherits that. The tests marked `sigint` send SIGINT, the way a Ctrl+C
does, to processes of their own: each such process must set its handler itself, and no assertion
may take Python's default handler for granted. Here they run in a child pytest started that way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHILD = "GPUWATCH_TEST_SIGINT_IGNORED_CHILD"

# Run in the child before pytest: records how the child really started, from the kernel's view
# (SigIgn in /proc/self/status) as well as Python's.
BOOTSTRAP = """\
import json, os, signal, sys
with open("/proc/self/status") as f:
    ignored = int(next(l for l in f if l.startswith("SigIgn:")).split()[1], 16)
with open(os.environ["GPUWATCH_TEST_SIGINT_IGNORED_CHILD"], "w") as f:
    json.dump({"sigint_ignored": bool(ignored & (1 << (signal.SIGINT - 1))),
               "python_ignores_sigint": signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
               "session_leader": os.getsid(0) == os.getpid(),
               "stdin": os.readlink("/proc/self/fd/0")}, f)
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""

# At least these must have run and passed there: the ones that failed before their processes set
# their own SIGINT handlers.
REQUIRED = {
    "tests.test_agent::test_a_forked_child_reports_as_itself",
    "tests.test_demo::test_demo_tells_its_story_of_orphans_and_leftovers_and_cleans_up_on_ctrl_c",
    "tests.test_demo::test_demo_ends_everything_it_started_however_it_ends[SIGINT]",
}


def modules_that_may_mark_sigint() -> list[str]:
    """The test modules whose text says `sigint` (a test is marked so in its module: conftest
    marks none): the child collects these, not the whole suite, whose other modules (torch
    among their imports) it would import to run none of their tests."""
    here = Path(__file__).resolve()
    return sorted(str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")
                  if path != here and "sigint" in path.read_text())


def test_the_sigint_tests_pass_when_the_suite_starts_with_sigint_ignored(
        tmp_path: Path) -> None:
    if os.environ.get(CHILD):
        pytest.skip("already the child run")  # were it ever marked `sigint`: no recursion
    started_as = tmp_path / "started-as.json"
    junit = tmp_path / "junit.xml"
    # The shell's trap is what it does itself for `cmd &` in a script; exec keeps the disposition.
    child = subprocess.Popen(
        ["sh", "-c", 'trap "" INT; exec "$@"', "sh", sys.executable, "-c", BOOTSTRAP,
         "-q", "-p", "no:cacheprovider", "-m", "sigint", f"--junitxml={junit}",
         *modules_that_may_mark_sigint()],
        cwd=REPO, env={**os.environ, CHILD: str(started_as)}, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = child.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        # Its own session: the child pytest and what it started and did not give a session of
        # its own.
        os.killpg(child.pid, signal.SIGKILL)
        out, _ = child.communicate()
        pytest.fail(f"the child pytest ran past 300 s:\n{out}")
    assert json.loads(started_as.read_text()) == {
        "sigint_ignored": True, "python_ignores_sigint": True, "session_leader": True,
        "stdin": "/dev/null"}
    assert child.returncode == 0, out
    passed, failed = set(), set()
    for case in ElementTree.parse(junit).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(name)
        elif case.find("skipped") is None:
            passed.add(name)
    assert not failed, out
    assert REQUIRED - passed == set(), out
    assert not any("test_suite_robustness" in name for name in passed)
