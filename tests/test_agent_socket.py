"""The agent socket receiver, fed real datagrams by real sender processes.

Senders are tiny `python -c` programs using only socket and json, so these tests pin the wire
format of docs/agent-protocol.md rather than whatever gpuwatch.agent happens to send.
"""

from __future__ import annotations

import array
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from gpuwatch.model import NO_DISCOVERY, DiscoveredSize, TraceReport, TraceSite
from gpuwatch.protocol import MAX_FIGURE
from gpuwatch.simulate.demo import wait_for as poll_until
from gpuwatch.sources.agent_socket import (
    MAX_DATAGRAM,
    MAX_DISCOVERED_NAMES_PER_PROCESS,
    REASONS,
    TRACE_STATUSES,
    AgentReceiver,
    BufferSize,
)

# Sends each line on stdin, "x" and the payload in hex, as one blocking datagram (blocking: none
# is dropped; the "x" lets an empty payload be a line).
_SENDER = r"""
import socket, sys
path = sys.argv[1]
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
for line in sys.stdin:
    s.sendto(bytes.fromhex(line.strip()[1:]), path)
"""

# Builds n reports first, then sends them as fast as it can without blocking, dropping a report
# whenever the receiver's queue is full (as the agent does), and says how many went out.
_FLOODER = r"""
import json, socket, sys
path, n = sys.argv[1], int(sys.argv[2])
payloads = []
for i in range(n):
    if i % 10 == 9:
        buffers = {f"new{i}.{j}": {"items": j} for j in range(3)}  # fresh names: rejected soon
    else:
        buffers = {"replay": {"items": i, "bytes": 64 * i}, "queue": {"items": 3},
                   "metrics/history": {"bytes": 8 * i}}
    report = {"v": 1, "kind": "step", "seq": i, "step": i, "rss": 1 << 30, "buffers": buffers}
    if i % 100 == 99:
        report = "not an object"
    payloads.append(json.dumps(report).encode())
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.setblocking(False)
sent = dropped = 0
for p in payloads:
    try:
        s.sendto(p, path)
        sent += 1
    except BlockingIOError:
        dropped += 1
print(json.dumps({"sent": sent, "dropped": dropped}))
"""


