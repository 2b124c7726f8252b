"""The metrics port and the state socket under clients that connect and never finish: idle
connections, slow ones, ones that stop reading, more than the cap. Neither a thread per
connection nor a traceback: the others are still answered.

The last test floods a real daemon (200 idle and 200 slow TCP connections, 100 idle state-socket
ones) while it runs, where the machine allows it, in a cgroup whose `pids.max` is the unit's
`TasksMax=64`, and counts its threads in /proc/PID/task.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge

from gpuwatch.serve.http_server import MetricsServer, bind_tcp
from gpuwatch.serve.listener import ConnectionStats
from gpuwatch.serve.state_client import MAX_RESPONSE
from gpuwatch.serve.state_socket import StateServer, StateUnavailable, fetch_status
from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from gpuwatch.sinks.document import MAX_DOCUMENT_BYTES
from tests.daemonproc import running_daemon, value

#: The systemd unit's TasksMax=.
TASKS_MAX = 64
PIDS_V1 = Path("/sys/fs/cgroup/pids")


@contextlib.contextmanager
def metrics_server(**limits: Any) -> Iterator[tuple[MetricsServer, str]]:
    registry = CollectorRegistry()
    Counter("listener_test_events", "Events.", registry=registry).inc(3)
    Gauge("listener_test_other", "Another family.", registry=registry).set(1)
    server = MetricsServer(bind_tcp("127.0.0.1", 0), registry, ConnectionStats(), **limits)
    server.start()
    try:
        yield server, f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()


def raw_request(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def scrape(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return bytes(r.read())


def test_only_metrics_and_the_root_page_answer() -> None:
    with metrics_server() as (server, base):
        assert b"listener_test_events_total 3.0" in scrape(f"{base}/metrics")
        assert b'href="/metrics"' in scrape(f"{base}/")
        for path in ("/favicon.ico", "/metrics/", "/debug", "/metricsx"):
            with pytest.raises(urllib.error.HTTPError) as err:
                scrape(base + path)
            assert err.value.code == 404
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(f"{base}/metrics", data=b"x"))
        assert err.value.code == 405 and err.value.headers["Allow"] == "GET, HEAD"

        head = raw_request(server.port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
        # What Prometheus asks for: gzip, and the formats by Accept.
        answer = raw_request(server.port, b"GET /metrics HTTP/1.1\r\nAccept-Encoding: gzip\r\n"
                                          b"Accept: application/openmetrics-text; "
                                          b"version=1.0.0\r\n\r\n")
        headers, _, body = answer.partition(b"\r\n\r\n")
        assert b"Content-Encoding: gzip" in headers
        assert b"application/openmetrics-text" in headers
        assert gzip.decompress(body).endswith(b"# EOF\n")
        only = scrape(f"{base}/metrics?name[]=listener_test_other")
        assert b"listener_test_other 1.0" in only and b"listener_test_events" not in only

        assert raw_request(server.port, b"nonsense\r\n\r\n").startswith(b"HTTP/1.1 400 ")
        huge = b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (64 << 10) + b"\r\n\r\n"
        with contextlib.suppress(ConnectionResetError):  # it may close while we still send
            assert raw_request(server.port, huge).startswith(b"HTTP/1.1 431 ")
        stats = server.stats
        assert stats.responses["200"] == 5 and stats.responses["404"] == 4
        wait_for("every connection counted", lambda: stats.result(
            "metrics", "answered") == 12 or None, 5)


def slowloris(socks: list[socket.socket], stop: threading.Event, every: float) -> None:
    """Send a request one byte at a time to each socket until the server closes it."""
    request = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slow\r\n\r\n"
    sent = 0
    while socks and not stop.is_set():
        for s in list(socks):
            try:
                s.send(request[sent % len(request):][:1])
            except OSError:
                socks.remove(s)
        sent += 1
        stop.wait(every)


@contextlib.contextmanager
def flood(port: Optional[int], unix: Optional[Path], idle: int, slow: int,
          every: float = 2.0) -> Iterator[list[socket.socket]]:
    """`idle` connections that send nothing and `slow` that send a byte every `every` s."""
    socks: list[socket.socket] = []
    for _ in range(idle + slow):
        if unix is not None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(unix))
        else:
            assert port is not None
            s = socket.create_connection(("127.0.0.1", port))
        socks.append(s)
    stop = threading.Event()
    sender = threading.Thread(target=slowloris, args=(socks[idle:], stop, every), daemon=True)
    sender.start()
    try:
        yield socks
    finally:
        stop.set()
        sender.join()
        for s in socks:
            s.close()


def test_idle_and_slow_clients_are_dropped_on_time_and_never_delay_a_scrape() -> None:
    with metrics_server(request_timeout=1.5) as (server, base):
        scrape(f"{base}/metrics")  # the listener's thread and its renderer's, both started
        threads_before = threading.active_count()
        with flood(server.port, None, idle=200, slow=200, every=0.3):
            worst = 0.0
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                start = time.monotonic()
                assert b"listener_test_events" in scrape(f"{base}/metrics")
                worst = max(worst, time.monotonic() - start)
                time.sleep(0.05)
            # The flood's own sender thread is the only new thread in this process.
            assert threading.active_count() <= threads_before + 1
        stats = server.stats
        assert worst < 1.0, worst
        # Every flood connection was closed by the server, by its deadline or the cap.
        assert stats.result("metrics", "timed_out") + stats.result("metrics", "evicted") >= 400
        assert stats.result("metrics", "timed_out") >= 200  # the rest made room under the cap
        wait_for("no connection left open", lambda: server.listener.open_connections == 0
                 or None, 5)


def test_a_listener_with_no_connection_open_sleeps_until_one_comes() -> None:
    """A daemon nobody scrapes wakes for its polls alone: the metrics port's loop does not turn
    every second while no connection is open (each turn takes the interpreter's lock and the
    poll's cache)."""
    with metrics_server() as (server, base):
        scrape(f"{base}/metrics")
        wait_for("the scrape's connection closed",
                 lambda: server.listener.open_connections == 0 or None, 5)
        turns = server.listener.turns
        time.sleep(4.0)  # the window counted: a loaded machine turns it less, never more
        # At most the expiry the closed connection had set, and nothing after it.
        assert server.listener.turns - turns <= 1
        assert b"listener_test_events" in scrape(f"{base}/metrics")


def test_past_the_cap_the_oldest_idle_connection_makes_room() -> None:
    with metrics_server(max_connections=8) as (server, base), \
            flood(server.port, None, idle=8, slow=0) as socks:
        wait_for("8 open", lambda: server.listener.open_connections == 8 or None, 5)
        assert b"listener_test_events" in scrape(f"{base}/metrics")
        assert server.stats.result("metrics", "evicted") == 1
        assert socks[0].recv(1) == b""  # the oldest, closed
        assert server.stats.result("metrics", "refused") == 0


def state_server(tmp_path: Path, body: bytes, **limits: Any) -> StateServer:
    server = StateServer(tmp_path / "state.sock", lambda: body, group=None, **limits)
    server.start()
    return server


def test_a_client_that_stops_reading_the_state_socket_is_closed_quietly(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gpuwatch.serve.listener")
    body = json.dumps({"padding": "x" * (16 << 20)}).encode()  # more than socket buffers hold
    server = state_server(tmp_path, body, response_timeout=0.5)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stuck:
            stuck.connect(str(server.path))
            stuck.sendall(b"status\n")
            wait_for("the stuck reader closed", lambda: server.stats.result(
                "state", "timed_out") == 1 or None, 5)
            # Another client is answered meanwhile and after.
            assert len(fetch_status(server.path)["padding"]) == 16 << 20
        assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
        assert "Traceback" not in caplog.text and "TimeoutError" not in caplog.text
        (line,) = [r.getMessage() for r in caplog.records if "timed out" in r.getMessage()]
        assert "no complete answer read by the client in time" in line
    finally:
        server.stop()


def test_an_answer_over_32_MiB_at_the_state_socket_is_refused_not_held(tmp_path: Path) -> None:
    """The daemon serves at most 8 MiB (MAX_DOCUMENT_BYTES); `status`, `reap` and the epilog
    read at most four times that of whatever answers at the socket, and say why."""
    assert MAX_RESPONSE >= 4 * MAX_DOCUMENT_BYTES
    server = state_server(tmp_path, json.dumps({"padding": "x" * (40 << 20)}).encode())
    try:
        with pytest.raises(StateUnavailable, match=f"answer larger than {MAX_RESPONSE} bytes"):
            fetch_status(server.path, timeout=30)
    finally:
        server.stop()


def test_idle_state_socket_clients_do_not_keep_status_out(tmp_path: Path) -> None:
    server = state_server(tmp_path, b'{"ok": true}', request_timeout=1.0)
    try:
        with flood(None, server.path, idle=100, slow=0):
            for _ in range(5):
                assert fetch_status(server.path) == {"ok": True}
            assert server.stats.result("state", "evicted") >= 100 - 64
        # A half-closed request without its newline is still a request.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(server.path))
            s.sendall(b"status")
            s.shutdown(socket.SHUT_WR)
            assert json.loads(s.recv(100)) == {"ok": True}
        with pytest.raises(StateUnavailable, match="unknown request"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(server.path))
                s.sendall(b"tell me everything\n")
                answer = json.loads(s.recv(200))
            raise StateUnavailable(answer["error"])
    finally:
        server.stop()


# -- a real daemon, flooded ----------------------------------------------------------------------
@contextlib.contextmanager
def pids_cgroup(limit: int) -> Iterator[Optional[Path]]:
    """A cgroup v1 `pids` group limited to `limit` tasks, or None where none can be made."""
    path = PIDS_V1 / f"gpuwatch-test-{os.getpid()}"
    try:
        path.mkdir()
        (path / "pids.max").write_text(str(limit))
    except OSError:
        with contextlib.suppress(OSError):
            path.rmdir()
        yield None
        return
    try:
        yield path
    finally:
        # Empty once the daemon has exited; the kernel refuses to remove it before.
        wait_for("the test cgroup to empty", lambda: not (path / "cgroup.procs").read_text()
                 or None, 10)
        path.rmdir()


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_a_daemon_flooded_with_idle_and_slow_connections_keeps_answering_in_bounded_threads(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with pids_cgroup(TASKS_MAX) as cgroup, running_daemon(cli_env, tmp_path) as d:
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(d.proc.pid))  # with all its threads
        port = int(d.metrics_url.split(":")[2].split("/")[0])
        state = d.runtime_dir / "state.sock"
        d.scrape()
        fetch_status(state)
        idle_threads = threads(d.proc.pid)
        scrapes = statuses = failures = 0
        most = idle_threads
        with flood(port, None, idle=200, slow=200), flood(None, state, idle=100, slow=0):
            # Past the daemon's 10 s request timeout, so that every flood connection ends.
            deadline = time.monotonic() + 12
            while time.monotonic() < deadline:
                try:
                    assert "gpuwatch_polls_total" in d.scrape_text()
                    scrapes += 1
                    assert fetch_status(state)["source"] == "daemon"
                    statuses += 1
                except (OSError, StateUnavailable, AssertionError) as exc:
                    failures += 1
                    print(f"failed: {exc!r}")
                most = max(most, threads(d.proc.pid))
                time.sleep(0.2)
        samples = d.scrape()
        closed = {(sock, result): value(samples, "gpuwatch_connections_total", socket=sock,
                                        result=result) or 0
                  for sock in ("metrics", "state") for result in ("timed_out", "evicted")}
        events = (cgroup / "pids.events").read_text() if cgroup is not None else "max 0"
        peak = (cgroup / "pids.peak").read_text().strip() \
            if cgroup is not None and (cgroup / "pids.peak").exists() else "?"
        print(f"\nflood: {scrapes} scrapes and {statuses} status answers, {failures} failed; "
              f"threads {idle_threads} idle, at most {most} flooded (pids.peak {peak}, "
              f"pids.max {TASKS_MAX if cgroup else 'not set: no pids cgroup here'}); "
              f"metrics connections timed out {closed['metrics', 'timed_out']:g} and "
              f"evicted {closed['metrics', 'evicted']:g}; state.sock ones timed out "
              f"{closed['state', 'timed_out']:g} and evicted {closed['state', 'evicted']:g}")
        assert failures == 0 and scrapes >= 20
        assert most <= idle_threads + 2 <= 12
        # Every flood connection was closed by the daemon: at its deadline, or to make room
        # under the cap (256 on the metrics port, 64 on state.sock).
        assert closed["metrics", "timed_out"] + closed["metrics", "evicted"] >= 400
        assert closed["state", "timed_out"] + closed["state", "evicted"] >= 100
        assert closed["state", "evicted"] >= 100 - 64
        assert re.search(r"^max 0$", events, re.M), events
        log = d.log()
        assert "can't start new thread" not in log and "Traceback" not in log
