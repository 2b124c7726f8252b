"""The daemon's own reaping: off by default; when on, only the configured kinds, only findings
open long enough, with the same checks and the same audit as `gpuwatch reap`."""

from __future__ import annotations

import json
from pathlib import Path

from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from tests.daemonproc import RunningDaemon, Samples, running_daemon, value
from tests.realprocs import GIB
from tests.scenarios import (
    JobPids,
    running,
    sigkill_launcher,
    torchrun_job,
    wait_not_running,
)

DETECTORS = "[detectors]\nleftover_grace = 0.5\nzombie_grace = 0.5\nmin_age = 0\n"


def test_auto_reap_ends_orphans_after_auto_after_and_leaves_other_kinds(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    config = DETECTORS + "[reaper]\nauto = true\nauto_kinds = [\"orphan\"]\nauto_after = 1.0\n" \
                         "grace = 1\n"
    with torchrun_job(tmp_path, workers=2, helpers=("redis",)) as orphaned, \
            torchrun_job(tmp_path, workers=1, helpers=("actor",),
                         trainer_exit_after=2.0) as finishing, \
            running_daemon(cli_env, tmp_path, config=config, args=("--interval", "0.2")) as d:
        for pid in orphaned.workers:
            fake_node.hold(pid, device=0, used=GIB)
        fake_node.hold(finishing.workers[0], device=1, used=GIB)
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
