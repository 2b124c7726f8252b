"""The agent socket's parser, fuzzed: whatever a local user sends to agent.sock, the receiver never
raises, counts every datagram exactly once (accepted, or rejected with a documented reason), and
keeps working.

Any local user may write to agent.sock (docs/agent-protocol.md), so its parser is the daemon's
widest attack surface. `AgentReceiver.handle` (one datagram, with the kernel's credentials) is
driven directly with arbitrary bytes, arbitrary JSON and reports shaped like the protocol's with
every field given every type; then, through a real socket, with descriptors passed along
(SCM_RIGHTS), which must all be closed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatch.protocol import SOCKET_NAME as AGENT_SOCKET_NAME
from gpuwatch.sources.agent_socket import AgentReceiver

# No example database in the working tree: a failure prints its reproduction blob instead.
FAST = settings(max_examples=400, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow])
STREAM = settings(FAST, max_examples=120)
SOCKET = settings(max_examples=60, deadline=None, database=None, print_blob=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ---- what a sender can put in a datagram ---------------------------------------------------------

INT_EDGES = st.sampled_from([0, 1, -1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63)])
INTS = st.one_of(st.integers(min_value=0, max_value=2**63 - 1), st.integers(), INT_EDGES)
TEXT = st.one_of(st.text(max_size=80), st.text(alphabet="\x00\x1f\x7f\n\t\u2028ab", max_size=8),
                 st.just("x" * 300))
LEAVES = st.one_of(st.none(), st.booleans(), INTS, st.floats(allow_nan=True), TEXT)
JSON_VALUES = st.recursive(
    LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                    st.dictionaries(TEXT, inner, max_size=6)),
    max_leaves=30)


def anything_or(*strategies: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The right thing three times in four, anything at all the fourth."""
    right = st.one_of(*strategies)
    return st.one_of(right, right, right, JSON_VALUES)


GOOD_INTS = st.one_of(st.integers(min_value=0, max_value=2**63 - 1), INT_EDGES)


BUFFER_NAMES = st.one_of(st.from_regex(r"[A-Za-z0-9_.:/-]{1,64}", fullmatch=True),
                         st.from_regex(r"[A-Za-z0-9_.:/<>-]{1,128}", fullmatch=True), TEXT)
SIZE = anything_or(st.fixed_dictionaries({}, optional={"items": anything_or(GOOD_INTS),
                                                       "bytes": anything_or(GOOD_INTS)}))
SIZES = anything_or(st.dictionaries(BUFFER_NAMES, SIZE, max_size=70))
FRAME = anything_or(st.fixed_dictionaries({}, optional={"file": anything_or(TEXT),
                                                        "line": anything_or(GOOD_INTS)}))
SITE = anything_or(st.fixed_dictionaries({}, optional={
    "file": anything_or(TEXT), "line": anything_or(GOOD_INTS), "bytes": anything_or(GOOD_INTS),
    "count": anything_or(GOOD_INTS)}))
TRACE = anything_or(st.fixed_dictionaries({}, optional={
    "status": anything_or(st.sampled_from(["done", "refused", "failed", "other"])),
    "why": anything_or(TEXT), "steps": anything_or(GOOD_INTS),
    "sites": anything_or(st.lists(SITE, max_size=10)),
    "traceback": anything_or(st.lists(FRAME, max_size=18))}))
EXIT = anything_or(st.fixed_dictionaries({}, optional={
    "threads": anything_or(st.lists(TEXT, max_size=70)), "executors": anything_or(GOOD_INTS),
    "process_group": anything_or(st.booleans()),
    "thread_pools": anything_or(st.lists(anything_or(st.fixed_dictionaries({}, optional={
        "workers": anything_or(GOOD_INTS),
        "threads": anything_or(st.lists(TEXT, max_size=6))})), max_size=66))}))
CUDA = anything_or(st.fixed_dictionaries({}, optional={
    k: anything_or(GOOD_INTS) for k in ("allocated", "reserved", "active", "allocations")}))