class TickClock:
    """A clock that advances one second per reading: receive times tell reports apart."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start - 1.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def report(kind: str = "step", **fields: Any) -> bytes:
    return json.dumps({"v": 1, "kind": kind, "seq": 0, **fields}).encode()


class Sender:
    """One live sender process: several batches of reports from the same PID."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _SENDER, str(path)],
                                     stdin=subprocess.PIPE, text=True)
        self.pid = self.proc.pid

    def send(self, *payloads: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("".join(f"x{p.hex()}\n" for p in payloads))
        self.proc.stdin.flush()

    def close(self) -> None:
        self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0


def send(path: Path, *payloads: bytes) -> int:
    """Send `payloads` from a fresh child process that exits when done; its PID."""
    sender = Sender(path)
    sender.send(*payloads)
    sender.close()
    return sender.pid


def handled(receiver: AgentReceiver) -> int:
    return receiver.accepted + sum(receiver.rejected.values())


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    """The project's poll-with-deadline, for predicates that answer truthy or falsy."""
    return poll_until(what, lambda: predicate() or None, timeout)


def wait_handled(receiver: AgentReceiver, count: int) -> None:
    wait_for(lambda: handled(receiver) >= count, f"{count} datagrams handled")
    assert handled(receiver) == count


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    return tmp_path / "agent.sock"


@pytest.fixture
def receivers(sock_path: Path) -> Iterator[Callable[..., AgentReceiver]]:
    started: list[AgentReceiver] = []

    def start(**kwargs: Any) -> AgentReceiver:
        kwargs.setdefault("clock", TickClock())
        receiver = AgentReceiver(sock_path, **kwargs)
        receiver.start()
        started.append(receiver)
        return receiver

    yield start
    for receiver in started:
        receiver.stop()


@pytest.fixture
def receiver(receivers: Callable[..., AgentReceiver]) -> AgentReceiver:
    return receivers()


# -- accepted reports ----------------------------------------------------------------------------


def test_step_report_is_drained_under_the_senders_kernel_pid_with_its_fields(
        receiver: AgentReceiver, sock_path: Path) -> None:
    pid = send(sock_path, report(
        step=42, rss=123_456_789, cuda={"allocated": 1 << 30, "reserved": 3 << 30},
        buffers={"replay": {"items": 10, "bytes": 4096}, "queue": {"items": 3},
                 "metrics/loss:v1.2-x_y": {}}))
    wait_handled(receiver, 1)

    readings = receiver.drain()
    assert list(readings) == [pid]
    r = readings[pid]
    assert r.pid == pid
    assert r.uid == os.getuid()
    assert r.first_seen == r.last_seen == 1000.0
    assert r.step == 42
    assert r.step_changed_at == 1000.0
    assert r.finished_at is None and r.exit_report is None
    assert len(r.points) == 1
    point = r.points[0]
    assert r.latest == point
    assert (point.step, point.at, point.rss_bytes) == (42, 1000.0, 123_456_789)
    assert (point.cuda_allocated_bytes, point.cuda_reserved_bytes) == (1 << 30, 3 << 30)
    assert dict(point.buffers) == {"replay": BufferSize(10, 4096), "queue": BufferSize(3, None),
                                   "metrics/loss:v1.2-x_y": BufferSize(None, None)}
    with pytest.raises(TypeError):
        point.buffers["new"] = BufferSize(1, 1)  # type: ignore[index]

    again = receiver.drain()[pid]
    assert again.points == ()
    assert again.latest == point
    assert again.step == 42


def test_optional_figures_may_be_absent_or_null(receiver: AgentReceiver, sock_path: Path) -> None:
    pid = send(sock_path, report(step=1),
               report(step=2, rss=None, cuda={"allocated": None}, buffers={"b": {"items": None}}))
    wait_handled(receiver, 2)
    first, second = receiver.drain()[pid].points
    assert (first.rss_bytes, first.cuda_allocated_bytes, first.buffers) == (None, None, {})
    assert (second.rss_bytes, second.cuda_allocated_bytes, second.cuda_reserved_bytes) == (
        None, None, None)
    assert dict(second.buffers) == {"b": BufferSize(None, None)}


def test_step_changed_at_moves_only_when_the_step_changes(
        receiver: AgentReceiver, sock_path: Path) -> None:
    sender = Sender(sock_path)
    try:
        # Receive times: 1000, 1001, 1002, 1003.
        sender.send(report(step=5), report(step=5), report(step=5), report(step=6))
        wait_handled(receiver, 4)
        r = receiver.drain()[sender.pid]
        assert [p.at for p in r.points] == [1000.0, 1001.0, 1002.0, 1003.0]
        assert r.step == 6
        assert r.step_changed_at == 1003.0
        assert r.last_seen == 1003.0

        # Across drains too: 1004 and 1005 repeat step 6, 1006 goes back to 2 (a restart).
        sender.send(report(step=6), report(step=6))
        wait_handled(receiver, 6)
        r = receiver.drain()[sender.pid]
        assert (r.step, r.step_changed_at, r.last_seen) == (6, 1003.0, 1005.0)
        sender.send(report(step=2))
        wait_handled(receiver, 7)
        r = receiver.drain()[sender.pid]
        assert (r.step, r.step_changed_at) == (2, 1006.0)
    finally:
        sender.close()


def test_step_stays_when_it_repeats_across_reports_from_one_process(
        receiver: AgentReceiver, sock_path: Path) -> None:
    pid = send(sock_path, report(step=7), report(step=7), report(step=7))
    wait_handled(receiver, 3)
    r = receiver.drain()[pid]
    assert (r.step, r.step_changed_at, r.last_seen) == (7, 1000.0, 1002.0)


def test_finished_and_exit_reports_are_stored(receiver: AgentReceiver, sock_path: Path) -> None:
    pid = send(sock_path,
               report(step=100),
               report("finished", step=100),
               report("finished"),  # a second one keeps the first time
               report("exit", exit={"threads": ["MainThread", "loader-0"], "executors": 2,
                                    "process_group": True, "future": "ignored"}))
    wait_handled(receiver, 4)
    assert receiver.accepted == 4
    r = receiver.drain()[pid]
    assert r.finished_at == 1001.0
    assert r.exit_report == {"threads": ("MainThread", "loader-0"), "executors": 2,
                             "process_group": True}
    assert r.exit_report is not None
    with pytest.raises(TypeError):
        r.exit_report["executors"] = 0  # type: ignore[index]
    assert len(r.points) == 1  # only step reports are points
    assert r.step == 100 and r.step_changed_at == 1000.0
    assert r.last_seen == 1003.0


def test_an_exit_report_keeps_each_thread_pool_with_its_workers_and_their_names(
        receiver: AgentReceiver, sock_path: Path) -> None:
    pools = [{"workers": 1, "threads": ["reward_buffer_0"]},
             {"workers": 16, "threads": ["loader_0", "loader_1", "loader_2", "loader_3"]}]
    pid = send(sock_path, report("exit", exit={"executors": 3, "thread_pools": pools}))
    wait_handled(receiver, 1)
    r = receiver.drain()[pid]
    assert r.exit_report is not None
    assert [dict(pool) for pool in r.exit_report["thread_pools"]] == [
        {"workers": 1, "threads": ("reward_buffer_0",)},
        {"workers": 16, "threads": ("loader_0", "loader_1", "loader_2", "loader_3")}]
    with pytest.raises(TypeError):
        r.exit_report["thread_pools"][0]["workers"] = 0


def test_a_finished_report_without_a_step_report_makes_a_reading_without_points(
        receiver: AgentReceiver, sock_path: Path) -> None:
    pid = send(sock_path, report("finished"))
    wait_handled(receiver, 1)
    r = receiver.drain()[pid]
    assert (r.finished_at, r.step, r.latest, r.points) == (1000.0, None, None, ())


def test_identity_in_the_payload_is_ignored_for_the_kernels(
        receiver: AgentReceiver, sock_path: Path) -> None:
    pid = send(sock_path, report(step=3, pid=1, uid=0, sender={"pid": 1}))
    wait_handled(receiver, 1)
    readings = receiver.drain()
    assert list(readings) == [pid]
    assert pid != 1
    assert readings[pid].uid == os.getuid()


def test_unknown_keys_are_ignored(receiver: AgentReceiver, sock_path: Path) -> None:
    send(sock_path, report(step=1, future_field=[1, {"x": -1}], buffers={
        "b": {"items": 1, "colour": "red", "bytes": 2}}, cuda={"allocated": 1, "device": "x"}))
    wait_handled(receiver, 1)
    assert receiver.accepted == 1


# -- discovered containers, CUDA figures and trace reports ---------------------------------------


def test_cuda_allocator_figures_and_discovered_containers_are_stored_on_the_point(
        receiver: AgentReceiver, sock_path: Path) -> None:
    pid = send(sock_path, report(
        step=9, cuda={"allocated": 3 << 30, "reserved": 5 << 30, "active": (3 << 30) + 4096,
                      "allocations": 812},
        discovered={"areal.infra.rpc.rtensor._fetch_buffer": {"items": 36, "bytes": 72 << 20,
                                                              "step": 7},
                    "mymod.Registry.entries": {"items": 5},
                    "mymod.<locals>.cache:v2/x-y": {}}))
    wait_handled(receiver, 1)
    (point,) = receiver.drain()[pid].points
    assert (point.cuda_allocated_bytes, point.cuda_reserved_bytes, point.cuda_active_bytes,
            point.cuda_allocations) == (3 << 30, 5 << 30, (3 << 30) + 4096, 812)
    assert dict(point.discovered) == {
        "areal.infra.rpc.rtensor._fetch_buffer": DiscoveredSize(36, 72 << 20, 7),
        "mymod.Registry.entries": DiscoveredSize(5, None, None),
        "mymod.<locals>.cache:v2/x-y": DiscoveredSize(None, None, None)}
    assert point.buffers == {}
    with pytest.raises(TypeError):
        point.discovered["new"] = BufferSize(1, 1)  # type: ignore[index]


def test_a_report_without_a_discovery_pass_differs_from_a_pass_that_found_nothing(
        receiver: AgentReceiver, sock_path: Path) -> None:
    pid = send(sock_path, report(step=1), report(step=2, discovered={}),
               report(step=3, cuda={"allocated": 1}))
    wait_handled(receiver, 3)
    first, second, third = receiver.drain()[pid].points
    assert first.discovered is NO_DISCOVERY and third.discovered is NO_DISCOVERY
    assert second.discovered == {} and second.discovered is not NO_DISCOVERY
    assert (third.cuda_active_bytes, third.cuda_allocations) == (None, None)


def test_discovered_names_are_kept_for_the_least_recently_reported_to_go_not_capped() -> None:
    """Unlike buffer names, discovered names churn over a run: a process may report any number
    of them over its life, while the daemon keeps at most 256 interned."""
    receiver = AgentReceiver(Path("/nonexistent/agent.sock"))
    for i in range(100):  # 800 distinct names, and one name reported every time
        names = {f"mod.grower{i * 7 + j}": {"items": i} for j in range(7)}
        receiver.handle(report(step=i, discovered={"mod.steady": {"items": i}, **names}), 1,
                        1000)
    assert receiver.accepted == 100 and sum(receiver.rejected.values()) == 0
    kept = receiver.store._agents[1].discovered_names
    assert len(kept) == MAX_DISCOVERED_NAMES_PER_PROCESS
    assert "mod.steady" in kept and "mod.grower699" in kept and "mod.grower0" not in kept
    # An evicted name is valid again when it comes back.
    receiver.handle(report(step=100, discovered={"mod.grower0": {"items": 1}}), 1, 1000)
    assert receiver.accepted == 101
    assert list(receiver.drain()[1].points[-1].discovered) == ["mod.grower0"]
    # Points share one string per name with the store, as buffers do.
    receiver.handle(report(step=101, discovered={"mod.steady": {}}), 1, 1000)
    (name,) = receiver.drain()[1].points[-1].discovered
    assert name is next(k for k in receiver.store._agents[1].discovered_names if k == "mod.steady")


def test_the_newest_trace_report_is_kept_and_reports_are_counted_by_status() -> None:
    receiver = AgentReceiver(Path("/nonexistent/agent.sock"), clock=TickClock())
    assert dict(receiver.trace_reports) == dict.fromkeys(TRACE_STATUSES, 0)
    receiver.handle(report(step=40), 1, 1000)  # at 1000
    receiver.handle(report("trace", step=41, trace={
        "status": "refused", "why": "GPUWATCH_AGENT_TRACING=0"}), 1, 1000)  # 1001
    assert receiver.drain()[1].trace == TraceReport("refused", "GPUWATCH_AGENT_TRACING=0", None,
                                                    (), (), 1001.0, 41)
    receiver.handle(report("trace", step=62, trace={
        "status": "done", "steps": 20, "future": 1,
        "sites": [site(bytes=60 << 20, count=20),
                  site(file="/opt/venv/lib/data/loader.py", line=88, bytes=4096, count=10)],
        "traceback": [{"file": "train.py", "line": 120}, {"file": "leaky.py", "line": 42}]}),
        1, 1000)  # 1002
    receiver.handle(report("trace", trace={"status": "failed", "why": "busy"}), 2, 1000)
    readings = receiver.drain()
    assert readings[1].trace == TraceReport(
        "done", "", 20, (TraceSite("leaky.py", 42, 60 << 20, 20),
                         TraceSite("/opt/venv/lib/data/loader.py", 88, 4096, 10)),
        (("train.py", 120), ("leaky.py", 42)), 1002.0, 62)
    assert readings[1].step == 62 and readings[1].points == ()
    assert readings[2].trace is not None and readings[2].trace.step is None
    assert dict(receiver.trace_reports) == {"done": 1, "refused": 1, "failed": 1}
    assert receiver.accepted == 4
    # A rejected trace report leaves the stored one and the counts as they were.
    receiver.handle(trace_report(sites=[site()] * 9), 1, 1000)
    assert receiver.drain()[1].trace is not None
    assert dict(receiver.trace_reports) == {"done": 1, "refused": 1, "failed": 1}


def test_a_report_of_exactly_the_size_limit_is_accepted(
        receiver: AgentReceiver, sock_path: Path) -> None:
    base = report(step=1, pad="")
    payload = report(step=1, pad="x" * (MAX_DATAGRAM - len(base)))
    assert len(payload) == MAX_DATAGRAM
    send(sock_path, payload, payload + b" ")
    wait_handled(receiver, 2)
    assert receiver.accepted == 1
    assert receiver.rejected["oversized"] == 1


# -- the reply channel ---------------------------------------------------------------------------

# An agent's socket as gpuwatch.agent sets it up, written out with socket alone: autobound to an
# abstract address, SO_PASSCRED on. It sends one step report, says so, then either waits for
# the daemon's request and prints what arrived (credentials and source address included), or,
# with "hold", keeps its socket open without ever reading it until stdin closes.
_AGENT = r"""
import json, socket, struct, sys
path, mode = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
s.bind("")
s.sendto(b'{"v": 1, "kind": "step", "step": 1}', path)
print(json.dumps({"address": s.getsockname().hex()}), flush=True)
if mode == "hold":
    sys.stdin.read()
    sys.exit(0)
s.settimeout(60)
data, ancillary, flags, source = s.recvmsg(1024, socket.CMSG_SPACE(struct.calcsize("3i")))
pid = uid = None
for level, kind, cdata in ancillary:
    if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
        pid, uid, _ = struct.unpack("iII", cdata[:12])
print(json.dumps({"request": json.loads(data), "pid": pid, "uid": uid, "source": source,
                  "truncated": bool(flags & socket.MSG_TRUNC)}), flush=True)
"""


class Agent:
    """A live agent-like process, its PID and its abstract address."""

    def __init__(self, path: Path, mode: str = "answer") -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _AGENT, str(path), mode],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        assert self.proc.stdout is not None
        self.address = bytes.fromhex(json.loads(self.proc.stdout.readline())["address"])

    def received(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the child gives up after 60 s
        assert line, "the agent received no request"
        return json.loads(line)

    def close(self) -> None:
        self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0


def test_a_trace_request_reaches_the_agent_from_agent_sock_with_the_daemons_credentials(
        receiver: AgentReceiver, sock_path: Path) -> None:
    agent = Agent(sock_path)
    try:
        wait_handled(receiver, 1)
        reading = receiver.drain()[agent.pid]
        assert reading.can_reply
        assert agent.address.startswith(b"\0")
        assert receiver.request_trace(agent.pid, 20)
        got = agent.received()
    finally:
        agent.close()
    assert got["request"] == {"v": 1, "kind": "trace", "steps": 20}
    assert not got["truncated"]
    # What the agent checks before it accepts a request: credentials the kernel attached, of
    # root or the socket file's owner, from the very path it reports to.
    assert got["uid"] == os.getuid() == os.stat(sock_path).st_uid
    assert got["pid"] == os.getpid()
    assert got["source"] == str(sock_path)


def test_a_report_from_an_unbound_or_path_bound_socket_leaves_nowhere_to_answer(
        receiver: AgentReceiver, sock_path: Path, tmp_path: Path) -> None:
    unbound = send(sock_path, report(step=1))  # the Sender's socket is never bound
    bound_to_a_path = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[2])
