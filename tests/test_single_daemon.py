"""One daemon per runtime directory: a second one is refused, a dead one does not block, and no
daemon removes a socket or file it did not create."""

from __future__ import annotations

import fcntl
import json
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Callable

import pytest

from gpuwatch.runtime_dir import (
    EXIT_ALREADY_RUNNING,
    LOCK_NAME,
    AlreadyRunning,
    file_identity,
    refuse_if_held,
)
from gpuwatch.serve.state_socket import StateServer, fetch_status
from gpuwatch.simulate.demo import read_json
from gpuwatch.simulate.fakenvml import FakeNode
from gpuwatch.sources.agent_socket import AgentReceiver
from tests.daemonproc import RunningDaemon, running_daemon, value
from tests.realprocs import gpuwatch, status_json


def send_report(runtime: Path) -> None:
    """One valid step report (docs/agent-protocol.md), sent as a raw datagram by this process."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(json.dumps({"v": 1, "kind": "step", "step": 1}).encode(),
                 str(runtime / "agent.sock"))


def reports_accepted(d: RunningDaemon) -> float:
    return value(d.scrape(), "gpuwatch_agent_reports_total") or 0


def assert_receives_reports(d: RunningDaemon) -> None:
    before = reports_accepted(d)
    send_report(d.runtime_dir)
    d.wait_for_metrics("the report counted", lambda s: True if (
        value(s, "gpuwatch_agent_reports_total") or 0) > before else None)


def assert_serves_status(env: Mapping[str, str], d: RunningDaemon) -> None:
    code, doc = status_json(env)
    assert doc["source"] == "daemon", (code, doc.get("source_detail"), d.log())


def test_a_second_daemon_on_the_same_runtime_dir_is_refused_and_leaves_the_first_alone(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_daemon(cli_env, tmp_path / "first") as first:
        runtime = first.runtime_dir
        sockets = {name: file_identity(runtime / name) for name in ("state.sock", "agent.sock")}
        info = (runtime / "daemon.json").read_text()
        lock = runtime / LOCK_NAME
        assert lock.read_text() == f"{first.proc.pid}\n"
        assert stat.S_IMODE(lock.stat().st_mode) == 0o644

        # As a user would start it by hand, even on the same port: the runtime directory is
        # checked first, so the answer is about the daemon, not about the port.
        port = first.metrics_url.split(":")[2].split("/")[0]
        started = time.monotonic()
        second = subprocess.run(
            [sys.executable, "-m", "gpuwatch", "daemon", "--listen", f"127.0.0.1:{port}",
             "--runtime-dir", str(runtime), "--config", str(first.config_path)],
            env=cli_env, capture_output=True, text=True, timeout=60)
        assert second.returncode == EXIT_ALREADY_RUNNING, second.stderr
        assert time.monotonic() - started < 20
        message = second.stderr.strip()
        assert len(message.splitlines()) == 1, message
        assert f"PID {first.proc.pid}" in message and str(runtime) in message
        assert first.metrics_url in message and "--runtime-dir" in message

        assert first.proc.poll() is None
        assert {name: file_identity(runtime / name) for name in sockets} == sockets
        assert (runtime / "daemon.json").read_text() == info
        assert lock.read_text() == f"{first.proc.pid}\n"
        assert_serves_status(cli_env, first)
        assert "from the running daemon" in gpuwatch(["status"], cli_env).stdout
        assert_receives_reports(first)


def test_a_daemon_killed_with_sigkill_does_not_block_the_next(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_daemon(cli_env, tmp_path / "first") as first:
        first.proc.kill()
        first.proc.wait()
        runtime = first.runtime_dir
        # What it leaves: both sockets (answered by no one) and its daemon.json.
        assert (runtime / "state.sock").exists() and (runtime / "agent.sock").exists()
        assert (read_json(runtime / "daemon.json") or {}).get("pid") == first.proc.pid

    with running_daemon(cli_env, tmp_path / "next") as nxt:
        assert (runtime / LOCK_NAME).read_text() == f"{nxt.proc.pid}\n"
        # Answers on both paths show the stale sockets were replaced (a freed inode number is
        # often reused at once, so comparing inodes would prove nothing).
        assert_serves_status(cli_env, nxt)
        assert_receives_reports(nxt)
        nxt.proc.send_signal(signal.SIGTERM)
        assert nxt.proc.wait(15) == 0
    for name in ("state.sock", "agent.sock", "daemon.json"):
        assert not (runtime / name).exists(), name


def test_daemons_on_different_runtime_dirs_run_side_by_side(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    other_env = {**cli_env, "GPUWATCH_RUNTIME_DIR": str(tmp_path / "run-b")}
    with running_daemon(cli_env, tmp_path / "a") as a, \
            running_daemon(other_env, tmp_path / "b") as b:
        assert a.proc.poll() is None and b.proc.poll() is None
        for env, d in ((cli_env, a), (other_env, b)):
            assert_serves_status(env, d)
        # Each counts only what was sent to its own socket.
        before = reports_accepted(b)
        assert_receives_reports(a)
        assert reports_accepted(b) == before
        assert_receives_reports(b)


def test_a_daemon_json_rewritten_by_another_process_is_left_on_shutdown(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_daemon(cli_env, tmp_path / "d") as d:
        foreign = json.dumps({"pid": 1, "metrics_url": "http://127.0.0.1:1/metrics"})
        (d.runtime_dir / "daemon.json").write_text(foreign)
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(15) == 0
    assert (d.runtime_dir / "daemon.json").read_text() == foreign
    assert not (d.runtime_dir / "state.sock").exists()


def test_a_lock_file_that_cannot_be_created_is_named_and_nothing_is_touched(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    runtime = Path(cli_env["GPUWATCH_RUNTIME_DIR"])
    (runtime / LOCK_NAME).mkdir(parents=True)  # not a file that can be opened for writing
    result = gpuwatch(["daemon", "--listen", "127.0.0.1:0"], cli_env)
    assert result.returncode == 1, result.stderr
    assert str(runtime / LOCK_NAME) in result.stderr
    assert sorted(p.name for p in runtime.iterdir()) == [LOCK_NAME]


def test_a_user_who_may_not_write_the_lock_file_still_learns_who_holds_it(
        tmp_path: Path) -> None:
    # The check a second daemon makes when opening the lock file for writing is refused (the
    # service's directory, seen by another user). Tests run as root, so it is called directly.
    path = tmp_path / LOCK_NAME
    path.write_text("4242\n")
    refuse_if_held(path, tmp_path)  # nobody holds it: nothing to say
    with open(path, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(AlreadyRunning, match=f"PID 4242.*{re.escape(str(tmp_path))}"):
            refuse_if_held(path, tmp_path)


# ---- the classes that own the sockets ------------------------------------------------------------


def _another_file(path: Path) -> None:
    path.write_text("someone else's")


def _another_socket(path: Path) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.close()  # the file stays: it is what a stale or foreign socket looks like


@pytest.mark.parametrize("replace", [_another_file, _another_socket])
def test_state_server_stop_leaves_a_path_replaced_since_it_bound(
        tmp_path: Path, replace: Callable[[Path], None]) -> None:
    path = tmp_path / "state.sock"
    server = StateServer(path, lambda: b'{"ok": true}', group=None)
    server.start()
    try:
        assert fetch_status(path) == {"ok": True}
        path.unlink()
        replace(path)
        replaced = file_identity(path)
    finally:
        server.stop()
    assert file_identity(path) == replaced

    # Its own socket, still in place, it does remove.
    path.unlink()
    server = StateServer(path, lambda: b"{}", group=None)
    server.start()
    server.stop()
    assert not path.exists()


@pytest.mark.parametrize("replace", [_another_file, _another_socket])
def test_agent_receiver_stop_leaves_a_path_replaced_since_it_bound(
        tmp_path: Path, replace: Callable[[Path], None]) -> None:
    path = tmp_path / "agent.sock"
    receiver = AgentReceiver(path)
    receiver.start()
    try:
        path.unlink()
        replace(path)
        replaced = file_identity(path)
    finally:
        receiver.stop()
    assert file_identity(path) == replaced