REPORTS = st.fixed_dictionaries(
    {"v": anything_or(st.just(1)),
     "kind": anything_or(st.sampled_from(["step", "finished", "exit", "trace", "tick"])),
     "step": anything_or(GOOD_INTS)},
    optional={"seq": anything_or(GOOD_INTS), "rss": anything_or(GOOD_INTS), "cuda": CUDA,
              "buffers": SIZES, "discovered": SIZES, "exit": EXIT, "trace": TRACE,
              "pad": st.text(max_size=20)})


@st.composite
def datagrams(draw: st.DrawFn) -> bytes:
    """Bytes as a sender may send them: a report shaped like the protocol's (as JSON, or cut
    short, or with bits flipped), any JSON, or any bytes at all."""
    how = draw(st.sampled_from(["report", "report", "report", "json", "bytes", "cut", "flip",
                                "nested"]))
    if how == "bytes":
        return draw(st.binary(max_size=17_000))
    if how == "json":
        return json.dumps(draw(JSON_VALUES)).encode()
    if how == "nested":
        depth = draw(st.integers(min_value=1, max_value=20_000))
        return draw(st.sampled_from([b"[", b'{"a":'])) * depth
    encoded = json.dumps(draw(REPORTS), ensure_ascii=draw(st.booleans())).encode(
        "utf-8", "surrogatepass")
    if how == "cut":
        return encoded[:draw(st.integers(min_value=0, max_value=len(encoded)))]
    if how == "flip":
        data = bytearray(encoded)
        for i in draw(st.lists(st.integers(min_value=0, max_value=len(data) - 1), max_size=6)):
            data[i] ^= 1 << draw(st.integers(min_value=0, max_value=7))
        return bytes(data)
    return encoded


SENDERS = st.tuples(st.integers(min_value=1, max_value=4_194_304),
                    st.integers(min_value=0, max_value=2**32 - 1))
ADDRESSES = st.one_of(st.none(), st.binary(max_size=40), st.text(max_size=40),
                      st.builds(lambda b: b"\0" + b, st.binary(max_size=20)))


def counted(receiver: AgentReceiver) -> int:
    return receiver.accepted + sum(receiver.rejected.values())


# ---- the parser, called directly -----------------------------------------------------------------


@FAST
@given(payload=datagrams(), sender=SENDERS, truncated=st.booleans(), address=ADDRESSES)
def test_one_datagram_never_raises_and_is_counted_once(
        payload: bytes, sender: tuple[int, int], truncated: bool, address: Any) -> None:
    receiver = AgentReceiver(Path("/nonexistent/agent.sock"))
    receiver.handle(payload, sender[0], sender[1], truncated=truncated, address=address)
    assert counted(receiver) == 1
    assert set(receiver.rejected) >= {"malformed", "version", "oversized", "too_many_buffers",
                                      "bad_name", "bad_value", "bad_type"}


@STREAM
@given(batch=st.lists(st.tuples(datagrams(), SENDERS, ADDRESSES), min_size=1, max_size=25),
       forget=st.lists(st.integers(min_value=1, max_value=4_194_304), max_size=5))
def test_a_stream_of_datagrams_from_many_senders(
        batch: list[tuple[bytes, tuple[int, int], Any]], forget: list[int]) -> None:
    """Reports from several processes (PIDs reused by other users included), drained and
    forgotten as the poll thread does: nothing raises, every datagram is counted once, and
    what is drained is what was accepted."""
    receiver = AgentReceiver(Path("/nonexistent/agent.sock"), max_processes=8)
    senders = {sender for _, sender, _ in batch}
    for n, (payload, sender, address) in enumerate(batch, start=1):
        receiver.handle(payload, *sender, address=address)
        assert counted(receiver) == n
        if n % 7 == 0:
            receiver.drain()
            receiver.forget(forget)
    readings = receiver.drain()
    assert set(readings) <= {pid for pid, _ in senders}
    for pid, reading in readings.items():
        assert reading.pid == pid
        assert reading.uid in {uid for p, uid in senders if p == pid}
        for point in reading.points:
            assert point.step >= 0
    # And a plain report is still taken.
    before = receiver.accepted
    receiver.handle(b'{"v": 1, "kind": "step", "seq": 1, "step": 1}', 7, 1000)
    assert receiver.accepted == before + 1 or receiver.rejected["too_many_processes"]