s.sendto(b'{"v": 1, "kind": "step", "step": 1}', sys.argv[1])
"""
    subprocess.run([sys.executable, "-c", bound_to_a_path, str(sock_path),
                    str(tmp_path / "victim.sock")], check=True, timeout=30)
    wait_handled(receiver, 2)
    readings = receiver.drain()
    assert len(readings) == 2
    assert [r.can_reply for r in readings.values()] == [False, False]
    for pid in readings:
        assert not receiver.request_trace(pid, 20)
    assert not receiver.request_trace(999_999_999, 20)  # no such process
    assert unbound in readings


def test_the_newest_report_decides_where_to_answer(receiver: AgentReceiver) -> None:
    receiver.handle(report(step=1), 5, 1000, address=b"\0abcde")
    assert receiver.drain()[5].can_reply
    receiver.handle(report(step=2), 5, 1000, address=None)  # a new, unbound socket
    assert not receiver.drain()[5].can_reply
    receiver.handle(report(step=3), 5, 1000, address="/tmp/some.sock")
    assert not receiver.drain()[5].can_reply
    receiver.handle(report(step=4, rss=-1), 5, 1000, address=b"\0abcde")  # rejected: not kept
    assert not receiver.drain()[5].can_reply


def test_request_trace_refuses_steps_outside_1_to_100_and_works_only_while_running(
        receivers: Callable[..., AgentReceiver], sock_path: Path) -> None:
    receiver = receivers()
    agent = Agent(sock_path, mode="hold")
    try:
        wait_handled(receiver, 1)
        for steps in (0, 101, -1, True):
            assert not receiver.request_trace(agent.pid, steps)
        assert receiver.request_trace(agent.pid, 100)
        receiver.stop()
        assert not receiver.request_trace(agent.pid, 1)
    finally:
        agent.close()


def test_request_search_reaches_the_agent_and_refuses_seconds_outside_1_to_60(
        receiver: AgentReceiver, sock_path: Path) -> None:
    agent = Agent(sock_path)
    try:
        wait_handled(receiver, 1)
        for seconds in (0, 61, -1, True, 2.5):
            assert not receiver.request_search(agent.pid, seconds)  # type: ignore[arg-type]
        assert receiver.request_search(agent.pid, 60)
        got = agent.received()
    finally:
        agent.close()
    assert got["request"] == {"v": 1, "kind": "search", "seconds": 60}
    assert got["source"] == str(sock_path)
    assert not receiver.request_search(999_999_999, 60)  # no such process


def test_request_trace_never_blocks_on_a_full_queue_nor_raises_once_the_agent_is_gone(
        receiver: AgentReceiver, sock_path: Path) -> None:
    agent = Agent(sock_path, mode="hold")  # never reads its socket
    try:
        wait_handled(receiver, 1)
        results = []
        started = time.monotonic()
        # The queue of a Unix datagram socket holds a few datagrams (net.unix.max_dgram_qlen)
        # or a few hundred KiB: it is full long before this.
        while len(results) < 10_000 and (not results or results[-1]):
            results.append(receiver.request_trace(agent.pid, 20))
        elapsed = time.monotonic() - started
        assert results[0] and not results[-1], len(results)
        assert elapsed < 2.0
    finally:
        agent.close()
    # Its socket is closed: nobody listens at the address any more.
    assert not receiver.request_trace(agent.pid, 20)


# -- rejected reports ----------------------------------------------------------------------------

_65_BUFFERS = {f"b{i}": {"items": i} for i in range(65)}
_9_DISCOVERED = {f"mod.grower{i}": {"items": i} for i in range(9)}


def trace_report(**trace: Any) -> bytes:
    return report("trace", step=7, trace={"status": "done", "steps": 5, **trace})


def site(**fields: Any) -> dict[str, Any]:
    return {"file": "leaky.py", "line": 42, "bytes": 1024, "count": 1, **fields}

REJECTIONS: dict[str, list[bytes]] = {
    "malformed": [
        b"not json",
        b"[1, 2, 3]",
        b'"a string"',
        b'{"v": 1, "kind": "step", "step": 1',
        b'{"v": 1, "kind": "step", "step": 1, "s": "\xff\xfe"}',  # not UTF-8
        '{"v": 1, "kind": "step", "step": 1}'.encode("utf-16"),
        b"",
        report(kind=None),  # type: ignore[arg-type]
        report(),  # a step report without its step
        report("trace", step=1),  # a trace report without its trace
        report("trace", trace={"why": "no status"}),
    ],
    "version": [
        json.dumps({"v": 2, "kind": "step", "step": 1}).encode(),
        json.dumps({"kind": "step", "step": 1}).encode(),
        json.dumps({"v": "1", "kind": "step", "step": 1}).encode(),
        json.dumps({"v": True, "kind": "step", "step": 1}).encode(),
    ],
    "oversized": [report(step=1, pad="x" * 20 * 1024)],
    "too_many_buffers": [report(step=1, buffers=_65_BUFFERS),
                         report(step=1, discovered=_9_DISCOVERED)],
    "bad_name": [report(step=1, buffers={name: {}}) for name in (
        "", "x" * 65, "two words", "ümlaut", "semi;colon", "new\nline", "tab\t")] + [
        report(step=1, discovered={name: {}}) for name in (
            "", "x" * 129, "two words", "ümlaut", "semi;colon", "a[0]", "f()", "new\nline")],
    "bad_value": [
        report(step=-1),
        report(step=1 << 63),
        report(step=1, rss=1 << 64),
        report(step=1, seq=-5),
        report(step=1, cuda={"allocated": -1}),
        report(step=1, buffers={"b": {"items": -1}}),
        report(step=1, buffers={"b": {"bytes": 1 << 63}}),
        report("exit", exit={"threads": ["t"] * 65}),
        report("exit", exit={"threads": ["t" * 65]}),
        report("exit", exit={"executors": -1}),
        report("exit", exit={"thread_pools": [{"workers": 1}] * 65}),
        report("exit", exit={"thread_pools": [{"workers": 0}]}),
        report("exit", exit={"thread_pools": [{"workers": 5, "threads": ["t"] * 5}]}),
        report("exit", exit={"thread_pools": [{"workers": 1, "threads": ["t" * 65]}]}),
        report("paused", step=1),
        report(step=1, cuda={"active": -1}),
        report(step=1, cuda={"allocations": 1 << 63}),
        report(step=1, discovered={"m.d": {"items": -1}}),
        report(step=1, discovered={"m.d": {"bytes": 1 << 63}}),
        trace_report(status="maybe"),
        trace_report(why="x" * 201),
        trace_report(why="line\nbreak"),
        trace_report(steps=-1),
        trace_report(sites=[site()] * 9),
        trace_report(sites=[site(file="x" * 257)]),
        trace_report(sites=[site(file="")]),
        trace_report(sites=[site(file="evil\x1b[2J.py")]),
        trace_report(sites=[site(bytes=-1)]),
        trace_report(sites=[site(count=-1)]),
        trace_report(sites=[site(line=1 << 63)]),
        trace_report(traceback=[{"file": "a.py", "line": 1}] * 17),
        trace_report(traceback=[{"file": "x" * 257, "line": 1}]),
    ],
    "bad_type": [
        report(step="5"),
        report(step=True),
        report(step=1.0),
        report(step=1, rss="1"),
        report(step=1, seq=False),
        report(step=1, cuda=[1, 2]),
        report(step=1, cuda={"reserved": 1.5}),
        report(step=1, buffers=["b"]),
        report(step=1, buffers={"b": 3}),
        report(step=1, buffers={"b": {"items": "3"}}),
        report(kind=1),  # type: ignore[arg-type]
        report("exit", exit=["MainThread"]),
        report("exit", exit={"threads": "MainThread"}),
        report("exit", exit={"threads": [1]}),
        report("exit", exit={"executors": True}),
        report("exit", exit={"process_group": 1}),
        report("exit", exit={"thread_pools": {"workers": 1}}),
        report("exit", exit={"thread_pools": [["reward_buffer_0"]]}),
        report("exit", exit={"thread_pools": [{"threads": ["t"]}]}),
        report("exit", exit={"thread_pools": [{"workers": "1"}]}),
        report("exit", exit={"thread_pools": [{"workers": 1, "threads": [1]}]}),
        report(step=1, cuda={"active": "1"}),
        report(step=1, cuda={"allocations": 1.0}),
        report(step=1, discovered=["m.d"]),
        report(step=1, discovered={"m.d": 3}),
        report(step=1, discovered={"m.d": {"bytes": 1.5}}),
        report("trace", trace="done"),
        report("trace", trace={"status": 1}),
        trace_report(why=5),
        trace_report(steps="5"),
        trace_report(sites={"leaky.py": 1}),
        trace_report(sites=["leaky.py:42"]),
        trace_report(sites=[{"line": 1, "bytes": 1, "count": 1}]),  # no file
        trace_report(sites=[site(line=None)]),
        trace_report(sites=[site(bytes="1")]),
        trace_report(sites=[site(file=42)]),
        trace_report(traceback="leaky.py:42"),
        trace_report(traceback=[["leaky.py", 42]]),
        trace_report(traceback=[{"file": "leaky.py"}]),
    ],
    # Within a 64-bit integer, beyond any machine: the protocol's MAX_FIGURE.
    "implausible": [
        report(step=MAX_FIGURE + 1),
        report(step=1, rss=(1 << 63) - 1),
        report(step=1, rss=MAX_FIGURE + 1),
        report(step=1, cuda={"allocated": MAX_FIGURE + 1}),
        report(step=1, cuda={"reserved": MAX_FIGURE + 1}),
        report(step=1, cuda={"active": MAX_FIGURE + 1}),
        report(step=1, cuda={"allocations": MAX_FIGURE + 1}),
        report(step=1, buffers={"b": {"bytes": (1 << 63) - 1}}),
        report(step=1, buffers={"b": {"items": MAX_FIGURE + 1}}),
        report(step=1, discovered={"m.d": {"bytes": MAX_FIGURE + 1}}),
        report(step=1, discovered={"m.d": {"items": MAX_FIGURE + 1}}),
        trace_report(steps=MAX_FIGURE + 1),
        trace_report(sites=[site(bytes=(1 << 63) - 1)]),
        trace_report(sites=[site(count=MAX_FIGURE + 1)]),
    ],
}


@pytest.mark.parametrize("reason", sorted(REJECTIONS))
def test_each_rejection_is_counted_exactly_under_its_reason(
        reason: str, receiver: AgentReceiver, sock_path: Path) -> None:
    payloads = REJECTIONS[reason]
    send(sock_path, *payloads)
    wait_handled(receiver, len(payloads))
    assert receiver.accepted == 0
    assert dict(receiver.rejected) == {r: (len(payloads) if r == reason else 0) for r in REASONS}
    assert receiver.drain() == {}


def test_figures_beyond_what_the_node_holds_are_implausible_once_nvml_has_answered() -> None:
    """A byte figure or count above MemTotal plus the GPUs' memory is rejected and counted as
    `implausible`; until NVML has told the GPUs' memory, only MAX_FIGURE bounds them (a CUDA
    figure may rightly exceed the host's memory)."""
    gib = 1 << 30
    receiver = AgentReceiver(Path("/nonexistent/agent.sock"))
    receiver.note_node_memory(8 * gib, None)  # NVML has not answered: only MAX_FIGURE

    def accepted(pid: int, **fields: Any) -> bool:
        before = receiver.accepted
        receiver.handle(report(step=1, **fields), pid, 1000)
        return receiver.accepted > before

    assert accepted(100, cuda={"allocated": 20 * gib})
    receiver.note_node_memory(8 * gib, 16 * gib)
    receiver.note_node_memory(8 * gib, None)  # a poll without NVML keeps what it told
    receiver.note_node_memory(8 * gib, 8 * gib)  # a GPU missing from a poll: the largest stays
    assert receiver.max_bytes == 24 * gib
    assert accepted(101, cuda={"allocated": 20 * gib}, rss=2 * gib)
    assert accepted(102, buffers={"b": {"bytes": 24 * gib, "items": 24 * gib}})
    for figures in ({"cuda": {"allocated": 24 * gib + 1}}, {"rss": 25 * gib},
                    {"buffers": {"b": {"bytes": 1 << 45}}},
                    {"discovered": {"m.d": {"items": 25 * gib}}}):
        assert not accepted(103, **figures), figures
    receiver.handle(trace_report(sites=[site(bytes=(1 << 63) - 1)]), 103, 1000)
    assert receiver.rejected["implausible"] == 5
    assert set(receiver.drain()) == {100, 101, 102}


