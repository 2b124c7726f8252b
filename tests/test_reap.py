"""`gpuwatch reap`: real processes under the fake driver, planned from a real daemon's findings
(or from one poll), signalled for real, and checked afterwards in /proc, in the fake driver's
process lists, in the audit log and in the daemon's /metrics.

tests/scenarios_reap.md tabulates every scenario and its expected outcome.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuwatch.config import load_config
from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from gpuwatch.simulate.job import launch_env
from gpuwatch.units import human_bytes
from tests.daemonproc import WatchedNode, running_daemon, setpriv_or_skip, shared_node, value
from tests.protected import roots_own_program
from tests.realprocs import GIB, processes_by_pid, status_json
from tests.scenarios import (
    _orphan,
    clean_env,
    comm,
    free_pid,
    orphaned_worker_under_pid1,
    plain_service,
    process_on_pid,
    running,
    sigkill_launcher,
    state,
    status_field,
    torchrun_job,
    unreaped_child,
    wait_not_running,
)

INTERVAL = 0.2
DETECTORS = """
[detectors]
leftover_grace = 1
zombie_grace = 0.5
ghost_grace = 0.5
min_age = 0
"""
GRACE = "1"
NOBODY = 65534
PF_KTHREAD = 0x00200000

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_NOTHING_TO_DO = 3
EXIT_INCOMPLETE = 4
EXIT_NO_PERMISSION = 77


# ---- the daemon, the CLI, the audit log ---------------------------------------------------------


@contextlib.contextmanager
def watching(node: FakeNode, env: dict[str, str], tmp_path: Path) -> Iterator[WatchedNode]:
    """The daemon on `node`, polling every INTERVAL with short detector graces."""
    with running_daemon(env, tmp_path, config=DETECTORS,
                        args=("--interval", str(INTERVAL))) as daemon:
        yield WatchedNode(node, env, daemon)


@pytest.fixture
def watched(fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path
            ) -> Iterator[WatchedNode]:
    with watching(fake_node, cli_env, tmp_path) as w:
        yield w


def findings(doc: dict[str, Any], kind: Optional[str] = None) -> list[dict[str, Any]]:
    return [f for f in doc["findings"] if kind is None or f["kind"] == kind]


def reap(args: Sequence[str], env: Mapping[str, str], timeout: float = 90
         ) -> subprocess.CompletedProcess[str]:
    """`gpuwatch reap ARGS` as a script runs it: stdin is no terminal."""
    return subprocess.run([sys.executable, "-m", "gpuwatch", "reap", *args], env=dict(env),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


def reap_json(args: Sequence[str], env: Mapping[str, str]) -> tuple[int, dict[str, Any]]:
    result = reap([*args, "--json"], env)
    assert result.stdout, f"exit {result.returncode}: {result.stderr}"
    doc = json.loads(result.stdout)
    assert doc["schema"] == 1
    return result.returncode, doc


def actions_by_pid(out: dict[str, Any]) -> dict[int, dict[str, Any]]:
    actions = {a["pid"]: a for a in out["actions"]}
    assert len(actions) == len(out["actions"]), out["actions"]
    return actions


def signal_names(action: dict[str, Any]) -> list[str]:
    """The signals an action names, in order ("SIGKILL after 1 s" names SIGKILL)."""
    return [s.split()[0] for s in action["signals"] if s.startswith("SIG")]


def audit(state_dir: Path) -> list[dict[str, Any]]:
    path = state_dir / "reap.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def executed(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The results: not the plans, nor a "signalled" line (a signal sent, no result yet)."""
    return [e for e in entries if e["phase"] == "executed"]


def state_dir(env: Mapping[str, str]) -> Path:
    return Path(env["GPUWATCH_STATE_DIR"])


def row_of(text: str, pid: int) -> str:
    """The one line of the text view that is PID `pid`'s row."""
    rows = [line for line in text.splitlines() if str(pid) in line.split()]
    assert len(rows) == 1, f"PID {pid} has {len(rows)} rows in:\n{text}"
    return rows[0]


def hand_made_finding(process: dict[str, Any], kind: str, taken_at: float) -> dict[str, Any]:
    """A finding as docs/json.md describes it, for a process of a real status document."""
    return {"kind": kind, "severity": "critical", "pid": process["pid"],
            "start_time": process["start_time"], "name": process["name"],
            "user": process["user"], "job": process["job"], "gpus": [0],
            "gpu_memory_bytes": GIB, "reason": f"hand-made {kind} finding",
            "since": taken_at - 60, "details": {}}


