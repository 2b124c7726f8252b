"""The daemon's own reaping: off by default; when on, only the configured kinds, only findings
open long enough, with the same checks and the same audit as `gpuwatch reap`."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest

from gpuwatch.config import load_config
from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from tests.daemonproc import RunningDaemon, Samples, running_daemon, value
from tests.realprocs import GIB, status_json
from tests.scenarios import (
    JobPids,
    running,
    sigkill_launcher,
    torchrun_job,
    wait_not_running,
)
from tests.test_reap import audit
from tests.test_reap_services import forged, services

DETECTORS = "[detectors]\nleftover_grace = 0.5\nzombie_grace = 0.5\nmin_age = 0\n"


def test_auto_reap_ends_orphans_after_auto_after_and_leaves_other_kinds(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    # A grace long enough for a worker to end on SIGTERM however starved the machine (its
    # result is then "exited", not "killed"); the test waits only as long as they take.
    config = DETECTORS + "[reaper]\nauto = true\nauto_kinds = [\"orphan\"]\nauto_after = 1.0\n" \
                         "grace = 20\n"
    # The finishing trainer's 2 s run from when it holds its memory (SIGUSR1), so that the
    # daemon sees it hold some however slowly this machine started them.
    with torchrun_job(tmp_path, workers=2, helpers=("redis",)) as orphaned, \
            torchrun_job(tmp_path, workers=1, helpers=("actor",), trainer_exit_after=2.0,
                         trainer_exit_clock="sigusr1") as finishing, \
            running_daemon(cli_env, tmp_path, config=config, args=("--interval", "0.2")) as d:
        for pid in orphaned.workers:
            fake_node.hold(pid, device=0, used=GIB)
        fake_node.hold(finishing.workers[0], device=1, used=GIB)
        os.kill(finishing.workers[0], signal.SIGUSR1)
        d.wait_for_metrics("the workers seen", lambda s: (value(
            s, "gpuwatch_findings", kind="orphan") == 0 and value(s, "gpuwatch_polls_total") > 3)
            or None)
        sigkill_launcher(orphaned)
        wait_not_running(orphaned.workers, timeout=30)  # reaped by the daemon, nobody else
        samples = d.wait_for_metrics("the reaps counted", lambda s: s if (
            value(s, "gpuwatch_reaped_total", kind="orphan", result="exited") or 0) >= 2
            else None)
        assert value(samples, "gpuwatch_reaped_total", kind="leftover", result="exited") == 0
        # The leftover of the other job is found, but leftovers are not in auto_kinds.
        d.wait_for_metrics("a leftover", lambda s: (
            value(s, "gpuwatch_findings", kind="leftover") or 0) >= 1 or None)
        assert running(finishing.helpers["actor"])
        audit = [json.loads(line) for line in
                 (Path(cli_env["GPUWATCH_STATE_DIR"]) / "reap.jsonl").read_text().splitlines()]
        executed = [e for e in audit if e["phase"] == "executed"]
        assert {e["pid"] for e in executed} >= set(orphaned.workers)
        assert all(e["actor"] == "daemon" and e["kind"] == "orphan" for e in executed)
        d.wait_for_log("auto-reap: orphan")


def _orphan_it(d: RunningDaemon, job: JobPids) -> Samples:
    """Let the daemon see the job, kill its launcher, and return the metrics with the orphan."""
    d.wait_for_metrics("the worker seen", lambda s: (
        value(s, "gpuwatch_polls_total") or 0) > 3 or None)
    sigkill_launcher(job)
    return d.wait_for_metrics("the orphan", lambda s: s if value(
        s, "gpuwatch_findings", kind="orphan") == 1 else None)


def test_auto_reap_is_off_by_default(fake_node: FakeNode, cli_env: dict[str, str],
                                     tmp_path: Path) -> None:
    with torchrun_job(tmp_path, workers=1) as job, \
            running_daemon(cli_env, tmp_path, config=DETECTORS,
                           args=("--interval", "0.2")) as d:
        fake_node.hold(job.workers[0], device=0, used=GIB)
        first = _orphan_it(d, job)
        d.wait_for_metrics("ten more polls", lambda s: (
            value(s, "gpuwatch_polls_total") > value(first, "gpuwatch_polls_total") + 10) or None)
        assert running(job.workers[0])
        assert not (Path(cli_env["GPUWATCH_STATE_DIR"]) / "reap.jsonl").exists()


def test_a_reap_by_the_cli_is_counted_by_the_daemon(fake_node: FakeNode,
                                                     cli_env: dict[str, str],
                                                     tmp_path: Path) -> None:
    from tests.realprocs import gpuwatch

    with torchrun_job(tmp_path, workers=1) as job, \
            running_daemon(cli_env, tmp_path, config=DETECTORS,
                           args=("--interval", "0.2")) as d:
        fake_node.hold(job.workers[0], device=0, used=GIB)
        _orphan_it(d, job)
        result = gpuwatch(["reap", "--yes", "--grace", "1"], cli_env)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "GPU memory released" in result.stdout
        wait_for("the count", lambda: (value(d.scrape(), "gpuwatch_reaped_total", kind="orphan",
                                             result="exited") or 0) == 1 or None, 20)


def test_a_mistyped_kind_is_a_usage_error_not_nothing_to_do(cli_env: dict[str, str]) -> None:
    from tests.realprocs import gpuwatch

    result = gpuwatch(["reap", "--dry-run", "--kind", "orphans"], cli_env)
    assert result.returncode == 2
    assert "unknown kind orphans" in result.stderr


def test_the_daemons_auto_reap_refuses_and_records_a_services_processes_once(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """The auto-reap handed findings that call a kernel and a raylet's agent leftovers and the
    actor an orphan (a detector gone wrong): nothing signalled, each refusal in the audit log
    once, with its reason, however many polls bring it."""
    from gpuwatch.app.reaping import DaemonReaping
    from gpuwatch.sinks.document import from_json

    state = tmp_path / "auto-state"
    config_path = tmp_path / "auto.toml"
    config_path.write_text(f'[daemon]\nstate_dir = "{state}"\n[reaper]\nauto = true\n'
                           'auto_kinds = ["orphan", "leftover"]\nauto_after = 0\ngrace = 1\n')
    with services(fake_node, tmp_path) as pids:
        _, doc = status_json(cli_env)
        report = from_json(forged(doc, {pids["dashboard"]: "leftover",
                                        pids["kernel"]: "leftover", pids["actor"]: "orphan"}))
        reaping = DaemonReaping(load_config(config_path, environ={}), lambda *_: None)
        with caplog.at_level(logging.WARNING, logger="gpuwatch.daemon"):
            for _ in range(3):
                reaping.after_poll(report)
                if reaping._reaping is not None:
                    reaping._reaping.join(timeout=60)
        assert all(running(pid) for pid in pids.values())
        entries = audit(state)
        assert [e for e in entries if e["phase"] != "planned"] == []
        refused = {e["pid"]: e for e in entries}
        assert len(entries) == 3 and set(refused) == {pids["dashboard"], pids["kernel"],
                                                      pids["actor"]}
        assert all(e["action"] == "refuse-service" and e["actor"] == "daemon"
                   for e in entries), entries
        assert refused[pids["kernel"]]["refused"] == (
            f"a child of a service (jupyter-lab {pids['server']})")
        assert f"refused: a child of a service (raylet {pids['raylet']})" in caplog.text
