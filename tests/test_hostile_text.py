"""Another user's escape sequences never reach the admin's terminal.

A process chooses its command line, its name, its job id (an environment variable): a worker
started with `$'\\e]0;PWNED\\a\\e[2J\\e[31mFAKE-OK\\e[0m\\r\\nline2'` in its argv must not retitle
the window, clear the screen or forge a row when root runs `gpuwatch status` (on a terminal or
piped into one) or `reap --dry-run`. Every text view cleans such text through one function
(gpuwatch.sinks.text.clean); JSON keeps it exact.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from gpuwatch.actions.reap_plan import Action
from gpuwatch.model import Job, NodeReport, NodeSnapshot, NvmlStatus
from gpuwatch.simulate.demo import SimulatedNode, simulated_node, wait_for
from gpuwatch.simulate.job import launch_env
from gpuwatch.sinks.doctor_view import render_doctor
from gpuwatch.sinks.reap_view import render_reap
from gpuwatch.sinks.status_view import render_status
from gpuwatch.sinks.text import clean, evidence
from gpuwatch.units import plural
from tests.scenarios import _orphan, clean_env, cmdline
from tests.test_top import GPUWATCH, report, terminal, top_env, two_jobs

HOSTILE = "\x1b]0;PWNED\x07\x1b[2J\x1b[31mFAKE-OK\x1b[0m\r\nline2"
#: A process name of the kernel's 15 bytes at most: retitles the window, clears the screen.
HOSTILE_NAME = "\x1b]0;PW\x07\x1b[2J"
CONTROL = {chr(c) for c in range(32)} | {"\x7f"}


def _no_control(text: str) -> bool:
    return not (set(text) & CONTROL - {"\n"})


# ---- the one function, and every view that uses it -----------------------------------------------

def test_clean_shows_every_control_character_as_a_question_mark() -> None:
    assert clean(HOSTILE) == "?]0;PWNED??[2J?[31mFAKE-OK?[0m??line2"
    assert clean("\u202egnp.exe") == "?gnp.exe"  # a bidi override
    assert clean("\x9b31m") == "?31m"  # the one-byte CSI
    assert clean("train.py --lr 3e-4") == "train.py --lr 3e-4"


def _hostile_report() -> NodeReport:
    """Two jobs (tests/test_top.py) where one worker's every text is hostile, read as top and
    status read a document."""
    doc = two_jobs()
    p = doc["processes"][1]
    p.update(cmdline=["python", HOSTILE], name=HOSTILE_NAME, user=HOSTILE,
             cgroup=f"/{HOSTILE}", job={"source": "slurm", "id": HOSTILE})
    p["agent"] = {"step": 3, "step_changed_at": doc["taken_at"],
                  "first_seen": doc["taken_at"] - 60, "last_seen": doc["taken_at"],
                  "finished_at": None, "rss_bytes": 1, "cuda_allocated_bytes": None,
                  "cuda_reserved_bytes": None, "cuda_active_bytes": None,
                  "cuda_allocations": None, "buffers": {HOSTILE: {"items": 1, "bytes": 2}},
                  "exit": None}
    doc["findings"].append({
        "kind": "leak", "severity": "warning", "pid": p["pid"], "start_time": 0.0,
        "name": HOSTILE_NAME, "user": HOSTILE, "job": p["job"], "gpus": [0],
        "gpu_memory_bytes": 1 << 30, "since": doc["taken_at"] - 60,
        "reason": f"buffer `{HOSTILE}` grows",
        "details": {"series": f"buffer `{HOSTILE}`", "unit": "step", "window_steps": [1, 3],
                    "culprit": HOSTILE, "found_by": "watched", "growth_bytes_per_step": 1 << 20,
                    "limit_source": "node", "limit_bytes": None, "available_bytes": 1 << 30,
                    "projected_oom_step": 1027}})
    return report(doc)


@pytest.mark.parametrize("width", [0, 80])
def test_status_cleans_every_text_a_process_chose(width: int) -> None:
    text = render_status(_hostile_report(), width=width, colour=True)
    plain = render_status(_hostile_report(), width=width)
    assert _no_control(plain), plain
    # Colour adds its own SGR sequences and nothing else.
    assert "\x1b[2J" not in text and "\x1b]" not in text and "\r" not in text
    assert "FAKE-OK" in plain and not any(line.startswith(("line2", "FAKE-OK"))
                                          for line in plain.splitlines())


def test_reap_doctor_run_and_top_details_clean_it_too() -> None:
    action = Action(kind="orphan", action="terminate", reason=f"`{HOSTILE}` orphaned",
                    pid=4242, start_time=1.0, name=HOSTILE_NAME, user=HOSTILE,
                    job=Job(HOSTILE, "slurm"), signals=("SIGTERM",))
    report = NodeReport(NodeSnapshot(taken_at=1.7e9, hostname=HOSTILE, nvml=NvmlStatus(True),
                                     gpus=(), processes={}), source="daemon")
    for width in (0, 60):
        plan = render_reap(report, [(action, "planned", "")], True, width=width)
        assert _no_control(plan), plan
    checks = {"checks": [{"name": "daemon", "status": "fail", "summary": HOSTILE,
                          "fix": HOSTILE}]}
    assert _no_control(render_doctor(checks))
    from gpuwatch.sinks.top.view import details_lines
    hostile = _hostile_report()
    pid = next(p.pid for p in hostile.snapshot.processes.values() if p.user == HOSTILE)
    lines = [line.text for line in details_lines(hostile, pid, None, 100)]
    assert _no_control("\n".join(lines))
    assert "limit_bytes: none" in "\n".join(lines)  # not Python's `None`


def test_the_run_summary_cleans_commands_and_job_names() -> None:
    from gpuwatch.sinks.run_view import render_run

    class _Gpu:
        nvml, detail = False, "no NVML"

    class _Member:
        ref = type("Ref", (), {"pid": 7})()
        gpus: tuple[int, ...] = ()
        gpu_memory_bytes = 0
        signals: tuple[str, ...] = ()
        ended, leftover, command = "exited", False, HOSTILE

    class _Result:
        command_status, ended_by, exit_code = 0, "exit", 0
        job_id, cgroup, cgroup_reason = HOSTILE, None, HOSTILE
        started_at, ended_at = 0.0, 1.0
        members: ClassVar[list[_Member]] = [_Member()]
        gpu = _Gpu()

    assert _no_control(render_run(_Result()))  # type: ignore[arg-type]


def test_text_log_lines_are_cleaned_and_json_lines_exact(
        capsys: pytest.CaptureFixture[str]) -> None:
    from gpuwatch.logs import setup_logging

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        setup_logging("text")
        logging.getLogger("gpuwatch.test").warning("reaped %s", HOSTILE)
        text = capsys.readouterr().err
        assert text.count("\n") == 1 and _no_control(text.rstrip("\n")), repr(text)
        setup_logging("json")
        logging.getLogger("gpuwatch.test").warning("reaped %s", HOSTILE)
        assert json.loads(capsys.readouterr().err)["msg"] == f"reaped {HOSTILE}"
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_evidence_and_counts_read_as_words() -> None:
    assert evidence("limit_bytes", None) == "limit_bytes: none"
    assert evidence("available_bytes", 3 << 30) == "available_bytes: 3.0 GiB"
    assert evidence("projected_oom_in_seconds", 5400) == "projected_oom_in_seconds: 90 min"
    assert evidence("culprit", HOSTILE) == f"culprit: {clean(HOSTILE)}"
    assert evidence("exact", True) == "exact: yes"
    assert plural(1, "thread") == "1 thread" and plural(2, "thread") == "2 threads"
    assert plural(0, "thread") == "0 threads"


def test_plural_adds_es_after_a_hissing_ending_and_takes_an_irregular_plural() -> None:
    assert plural(1, "process") == "1 process" and plural(2, "process") == "2 processes"
    assert plural(1, "box") == "1 box" and plural(3, "box") == "3 boxes"
    assert plural(2, "batch") == "2 batches" and plural(2, "crash") == "2 crashes"
    assert plural(2, "GPU") == "2 GPUs" and plural(2, "torn line") == "2 torn lines"
    assert plural(1, "metric family", "metric families") == "1 metric family"
    assert plural(2, "metric family", "metric families") == "2 metric families"
    assert plural(0, "child", "children") == "0 children"


# ---- through a real terminal ------------------------------------------------------------------

needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="the terminal is a tmux pane (apt-get install tmux)")


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimulatedNode, int]]:
    """A simulated node, and on it an orphaned worker whose argv, name and job id carry escape
    sequences, holding GPU memory."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    with simulated_node(tmp_path_factory.mktemp("hostile-node"), listen="127.0.0.1:0",
                        interval=0.2, pace=1.0) as sim:
        body = ("import ctypes, sys, time; "
                f"ctypes.CDLL(None).prctl(15, {HOSTILE_NAME.encode()!r}, 0, 0, 0); "
                "time.sleep(600)")
        env = launch_env(0, 1, f"run-{HOSTILE}", base=clean_env())
        with _orphan([sys.executable, "-c", body, HOSTILE], env, "the hostile worker",
                     lambda pid: HOSTILE in cmdline(pid)) as pid:
            sim.node.hold(pid, device=0, used=1 << 30)
            status_env = {**sim.node.env(), "GPUWATCH_RUNTIME_DIR": str(sim.runtime_dir)}

            def found() -> Any:
                out = subprocess.run([sys.executable, "-m", "gpuwatch", "status", "--json"],
                                     capture_output=True, text=True, timeout=60,
                                     env=status_env).stdout
                doc = json.loads(out) if out else {"findings": []}
                return True if any(f["pid"] == pid and f["kind"] == "orphan"
                                   for f in doc["findings"]) else None

            wait_for("the hostile worker's orphan finding", found, 60)
            yield sim, pid