def test_every_reason_is_present_before_any_rejection(receiver: AgentReceiver) -> None:
    assert dict(receiver.rejected) == dict.fromkeys(REASONS, 0)
    assert receiver.accepted == 0


def test_a_rejected_report_changes_nothing_stored(
        receiver: AgentReceiver, sock_path: Path) -> None:
    pid = send(sock_path, report(step=1, buffers={"a": {}}),
               report(step=2, rss=-1, buffers={"b": {}}),  # bad_value: neither step nor name
               report(step=3, buffers={"c": {}}))
    wait_handled(receiver, 3)
    r = receiver.drain()[pid]
    assert [p.step for p in r.points] == [1, 3]
    assert [set(p.buffers) for p in r.points] == [{"a"}, {"c"}]


def test_distinct_buffer_names_are_capped_per_process_over_its_life(
        receiver: AgentReceiver, sock_path: Path) -> None:
    # 10,000 distinct names, 10 new ones per report: six reports fit (60 names), a seventh
    # would make 70.
    payloads = [report(step=i, buffers={f"name{i * 10 + j}": {"items": j} for j in range(10)})
                for i in range(1000)]
    known = report(step=5000, buffers={"name0": {"items": 1}, "name59": {"items": 2}})
    up_to_64 = report(step=5001, buffers={f"last{j}": {} for j in range(4)})
    pid = send(sock_path, *payloads, known, up_to_64, report(step=5002, buffers={"one_more": {}}))
    wait_handled(receiver, 1003)
    assert receiver.accepted == 6 + 2
    assert receiver.rejected["too_many_buffers"] == 994 + 1
    r = receiver.drain()[pid]
    assert [p.step for p in r.points] == [0, 1, 2, 3, 4, 5, 5000, 5001]
    names = set().union(*(p.buffers for p in r.points))
    assert len(names) == 64


