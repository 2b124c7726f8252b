"""`status`, `reap --dry-run`, `doctor` and `top` on real terminals of every width, as a newcomer
meets them: in tmux at 40, 60, 80, 100 and 200 columns, coloured (TERM=xterm-256color) and
under NO_COLOR, on a simulated node whose findings are all there (orphans, leftovers, a leak).

None may crash; from 60 columns up every process row says which program it is: columns give
way (USER, STATE, RSS, ...) before the command's name does.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.simulate.demo import SimulatedNode, simulated_node, wait_for
from gpuwatch.sinks.text import clean
from gpuwatch.units import short_command
from tests.test_top import GPUWATCH, Terminal, terminal, top_env

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="the terminals are tmux panes (apt-get install tmux)")

WIDTHS = (40, 60, 80, 100, 200)
#: Tall enough that nothing a command prints scrolls out of the pane.
HEIGHT = 150
#: Where the colour variant's TERM differs from tmux's own: what the issue's user had.
COLOURS = {"colour": {"TERM": "xterm-256color"}, "no-colour": {"NO_COLOR": "1"}}
#: A tree's branches (Unicode, or ASCII where the terminal's encoding has no Unicode).
ROW = re.compile(r"^[\s│├└─|`\-…~]*(\d+)\s")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimulatedNode]:
    """Job A lost its launcher (orphans), job B's helpers become leftovers, job C leaks; all
    found before any test looks."""
    with simulated_node(tmp_path_factory.mktemp("narrow-node"), listen="127.0.0.1:0",
                        interval=0.2, pace=1.0) as sim:
        sim.training.launcher.kill()
        sim.training.launcher.wait()
        env = {**sim.node.env(), "GPUWATCH_RUNTIME_DIR": str(sim.runtime_dir),
               "GPUWATCH_CONFIG": "/dev/null"}

        def findings() -> Any:
            done = subprocess.run([sys.executable, "-m", "gpuwatch", "status", "--json"],
                                  capture_output=True, text=True, timeout=60, env=env)
            kinds = [f["kind"] for f in json.loads(done.stdout)["findings"]] \
                if done.returncode in (0, 1, 3, 4) and done.stdout else []
            return True if {"orphan", "leftover", "leak"} <= set(kinds) else None

        wait_for("orphans, leftovers and the leak", findings, 90)
        yield sim


def _document(env: dict[str, str], *args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "gpuwatch", *args], capture_output=True,
                          text=True, timeout=60, env=env)
    return dict(json.loads(done.stdout))


def _run(term: Terminal, command: str) -> tuple[str, int]:
    """`command` on the terminal, from a cleared screen: the screen (wrapped lines joined) and
    its exit status."""
    mark = f"rc-{next(_RUNS)}"
    term.type(f"clear; {command}; echo \"{mark}=$?\"")
    found = rf"^{mark}=(\d+)$"
    screen = term.wait(f"{command} to end", lambda s: re.search(found, s, re.M), 90)
    joined = term.tmux("capture-pane", "-p", "-J", "-t", "top")
    return joined, int(re.search(found, screen, re.M).group(1))  # type: ignore[union-attr]


_RUNS = itertools.count()


def _program(p: dict[str, Any]) -> str:
    return clean(short_command(p["name"], p["cmdline"])).split(" ", 1)[0]


@pytest.mark.parametrize("colour", COLOURS)
@pytest.mark.parametrize("width", WIDTHS)
def test_status_reap_and_doctor_fit_every_width_and_name_every_program(
        node: SimulatedNode, tmp_path: Path, width: int, colour: str) -> None:
    env = top_env(node, tmp_path, **COLOURS[colour])
    doc = _document(env, "status", "--json")
    programs = {p["pid"]: _program(p) for p in doc["processes"]}
    with terminal(tmp_path / "t", env, width, HEIGHT) as term:
        screen, rc = _run(term, f"{GPUWATCH} status")
        assert "Traceback" not in screen and rc == 0, screen
        table = screen[screen.index("PID "):].split("\n\n")[0].splitlines()
        rows = [(int(m.group(1)), line) for line in table if (m := ROW.match(line))]
        assert len(rows) >= 8, screen  # every holder and every process with a finding
        if width >= 60:
            for pid, line in rows:
                assert programs[pid] in line, (pid, programs[pid], screen)
                assert len(line) <= width, screen
        assert "[orphan]" in screen and "[leak]" in screen
        assert re.search(r"agent: step \d+", screen), screen  # the instrumented trainer

        plan = _document(env, "reap", "--dry-run", "--json")
        screen, rc = _run(term, f"{GPUWATCH} reap --dry-run")
        assert "Traceback" not in screen and rc == 0, screen
        for action in plan["actions"]:
            (line,) = [line for line in screen.splitlines()
                       if (m := ROW.match(line)) and int(m.group(1)) == action["pid"]]
            assert len(line) <= width, screen
            if width >= 60:
                assert clean(action["name"]) in line, (action, screen)

        screen, rc = _run(term, f"{GPUWATCH} doctor")
        assert "Traceback" not in screen and rc in (0, 3, 4), screen
        assert re.search(r"^(ok|warn|fail|skip)\s+nvml", screen, re.M), screen


@pytest.mark.parametrize("colour", COLOURS)
@pytest.mark.parametrize("width", WIDTHS)
def test_top_fits_every_width_and_names_every_program(
        node: SimulatedNode, tmp_path: Path, width: int, colour: str) -> None:
    env = top_env(node, tmp_path, **COLOURS[colour])
    doc = _document(env, "status", "--json")
    programs = {p["pid"]: _program(p) for p in doc["processes"]}
    with terminal(tmp_path / "t", env, width, 30) as term:
        term.type(f"{GPUWATCH} top; echo \"rc=$?\"")
        screen = term.wait("top's rows", lambda s: "[orphan]" in s and "q quit" in s)
        assert "Traceback" not in screen
        rows = [(int(m.group(1)), line) for line in screen.splitlines()
                if (m := ROW.match(line)) and int(m.group(1)) in programs]
        assert rows, screen
        assert all(len(line) <= width for line in screen.splitlines())
        if width >= 60:
            for pid, line in rows:
                assert programs[pid][:width] in line, (pid, programs[pid], screen)
        term.keys("q")
        term.wait("top to end with 0", lambda s: "rc=0" in s)