@needs_tmux
@pytest.mark.parametrize("command", ["status", "status | cat", "reap --dry-run"])
def test_a_hostile_argv_neither_clears_nor_retitles_nor_forges_a_row(
        hostile: tuple[SimulatedNode, int], tmp_path: Path, command: str) -> None:
    sim, pid = hostile
    with terminal(tmp_path / "t", top_env(sim, tmp_path, TERM="xterm-256color"), 200, 120
                  ) as term:
        term.tmux("select-pane", "-t", "top", "-T", "gpuwatch-test")
        term.type(f"echo BEFORE-MARK; {GPUWATCH} {command}; echo \"done=$?\"")
        screen = term.wait(f"{command} to end",
                           lambda s: re.search(r"^done=\d+$", s, re.M), 90)
        assert "BEFORE-MARK" in screen, screen  # the screen was not cleared
        assert str(pid) in screen and "FAKE-OK" in screen, screen  # the row is there
        lines = screen.splitlines()
        assert not [line for line in lines if line.startswith(("line2", "FAKE-OK"))], screen
        assert term.tmux("display", "-p", "-t", "top", "#{pane_title}").strip() == \
            "gpuwatch-test"
        assert "\x1b[31mFAKE-OK" not in term.screen(escapes=True)


def test_json_keeps_a_hostile_argv_exact(hostile: tuple[SimulatedNode, int],
                                         tmp_path: Path) -> None:
    sim, pid = hostile
    # Bytes: text mode would read the argv's \r\n as a newline.
    out = subprocess.run([sys.executable, "-m", "gpuwatch", "status", "--json"],
                         capture_output=True, timeout=60, env=top_env(sim, tmp_path)).stdout
    (p,) = [p for p in json.loads(out)["processes"] if p["pid"] == pid]
    # Escapes and all, line endings translated as psutil reads a command line.
    assert p["cmdline"][-1] == HOSTILE.replace("\r\n", "\n") and p["name"] == HOSTILE_NAME