# ---- processes of our own ---------------------------------------------------------------------

SIGTERM_IGNORING_WORKER = """\
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stuck in a collective; only SIGKILL ends it
while True:
    time.sleep(3600)
"""

NEVER_WAITING_WORKER = """\
import os, time
child = os.fork()
if child == 0:
    os._exit(0)
while True:  # never waits for its child, which stays a zombie while this runs
    time.sleep(3600)
"""

SIGNAL_RECORDER = """\
import signal, sys, time
log = open(sys.argv[1], "a", buffering=1)
def record(signum, _frame):
    log.write(signal.Signals(signum).name + "\\n")
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD,
          signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT):
    signal.signal(s, record)
log.write("ready\\n")
while True:
    time.sleep(3600)
"""


def _script(tmp_path: Path, name: str, body: str) -> Path:
    """A Python script run through its #! line, so that its comm is `name`."""
    script = tmp_path / f"prog-{uuid.uuid4().hex[:8]}" / name
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\n{body}")
    script.chmod(0o755)
    return script


def _ignores_sigterm(pid: int) -> bool:
    mask = status_field(pid, "SigIgn")
    return mask is not None and bool(int(mask, 16) & (1 << (signal.SIGTERM - 1)))


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _worker_env(run_id: str) -> dict[str, str]:
    return launch_env(0, 1, run_id, base=clean_env())


@contextlib.contextmanager
def sigterm_ignoring_worker(tmp_path: Path) -> Iterator[int]:
    """A rank-0 worker under PID 1 (its launcher gone) that ignores SIGTERM. Yields its PID."""
    script = _script(tmp_path, "stuck-worker", SIGTERM_IGNORING_WORKER)
    with _orphan([str(script)], _worker_env("stuck-run"), "the SIGTERM-ignoring worker",
                 _ignores_sigterm) as pid:
        yield pid


