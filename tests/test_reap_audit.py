"""The reaper as its systemd unit runs it, and an audit log that survives a crash.

Real processes under the fake driver, real signals, real daemons (killed with SIGKILL where the
scenario says so), real users and capabilities through setpriv(1): a batch signals every
candidate before it waits any grace, each result is in reap.jsonl the moment it is known, a
daemon killed in the middle of a reap leaves every result it had and its successor records what
became of the rest, a torn last line is skipped and counted, a PID reused during the grace is
recorded as what it is, and whether another user's process may be signalled is decided by
CAP_KILL, not by uid 0.

tests/scenarios_reap.md tabulates every scenario and its expected outcome.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import pytest

from gpuwatch.actions.reaper import Filters, Reaper, Result
from gpuwatch.actions.signals import CAP_KILL, Signaller
from gpuwatch.config import load_config
from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from gpuwatch.sinks.document import from_json
from gpuwatch.sources.processes import ProcessSource
from tests.daemonproc import (
    RunningDaemon,
    WatchedNode,
    running_daemon,
    setpriv_or_skip,
    shared_node,
    value,
)
from tests.realprocs import GIB, processes_by_pid, status_json
from tests.scenarios import (
    _orphan,
    cmdline,
    comm,
    orphaned_worker_under_pid1,
    running,
    status_field,
)
from tests.test_reap import (
    DETECTORS,
    NOBODY,
    _script,
    _worker_env,
    hand_made_finding,
    process_with_pid,
    reap,
    received,
    signal_recorder,
    state_dir,
)

EXIT_OK = 0
EXIT_INCOMPLETE = 4
AUTO_REAP = DETECTORS + '[reaper]\nauto = true\nauto_kinds = ["orphan"]\nauto_after = 0\n'
#: The unit's three capabilities (systemd/gpuwatch.service), as setpriv names them.
UNIT_CAPS = "+kill,+sys_ptrace,+dac_read_search"


# ---- the audit log ------------------------------------------------------------------------------


def audit_lines(states: Path) -> list[Union[dict[str, Any], str]]:
    """Every line of reap.jsonl: its entry, or the text of a line that does not parse."""
    path = states / "reap.jsonl"
    if not path.exists():
        return []
    out: list[Union[dict[str, Any], str]] = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append(line)
    return out


def entries(states: Path, pid: Optional[int] = None, phase: Optional[str] = None
            ) -> list[dict[str, Any]]:
    return [e for e in audit_lines(states) if isinstance(e, dict)
            and (pid is None or e["pid"] == pid) and (phase is None or e["phase"] == phase)]


def sent(entry: dict[str, Any]) -> list[str]:
    return [s["signal"] for s in entry["sent"]]


# ---- workers that say when SIGTERM reached them -------------------------------------------------

TIMED_WORKER = """\
import os, signal, sys, time
log, on_sigterm = sys.argv[1], sys.argv[2]
def record(_signum, _frame):
    with open(log, "a") as f:
        f.write(f"SIGTERM {time.time():.6f}\\n")
    if on_sigterm == "exit":
        os._exit(0)
signal.signal(signal.SIGTERM, record)
with open(log, "a") as f:
    f.write("ready\\n")
while True:  # a rank-0 worker whose launcher is gone
    time.sleep(3600)
