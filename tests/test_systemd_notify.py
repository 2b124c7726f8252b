"""gpuwatch.systemd_notify against real AF_UNIX datagram sockets standing in for systemd."""

from __future__ import annotations

import os
import re
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch import systemd_notify as sd

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="sd_notify is Linux-only (abstract sockets, SO_PASSCRED)")

RECV_DEADLINE_S = 5.0


def time_monotonic_usec() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Manager:
    """The receiving end of NOTIFY_SOCKET, as systemd binds it."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        self.address = address  # what goes into $NOTIFY_SOCKET
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.settimeout(RECV_DEADLINE_S)

    def receive(self) -> str:
        return self.receive_with_pid()[0]

    def receive_with_pid(self) -> tuple[str, int]:
        """The next datagram and the sender's PID (systemd's NotifyAccess=main check uses it)."""
        creds_size = socket.CMSG_SPACE(3 * 4)  # struct ucred: pid, uid, gid
        data, ancillary, _flags, _addr = self.sock.recvmsg(4096, creds_size)
        pid = -1
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = int.from_bytes(payload[:4], sys.byteorder, signed=True)
        return data.decode(), pid

    def assert_nothing_pending(self) -> None:
        self.sock.setblocking(False)
        try:
            with pytest.raises(BlockingIOError):
                self.sock.recv(4096)
        finally:
            self.sock.settimeout(RECV_DEADLINE_S)


@pytest.fixture
def path_manager(tmp_path_factory: pytest.TempPathFactory,
                 monkeypatch: pytest.MonkeyPatch) -> Iterator[Manager]:
    # A short directory: sun_path holds at most 107 bytes, and tmp_path grows with the test name.
    path = tmp_path_factory.mktemp("sd") / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield Manager(s, str(path))


@pytest.fixture
def abstract_manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[Manager]:
    name = f"gpuwatch-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        yield Manager(s, "@" + name)


@pytest.fixture(params=["path", "abstract"])
def manager(request: pytest.FixtureRequest) -> Manager:
    return request.getfixturevalue(f"{request.param}_manager")


# -- each message arrives intact ---------------------------------------------------------------

def test_ready_sends_ready_and_status(manager: Manager) -> None:
    assert sd.ready(status="NVML up: 8 GPUs") is True
    assert manager.receive() == "READY=1\nSTATUS=NVML up: 8 GPUs"


def test_ready_without_status_sends_only_ready(manager: Manager) -> None:
    assert sd.ready() is True
    assert manager.receive() == "READY=1"


def test_stopping_sends_stopping(manager: Manager) -> None:
    assert sd.stopping() is True
    assert manager.receive() == "STOPPING=1"


def test_reloading_sends_reloading_with_current_monotonic_clock(manager: Manager) -> None:
    before = time_monotonic_usec()
    assert sd.reloading() is True
    after = time_monotonic_usec()
    message = manager.receive()
    match = re.fullmatch(r"RELOADING=1\nMONOTONIC_USEC=(\d+)", message)
    assert match, message
    assert before <= int(match.group(1)) <= after


def test_status_sends_status(manager: Manager) -> None:
    assert sd.status("polling 4 GPUs") is True
    assert manager.receive() == "STATUS=polling 4 GPUs"


def test_watchdog_ping_sends_watchdog(manager: Manager) -> None:
    assert sd.watchdog_ping() is True
    assert manager.receive() == "WATCHDOG=1"


def test_notify_sends_the_message_verbatim(manager: Manager) -> None:
    message = "STATUS=ünïcode ✓\nERRNO=0"
    assert sd.notify(message) is True
    assert manager.receive() == message


def test_a_newline_in_a_status_text_cannot_inject_an_assignment(manager: Manager) -> None:
    assert sd.status("NVML error\nREADY=1") is True
    assert manager.receive() == "STATUS=NVML error READY=1"
    assert sd.ready(status="a\r\nSTOPPING=1") is True
    assert manager.receive() == "READY=1\nSTATUS=a STOPPING=1"


def test_notify_reads_the_socket_from_the_given_environ(path_manager: Manager,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert sd.notify("STATUS=x", environ={"NOTIFY_SOCKET": path_manager.address}) is True
    assert path_manager.receive() == "STATUS=x"


def test_messages_carry_the_senders_pid(manager: Manager) -> None:
    assert sd.watchdog_ping() is True
    assert manager.receive_with_pid() == ("WATCHDOG=1", os.getpid())


def test_a_forked_child_notifies_as_itself_and_the_parent_keeps_working(manager: Manager) -> None:
    assert sd.status("parent before fork") is True  # the parent now has a cached socket
    assert manager.receive() == "STATUS=parent before fork"
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through its exit status only
        code = 0 if sd.status("child") else 1
        os._exit(code)
    _, wait_status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(wait_status) == 0
    assert manager.receive_with_pid() == ("STATUS=child", child)
    # The child's exit closed its descriptors; the parent's cached socket must be unaffected.
    assert sd.status("parent after fork") is True
    assert manager.receive_with_pid() == ("STATUS=parent after fork", os.getpid())


# -- no systemd, or a broken address: False, never an exception --------------------------------

def test_without_notify_socket_every_function_returns_false(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sd.notify("READY=1") is False
    assert sd.ready(status="x") is False
    assert sd.stopping() is False
    assert sd.reloading() is False
    assert sd.status("x") is False
    assert sd.watchdog_ping() is False


def test_empty_notify_socket_is_treated_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert sd.ready() is False


def test_a_socket_path_that_does_not_exist_returns_false(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "absent"))
    assert sd.ready() is False
    assert sd.watchdog_ping() is False


def test_an_abstract_name_nobody_bound_returns_false(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", f"@gpuwatch-test-unbound-{uuid.uuid4().hex}")
    assert sd.stopping() is False


@pytest.mark.parametrize("address", ["relative/notify", "vsock:2:1234", "/" + "x" * 200,
                                     "/bad\0path"])
def test_an_unusable_address_returns_false(address: str) -> None:
    assert sd.notify("READY=1", environ={"NOTIFY_SOCKET": address}) is False


def test_a_full_manager_queue_returns_false_instead_of_blocking(path_manager: Manager) -> None:
    # Nobody reads: the receive queue fills after a bounded number of datagrams, and from then on
    # notify() must answer False at once (the poll loop never waits on PID 1).
    for _ in range(100_000):
        if not sd.watchdog_ping():
            break
    else:
        pytest.fail("100000 datagrams were queued and none refused")
    assert sd.watchdog_ping() is False
    assert path_manager.receive() == "WATCHDOG=1"  # what was queued is intact


# -- watchdog_interval ------------------------------------------------------------------------

def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    assert sd.watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0


def test_watchdog_interval_honours_a_watchdog_pid_that_names_us() -> None:
    env = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}
    assert sd.watchdog_interval(env) == 15.0


def test_watchdog_interval_is_none_when_watchdog_pid_names_another_process() -> None:
    env = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    assert sd.watchdog_interval(env) is None


@pytest.mark.parametrize("env", [
    {},
    {"WATCHDOG_USEC": ""},
    {"WATCHDOG_USEC": "0"},
    {"WATCHDOG_USEC": "-5"},
    {"WATCHDOG_USEC": "soon"},
    {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "not-a-pid"},
])
def test_watchdog_interval_is_none_without_a_usable_watchdog(env: dict[str, str]) -> None:
    assert sd.watchdog_interval(env) is None


def test_watchdog_interval_reads_the_process_environment_by_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sd.watchdog_interval() == 2.0