@contextlib.contextmanager
def never_waiting_worker(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """A rank-0 worker under PID 1 whose exited child it never waits for. Yields (worker PID,
    zombie child PID)."""
    script = _script(tmp_path, "careless-worker", NEVER_WAITING_WORKER)

    def zombie_child(pid: int) -> bool:
        kids = _children(pid)
        return len(kids) == 1 and state(kids[0]) == "Z"

    with _orphan([str(script)], _worker_env("careless-run"), "the never-waiting worker",
                 zombie_child) as pid:
        yield pid, _children(pid)[0]


@contextlib.contextmanager
def signal_recorder(tmp_path: Path, name: str = "recorder") -> Iterator[tuple[int, Path]]:
    """A process under PID 1 that writes the name of every catchable signal it gets to a log
    (and dies only of SIGKILL). Yields (PID, log)."""
    script = _script(tmp_path, name, SIGNAL_RECORDER)
    log = script.parent / "signals.log"

    def ready(_pid: int) -> bool:
        return log.exists() and "ready" in log.read_text()

    with _orphan([str(script), str(log)], clean_env(), f"the {name} process", ready) as pid:
        yield pid, log


def received(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line != "ready"]


@contextlib.contextmanager
def process_with_pid(pid: int, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A new, unrelated signal recorder that gets exactly `pid`: real PID reuse, made on purpose
    by setting the kernel's last-allocated PID (root only; other forks may race, so retry).
    Yields the process and its signal log once its handlers are in place."""
    script = _script(tmp_path, "newcomer", SIGNAL_RECORDER)
    log = script.parent / "signals.log"
    with process_on_pid(pid, [str(script), str(log)]) as proc:
        wait_for("the new process's handlers",
                 lambda: True if log.exists() and "ready" in log.read_text() else None,
                 20, alive=proc)
        yield proc, log


@contextlib.contextmanager
def process_of_nobody() -> Iterator[int]:
    """`sleep` running as uid 65534 (nobody), a child of this process. Yields its PID."""
    proc = subprocess.Popen(["sleep", "600"], user=NOBODY, group=NOBODY, extra_groups=[])
    try:
        def as_nobody() -> Optional[bool]:
            uids = status_field(proc.pid, "Uid")
            return True if uids is not None and uids.split()[0] == str(NOBODY) else None

        wait_for("sleep to run as nobody", as_nobody, 20, alive=proc)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _kernel_thread() -> Optional[int]:
    for entry in sorted(os.scandir("/proc"), key=lambda e: int(e.name) if e.name.isdigit() else 0):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[6]) & PF_KTHREAD:
            return int(entry.name)
    return None


# ---- plans and dry runs ------------------------------------------------------------------------


def test_a_dry_run_or_a_run_without_confirmation_plans_every_orphan_and_sends_nothing(
        watched: WatchedNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with torchrun_job(tmp_path, workers=3) as job:
        memory = {pid: (rank + 1) * GIB for rank, pid in enumerate(job.workers)}
        for rank, pid in enumerate(job.workers):
            watched.node.hold(pid, device=rank % 2, used=memory[pid])
        watched.holding(*job.workers)
        sigkill_launcher(job)
        orphans = watched.findings_of("orphan", job.workers)

        text = reap(["--dry-run"], cli_env)
        assert text.returncode == EXIT_OK, text.stderr
        assert "from the running daemon" in text.stdout.splitlines()[0]
        for pid in job.workers:
            row = row_of(text.stdout, pid)
            assert "orphan" in row and "SIGTERM" in row and "root" in row
            assert human_bytes(memory[pid]) in row
            assert f"parent {job.launcher} (" in row  # the finding's reason

        rc, out = reap_json(["--dry-run"], cli_env)
        assert rc == EXIT_OK and out["dry_run"] is True and out["source"] == "daemon"
        actions = actions_by_pid(out)
        assert set(actions) == set(job.workers)
        for pid, a in actions.items():
            assert (a["kind"], a["action"], a["result"]) == ("orphan", "terminate", "planned")
            assert signal_names(a)[0] == "SIGTERM"
            assert a["start_time"] == orphans[pid]["start_time"]
            assert a["gpu_memory_bytes"] == memory[pid]
            assert a["user"] == orphans[pid]["user"] and a["job"] == orphans[pid]["job"]

        assert all(running(pid) for pid in job.workers)
        entries = audit(state_dir(cli_env))
        assert len(entries) == 2 * len(job.workers), entries  # one per action and dry run
        assert {(e["result"], e["dry_run"]) for e in entries} == {("planned", True)}
        assert {e["pid"] for e in entries} == set(job.workers)
        for e in entries:
            assert e["kind"] == "orphan" and e["action"] == "terminate"
            assert e["start_time"] == orphans[e["pid"]]["start_time"]
            assert isinstance(e["ts"], (int, float))

        # Without --yes and with no terminal to ask on: refuses to act, says what is needed.
        unconfirmed = reap([], cli_env)
        assert unconfirmed.returncode == EXIT_USAGE
        assert "--yes" in unconfirmed.stdout + unconfirmed.stderr
        assert all(running(pid) for pid in job.workers)
        assert executed(audit(state_dir(cli_env))) == []


def test_filters_narrow_the_plan_to_the_pids_user_job_kind_and_age_asked_for(
        watched: WatchedNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with torchrun_job(tmp_path, workers=2) as job:
        for pid in job.workers:
            watched.node.hold(pid, device=0, used=GIB)
        watched.holding(*job.workers)
        sigkill_launcher(job)
        orphans = watched.findings_of("orphan", job.workers)
        first, second = job.workers
        user = orphans[first]["user"]
        job_id = orphans[first]["job"]["id"]
        opened = max(f["since"] for f in orphans.values())
        wait_for("the findings to be open 1.5 s",
                 lambda: True if time.time() - opened > 1.5 else None, 10)

        def planned(*args: str) -> tuple[int, set[int]]:
            rc, out = reap_json(["--dry-run", *args], cli_env)
            return rc, set(actions_by_pid(out))

        assert planned() == (EXIT_OK, {first, second})
        assert planned("--pid", str(first)) == (EXIT_OK, {first})
        assert planned("--pid", str(first), "--pid", str(second)) == (EXIT_OK, {first, second})
        assert planned("--user", user) == (EXIT_OK, {first, second})
        assert planned("--user", "nobody") == (EXIT_NOTHING_TO_DO, set())
        assert planned("--job", job_id) == (EXIT_OK, {first, second})
        assert planned("--job", "no-such-job") == (EXIT_NOTHING_TO_DO, set())
        assert planned("--kind", "orphan") == (EXIT_OK, {first, second})
        assert planned("--kind", "leftover") == (EXIT_NOTHING_TO_DO, set())
        assert planned("--older-than", "1") == (EXIT_OK, {first, second})
        assert planned("--older-than", "3600") == (EXIT_NOTHING_TO_DO, set())
        assert all(running(pid) for pid in job.workers)
        assert executed(audit(state_dir(cli_env))) == []


def test_without_a_daemon_or_with_poll_the_plan_comes_from_one_poll(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with orphaned_worker_under_pid1(tmp_path) as worker:
        fake_node.hold(worker, device=0, used=GIB)
        alone = reap(["--dry-run"], cli_env)
        assert alone.returncode == EXIT_OK, alone.stderr
        assert "one poll" in alone.stdout.splitlines()[0]
        assert "orphan" in row_of(alone.stdout, worker)
        rc, out = reap_json(["--dry-run"], cli_env)
        assert (rc, out["source"], list(actions_by_pid(out))) == (EXIT_OK, "poll", [worker])

        with watching(fake_node, cli_env, tmp_path) as w:
            w.findings_of("orphan", [worker])
            daemon = reap(["--dry-run"], cli_env)
            assert "from the running daemon" in daemon.stdout.splitlines()[0]
            forced = reap(["--dry-run", "--poll"], cli_env)
            assert forced.returncode == EXIT_OK, forced.stderr
            assert "one poll" in forced.stdout.splitlines()[0]
            _, out = reap_json(["--dry-run", "--poll"], cli_env)
            assert out["source"] == "poll" and list(actions_by_pid(out)) == [worker]
        assert running(worker)


# ---- reaping ----------------------------------------------------------------------------------


def test_orphans_of_a_sigkilled_launcher_are_reaped_and_their_gpu_memory_freed(
        watched: WatchedNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with torchrun_job(tmp_path, workers=2) as doomed, torchrun_job(tmp_path, workers=2) as healthy:
        memory = {doomed.workers[0]: 2 * GIB, doomed.workers[1]: 3 * GIB,
                  healthy.workers[0]: GIB, healthy.workers[1]: GIB}
        for pid, used in memory.items():
            watched.node.hold(pid, device=0, used=used)
        watched.holding(*memory)
        sigkill_launcher(doomed)
        watched.findings_of("orphan", doomed.workers)
        before = watched.doc()
        used_before = before["gpus"][0]["memory_used_bytes"]

        rc, out = reap_json(["--yes", "--kind", "orphan", "--grace", GRACE], cli_env)
        assert rc == EXIT_OK, out
        assert out["dry_run"] is False and out["source"] == "daemon"
        actions = actions_by_pid(out)
        assert set(actions) == set(doomed.workers)
        for a in actions.values():
            assert (a["action"], a["result"]) == ("terminate", "exited"), a
            assert signal_names(a)[0] == "SIGTERM"
        wait_not_running(doomed.workers)
        assert all(running(pid) for pid in [healthy.launcher, *healthy.workers])

        after = watched.doc_when("the reaped workers gone from the GPU", lambda d: not (
            set(doomed.workers) & {p["pid"] for p in d["processes"] if p["holds_gpu"]}))
        freed = memory[doomed.workers[0]] + memory[doomed.workers[1]]
        assert after["gpus"][0]["memory_used_bytes"] == used_before - freed
        assert {p["pid"] for p in after["processes"] if p["holds_gpu"]} == set(healthy.workers)
        watched.doc_when("the orphan findings closed", lambda d: findings(d) == [])

        done = executed(audit(state_dir(cli_env)))
        assert {(e["pid"], e["kind"], e["action"], e["result"]) for e in done} == {
            (pid, "orphan", "terminate", "exited") for pid in doomed.workers}
        watched.daemon.wait_for_metrics(
            "the reaped orphans counted",
            lambda s: True if value(s, "gpuwatch_reaped_total", kind="orphan",
                                    result="exited") == 2 else None)


@pytest.mark.parametrize("grace_from", ["flag", "config"])
def test_a_worker_that_ignores_sigterm_is_sigkilled_after_the_grace_period(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path, grace_from: str) -> None:
    if grace_from == "flag":
        grace_args = ["--grace", GRACE]
    else:
        reaper_config = tmp_path / "reaper.toml"
        reaper_config.write_text(f"[reaper]\ngrace = {GRACE}\n")
        grace_args = ["--config", str(reaper_config)]
    with sigterm_ignoring_worker(tmp_path) as worker:
        fake_node.hold(worker, device=1, used=3 * GIB)
        with watching(fake_node, cli_env, tmp_path) as w:
            w.findings_of("orphan", [worker])
            started = time.monotonic()
            rc, out = reap_json(["--yes", *grace_args], cli_env)
            took = time.monotonic() - started
            (a,) = out["actions"]
            assert (a["pid"], a["action"], a["result"]) == (worker, "terminate", "killed"), a
            assert signal_names(a) == ["SIGTERM", "SIGKILL"]
            assert a["gpu_memory_bytes"] == 3 * GIB
            assert rc == EXIT_OK
            assert not running(worker)
            # The grace was waited out, and it was ours (1 s), not the default 10 s.
            assert float(GRACE) <= took < 10
            w.doc_when("the worker gone from the GPU", lambda d: worker not in {
                p["pid"] for p in d["processes"] if p["holds_gpu"]})
        (entry,) = executed(audit(state_dir(cli_env)))
        assert (entry["pid"], entry["result"]) == (worker, "killed")


def test_a_pid_reused_between_plan_and_signal_is_not_signalled(
        watched: WatchedNode, tmp_path: Path) -> None:
    from gpuwatch.actions.reaper import Filters, Reaper
    from gpuwatch.sinks.document import from_json

    with torchrun_job(tmp_path, workers=1) as job:
        old, doc = watched.orphan(job, used=GIB)
        audit_path = tmp_path / "api-audit" / "reap.jsonl"
        audit_path.parent.mkdir()
        reaper = Reaper(load_config(watched.daemon.config_path, environ={}),
                        audit_path=audit_path, daemon_pid=watched.daemon.proc.pid)
        actions = reaper.plan(from_json(doc), Filters(kinds=frozenset({"orphan"})))
        assert [a.pid for a in actions] == [old]

        os.kill(old, signal.SIGKILL)
        # Free once reaped: its adopter may reap lazily (PID 1 here does).
        wait_for(f"PID {old} to be released",
                 lambda: True if not Path(f"/proc/{old}").exists() else None, 60)
        with process_with_pid(old, tmp_path) as (newcomer, log):
            (result,) = reaper.execute(actions, grace=1.0)
            assert result.action.pid == old
            assert result.result == "identity-changed", result
            assert newcomer.poll() is None and running(old)
            assert received(log) == []
        (entry,) = executed(audit(audit_path.parent))
        assert (entry["pid"], entry["result"]) == (old, "identity-changed")


# ---- what is never signalled --------------------------------------------------------------------


def test_pid_1_the_daemon_kernel_threads_and_protected_processes_are_refused_with_reasons(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    from gpuwatch.actions.reaper import Filters, Reaper
    from gpuwatch.sinks.document import from_json

    config_path = tmp_path / "reaper.toml"
    config_path.write_text('[detectors]\nprotected_names = ["reap-guarded"]\n'
                           'protected_users = ["nobody"]\n')
    kthread = _kernel_thread()
    # Protected by the file it runs (root's, where only root may write), not by its name: a
    # service that merely calls itself reap-guarded (its comm) is reaped like any other.
    with roots_own_program("reap-guarded") as program, \
            _orphan([str(program), "600"], clean_env(), "root's reap-guarded",
                    lambda pid: comm(pid) == "reap-guarded") as guarded, \
            plain_service(tmp_path, name="reap-guarded") as unguarded, \
            process_of_nobody() as nobodys, \
            watching(fake_node, cli_env, tmp_path) as w:
        why = {1: "pid 1", w.daemon.proc.pid: "daemon", guarded: "protected",
               nobodys: "protected"}
        if kthread is not None:
            why[kthread] = "kernel thread"
        for pid in [*why, unguarded]:
            fake_node.hold(pid, device=0, used=GIB)
        doc = w.holding(*why, unguarded)
        listed = processes_by_pid(doc)
        doc["findings"] = [hand_made_finding(listed[pid], "orphan", doc["taken_at"])
                           for pid in [*why, unguarded]]

        reaper = Reaper(load_config(config_path, environ={}),
                        audit_path=tmp_path / "reap.jsonl", daemon_pid=w.daemon.proc.pid)
        actions = reaper.plan(from_json(doc), Filters(kinds=frozenset({"orphan"})))
        results = {r.action.pid: r for r in reaper.execute(actions, grace=1.0)}
        assert set(results) == {*why, unguarded}
        for pid, reason in why.items():
            assert results[pid].result == "refused", (pid, results[pid])
            assert reason in results[pid].detail.lower(), (pid, results[pid].detail)
        assert all(running(pid) for pid in why)
        # Refusals are about those processes, not a blanket no: the unprotected one is reaped.
        assert results[unguarded].result == "exited", results[unguarded]
        assert not running(unguarded)


def test_as_root_another_users_process_is_reaped_only_while_allow_other_users_is_on(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    from gpuwatch.actions.reaper import Filters, Reaper
    from gpuwatch.sinks.document import from_json

    if os.geteuid() != 0:
        pytest.skip("needs root")
    forbidding = tmp_path / "forbidding.toml"
    forbidding.write_text("[reaper]\nallow_other_users = false\n")
    with process_of_nobody() as nobodys:
        fake_node.hold(nobodys, device=0, used=GIB)
        _, doc = status_json(cli_env)
        doc["findings"] = [hand_made_finding(processes_by_pid(doc)[nobodys], "orphan",
                                             doc["taken_at"])]
        only_orphans = Filters(kinds=frozenset({"orphan"}))

        strict = Reaper(load_config(forbidding, environ={}), audit_path=tmp_path / "reap.jsonl")
        (refused,) = strict.execute(strict.plan(from_json(doc), only_orphans), grace=1.0)
        assert refused.result == "refused", refused
        assert "another user" in refused.detail.lower(), refused.detail
        assert running(nobodys)

        default = Reaper(load_config(Path("/dev/null"), environ={}),
                         audit_path=tmp_path / "reap.jsonl")
        (reaped,) = default.execute(default.plan(from_json(doc), only_orphans), grace=1.0)
        assert reaped.result == "exited", reaped
        assert not running(nobodys)


def test_a_caller_without_cap_kill_is_refused_another_users_process(
        fake_nvml_lib: Path, tmp_path: Path) -> None:
    setpriv = setpriv_or_skip()
    # Everything the caller needs lives where uid 65534 can reach it: pytest's tmp_path is
    # root's alone. The daemon (root) keeps serving its state socket, opened to the caller's
    # group as the gpuwatch group would be. The state directory is root's (a root daemon
    # refuses one another user owns); the audit log in it is the caller's to append to.
    with shared_node(fake_nvml_lib, 0, 0) as (node, env):
        shared = Path(env["HOME"])
        runtime, states = Path(env["GPUWATCH_RUNTIME_DIR"]), Path(env["GPUWATCH_STATE_DIR"])
        (states / "reap.jsonl").write_text("")
        os.chown(states / "reap.jsonl", NOBODY, NOBODY)
        with orphaned_worker_under_pid1(tmp_path) as worker:
            node.hold(worker, device=0, used=GIB)
            with watching(node, env, tmp_path) as w:
                w.findings_of("orphan", [worker])
                os.chown(runtime / "state.sock", -1, NOBODY)
                # The interpreter lives under /root (mode 0700): the caller may read and search
                # files (CAP_DAC_READ_SEARCH), which grants no right to signal anyone.
                result = subprocess.run(
                    [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                     "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
                     sys.executable, "-m", "gpuwatch", "reap", "--yes", "--json",
                     "--grace", GRACE],
                    env=env, cwd=shared, stdin=subprocess.DEVNULL, capture_output=True,
                    text=True, timeout=90)
                assert result.stdout, f"exit {result.returncode}: {result.stderr}"
                out = json.loads(result.stdout)
                assert out["source"] == "daemon"
                (a,) = out["actions"]
                assert (a["pid"], a["result"]) == (worker, "refused"), a
                assert "another user" in a["detail"].lower(), a["detail"]
                assert "CAP_KILL" in a["detail"], a["detail"]  # what it lacks, not "root"
                assert result.returncode == EXIT_INCOMPLETE
                assert running(worker)
        (entry,) = executed(audit(states))
        assert (entry["pid"], entry["result"]) == (worker, "refused")


GPUWATCH_GROUP = 4242  # a group id no account uses: the `gpuwatch` group of a real install


def test_a_gpuwatch_group_member_may_dry_run_and_is_refused_a_reap_it_cannot_record(
        fake_nvml_lib: Path, tmp_path: Path) -> None:
    """The state directory as the unit makes it (0750, the daemon's, group gpuwatch): a member
    of the group, not root, plans without a traceback and is told why it may not reap."""
    setpriv = setpriv_or_skip()
    with shared_node(fake_nvml_lib, 0, 0) as (node, env):
        shared = Path(env["HOME"])
        runtime, states = Path(env["GPUWATCH_RUNTIME_DIR"]), Path(env["GPUWATCH_STATE_DIR"])
        os.chown(states, 0, GPUWATCH_GROUP)
        states.chmod(0o750)
        (states / "reap.jsonl").write_text("")
        os.chown(states / "reap.jsonl", 0, GPUWATCH_GROUP)
        (states / "reap.jsonl").chmod(0o640)
        member = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}",
                  f"--groups={GPUWATCH_GROUP}", sys.executable, "-m", "gpuwatch", "reap",
                  "--json", "--grace", GRACE]
        with orphaned_worker_under_pid1(tmp_path) as worker:
            node.hold(worker, device=0, used=GIB)
            with watching(node, env, tmp_path) as w:
                w.findings_of("orphan", [worker])
                os.chown(runtime / "state.sock", -1, GPUWATCH_GROUP)
                dry = subprocess.run([*member, "--dry-run"], env=env, cwd=shared,
                                     stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                     timeout=90)
                assert "Traceback" not in dry.stderr, dry.stderr
                assert dry.returncode == EXIT_OK, dry.stderr
                (planned,) = json.loads(dry.stdout)["actions"]
                assert planned["pid"] == worker
                assert "not recorded" in dry.stderr and "permission denied" in dry.stderr.lower()

                real = subprocess.run([*member, "--yes"], env=env, cwd=shared,
                                      stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                      timeout=90)
                assert "Traceback" not in real.stderr, real.stderr
                assert real.returncode == EXIT_NO_PERMISSION, real.stderr
                assert "nothing signalled" in real.stderr
                assert str(states / "reap.jsonl") in real.stderr
                assert running(worker)
        assert audit(states) == []


def test_unkillable_and_ghost_findings_are_reported_and_never_signalled(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    from gpuwatch.actions.reaper import Filters, Reaper
    from gpuwatch.sinks.document import from_json

    with signal_recorder(tmp_path, name="stuck-in-d") as (stuck, log):
        fake_node.hold(stuck, device=0, used=GIB)
        missing = free_pid()
        fake_node.hold(missing, device=1, used=2 * GIB, ghost=True)

        # A ghost, for real: NVML lists a PID that /proc lacks. Nothing to signal.
        _, out = reap_json(["--yes", "--kind", "ghost", "--grace", GRACE], cli_env)
        (a,) = out["actions"]
        assert (a["pid"], a["kind"], a["action"]) == (missing, "ghost", "report")
        assert signal_names(a) == []
        assert a["result"] not in ("exited", "killed", "reaped")

        # An unkillable process (state D cannot be made here): a hand-made finding.
        _, doc = status_json(cli_env)
        doc["findings"] = [hand_made_finding(processes_by_pid(doc)[stuck], "unkillable",
                                             doc["taken_at"])]
        reaper = Reaper(load_config(Path("/dev/null"), environ={}),
                        audit_path=tmp_path / "reap.jsonl")
        actions = reaper.plan(from_json(doc), Filters(kinds=frozenset({"unkillable"})))
        (result,) = reaper.execute(actions, grace=1.0)
        assert result.action.pid == stuck and result.action.action == "report"
        assert list(result.action.signals) == []
        assert result.result == "unkillable", result
        assert running(stuck) and received(log) == []


# ---- zombies ------------------------------------------------------------------------------------


def test_a_zombie_whose_parent_ignores_sigchld_is_not_reaped(
        watched: WatchedNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with unreaped_child(tmp_path) as (parent, child):
        watched.node.hold(parent, device=0, used=GIB)  # the parent is a GPU job's process
        watched.findings_of("zombie", [child])
        rc, out = reap_json(["--yes", "--grace", GRACE], cli_env)
        (a,) = out["actions"]
        assert (a["pid"], a["kind"], a["action"]) == (child, "zombie", "reap-via-parent"), a
        assert signal_names(a) == ["SIGCHLD"]
        assert a["result"] in ("still-running", "failed"), a
        assert rc == EXIT_INCOMPLETE
        assert running(parent) and state(child) == "Z"


def test_a_zombie_whose_parent_is_an_orphan_goes_with_its_parent(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with never_waiting_worker(tmp_path) as (worker, zombie):
        fake_node.hold(worker, device=0, used=2 * GIB)
        with watching(fake_node, cli_env, tmp_path) as w:
            w.findings_of("orphan", [worker])
            w.findings_of("zombie", [zombie])
            # Its new parent reaps the zombie; PID 1 here takes up to 2 s to do it.
            rc, out = reap_json(["--yes", "--grace", "5"], cli_env)
            actions = actions_by_pid(out)
            assert set(actions) == {worker, zombie}
            assert (actions[worker]["action"], actions[worker]["result"]) == (
                "terminate", "exited"), actions[worker]
            assert actions[zombie]["result"] == "reaped", actions[zombie]
            assert rc == EXIT_OK
            assert not running(worker)
            wait_for("the zombie to be reaped by its adopter",
                     lambda: True if state(zombie) is None else None, 10)


# ---- jobs ------------------------------------------------------------------------------------


def test_job_reaps_only_that_jobs_leftovers_and_then_has_nothing_to_do(
        watched: WatchedNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    roles = ("redis", "actor")
    with torchrun_job(tmp_path, workers=1, helpers=roles, trainer_exit_after=3.0,
                      env={"SLURM_JOB_ID": "41001"}) as first:
        watched.node.hold(first.workers[0], device=0, used=GIB)
        watched.holding(first.workers[0])
        with torchrun_job(tmp_path, workers=1, helpers=roles, trainer_exit_after=3.0,
                          env={"SLURM_JOB_ID": "41002"}) as second:
            watched.node.hold(second.workers[0], device=1, used=GIB)
            watched.holding(second.workers[0])
            mine, theirs = list(first.helpers.values()), list(second.helpers.values())
            leftovers = watched.findings_of("leftover", [*mine, *theirs])
            assert {leftovers[pid]["job"]["id"] for pid in mine} == {"41001"}
            assert {leftovers[pid]["job"]["id"] for pid in theirs} == {"41002"}

            result = reap(["--yes", "--job", "41001", "--grace", GRACE], cli_env)
            assert result.returncode == EXIT_OK, result.stdout + result.stderr
            assert "from the running daemon" in result.stdout.splitlines()[0]
            for pid in mine:
                assert "leftover" in row_of(result.stdout, pid)
            assert str(theirs[0]) not in result.stdout and str(theirs[1]) not in result.stdout
            wait_not_running(mine)
            assert all(running(pid) for pid in theirs)

            watched.doc_when("job 41001's leftovers closed", lambda d: not any(
                f["job"] and f["job"]["id"] == "41001" for f in findings(d)))
            again = reap(["--yes", "--job", "41001", "--grace", GRACE], cli_env)
            assert again.returncode == EXIT_NOTHING_TO_DO, again.stdout + again.stderr
            assert all(running(pid) for pid in theirs)
            done = executed(audit(state_dir(cli_env)))
            assert {(e["pid"], e["kind"], e["result"]) for e in done} == {
                (pid, "leftover", "exited") for pid in mine}



# ---- what the exit code says -------------------------------------------------------------------
def test_still_held_counts_memory_the_plan_named_not_lines_of_the_plan_left_undone() -> None:
    """release.still_held, on NVML readings as `nvml_after` returns them and real PIDs: this
    process stands for one still running, and for a newcomer on a reused PID."""
    from gpuwatch.actions.reap_plan import Action, Result
    from gpuwatch.actions.release import still_held
    from gpuwatch.model import GpuDevice, GpuProcessUsage, NvmlReading, NvmlStatus
    from gpuwatch.sources.processes import ProcessSource

    me = os.getpid()
    stat = ProcessSource().stat(me)
    assert stat is not None
    gone = free_pid()

    def result(pid: int, outcome: str, start: Optional[float] = 1.0,
               target: Optional[int] = None) -> Result:
        return Result(Action(kind="orphan", action="terminate", reason="", pid=pid,
                             start_time=start, target=target if target is not None else pid),
                      outcome)

    def listing(*pids: int) -> NvmlReading:
        usage = tuple(GpuProcessUsage(0, "GPU-0", pid, GIB) for pid in pids)
        return NvmlReading(NvmlStatus(available=True), (GpuDevice(0, processes=usage),))

    blind = NvmlReading(NvmlStatus(available=False, error="process list unreadable on GPU 0"))
    # A PID reused before any signal: what it was planned for had exited, whatever NVML lists.
    assert still_held([result(me, "identity-changed")], listing(me)) == []
    # Ended: held only while the driver lists the PID and no other process has it.
    assert still_held([result(gone, "killed")], listing()) == []
    assert still_held([result(gone, "killed")], listing(gone)) == [gone]
    assert still_held([result(me, "gone")], listing(me)) == []  # the newcomer's, not ours
    assert still_held([result(me, "exited", start=stat.start_time)], listing(me)) == [me]
    # Not ended: held when NVML lists it, or the process signalled for it (a zombie's parent).
    assert still_held([result(me, "refused")], listing()) == []
    assert still_held([result(me, "still-running")], listing(me)) == [me]
    assert still_held([result(gone, "failed", target=me)], listing(me)) == [me]
    # NVML unreadable afterwards: ended counts as freed, anything else as holding.
    assert still_held([result(gone, "killed"), result(me, "refused")], blind) == [me]