"""


@contextlib.contextmanager
def timed_worker(tmp_path: Path, on_sigterm: str) -> Iterator[tuple[int, Path]]:
    """An orphaned rank-0 worker under PID 1 that writes the time each SIGTERM reaches it to a
    log, then exits (`on_sigterm` "exit") or carries on ("ignore": only SIGKILL ends it).
    Yields (PID, log)."""
    script = _script(tmp_path, "timed-worker", TIMED_WORKER)
    log = script.parent / "sigterm.log"

    def ready(_pid: int) -> bool:
        return log.exists() and "ready" in log.read_text()

    with _orphan([str(script), str(log), on_sigterm], _worker_env("timed-run"),
                 f"a worker that does {on_sigterm!r} on SIGTERM", ready) as pid:
        yield pid, log


def sigterm_times(log: Path) -> list[float]:
    return [float(line.split()[1]) for line in log.read_text().splitlines()
            if line.startswith("SIGTERM ")]


def pid_released(pid: int) -> None:
    """Wait until nothing has `pid`, zombie included (PID 1 here collects lazily)."""
    wait_for(f"PID {pid} to be released",
             lambda: True if not Path(f"/proc/{pid}").exists() else None, 60)


# ---- other users, capabilities ------------------------------------------------------------------


def as_user_with(setpriv: str, caps: str) -> list[str]:
    """uid/gid 65534 with `caps` in its effective set across exec (ambient), as systemd's
    `User=` with `AmbientCapabilities=` does."""
    return [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
            f"--inh-caps={caps}", f"--ambient-caps={caps}"]


def as_root_without_cap_kill(setpriv: str) -> list[str]:
    """root with CAP_KILL out of its bounding set: root as a container with that capability
    dropped runs it."""
    return [setpriv, "--bounding-set=-kill", "--inh-caps=-kill"]


def effective(pid: int) -> tuple[int, bool]:
    """(effective uid, CAP_KILL in the effective set) of a running process."""
    uid = status_field(pid, "Uid")
    caps = status_field(pid, "CapEff")
    assert uid is not None and caps is not None
    return int(uid.split()[1]), bool(int(caps, 16) >> CAP_KILL & 1)


def daemon_as(prefix: Sequence[str], env: dict[str, str], where: Path, config: str
              ) -> contextlib.AbstractContextManager[RunningDaemon]:
    """`gpuwatch daemon` run through `prefix` (setpriv: another user, other capabilities),
    polling every 0.2 s on 127.0.0.1 (a free port). Stopped (SIGTERM) on the way out."""
    return running_daemon(env, where, config, prefix=prefix)


@contextlib.contextmanager
def nobodys_orphan(setpriv: str) -> Iterator[int]:
    """An orphaned rank-0 worker under PID 1 that runs as uid 65534. Yields its PID."""
    argv = [*as_user_with(setpriv, "+dac_read_search"), sys.executable, "-m",
            "gpuwatch.simulate.job", "--worker"]

    def started(pid: int) -> bool:
        uid = status_field(pid, "Uid")
        return (uid is not None and uid.split()[0] == str(NOBODY) and comm(pid) != "setpriv"
                and "--worker" in cmdline(pid))

    with _orphan(argv, _worker_env("nobodys-run"), "uid 65534's orphaned worker",
                 started) as pid:
        yield pid


def polls(d: RunningDaemon) -> float:
    return value(d.scrape(), "gpuwatch_polls_total") or 0


def wait_polls(d: RunningDaemon, n: int) -> None:
    """Wait until the daemon has polled `n` more times."""
    target = polls(d) + n
    d.wait_for_metrics(f"{n} more polls", lambda s: True if (
        value(s, "gpuwatch_polls_total") or 0) >= target else None, timeout=60)


# ---- one batch: SIGTERM to all, one grace, each result when known --------------------------------


def test_every_candidate_gets_sigterm_before_any_grace_is_waited_and_each_result_is_audited_when_known(  # noqa: E501
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    grace = 6.0
    states = tmp_path / "audit"
    with contextlib.ExitStack() as stack:
        stubborn, stubborn_log = stack.enter_context(timed_worker(tmp_path, "ignore"))
        quick = dict(stack.enter_context(timed_worker(tmp_path, "exit")) for _ in range(3))
        pids = [stubborn, *quick]
        for pid in pids:
            fake_node.hold(pid, device=0, used=GIB)
        _, doc = status_json(cli_env)
        reaper = Reaper(load_config(Path("/dev/null"), environ={}),
                        audit_path=states / "reap.jsonl")
        actions = reaper.plan(from_json(doc), Filters(kinds=frozenset({"orphan"})))
        assert sorted(a.pid for a in actions) == sorted(pids)
        # The one that ignores SIGTERM first: signalled one at a time, it would hold every
        # other's SIGTERM back by the whole grace.
        actions.sort(key=lambda a: a.pid != stubborn)
        started = time.time()
        results = {r.action.pid: r for r in reaper.execute(actions, grace=grace)}

        assert results[stubborn].result == "killed", results[stubborn]
        assert [name for name, _ in results[stubborn].sent] == ["SIGTERM", "SIGKILL"]
        for pid in quick:
            assert results[pid].result == "exited", results[pid]
            assert [name for name, _ in results[pid].sent] == ["SIGTERM"]
        assert not any(running(pid) for pid in pids)

        # When SIGTERM reached each, by its own clock: all together, well inside one grace.
        reached = {stubborn: sigterm_times(stubborn_log)}
        reached.update({pid: sigterm_times(log) for pid, log in quick.items()})
        assert all(len(times) == 1 for times in reached.values()), reached
        first = {pid: times[0] for pid, times in reached.items()}
        assert max(first.values()) - min(first.values()) < grace / 3, first
        assert started <= min(first.values())

        lines = audit_lines(states)
        assert all(isinstance(e, dict) for e in lines), lines
        planned = entries(states, phase="planned")
        done = {e["pid"]: e for e in entries(states, phase="executed")}
        assert len(planned) == 4 and set(done) == set(pids)
        assert len(entries(states, phase="executed")) == 4
        # Every SIGTERM on record moments after it was sent: in the result line of a process
        # that ended on it, in a "signalled" line (no result yet) for one still there.
        for pid in pids:
            after = [e for e in entries(states, pid) if e["phase"] != "planned"]
            assert after[0]["sent"][0]["signal"] == "SIGTERM", after
            assert after[0]["ts"] < first[pid] + 1.0, (after[0], first[pid])
        (waiting, *_) = entries(states, stubborn, "signalled")
        assert (waiting["result"], sent(waiting)) == (None, ["SIGTERM"])
        assert waiting["id"] == done[stubborn]["id"]
        # The plans first, before any signal; each result under its plan's id.
        assert [e["phase"] for e in lines[:4]] == ["planned"] * 4
        assert all(e["ts"] <= min(first.values()) + 0.01 for e in planned)
        assert {e["id"] for e in planned} == {e["id"] for e in done.values()}
        assert len({e["id"] for e in planned}) == 4
        # Each quick worker's result was written as soon as it exited: while the stubborn
        # one's grace still ran, not when the batch ended.
        for pid in quick:
            assert done[pid]["ts"] < first[stubborn] + grace / 2, (done[pid], first)
            assert done[pid]["ts"] < done[stubborn]["ts"]
            (term,) = done[pid]["sent"]
            assert term["signal"] == "SIGTERM" and abs(term["at"] - first[pid]) < 1.0
        term, kill = done[stubborn]["sent"]
        assert (term["signal"], kill["signal"]) == ("SIGTERM", "SIGKILL")
        assert kill["at"] - term["at"] >= grace
        assert done[stubborn]["result"] == "killed"


class HeldProcs(ProcessSource):
    """/proc as a reaper reads it, with a hold: while `held` is taken, its next look waits. What
    happens meanwhile (a process ended, its PID handed to a new one) falls between two of its
    looks, as it may between any two real ones."""

    def __init__(self) -> None:
        super().__init__()
        self.held = threading.Lock()

    def stat(self, pid: Union[int, str]) -> Any:
        with self.held:
            return super().stat(pid)


def test_a_pid_reused_during_the_grace_is_recorded_as_gone_and_the_newcomer_is_not_signalled(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    if not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("cannot steer PID allocation here (needs root)")
    states = tmp_path / "audit"
    # Records SIGTERM and carries on: only SIGKILL ends it.
    with signal_recorder(tmp_path, name="stuck-worker") as (worker, log):
        fake_node.hold(worker, device=0, used=GIB)
        _, doc = status_json(cli_env)
        doc["findings"] = [hand_made_finding(processes_by_pid(doc)[worker], "orphan",
                                             doc["taken_at"])]
        procs = HeldProcs()
        reaper = Reaper(load_config(Path("/dev/null"), environ={}),
                        audit_path=states / "reap.jsonl", signaller=Signaller(procs))
        actions = reaper.plan(from_json(doc), Filters(kinds=frozenset({"orphan"})))
        results: list[Result] = []
        batch = threading.Thread(target=lambda: results.extend(reaper.execute(actions,
                                                                               grace=120)),
                                 daemon=True)
        batch.start()
        wait_for("SIGTERM to reach the worker",
                 lambda: True if received(log) == ["SIGTERM"] else None, 20)
        with contextlib.ExitStack() as newcomers:
            with procs.held:
                # Something else ends the worker inside the grace, and its PID goes to a new,
                # unrelated process before the reaper looks again.
                os.kill(worker, signal.SIGKILL)
                pid_released(worker)
                newcomer, newcomer_log = newcomers.enter_context(
                    process_with_pid(worker, tmp_path))
            batch.join(30)
            assert not batch.is_alive()
            (result,) = results
            assert result.result == "gone", result
            assert "another process" in result.detail
            assert [name for name, _ in result.sent] == ["SIGTERM"]
            assert newcomer.poll() is None and running(worker)
            assert received(newcomer_log) == []
    (entry,) = entries(states, phase="executed")
    assert (entry["pid"], entry["result"], sent(entry)) == (worker, "gone", ["SIGTERM"])
    assert "PID now belongs to another process" in entry["detail"]


# ---- a daemon killed in the middle of a reap ----------------------------------------------------


def test_a_daemon_killed_mid_reap_has_each_result_it_had_and_its_successor_recovers_the_rest(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    states = state_dir(cli_env)
    reuse = os.access("/proc/sys/kernel/ns_last_pid", os.W_OK)
    with contextlib.ExitStack() as stack:
        quick, quick_log = stack.enter_context(timed_worker(tmp_path, "exit"))
        # Ignore SIGTERM: each keeps the grace (300 s) open until the daemon is killed.
        left_running, left_log = stack.enter_context(timed_worker(tmp_path, "ignore"))
        ended, ended_log = stack.enter_context(timed_worker(tmp_path, "ignore"))
        stubborn = {left_running: left_log, ended: ended_log}
        if reuse:
            reused, reused_log = stack.enter_context(timed_worker(tmp_path, "ignore"))
            stubborn[reused] = reused_log
        workers = [quick, *stubborn]
        for pid in workers:
            fake_node.hold(pid, device=0, used=GIB)

        with running_daemon(cli_env, tmp_path / "first", config=DETECTORS) as first:
            WatchedNode(fake_node, cli_env, first).findings_of("orphan", workers)
            # Auto-reap on once every worker is an orphan: one batch for all of them.
            first.config_path.write_text(AUTO_REAP + "grace = 300\n")
            first.proc.send_signal(signal.SIGHUP)
            wait_for("SIGTERM to reach every worker", lambda: True if all(
                sigterm_times(log) for log in [quick_log, *stubborn.values()]) else None,
                30, alive=first.proc)
            wait_for("the exited worker's result in the audit log", lambda: True if entries(
                states, quick, "executed") else None, 10, alive=first.proc)
            wait_for("the SIGTERM to each of the others on record", lambda: True if all(
                entries(states, pid, "signalled") for pid in stubborn) else None, 10,
                alive=first.proc)
            first.proc.kill()
            first.proc.wait()
        # Its daemon.json stays behind; with PIDs steered below, the next daemon may even get
        # its PID, and its stale file would pass for the new one's.
        (Path(cli_env["GPUWATCH_RUNTIME_DIR"]) / "daemon.json").unlink()

        # What the killed daemon left: every plan, and the result it had.
        assert all(isinstance(e, dict) for e in audit_lines(states))
        plans = {e["pid"]: e for e in entries(states, phase="planned")}
        assert set(plans) == set(workers)
        assert {e["actor"] for e in plans.values()} == {"daemon"}
        assert {e["reaper"]["pid"] for e in plans.values()} == {first.proc.pid}
        (result,) = entries(states, quick, "executed")
        assert (result["result"], result["id"], sent(result)) == (
            "exited", plans[quick]["id"], ["SIGTERM"])
        assert abs(result["sent"][0]["at"] - sigterm_times(quick_log)[0]) < 1.0
        assert all(entries(states, pid, "executed") == [] for pid in stubborn)
        for pid, log in stubborn.items():
            (signalled,) = entries(states, pid, "signalled")
            assert (signalled["id"], signalled["result"], sent(signalled)) == (
                plans[pid]["id"], None, ["SIGTERM"])
            assert signalled["reaper"]["pid"] == first.proc.pid
            assert signalled["ts"] < sigterm_times(log)[0] + 1.0

        # Meanwhile: one worker is ended by someone else, another too and its PID reused.
        os.kill(ended, signal.SIGKILL)
        if reuse:
            os.kill(reused, signal.SIGKILL)
            pid_released(reused)
            newcomer, newcomer_log = stack.enter_context(process_with_pid(reused, tmp_path))

        with running_daemon(cli_env, tmp_path / "second", config=DETECTORS) as second:
            def recovered() -> Optional[dict[int, dict[str, Any]]]:
                got = {e["pid"]: e for e in entries(states, phase="recovered")}
                return got if set(got) == set(stubborn) else None

            found = wait_for("the unfinished actions recovered", recovered, 20,
                             alive=second.proc)
            for pid, e in found.items():
                assert e["id"] == plans[pid]["id"] and e["kind"] == "orphan"
                assert e["actor"] == "daemon" and e["reaper"]["pid"] == second.proc.pid
                assert e["detail"].startswith(f"its reaper (daemon PID {first.proc.pid}, started ")
                assert ") stopped after sending SIGTERM before recording a result" in e["detail"]
            assert found[left_running]["result"] == "still-running", found[left_running]
            assert "same PID and start time" in found[left_running]["detail"]
            assert found[ended]["result"] == "gone", found[ended]
            if reuse:
                assert found[reused]["result"] == "gone", found[reused]
                assert "PID now belongs to another process" in found[reused]["detail"]
                assert newcomer.poll() is None and received(newcomer_log) == []
            # Nothing more was sent, and the action with a result is not recovered.
            assert running(left_running) and len(sigterm_times(left_log)) == 1
            assert entries(states, quick, "recovered") == []
            gone = len(stubborn) - 1
            second.wait_for_metrics("the recovered results counted", lambda s: True if (
                value(s, "gpuwatch_reaped_total", kind="orphan", result="gone") == gone
                and value(s, "gpuwatch_reaped_total", kind="orphan",
                          result="still-running") == 1) else None)
            # The first daemon's result is its own run's: not counted again.
            assert value(second.scrape(), "gpuwatch_reaped_total", kind="orphan",
                         result="exited") == 0
            second.wait_for_log("was left without a result")


# ---- a torn last line ---------------------------------------------------------------------------


def test_a_torn_last_line_is_skipped_counted_and_the_next_entry_starts_on_a_line_of_its_own(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    states = state_dir(cli_env)
    states.mkdir(parents=True)
    log = states / "reap.jsonl"
    earlier = {"ts": 1.0, "actor": "cli", "uid": 0, "phase": "executed", "dry_run": False,
               "pid": 4242, "kind": "orphan", "action": "terminate", "result": "exited"}
    # What a reaper killed in the middle of a write leaves: the start of a line.
    torn = [json.dumps({**earlier, "pid": pid, "detail": "x" * 40})[:60] for pid in (1, 2)]
    log.write_text(json.dumps(earlier) + "\n" + torn[0])
    with orphaned_worker_under_pid1(tmp_path) as worker:
        fake_node.hold(worker, device=0, used=GIB)
        # No daemon: the next writer (a dry run) puts its entry on a line of its own.
        dry = reap(["--dry-run"], cli_env)
        assert dry.returncode == EXIT_OK, dry.stdout + dry.stderr
        with log.open("a") as f:
            f.write(torn[1])
        with running_daemon(cli_env, tmp_path, config=DETECTORS) as d:
            d.wait_for_log("ended in a torn line")
            d.wait_for_log("2 torn lines skipped")
            assert log.read_bytes().endswith(b"\n")
            WatchedNode(fake_node, cli_env, d).findings_of("orphan", [worker])
            done = reap(["--yes", "--grace", "1"], cli_env)
            assert done.returncode == EXIT_OK, done.stdout + done.stderr
            d.wait_for_metrics("the reap counted", lambda s: True if value(
                s, "gpuwatch_reaped_total", kind="orphan", result="exited") == 1 else None)
            # Nothing torn since it started: no new count.
            assert d.log().count("torn lines skipped") == 1
    lines = audit_lines(states)
    assert lines[:2] == [earlier, torn[0]]
    assert isinstance(lines[2], dict) and (lines[2]["phase"], lines[2]["dry_run"]) == (
        "planned", True)
    assert lines[3] == torn[1]
    assert all(isinstance(e, dict) for e in lines[4:])
    assert [(e["phase"], e["result"]) for e in lines[4:]
            if isinstance(e, dict) and e["phase"] != "signalled"] == [
        ("planned", "planned"), ("executed", "exited")]


# ---- who may signal whom: CAP_KILL, not uid 0 ---------------------------------------------------


def test_a_daemon_run_as_its_unit_runs_it_reaps_another_users_orphan(
        fake_nvml_lib: Path, tmp_path: Path) -> None:
    setpriv = setpriv_or_skip()
    with shared_node(fake_nvml_lib, NOBODY, NOBODY) as (node, env), \
            orphaned_worker_under_pid1(tmp_path) as worker:  # root's
        node.hold(worker, device=0, used=GIB)
        states = Path(env["GPUWATCH_STATE_DIR"])
        config = AUTO_REAP + "grace = 1\n"
        with daemon_as(as_user_with(setpriv, UNIT_CAPS), env, states.parent / "daemon",
                       config) as d:
            assert effective(d.proc.pid) == (NOBODY, True)  # the unit's gpuwatch account
            wait_for("the daemon to reap root's orphan",
                     lambda: True if not running(worker) else None, 30, alive=d.proc)
            d.wait_for_metrics("the reap counted", lambda s: True if value(
                s, "gpuwatch_reaped_total", kind="orphan", result="exited") == 1 else None)
        (entry,) = entries(states, worker, "executed")
        assert (entry["result"], entry["actor"], entry["uid"]) == ("exited", "daemon", NOBODY)
        assert sent(entry) == ["SIGTERM"]
        assert all(e["refused"] is None for e in entries(states))


def test_root_without_cap_kill_refuses_another_users_orphan_and_records_it_once(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    setpriv = setpriv_or_skip()
    states = state_dir(cli_env)
    config = AUTO_REAP + "grace = 1\n"
    with nobodys_orphan(setpriv) as worker:
        fake_node.hold(worker, device=0, used=GIB)
        for run in ("first", "second"):
            with daemon_as(as_root_without_cap_kill(setpriv), cli_env, tmp_path / run,
                           config) as d:
                assert effective(d.proc.pid) == (0, False)
                wait_for("the refusal in the audit log", lambda: True if entries(
                    states, worker) else None, 20, alive=d.proc)
                # Polls every 0.2 s, each planning the same refused reap: recorded once.
                wait_polls(d, 25)
                (entry,) = entries(states, worker)
                assert (entry["phase"], entry["action"], entry["actor"]) == (
                    "planned", "refuse", "daemon")
                assert "CAP_KILL" in entry["refused"], entry["refused"]
                assert running(worker)
                # After a restart too: the log says it was recorded already.
                assert d.log().count(f"orphan {worker} ") == (1 if run == "first" else 0)

        # `gpuwatch reap` without CAP_KILL says why, and sends nothing.
        with daemon_as([], cli_env, tmp_path / "plain", DETECTORS) as d:
            WatchedNode(fake_node, cli_env, d).findings_of("orphan", [worker])
            result = subprocess.run(
                [*as_root_without_cap_kill(setpriv), sys.executable, "-m", "gpuwatch", "reap",
                 "--yes", "--json", "--grace", "1", "--pid", str(worker)],
                env=cli_env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                timeout=90)
        assert result.stdout, f"exit {result.returncode}: {result.stderr}"
        (a,) = json.loads(result.stdout)["actions"]
        assert (a["pid"], a["result"]) == (worker, "refused"), a
        assert "CAP_KILL" in a["detail"]
        assert result.returncode == EXIT_INCOMPLETE
        assert running(worker)
        (refused,) = entries(states, worker, "executed")
        assert (refused["actor"], refused["result"], sent(refused)) == ("cli", "refused", [])


def test_a_refusal_is_recorded_once_even_when_a_poll_in_between_plans_none(
        tmp_path: Path) -> None:
    """A daemon started again knows the refusals the log records; a poll that plans no
    refusal (the finding not old enough yet, a poll that missed it) makes it forget none. A
    new process on the same PID is another refusal."""
    from gpuwatch.actions.reap_audit import AuditFollower, AuditWriter
    from gpuwatch.actions.reap_plan import REFUSE, Action
    from gpuwatch.vocabulary import ReapOutcome

    path = tmp_path / "reap.jsonl"
    writer = AuditWriter(path, "daemon", os.geteuid())

    def refused(pid: int, start: float) -> Action:
        return Action(kind="orphan", action=REFUSE, reason="r", pid=pid, start_time=start,
                      refused="another user's process (nobody): signalling it needs CAP_KILL")

    old, other = refused(4001, 100.25), refused(4002, 100.5)
    writer.write([writer.entry(Result(old, ReapOutcome.PLANNED), "planned")])
    follower = AuditFollower(path, writer)  # a daemon started after that line
    follower.poll()
    assert follower.refusals_to_audit([]) == []  # its first poll plans none
    assert follower.refusals_to_audit([old, other]) == [other]
    assert follower.refusals_to_audit([]) == []
    assert follower.refusals_to_audit([old, other]) == []
    assert follower.refusals_to_audit([old, refused(4001, 300.0)]) == [refused(4001, 300.0)]


def test_a_process_the_log_records_as_ended_is_not_planned_again(tmp_path: Path) -> None:
    """An exited orphan stays a finding until its new parent collects it, and a daemon started
    again after a reap recovered its actions: neither ends the process a second time, nor counts
    it twice in gpuwatch_reaped_total."""
    from gpuwatch.actions.reap_audit import AuditFollower, AuditWriter
    from gpuwatch.actions.reap_plan import TERMINATE, Action

    path = tmp_path / "reap.jsonl"
    writer = AuditWriter(path, "daemon", os.geteuid())

    def action(pid: int, start: float) -> Action:
        return Action(kind="orphan", action=TERMINATE, reason="r", pid=pid, start_time=start,
                      target=pid, target_start_time=start)

    ended, killed, refused = action(4001, 100.25), action(4002, 100.5), action(4003, 101.0)
    writer.write([writer.entry(Result(ended, "exited", "on SIGTERM"), "executed"),
                  writer.entry(Result(refused, "refused", "another user's"), "executed")])
    earlier = AuditFollower(path, writer)  # a daemon started after those lines
    earlier.poll()
    later = [ended, action(4001, 200.0), killed, refused]  # 4001 again: its PID reused
    assert earlier.not_ended_yet(later) == [action(4001, 200.0), killed, refused]

    writer.write([writer.entry(Result(killed, "killed", "after SIGKILL"), "executed")])
    news = earlier.poll()
    assert news.counts == {("orphan", "killed"): 1}
    assert earlier.not_ended_yet(later) == [action(4001, 200.0), refused]


def _killed(pid: int) -> dict[str, Any]:
    """An entry recording that a reap killed the orphan `pid`."""
    from gpuwatch.actions.reap_plan import TERMINATE, Action

    action = Action(kind="orphan", action=TERMINATE, reason="r", pid=pid, start_time=100.0,
                    target=pid, target_start_time=100.0)
    return {"phase": "executed", "id": None, **Result(action, "killed", "after SIGKILL").as_json()}


def test_a_rotated_log_is_read_from_the_new_files_start_however_long_it_has_grown(
        tmp_path: Path) -> None:
    """The daemon reads the log it opened while the path names that file; once the path names
    another (logrotate renamed it, a reaper made a new one) the new file is read whole, even
    where it has grown past where the old one was read to."""
    from gpuwatch.actions.reap_audit import AuditFollower, AuditWriter

    path = tmp_path / "reap.jsonl"
    writer = AuditWriter(path, "daemon", os.geteuid())
    writer.touch()
    follower = AuditFollower(path, writer)
    follower.poll()
    writer.write([_killed(4001)])
    assert follower.poll().counts == {("orphan", "killed"): 1}
    assert follower.poll().counts == {}  # nothing new: nothing counted again
    path.rename(tmp_path / "reap.jsonl.1")
    writer.write([_killed(pid) for pid in (4002, 4003, 4004)])  # a new file, longer
    assert follower.poll().counts == {("orphan", "killed"): 3}
    writer.write([_killed(4005)])
    assert follower.poll().counts == {("orphan", "killed"): 1}


def test_a_log_put_in_place_of_the_one_read_meets_the_directorys_checks_again(
        tmp_path: Path) -> None:
    """Another user who can write the log's directory can put a file of their own in the log's
    place: the daemon reads it only through the directory's checks, which now refuse it (and
    say so once)."""
    from gpuwatch.actions.reap_audit import AuditFollower, AuditWriter

    states = tmp_path / "state"
    states.mkdir(mode=0o750)
    path = states / "reap.jsonl"
    writer = AuditWriter(path, "daemon", os.geteuid())
    writer.write([_killed(4001)])
    follower = AuditFollower(path, writer)
    assert follower.poll().error is None
    os.chmod(states, 0o777)  # a mistake: anyone may write it
    forged = states / "forged"
    forged.write_text(json.dumps(_killed(4009)) * 3 + "\n")
    forged.replace(path)
    news = follower.poll()
    assert news.counts == {} and news.error is not None and "refused" in news.error
    assert follower.poll().error is None  # said once
    os.chmod(states, 0o750)