def test_known_nasty_datagrams() -> None:
    """The classics, each once: deep nesting, numbers past the interpreter's digit limit, NaN,
    lone surrogates, a BOM, NUL bytes, the size limit and one byte past it."""
    nasty = [b"", b"\0", b"[" * 100_000, b'{"a":' * 50_000, b"\xef\xbb\xbf{}",
             b'{"v": 1, "kind": "step", "step": ' + b"9" * 5000 + b"}",
             b'{"v": 1, "kind": "step", "step": NaN}', b'{"v": 1, "kind": "step", "step": 1e999}',
             b'{"v": 1, "kind": "step", "step": 1, "buffers": {"\\ud800": {"items": 1}}}',
             b'{"v": 1, "kind": "trace", "trace": {"status": "done", "sites": [{}]}}',
             b'{"v": 1, "kind": "exit", "exit": {"threads": [null]}}',
             b'{"v": true, "kind": "step", "step": 1}', b'{"v": 1.0, "kind": "step", "step": 1}',
             json.dumps({"v": 1, "kind": "step", "step": 1, "pad": "x" * 16_300}).encode(),
             json.dumps({"v": 1, "kind": "step", "step": 1, "pad": "x" * 16_400}).encode()]
    receiver = AgentReceiver(Path("/nonexistent/agent.sock"))
    for n, payload in enumerate(nasty, start=1):
        receiver.handle(payload, 4242, 1000)
        assert counted(receiver) == n, payload[:60]
    assert receiver.rejected["oversized"] >= 1


# ---- through a real socket -----------------------------------------------------------------------


@contextlib.contextmanager
def listening() -> Iterator[AgentReceiver]:
    folder = Path(tempfile.mkdtemp(prefix="gpuwatch-fuzz-"))
    receiver = AgentReceiver(folder / AGENT_SOCKET_NAME)
    receiver.start()
    try:
        yield receiver
    finally:
        receiver.stop()
        # agent.sock, and agent.d/ where the receiver gave this user a socket of its own.
        shutil.rmtree(folder)


def open_fds() -> set[str]:
    """This process's open descriptors, less the one the listing itself used (it is closed by
    then; its number is the lowest free one, so it moves when another descriptor opens)."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):
            os.readlink(f"/proc/self/fd/{fd}")
            fds.add(fd)
    return fds


def wait_counted(receiver: AgentReceiver, n: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while counted(receiver) < n:
        assert time.monotonic() < deadline, f"{counted(receiver)} of {n} datagrams counted"
        time.sleep(0.005)


@SOCKET
@given(batch=st.lists(st.tuples(datagrams(), st.integers(min_value=0, max_value=3)),
                      min_size=1, max_size=15))
def test_through_a_real_socket_with_passed_descriptors(batch: list[tuple[bytes, int]]) -> None:
    """Sent for real (credentials from the kernel, some datagrams carrying open descriptors):
    every datagram counted once, every passed descriptor closed, the receiver still taking
    reports afterwards."""
    with listening() as receiver:
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            before = open_fds()
            for payload, fds in batch:
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                              struct.pack(f"{fds}i", *([null] * fds)))] if fds else []
                sender.sendmsg([payload], ancillary, 0, str(receiver.path))
            wait_counted(receiver, len(batch))
            # Descriptors arrive in this process (the receiver's thread is in it): all closed.
            # The one opened meanwhile is the socket of this user's own (agent.d/<uid>.sock),
            # which the receiving thread makes once the datagram that asks for it is counted.
            deadline = time.monotonic() + 20
            while not receiver.transport._private and receiver.transport._private_supported:
                assert time.monotonic() < deadline, "no socket of the user's own"
                time.sleep(0.005)
            own = {str(sock.fileno()) for sock in receiver.transport._private.values()}
            assert open_fds() - own == before - own
            sender.sendto(b'{"v": 1, "kind": "step", "seq": 1, "step": 1}', str(receiver.path))
            wait_counted(receiver, len(batch) + 1)
        finally:
            sender.close()
            os.close(null)
