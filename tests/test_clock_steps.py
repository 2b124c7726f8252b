"""A step of the wall clock (an NTP step, a VM resumed, `date -s`) changes no finding: durations
are timed on gpuwatch.clock.SteadyClock, and what the daemon shows is on the wall clock.

The end-to-end test steps the daemon's wall clock alone (gpuwatch.simulate.clockjump, an
LD_PRELOAD library): the machine's clock is never touched.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Optional

from gpuwatch.clock import SteadyClock
from gpuwatch.simulate.clockjump import ClockJump
from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from tests.daemonproc import RunningDaemon, running_daemon, status_now, value
from tests.realprocs import GIB, killed_after, progress_step, status_json
from tests.scenarios import unreaped_child

HOURS_2 = 7200.0


class Clocks:
    def __init__(self) -> None:
        self.wall = 1_000_000.0
        self.steady = 50.0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.steady += seconds


def test_the_steady_clock_starts_on_the_wall_clock_and_ignores_its_steps() -> None:
    c = Clocks()
    clock = SteadyClock(wall=lambda: c.wall, steady=lambda: c.steady)
    assert clock() == c.wall and clock.step() == 0.0
    c.advance(10.0)
    assert clock() == 1_000_010.0
    c.wall += HOURS_2  # stepped forward
    c.advance(5.0)
    assert clock() == 1_000_015.0
    assert clock.step() == HOURS_2
    c.wall -= 2 * HOURS_2  # and back, past where it was
    assert clock() == 1_000_015.0
    assert clock.step() == -HOURS_2


def test_the_real_steady_clock_reads_the_wall_clock_when_nobody_sets_it() -> None:
    clock = SteadyClock()
    assert abs(clock() - time.time()) < 0.5
    assert abs(clock.step()) < 0.5


def _doc(env: dict[str, str]) -> dict[str, Any]:
    _, doc = status_json(env)
    assert doc["source"] == "daemon", doc.get("source_detail")
    return doc


def _kinds(doc: dict[str, Any]) -> list[tuple[str, int]]:
    return sorted((f["kind"], f["pid"]) for f in doc["findings"])


def _process(doc: dict[str, Any], pid: int) -> Optional[dict[str, Any]]:
    return next((p for p in doc["processes"] if p["pid"] == pid), None)


def _polls(daemon: RunningDaemon) -> float:
    return value(daemon.scrape(), "gpuwatch_polls_total") or 0.0


def _stepped_by(daemon: RunningDaemon, seconds: float) -> Optional[float]:
    step = value(daemon.scrape(), "gpuwatch_clock_step_seconds")
    return step if step is not None and abs(step - seconds) < 60 else None


def test_a_clock_stepped_an_hour_either_way_flags_nothing_early_nor_late(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    # A trainer stepping every 2 s is stalled 2 h after its last step on a clock that jumps; a
    # zombie of seconds is older than its grace.
    zombie_grace = 12.0
    config = f"[detectors]\nstall_after = 60\nzombie_grace = {zombie_grace}\n"
    progress = tmp_path / "progress"
    with ClockJump(tmp_path) as jump, \
            running_daemon({**cli_env, **jump.env()}, tmp_path, config=config) as daemon, \
            killed_after([sys.executable, "-m", "gpuwatch.simulate.trainer", "--progress",
                          str(progress), "--step-seconds", "2"], cli_env) as trainer, \
            unreaped_child(tmp_path) as (parent, zombie):
        zombie_seen = time.monotonic()
        fake_node.hold(trainer.pid, device=0, used=GIB)
        fake_node.hold(parent, device=1, used=GIB)

        def all_seen() -> Optional[dict[str, Any]]:
            doc = status_now(cli_env)
            t = _process(doc, trainer.pid)
            ready = (t is not None and t["agent"] is not None and t["agent"]["step"] is not None
                     and _process(doc, zombie) is not None)
            return doc if ready else None

        before = wait_for("the trainer's steps and the zombie", all_seen, 30, alive=daemon.proc)
        assert _kinds(before) == []
        start = _process(before, trainer.pid)["start_time"]  # type: ignore[index]

        jump.set(HOURS_2)
        daemon.wait_for_metrics("the step forward seen", lambda _: _stepped_by(daemon, HOURS_2))
        # Long enough for the trainer's next step to be due, and a few polls on.
        polls = _polls(daemon)
        stepped_at = progress_step(progress)
        seen_forward = wait_for("polls and a training step under the step forward", lambda: (
            status_now(cli_env) if _polls(daemon) >= polls + 5
            and progress_step(progress) != stepped_at
            else None), 30, alive=daemon.proc)
        asked = time.monotonic()
        assert ("stalled", trainer.pid) not in _kinds(seen_forward)
        if asked - zombie_seen < zombie_grace:
            assert _kinds(seen_forward) == []
        # Shown on the wall clock as it reads now: the poll's time, the start times.
        assert abs(seen_forward["taken_at"] - (time.time() + HOURS_2)) < 60
        moved = _process(seen_forward, trainer.pid)["start_time"]  # type: ignore[index]
        assert abs(moved - start - HOURS_2) < 0.5

        jump.set(-HOURS_2)
        daemon.wait_for_metrics("the step back seen", lambda _: _stepped_by(daemon, -HOURS_2))
        doc = wait_for("the zombie after its grace, under the step back", lambda: (
            d if ("zombie", zombie) in _kinds(d := status_now(cli_env)) else None),
            zombie_grace + 30, alive=daemon.proc)
        # Not an hour late: on time, give or take the machine's load.
        assert time.monotonic() - zombie_seen < zombie_grace + 30
        assert _kinds(doc) == [("zombie", zombie)]
        assert abs(doc["taken_at"] - (time.time() - HOURS_2)) < 60
        # And as `gpuwatch status --json` shows it.
        assert _kinds(_doc(cli_env)) == [("zombie", zombie)]