def test_a_new_process_beyond_the_limit_is_rejected(
        receivers: Callable[..., AgentReceiver], sock_path: Path) -> None:
    receiver = receivers(max_processes=2)
    first = send(sock_path, report(step=1))
    second = send(sock_path, report(step=1))
    send(sock_path, report(step=1), report(step=2))  # a third process: both rejected
    send(sock_path, report(step=9))  # a fourth: rejected as well
    wait_handled(receiver, 5)
    assert receiver.accepted == 2
    assert receiver.rejected["too_many_processes"] == 3
    assert set(receiver.drain()) == {first, second}

    receiver.forget([first])  # a slot frees when a process is forgotten
    third = send(sock_path, report(step=1))
    wait_handled(receiver, 6)
    assert set(receiver.drain()) == {second, third}


def test_a_datagram_without_credentials_is_counted(sock_path: Path) -> None:
    # The kernel always attaches credentials under SO_PASSCRED; a socket standing in for it
    # exercises the branch for a datagram that comes without them (or with PID 0, a sender
    # whose PID is not visible in this namespace).
    receiver = AgentReceiver(sock_path)
    ucred_pid0 = (socket.SOL_SOCKET, socket.SCM_CREDENTIALS, array.array("i", [0, 0, 0]).tobytes())
    arrivals = [(report(step=1), [], 0, None), (report(step=1), [ucred_pid0], 0, None)]

    class FakeSocket:
        def recvmsg(self, bufsize: int, ancbufsize: int, flags: int = 0
                    ) -> tuple[bytes, list[Any], int, Any]:
            if not arrivals:
                raise BlockingIOError
            return arrivals.pop(0)

    receiver.transport._receive_batch(FakeSocket(), shared=True)  # type: ignore[arg-type]
    assert receiver.rejected["no_credentials"] == 2
    assert receiver.accepted == 0


