"""The reaper's own check: a `leftover` that is a service's process or runs under a live service
(or the daemon), and an `orphan` under one, are refused (`refuse-service`), whatever the findings
say: a document read back (an earlier daemon's, a forged one) names them, or the process turns
out to be under a service only right before the signal. Real services' stand-ins
(tests/scenarios.py `raylet_like`, `notebook_server_like`), real signals, the audit log, the CLI's
exit code, and the daemon's auto-reap.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpuwatch.config import load_config
from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from tests.realprocs import GIB, processes_by_pid, status_json
from tests.scenarios import (
    START_TIMEOUT,
    clean_env,
    comm,
    notebook_server_like,
    raylet_like,
    running,
    wait_not_running,
)
from tests.test_reap import (
    EXIT_INCOMPLETE,
    EXIT_NOTHING_TO_DO,
    audit,
    executed,
    hand_made_finding,
    reap,
    state_dir,
    watching,
)

EXIT_REFUSED_SERVICE = 5


def forged(doc: dict[str, Any], kinds: dict[int, str]) -> dict[str, Any]:
    """`doc` with hand-made findings of `kinds` ({pid: kind}) instead of its own: what an
    earlier daemon, or a document made up, may hand the reaper."""
    listed = processes_by_pid(doc)
    return {**doc, "findings": [hand_made_finding(listed[pid], kind, doc["taken_at"])
                                for pid, kind in kinds.items()]}


@contextlib.contextmanager
def services(fake_node: FakeNode, tmp_path: Path) -> Iterator[dict[str, int]]:
    """A raylet with its agents and an actor, and a notebook server with two kernels; the
    dashboard agent, the actor and a kernel hold GPU memory (so that a status document lists
    them). {"raylet", "dashboard", "actor", "server", "kernel"}: their PIDs."""
    with raylet_like(tmp_path) as ray, notebook_server_like(tmp_path, kernels=2) as server:
        dashboard, _, actor = ray.children()
        kernel, _ = server.children()
        for pid in (dashboard, actor, kernel):
            fake_node.hold(pid, device=0, used=GIB)
        yield {"raylet": ray.service, "dashboard": dashboard, "actor": actor,
               "server": server.service, "kernel": kernel}


def test_leftover_and_orphan_findings_naming_a_kernel_or_ray_agent_are_refused_not_signalled(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    """A document whose findings call a live notebook kernel and a raylet's dashboard agent
    leftovers, and the raylet's actor an orphan: planned `refuse-service` with the service
    named, carried out as `refused-service`, nothing signalled, all of it in the audit log."""
    from gpuwatch.actions.reaper import Filters, Reaper
    from gpuwatch.sinks.document import from_json

    with services(fake_node, tmp_path) as pids:
        _, doc = status_json(cli_env)
        doc = forged(doc, {pids["dashboard"]: "leftover", pids["kernel"]: "leftover",
                           pids["actor"]: "orphan"})
        audit_path = tmp_path / "audit" / "reap.jsonl"
        reaper = Reaper(load_config(None, environ={}), audit_path=audit_path)
        actions = reaper.plan(from_json(doc), Filters(kinds=frozenset({"leftover", "orphan"})))
        planned = {a.pid: a for a in actions}
        assert set(planned) == {pids["dashboard"], pids["kernel"], pids["actor"]}
        assert all(a.action == "refuse-service" and a.signals == () for a in actions), actions
        under_raylet = f"a child of a service (raylet {pids['raylet']})"
        assert planned[pids["dashboard"]].refused == under_raylet
        assert planned[pids["actor"]].refused == under_raylet
        assert planned[pids["kernel"]].refused == (
            f"a child of a service (jupyter-lab {pids['server']})")

        results = reaper.execute(actions, grace=1.0)
        assert [(r.result, r.sent) for r in results] == [("refused-service", ())] * 3
        assert all(running(pid) for pid in pids.values())
        entries = {e["pid"]: e for e in executed(audit(audit_path.parent))}
        assert set(entries) == set(planned)
        for pid, entry in entries.items():
            assert (entry["action"], entry["result"], entry["sent"]) == (
                "refuse-service", "refused-service", []), entry
            assert entry["refused"] == planned[pid].refused


def test_a_leftover_whose_own_process_is_a_service_is_refused_as_one(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    """The service itself named a leftover (the raylet, the notebook server): refused as a
    service, not only as a service's child."""
    from gpuwatch.actions.reaper import Filters, Reaper
    from gpuwatch.sinks.document import from_json

    with services(fake_node, tmp_path) as pids:
        for pid in (pids["raylet"], pids["server"]):
            fake_node.hold(pid, device=1, used=GIB)
        _, doc = status_json(cli_env)
        doc = forged(doc, {pids["raylet"]: "leftover", pids["server"]: "leftover"})
        reaper = Reaper(load_config(None, environ={}), audit_path=tmp_path / "reap.jsonl")
        actions = reaper.plan(from_json(doc), Filters(kinds=frozenset({"leftover"})))
        assert {a.pid: (a.action, a.refused) for a in actions} == {
            pids["raylet"]: ("refuse-service", f"a service (raylet {pids['raylet']})"),
            pids["server"]: ("refuse-service", f"a service (jupyter-lab {pids['server']})")}
        reaper.execute(actions, grace=1.0)
        assert all(running(pid) for pid in pids.values())