def test_the_receiving_thread_survives_an_exception_while_handling(
        receiver: AgentReceiver, sock_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    handle = receiver.handle
    calls = []

    def failing_once(payload: bytes, pid: int, uid: int, truncated: bool = False,
                     address: Any = None, via: Any = None) -> None:
        calls.append(payload)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        handle(payload, pid, uid, truncated, address, via)

    # What the transport hands each datagram to.
    monkeypatch.setattr(receiver.transport, "_handle", failing_once)
    receiver.stop()
    receiver.start()
    pid = send(sock_path, report(step=1), report(step=2))
    wait_handled(receiver, 2)
    assert receiver.rejected["malformed"] == 1
    assert [p.step for p in receiver.drain()[pid].points] == [2]


def test_passed_file_descriptors_are_closed_not_kept(
        receiver: AgentReceiver, sock_path: Path) -> None:
    sender = r"""
import array, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
fds = array.array("i", [os.open("/dev/null", os.O_RDONLY) for _ in range(4)])
for step in range(20):
    s.sendmsg([b'{"v": 1, "kind": "step", "step": %d}' % step],
               [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())], 0, sys.argv[1])
"""
    before = len(os.listdir("/proc/self/fd"))
    subprocess.run([sys.executable, "-c", sender, str(sock_path)], check=True, timeout=30)
    wait_handled(receiver, 20)
    assert receiver.accepted == 20
    # One more descriptor is the sending user's own socket (agent.d), made at its first report.
    assert len(os.listdir("/proc/self/fd")) <= before + len(receiver.transport._private)


# -- bounds under load ---------------------------------------------------------------------------


def test_a_flood_leaves_the_receiver_alive_bounded_and_consistent(
        receiver: AgentReceiver, sock_path: Path) -> None:
    send(sock_path, report(step=0))
    wait_handled(receiver, 1)
    receiver.drain()
    rss_before = rss_bytes()

    proc = subprocess.run([sys.executable, "-c", _FLOODER, str(sock_path), "100000"],
                          capture_output=True, text=True, check=True, timeout=120)
    flood = json.loads(proc.stdout)
    assert flood["sent"] + flood["dropped"] == 100_000
    assert flood["sent"] > 0
    # Every datagram the kernel took is handled exactly once: accepted or rejected, never lost.
    wait_handled(receiver, 1 + flood["sent"])
    assert receiver.accepted <= 1 + flood["sent"]
    assert receiver.rejected["malformed"] > 0 or flood["sent"] < 100
    assert rss_bytes() - rss_before < 16 << 20

    readings = receiver.drain()
    (flooder,) = (r for r in readings.values() if r.points)
    assert len(flooder.points) <= receiver.max_points
    names = set().union(*(p.buffers for p in flooder.points))
    assert len(names) <= 64

    pid = send(sock_path, report(step=77))
    wait_for(lambda: receiver.drain().get(pid), "a normal report after the flood")


def test_memory_is_bounded_whatever_is_sent() -> None:
    """Every bound at once: all process slots taken, each with 64 maximal names, full pending
    points of 64 buffers and 8 discovered containers with large figures, a maximal exit report,
    a maximal trace report, the longest reply address, and names churning (buffer names
    rejected, discovered names replacing the least recently reported)."""
    processes, max_pending = 8, 2048
    receiver = AgentReceiver(Path("/nonexistent/agent.sock"), max_processes=processes,
                             max_points=256, max_pending=max_pending)
    names = [f"{i:02d}".ljust(64, "n") for i in range(64)]
    exit_report = report("exit", exit={"threads": [f"{i:02d}".ljust(64, "t") for i in range(64)],
                                       "executors": (1 << 63) - 1, "process_group": True})
    big = MAX_FIGURE  # the largest figure a report may carry; line numbers may be larger
    line = (1 << 63) - 1
    address = b"\0" + b"a" * 107  # sun_path's 108 bytes

    def round_(first_step: int) -> list[tuple[bytes, int]]:
        sends = []
        for pid in range(100, 100 + processes + 2):  # two more than fit
            for step in range(first_step, first_step + 40):
                sends.append((report(step=step, rss=big - step, buffers={
                    name: {"items": big - step - i, "bytes": big - i}
                    for i, name in enumerate(names)}, discovered={
                    f"{step}.{i}".ljust(128, "d"): {"items": big - i, "bytes": big - step}
                    for i in range(8)}), pid))
            for churn in range(5):
                sends.append((report(step=first_step, buffers={
                    f"churn{first_step}.{churn}.{i}": {} for i in range(64)}), pid))
            sends.append((exit_report, pid))
            sends.append((report("trace", step=big, trace={
                "status": "failed", "why": f"{first_step}".ljust(200, "w"), "steps": big,
                "sites": [{"file": f"{first_step}.{i}".ljust(256, "f"), "line": line,
                           "bytes": big, "count": big} for i in range(8)],
                "traceback": [{"file": f"{first_step}.{i}".ljust(256, "t"), "line": line}
                              for i in range(16)]}), pid))
        return sends

    rounds = [round_(r * 1000) for r in range(4)]  # built first: only the receiver is measured
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for payload, pid in rounds[0]:
            receiver.handle(payload, pid, 1000, address=address)
        after_one = tracemalloc.get_traced_memory()[0] - base
        for sends in rounds[1:]:
            for payload, pid in sends:
                receiver.handle(payload, pid, 1000, address=address + b"")
        after_four = tracemalloc.get_traced_memory()[0] - base
        readings = receiver.drain()
        del readings
        fixed = tracemalloc.get_traced_memory()[0] - base  # no pending points left
    finally:
        tracemalloc.stop()

    assert receiver.accepted > 0 and receiver.rejected["too_many_buffers"] > 0
    assert receiver.store._pending_total <= max_pending + processes * 73
    assert after_four - after_one < 64 << 10  # flat: later rounds add nothing
    # What the docstring promises: a fixed part per process plus a part per pending entry.
    per_process, per_entry = 104 << 10, 256
    assert fixed < processes * per_process
    assert after_four < processes * per_process + max_pending * per_entry
    for sends in rounds[:1]:
        for payload, pid in sends:
            receiver.handle(payload, pid, 1000, address=address)
    readings = receiver.drain()
    assert len(readings) == processes
    assert sum(len(r.points) for r in readings.values()) <= max_pending


def test_over_the_global_cap_a_process_loses_its_own_oldest_points_first() -> None:
    receiver = AgentReceiver(Path("/nonexistent/agent.sock"), max_pending=20, clock=TickClock())
    for step in range(10):
        receiver.handle(report(step=step), 1, 1000)
    for step in range(30):
        receiver.handle(report(step=step), 2, 1000)
    readings = receiver.drain()
    assert [p.step for p in readings[1].points] == list(range(10))
    assert [p.step for p in readings[2].points] == list(range(20, 30))
    assert readings[2].latest is not None and readings[2].latest.step == 29

    receiver.handle(report(step=1, buffers={f"b{i}": {} for i in range(64)}), 3, 1000)
    assert len(receiver.drain()[3].points) == 1  # a process keeps its newest point at least


def test_pending_points_are_capped_per_process_keeping_the_newest() -> None:
    receiver = AgentReceiver(Path("/nonexistent/agent.sock"), max_points=4)
    for step in range(10):
        receiver.handle(report(step=step), 1, 1000)
    r = receiver.drain()[1]
    assert [p.step for p in r.points] == [6, 7, 8, 9]
    assert r.latest == r.points[-1]


def test_a_pid_reused_by_another_user_starts_afresh() -> None:
    receiver = AgentReceiver(Path("/nonexistent/agent.sock"), clock=TickClock())
    receiver.handle(report("finished", step=5), 7, 1000)
    receiver.handle(report(step=1), 7, 1001)
    r = receiver.drain()[7]
    assert (r.uid, r.first_seen, r.finished_at, r.step) == (1001, 1001.0, None, 1)


# -- lifecycle -----------------------------------------------------------------------------------


def test_forget_drops_a_pid(receiver: AgentReceiver, sock_path: Path) -> None:
    first = send(sock_path, report(step=1))
    second = send(sock_path, report(step=1))
    wait_handled(receiver, 2)
    receiver.forget([first, 999_999_999])
    assert set(receiver.drain()) == {second}


def test_the_socket_file_is_writable_by_every_user(
        receiver: AgentReceiver, sock_path: Path) -> None:
    st = os.stat(sock_path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o666
    assert sorted(p.name for p in sock_path.parent.iterdir()) == ["agent.sock"]


def test_a_stale_socket_is_replaced(receivers: Callable[..., AgentReceiver],
                                    sock_path: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(sock_path))
    stale.close()
    receiver = receivers()
    pid = send(sock_path, report(step=1))
    wait_handled(receiver, 1)
    assert pid in receiver.drain()


def test_stop_is_prompt_and_removes_the_socket(sock_path: Path) -> None:
    receiver = AgentReceiver(sock_path)
    receiver.start()
    thread = receiver.transport._thread
    assert thread is not None and thread.is_alive()
    started = time.monotonic()
    receiver.stop()
    # Woken, not waiting out a timeout; a loaded machine may be slow to schedule the thread.
    assert time.monotonic() - started < 3
    assert not thread.is_alive()
    assert not sock_path.exists()
    receiver.stop()  # twice is harmless


def test_stop_leaves_a_socket_that_another_receiver_put_in_place(sock_path: Path) -> None:
    old, new = AgentReceiver(sock_path), AgentReceiver(sock_path)
    old.start()
    new.start()
    old.stop()
    assert sock_path.exists()
    new.stop()
    assert not sock_path.exists()


def test_drain_is_safe_while_reports_arrive(receivers: Callable[..., AgentReceiver],
                                            sock_path: Path) -> None:
    receiver = receivers(max_points=4096)  # room for all: any loss would be a race
    payloads = [report(step=i) for i in range(2000)]
    seen: list[int] = []
    done = threading.Event()
    error: list[Optional[BaseException]] = [None]

    def drain_loop() -> None:
        try:
            while not done.wait(0.001):
                for r in receiver.drain().values():
                    seen.extend(p.step for p in r.points)
        except BaseException as exc:  # reported by the test thread
            error[0] = exc

    drainer = threading.Thread(target=drain_loop)
    drainer.start()
    try:
        send(sock_path, *payloads)
        wait_handled(receiver, 2000)
    finally:
        done.set()
        drainer.join()
    assert error[0] is None
    for r in receiver.drain().values():
        seen.extend(p.step for p in r.points)
    assert seen == list(range(2000))  # none lost or repeated between drains


# -- one user's flood and another user's reports ------------------------------------------------
FLOODER_UID = 4243  # no account needed: a uid of its own, as a second local user
VICTIM_UID = 65534

_JUNK_FLOODER = r"""
import os, socket, sys, threading
path, threads = sys.argv[1], int(sys.argv[2])
def flood():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # blocking: sleeps on a full queue
    while True:
        try:
            s.sendto(b"junk", path)
        except OSError:
            pass
for _ in range(threads):
    threading.Thread(target=flood, daemon=True).start()
print("flooding", flush=True)
sys.stdin.read()  # until the test closes it
"""

_VICTIM = r"""
import json, os, sys, time
from gpuwatch.agent._transport import Transport
path, own_wanted, most = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t = Transport()
started = time.monotonic()
moved_after, own, step = None, [], 0
# 10 reports a second, as a training loop's steps; until `own_wanted` went to its own socket.
while len(own) < own_wanted and step < most:
    sent = t.sent
    t.send(json.dumps({"v": 1, "kind": "step", "seq": step, "step": step,
                       "rss": step << 22}).encode(), path)
    if t.private is not None:
        moved_after = moved_after if moved_after is not None else time.monotonic() - started
        if t.sent > sent:
            own.append(step)
    step += 1
    time.sleep(max(0.0, started + step / 10 - time.monotonic()))
print(json.dumps({"pid": os.getpid(), "steps": step, "own": own, "moved_after": moved_after,
                  "sent": t.sent, "dropped": t.dropped}), flush=True)
"""


def test_a_flood_from_one_user_does_not_starve_another_user_s_reports() -> None:
    """200 senders of one user keep agent.sock's kernel queue (net.unix.max_dgram_qlen, 10 by
    default) full; another user's agent, sending 10 reports a second, non-blocking as the
    agent does, gets one report through agent.sock (it retries with every step) and from then
    on sends to a socket of its own, which only it may write to: nearly every report sent
    there is received, whatever the flood does."""
    import shutil
    import tempfile

    from tests.daemonproc import setpriv_or_skip

    setpriv = setpriv_or_skip()
    shared = Path(tempfile.mkdtemp(prefix="gpuwatch-agent-flood-"))
    shared.chmod(0o755)
    path = shared / "agent.sock"
    receiver = AgentReceiver(path, max_reports_per_second=20_000)
    receiver.start()
    flooder = subprocess.Popen(
        [setpriv, f"--reuid={FLOODER_UID}", f"--regid={FLOODER_UID}", "--clear-groups",
         sys.executable, "-c", _JUNK_FLOODER, str(path), "200"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert flooder.stdout is not None and flooder.stdout.readline() == "flooding\n"
        poll_until("the flood to fill the queue", lambda: (
            receiver.rejected["rate_limited"] + receiver.rejected["malformed"] > 1000) or None,
                   30)
        # How long the first report takes to win a slot of the flooded queue depends on how
        # the kernel schedules 200 woken senders against one: 400 steps (40 s) are allowed in
        # all, for it and the 40 sent to its own socket after it.
        own_wanted, most = 40, 400
        victim = subprocess.run(
            [setpriv, f"--reuid={VICTIM_UID}", f"--regid={VICTIM_UID}", "--clear-groups",
             sys.executable, "-c", _VICTIM, str(path), str(own_wanted), str(most)],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        assert victim.returncode == 0, victim.stderr
        figures = json.loads(victim.stdout)
        assert len(figures["own"]) == own_wanted, f"never moved to its own socket: {figures}"
        assert (shared / "agent.d" / f"{VICTIM_UID}.sock").exists()
        received = receiver.drain().get(figures["pid"])
        got = {p.step for p in received.points} if received is not None else set()
        own_received = len(got & set(figures["own"]))
        assert own_received >= 0.9 * own_wanted, (
            f"{own_received} of the {own_wanted} reports sent to its own socket received; "
            f"{figures}")
    finally:
        flooder.kill()
        flooder.wait(10)
        receiver.stop()
        shutil.rmtree(shared, ignore_errors=True)


def test_a_user_s_own_socket_takes_no_other_user_s_datagrams() -> None:
    import shutil
    import tempfile

    from tests.daemonproc import setpriv_or_skip

    setpriv = setpriv_or_skip()
    tmp_path = Path(tempfile.mkdtemp(prefix="gpuwatch-agent-own-"))  # reachable by any user
    tmp_path.chmod(0o755)
    receiver = AgentReceiver(tmp_path / "agent.sock")
    receiver.start()
    try:
        own = tmp_path / "agent.d" / f"{VICTIM_UID}.sock"
        code = ("import socket, sys\ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
                "try:\n    s.sendto(b'x', sys.argv[1]); print('sent')\n"
                "except OSError as e: print(e.errno)")
        first = subprocess.run([setpriv, f"--reuid={VICTIM_UID}", f"--regid={VICTIM_UID}",
                                "--clear-groups", sys.executable, "-c", code,
                                str(tmp_path / "agent.sock")], capture_output=True, text=True,
                               timeout=30)
        assert first.stdout.strip() == "sent"
        poll_until("the user's own socket", lambda: own.exists() or None, 10)
        for uid, expected in ((VICTIM_UID, "sent"), (FLOODER_UID, "13")):  # 13: EACCES
            result = subprocess.run([setpriv, f"--reuid={uid}", f"--regid={uid}",
                                     "--clear-groups", sys.executable, "-c", code, str(own)],
                                    capture_output=True, text=True, timeout=30)
            assert result.stdout.strip() == expected, (uid, result.stdout, result.stderr)
    finally:
        receiver.stop()
    assert not own.exists()
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_the_agent_moves_to_its_user_s_own_socket_takes_requests_there_and_falls_back(
        sock_path: Path) -> None:
    from gpuwatch.agent._transport import Transport

    receiver = AgentReceiver(sock_path)
    receiver.start()
    own = sock_path.parent / "agent.d" / f"{os.geteuid()}.sock"
    transport = Transport()
    try:
        transport.send(report(step=1), str(sock_path))
        assert transport.private is None or transport.private == str(own)
        poll_until("the user's own socket", lambda: own.exists() or None, 10)
        transport.private_checked = -10.0  # look again now, not in a second
        transport.send(report(step=2), str(sock_path))
        assert transport.private == str(own)
        poll_until("both reports", lambda: receiver.accepted >= 2 or None, 10)
        # The request goes out from the socket the report came in on, and the agent takes it.
        assert receiver.request_trace(os.getpid(), 5)
        got = poll_until("the request", lambda: transport.requests(), 10)
        assert [(r["kind"], r["steps"]) for r in got] == [("trace", 5)]
    finally:
        receiver.stop()
        transport.close()
    assert not own.exists()
    # A daemon gone (its sockets removed): the next report tries agent.sock again.
    transport.send(report(step=3), str(sock_path))
    assert transport.private is None