#: A child that takes SIGTERM as the cue for its parent to turn into a raylet, and carries on.
TELLS_ITS_PARENT = """\
import os, signal, time
signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getppid(), signal.SIGUSR1))
while True:
    time.sleep(3600)
"""

BECOMES_A_SERVICE = """\
import os, setproctitle, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
signal.signal(signal.SIGUSR1, lambda *_: setproctitle.setproctitle("raylet"))
signal.signal(signal.SIGTERM, lambda *_: (child.kill(), os._exit(0)))
print(child.pid, flush=True)
while True:
    time.sleep(3600)
"""


@contextlib.contextmanager
def parent_that_becomes_a_raylet(child: str = "import time; time.sleep(3600)"
                                 ) -> Iterator[tuple[int, int]]:
    """A plain Python process with one child running the Python code `child`; on SIGUSR1 the
    parent titles itself `raylet`. Yields (parent, child)."""
    proc = subprocess.Popen([sys.executable, "-c", BECOMES_A_SERVICE, child], env=clean_env(),
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True, text=True)
    try:
        assert proc.stdout is not None
        pid = int(proc.stdout.readline())
        wait_for("the child to run", lambda: running(pid) or None, START_TIMEOUT)
        yield proc.pid, pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_process_under_a_service_by_the_time_of_the_signal_is_not_signalled(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    """Planned while its parent was a plain process; the parent is a raylet by the time the
    reaper signals: the check right before the signal refuses it, nothing sent."""
    from gpuwatch.actions.reaper import Filters, Reaper
    from gpuwatch.sinks.document import from_json

    with parent_that_becomes_a_raylet() as (parent, child):
        fake_node.hold(child, device=0, used=GIB)
        _, doc = status_json(cli_env)
        doc = forged(doc, {child: "leftover"})
        audit_path = tmp_path / "audit" / "reap.jsonl"
        reaper = Reaper(load_config(None, environ={}), audit_path=audit_path)
        (action,) = reaper.plan(from_json(doc), Filters(kinds=frozenset({"leftover"})))
        assert action.action == "terminate", action

        os.kill(parent, signal.SIGUSR1)
        wait_for("the parent titled raylet", lambda: comm(parent) == "raylet" or None,
                 START_TIMEOUT)
        (result,) = reaper.execute([action], grace=1.0)
        assert result.result == "refused-service", result
        assert result.sent == ()
        assert result.detail == f"a child of a service (raylet {parent}): nothing sent"
        assert running(child) and running(parent)
        (entry,) = executed(audit(audit_path.parent))
        assert (entry["pid"], entry["result"], entry["sent"]) == (
            child, "refused-service", [])


def test_a_process_under_a_service_by_the_time_of_the_sigkill_gets_none(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    """It ignores SIGTERM, and its parent turns into a raylet during the grace: the check made
    again before the SIGKILL refuses it; only the SIGTERM was sent."""
    from gpuwatch.actions.reaper import Filters, Reaper
    from gpuwatch.sinks.document import from_json

    with parent_that_becomes_a_raylet(TELLS_ITS_PARENT) as (parent, child):
        fake_node.hold(child, device=0, used=GIB)
        _, doc = status_json(cli_env)
        reaper = Reaper(load_config(None, environ={}), audit_path=tmp_path / "reap.jsonl")
        (action,) = reaper.plan(from_json(forged(doc, {child: "leftover"})),
                                Filters(kinds=frozenset({"leftover"})))
        assert action.action == "terminate", action
        # The grace is long enough for the parent to retitle itself on a loaded machine; the
        # check before the SIGKILL is made once it is over, whenever that is.
        (result,) = reaper.execute([action], grace=8.0)
        assert comm(parent) == "raylet"
        assert result.result == "refused-service", result
        assert [name for name, _ in result.sent] == ["SIGTERM"]
        assert result.detail == (f"a child of a service (raylet {parent}): SIGTERM sent, "
                                 "SIGKILL not")
        assert running(child) and running(parent)


@contextlib.contextmanager
def serving(doc: dict[str, Any], path: Path) -> Iterator[None]:
    """A state socket at `path` that answers `doc`: an earlier daemon, whose findings the CLI
    takes as they come."""
    from gpuwatch.serve.state_socket import StateServer

    path.parent.mkdir(parents=True, exist_ok=True)
    server = StateServer(path, lambda: json.dumps(doc).encode(), group=None)
    server.start()
    try:
        yield
    finally:
        server.stop()


def test_reap_yes_refuses_what_an_earlier_daemons_document_calls_leftovers_and_exits_5(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    """`gpuwatch reap --yes` planning from a state socket whose findings name a kernel and a
    raylet's agent leftovers: nothing signalled, both refused in the text and the JSON, the
    audit log has them; the exit code is 4 while they hold GPU memory (the next job would find
    it taken), else 5, which tells the epilog that findings named a service's processes."""
    with services(fake_node, tmp_path) as pids:
        _, doc = status_json(cli_env)
        doc = forged(doc, {pids["dashboard"]: "leftover", pids["kernel"]: "leftover"})
        doc["source"] = "daemon"
        with serving(doc, Path(cli_env["GPUWATCH_RUNTIME_DIR"]) / "state.sock"):
            held = reap(["--yes", "--kind", "leftover", "--grace", "1"], cli_env)
            for pid in pids.values():
                fake_node.release(pid)
            as_json = reap(["--yes", "--kind", "leftover", "--grace", "1", "--json"], cli_env)
        assert held.returncode == EXIT_INCOMPLETE, held.stdout + held.stderr
        assert (f"refused-service: a child of a service (raylet {pids['raylet']})"
                in held.stdout), held.stdout
        assert (f"refused PID {pids['dashboard']}, {pids['kernel']}: " in held.stdout
                or f"refused PID {pids['kernel']}, {pids['dashboard']}: " in held.stdout)
        assert as_json.returncode == EXIT_REFUSED_SERVICE, as_json.stdout + as_json.stderr
        out = json.loads(as_json.stdout)
        assert {a["pid"]: (a["action"], a["result"]) for a in out["actions"]} == {
            pids["dashboard"]: ("refuse-service", "refused-service"),
            pids["kernel"]: ("refuse-service", "refused-service")}
        assert out["still_held"] == []
        assert all(running(pid) for pid in pids.values())
        results = [(e["pid"], e["result"], e["sent"])
                   for e in executed(audit(state_dir(cli_env)))]
        assert sorted(results) == sorted([(pids["dashboard"], "refused-service", []),
                                          (pids["kernel"], "refused-service", [])] * 2)


def test_reap_yes_against_a_running_daemon_plans_nothing_of_a_raylet_or_notebook_server(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    """The daemon's own findings: a raylet's actor and a kernel that held GPU memory are
    killed; `reap --yes` of every reapable kind has nothing to do, and the services and their
    other children still run."""
    with services(fake_node, tmp_path) as pids, watching(fake_node, cli_env, tmp_path) as w:
        w.holding(pids["actor"], pids["kernel"], pids["dashboard"])
        os.kill(pids["actor"], signal.SIGKILL)
        wait_not_running([pids["actor"]])
        seen = w.doc_when("the actor gone", lambda d: pids["actor"] not in {
            p["pid"] for p in d["processes"]})
        w.doc_when("polls past the leftover grace",
                   lambda d: d["taken_at"] >= seen["taken_at"] + 3)
        result = reap(["--yes", "--grace", "1", "--json"], cli_env)
        assert result.returncode == EXIT_NOTHING_TO_DO, result.stdout + result.stderr
        kept = [pid for name, pid in pids.items() if name != "actor"]
        assert [a for a in json.loads(result.stdout)["actions"] if a["pid"] in kept] == []
        assert all(running(pid) for pid in kept)


def test_a_leftover_under_the_daemon_is_refused_as_the_daemons(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    """A finding that names a process the daemon runs (by the daemon's PID, whatever its
    name): refused as the daemon's, nothing sent."""
    from gpuwatch.actions.reaper import Filters, Reaper
    from gpuwatch.sinks.document import from_json

    with parent_that_becomes_a_raylet() as (parent, child):
        fake_node.hold(child, device=0, used=GIB)
        _, doc = status_json(cli_env)
        reaper = Reaper(load_config(None, environ={}), audit_path=tmp_path / "reap.jsonl",
                        daemon_pid=parent)
        actions = reaper.plan(from_json(forged(doc, {child: "leftover"})),
                              Filters(kinds=frozenset({"leftover"})))
        assert [(a.action, a.refused) for a in actions] == [
            ("refuse-service", f"a child of the gpuwatch daemon (PID {parent})")]
        (result,) = reaper.execute(actions, grace=1.0)
        assert result.result == "refused-service" and running(child)
