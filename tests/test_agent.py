"""The in-process agent, in real processes, reporting to a real Unix datagram socket.

Each test runs a small training-like program in a child interpreter and reads what reaches a
receiving socket that, like the daemon's, takes the sender's PID and UID from the kernel.
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

REPO = Path(__file__).resolve().parent.parent
CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
Report = tuple[int, int, dict[str, Any]]  # kernel PID, kernel UID, the JSON


class Receiver:
    """A bound SOCK_DGRAM socket with SO_PASSCRED: every datagram with its sender's credentials."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(str(path))
        self.reports: list[Report] = []

    def close(self) -> None:
        self.sock.close()

    def _receive(self, timeout: float) -> bool:
        if not select.select([self.sock], [], [], max(timeout, 0))[0]:
            return False
        data, ancillary, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(CREDENTIALS.size))
        pid = uid = -1
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid, uid, _ = CREDENTIALS.unpack(payload[:CREDENTIALS.size])
        assert len(data) <= 16384
        self.reports.append((pid, uid, json.loads(data)))
        return True

    def wait_for(self, what: str, check: Callable[[list[Report]], Any], timeout: float = 15,
                 proc: Optional[subprocess.Popen[str]] = None) -> Any:
        """Receive until check(reports) is truthy; fail after `timeout` or when `proc` ended and
        nothing more is queued."""
        deadline = time.monotonic() + timeout
        while True:
            found = check(self.reports)
            if found:
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {what} within {timeout} s; got {self.reports}")
            if not self._receive(min(remaining, 0.1)) and proc is not None \
                    and proc.poll() is not None and not self._receive(0.2):
                out, err = proc.communicate()
                raise AssertionError(f"no {what}: the program exited with {proc.returncode}; "
                                     f"stdout {out!r} stderr {err!r}; got {self.reports}")

    def drain_until_exit(self, proc: subprocess.Popen[str], timeout: float = 30
                         ) -> tuple[str, str]:
        """Keep the queue empty while `proc` runs (the kernel holds only a few datagrams), then
        take what is left."""
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"the program ran past {timeout} s")
            self._receive(0.05)
        while self._receive(0.1):
            pass
        return proc.communicate()


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    # Short, under /tmp: a Unix socket path is limited to 107 bytes, which pytest's tmp_path
    # with a long test name can pass.
    with tempfile.TemporaryDirectory(prefix="gw-agent-", dir="/tmp") as d:
        yield Path(d)


@pytest.fixture
def receiver(runtime_dir: Path) -> Iterator[Receiver]:
    r = Receiver(runtime_dir / "agent.sock")
    yield r
    r.close()


def start(program: str, runtime_dir: Path, env_extra: Optional[dict[str, str]] = None,
          **popen: Any) -> subprocess.Popen[str]:
    """A training-like program in its own interpreter, finding the receiver through
    GPUWATCH_RUNTIME_DIR as a real one finds the daemon."""
    env = {**os.environ, "GPUWATCH_RUNTIME_DIR": str(runtime_dir), "PYTHONPATH": str(REPO),
           **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(program)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def run(program: str, runtime_dir: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    proc = start(program, runtime_dir)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def of_kind(reports: list[Report], kind: str, pid: Optional[int] = None) -> list[Report]:
    return [r for r in reports if r[2]["kind"] == kind and (pid is None or r[0] == pid)]


def first_step_report(program: str, runtime_dir: Path, receiver: Receiver,
                      timeout: float = 60) -> dict[str, Any]:
    """The first step report of `program`, which steps and then waits for its stdin to close.
    The deadline only bounds a failure: a program importing torch on a starved machine (two
    suites on 2 cores) took more than 15 s to step."""
    proc = start(program, runtime_dir, stdin=subprocess.PIPE)
    try:
        (_, _, report), = receiver.wait_for("a step report", lambda rs: of_kind(rs, "step"),
                                            timeout=timeout, proc=proc)
    finally:
        proc.communicate("")
    return report


def wait_exit(proc: subprocess.Popen[str], timeout: float = 20) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"still running after {timeout} s; stderr {err!r}") from None


def wait_file(path: Path, proc: subprocess.Popen[str], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"exited with {proc.returncode}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"{path.name} did not appear in {timeout} s"
        time.sleep(0.01)


# ---- reports -----------------------------------------------------------------------------------


def test_step_reports_carry_the_protocol_fields_and_the_kernel_pid_of_the_sender(
        runtime_dir: Path, receiver: Receiver) -> None:
    # Steps slower than the coalescing interval: every one of them is reported.
    proc = start("""
        import sys, time
        from gpuwatch import agent
        for step in (1, 2, 3):
            agent.step(step)
            time.sleep(0.08)
        sys.stdin.read()
        """, runtime_dir, stdin=subprocess.PIPE)
    try:
        steps = receiver.wait_for("three step reports",
                                  lambda rs: len(of_kind(rs, "step")) >= 3 and of_kind(rs, "step"),
                                  proc=proc)
    finally:
        proc.communicate("")
    assert proc.returncode == 0
    assert [r[2]["step"] for r in steps] == [1, 2, 3]
    assert [r[2]["seq"] for r in steps] == [0, 1, 2]
    for pid, uid, report in steps:
        assert pid == proc.pid and uid == os.getuid()
        assert report["v"] == 1 and report["kind"] == "step"
        assert isinstance(report["rss"], int) and report["rss"] > 1 << 20
        assert "cuda" not in report and "buffers" not in report


def test_buffers_report_items_and_sampled_bytes_and_leave_out_a_broken_callable(
        runtime_dir: Path, receiver: Receiver) -> None:
    proc = start("""
        import collections, queue, random, sys
        from gpuwatch import agent
        rng = random.Random(7)
        fetch = [bytes(rng.randrange(48 << 10, 80 << 10)) for _ in range(2000)]
        batches = collections.deque((bytes(1000), bytes(24), 3) for _ in range(300))
        q = queue.Queue()
        for _ in range(5):
            q.put(bytearray(100))
        agent.watch("fetch_buffer", fetch)
        agent.watch("batches", batches)
        agent.watch("queue_depth", lambda: 42)
        agent.watch("work_queue", q)
        agent.watch("broken", lambda: 1 / 0)
        agent.watch("ints", [1, 2, 3])
        agent.step(1)
        print(sum(map(len, fetch)), flush=True)
        sys.stdin.read()
        """, runtime_dir, stdin=subprocess.PIPE)
    try:
        (_, _, report), = receiver.wait_for("a step report", lambda rs: of_kind(rs, "step"),
                                            proc=proc)
        assert proc.stdout is not None
        true_bytes = int(proc.stdout.readline())
    finally:
        proc.communicate("")
    assert proc.returncode == 0
    buffers = report["buffers"]
    assert buffers["fetch_buffer"]["items"] == 2000
    assert abs(buffers["fetch_buffer"]["bytes"] - true_bytes) <= 0.1 * true_bytes
    assert buffers["batches"] == {"items": 300, "bytes": 300 * 1024}
    assert buffers["queue_depth"] == {"items": 42}
    assert buffers["work_queue"] == {"items": 5, "bytes": 500}
    assert buffers["ints"] == {"items": 3}  # numbers hold no buffer bytes worth reporting
    assert "broken" not in buffers


def test_watch_refuses_names_outside_the_protocol_and_a_65th_buffer(runtime_dir: Path) -> None:
    result = run("""
        from gpuwatch import agent
        for bad in ("", "x" * 65, "has space", "é", "new\\nline", 7):
            try:
                agent.watch(bad, [])
            except ValueError:
                pass
            else:
                raise SystemExit(f"accepted {bad!r}")
        agent.watch("a-Z_0.9:/x" * 6, [])
        for i in range(63):
            agent.watch(f"b{i}", [])
        agent.watch("b0", [1])  # replacing a name is not a new one
        try:
            agent.watch("one_too_many", [])
        except ValueError:
            print("refused")
        agent.unwatch("b0")
        agent.watch("one_too_many", [])
        """, runtime_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "refused\n"


# ---- coalescing --------------------------------------------------------------------------------


def test_a_10khz_loop_is_coalesced_and_its_last_step_is_sent_at_exit(
        runtime_dir: Path, receiver: Receiver) -> None:
    proc = start("""
        import json, time
        from gpuwatch import agent
        agent.watch("fetch_buffer", [bytes(1 << 10)] * 8)
        started = time.monotonic()
        for i in range(20000):
            agent.step(i)
            busy_until = time.perf_counter() + 50e-6  # a 10 kHz training step, give or take
            while time.perf_counter() < busy_until:
                pass
        print(json.dumps({"elapsed": time.monotonic() - started}))
        """, runtime_dir)
    out, err = receiver.drain_until_exit(proc)
    assert proc.returncode == 0 and err == ""
    elapsed = json.loads(out)["elapsed"]
    steps = of_kind(receiver.reports, "step")
    assert len(steps) <= elapsed / 0.05 + 2
    assert len(steps) >= 2
    assert steps[-1][2]["step"] == 19999
    assert [r[2]["seq"] for r in steps] == list(range(len(steps)))
    assert all(a[2]["step"] < b[2]["step"] for a, b in zip(steps, steps[1:]))
    assert of_kind(receiver.reports, "exit") == []  # nothing left running: no exit report


def test_after_a_pause_the_next_step_is_reported_at_once(
        runtime_dir: Path, receiver: Receiver) -> None:
    proc = start("""
        import sys
        from gpuwatch import agent
        for i in range(100):
            agent.step(i)
        print("paused", flush=True)
        sys.stdin.readline()
        agent.step(100)
        sys.stdin.read()
        """, runtime_dir, stdin=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline() == "paused\n"
        receiver.wait_for("the first step", lambda rs: of_kind(rs, "step"), proc=proc)
        time.sleep(0.1)  # longer than the coalescing interval
        proc.stdin.write("go\n")
        proc.stdin.flush()
        receiver.wait_for("step 100 while the program still runs",
                          lambda rs: [r for r in of_kind(rs, "step") if r[2]["step"] == 100],
                          proc=proc)
    finally:
        proc.communicate("")
    assert proc.returncode == 0


def test_steps_from_several_threads_keep_one_consistent_report_sequence(
        runtime_dir: Path, receiver: Receiver) -> None:
    proc = start("""
        import threading
        from gpuwatch import agent
        agent.watch("shared", [bytes(64)] * 100)
        def train(offset):
            for i in range(200000):
                agent.step(offset + i)
        threads = [threading.Thread(target=train, args=(k * 1000000,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        """, runtime_dir)
    _, err = receiver.drain_until_exit(proc)
    assert proc.returncode == 0 and err == ""
    steps = of_kind(receiver.reports, "step")
    assert len(steps) >= 2
    assert [r[2]["seq"] for r in steps] == list(range(len(steps)))
    assert all(0 <= r[2]["step"] % 1000000 < 200000 for r in steps)
    # The newest step recorded, whichever thread took it last: one thread's final step.
    assert steps[-1][2]["step"] in {k * 1000000 + 199999 for k in range(4)}
    # Buffers are sized for at most one report in SIZE_INTERVAL; those that carry them agree.
    sized = [r for r in steps if "buffers" in r[2]]
    assert sized[0] is steps[0]
    assert all(r[2]["buffers"]["shared"] == {"items": 100, "bytes": 6400} for r in sized)


# ---- no daemon ---------------------------------------------------------------------------------


def _no_daemon_program(steps: int) -> str:
    return f"""
        import json, time
        from gpuwatch import agent
        agent.watch("fetch_buffer", [bytes(1 << 20)] * 4)
        agent.watch("depth", lambda: 3)
        started = time.monotonic()
        for i in range({steps}):
            agent.step(i)
        elapsed = time.monotonic() - started
        for odd in ("x", -1, None, 2 ** 64, 1.5):
            agent.step(odd)
        agent.finished()
        print(json.dumps({{"elapsed": elapsed, **agent._stats()}}))
        """


@pytest.mark.parametrize("socket_file", ["missing", "stale"])
def test_without_a_daemon_the_loop_runs_and_sends_are_backed_off(
        runtime_dir: Path, socket_file: str) -> None:
    if socket_file == "stale":  # a daemon that died: the socket file is there, nobody reads it
        dead = Receiver(runtime_dir / "agent.sock")
        dead.close()
    result = run(_no_daemon_program(100000), runtime_dir)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    stats = json.loads(result.stdout)
    # Attempts at 0, 1, 3, 7, ... seconds (the backoff doubles), then one for finished().
    backed_off = math.floor(math.log2(stats["elapsed"] + 1)) + 1
    assert 2 <= stats["attempts"] <= backed_off + 1
    assert stats["failed"] == stats["attempts"] and stats["sent"] == 0
    # During the backoff no report is even built.
    assert stats["seq"] == stats["attempts"]


def test_a_daemon_with_a_full_queue_costs_dropped_reports_not_a_blocked_step(
        runtime_dir: Path, receiver: Receiver) -> None:
    # The receiver reads nothing while the program runs: the kernel queue fills after a few
    # datagrams and a blocking send would hang the training loop here.
    result = run("""
        import json
        from gpuwatch import agent
        agent.configure(min_interval=0)
        for i in range(500):
            agent.step(i)
        print(json.dumps(agent._stats()))
        """, runtime_dir)
    assert result.returncode == 0 and result.stderr == ""
    stats = json.loads(result.stdout)
    assert stats["dropped"] > 0 and stats["failed"] == 0
    assert stats["sent"] + stats["dropped"] == stats["attempts"] == 500
    assert stats["sent"] == len(receiver.wait_for("the queued reports",
                                                  lambda rs: len(rs) >= stats["sent"] and rs))


def test_a_daemon_that_starts_late_gets_reports_after_the_backoff(runtime_dir: Path) -> None:
    proc = start("""
        import json, time
        from gpuwatch import agent
        agent.step(0)
        print(json.dumps(agent._stats()), flush=True)
        for i in range(1, 3000):
            agent.step(i)
            time.sleep(0.01)
        """, runtime_dir)
    assert proc.stdout is not None
    receiver = None
    try:
        assert json.loads(proc.stdout.readline())["failed"] == 1
        receiver = Receiver(runtime_dir / "agent.sock")
        (pid, _, report), = receiver.wait_for("a report once the daemon is up",
                                              lambda rs: of_kind(rs, "step")[:1], proc=proc)
        assert pid == proc.pid and report["seq"] == 1 and report["step"] > 0
    finally:
        proc.kill()
        proc.communicate()
        if receiver is not None:
            receiver.close()


def test_a_daemon_started_again_is_reported_to_at_once_not_after_the_grown_backoff(
        runtime_dir: Path) -> None:
    """Three failed sends leave a 4 s backoff; a daemon that binds its socket again (a restart)
    hears the next step within the half second the agent takes to look, not 4 s later."""
    proc = start("""
        import json, time
        from gpuwatch import agent
        failed = 0
        for i in range(3000):
            agent.step(i)
            if agent._stats()["failed"] != failed:
                failed = agent._stats()["failed"]
                print(failed, flush=True)
            time.sleep(0.01)
        """, runtime_dir)
    assert proc.stdout is not None
    receiver = None
    try:
        while int(proc.stdout.readline() or 0) < 3:  # failed at 0, 1 and 3 s: next try at 7 s
            assert proc.poll() is None
        receiver = Receiver(runtime_dir / "agent.sock")
        bound = time.monotonic()
        receiver.wait_for("a report from the backed-off agent",
                          lambda rs: of_kind(rs, "step")[:1], proc=proc)
        # The backoff alone would take 4 s from failing; a loaded machine may take a second more.
        assert time.monotonic() - bound < 3.5
    finally:
        proc.kill()
        proc.communicate()
        if receiver is not None:
            receiver.close()


# ---- fork, finished ----------------------------------------------------------------------------


@pytest.mark.sigint
def test_a_forked_child_reports_as_itself(runtime_dir: Path, receiver: Receiver) -> None:
    proc = start("""
        import json, os, signal, sys, time
        from gpuwatch import agent
        # Not necessarily Python's default handler: ignored, when started by a `cmd &` in a script.
        before = signal.getsignal(signal.SIGINT)
        agent.graceful_shutdown(lambda: print("parent cleanup"))
        agent.step(10)
        child = os.fork()
        if child == 0:
            inherited = signal.getsignal(signal.SIGINT) is not before
            agent.finished()
            time.sleep(0.06)  # past the coalescing interval the finished report started
            agent.step(3)
            print(json.dumps({"child": os.getpid(), "inherited_cleanups": inherited}))
            sys.stdout.flush()
            os._exit(0)
        os.waitpid(child, 0)
        """, runtime_dir)
    out, err = receiver.drain_until_exit(proc)
    assert proc.returncode == 0, err
    child = json.loads(out)
    assert child["inherited_cleanups"] is False
    parent_steps = of_kind(receiver.reports, "step", proc.pid)
    assert [r[2]["step"] for r in parent_steps] == [10]
    (_, _, done), = of_kind(receiver.reports, "finished", child["child"])
    # Its own sequence, and no step of the parent's: it has not taken one yet.
    assert done["seq"] == 0 and "step" not in done
    (_, _, own), = of_kind(receiver.reports, "step", child["child"])
    assert own["seq"] == 1 and own["step"] == 3


def test_a_process_that_has_not_stepped_ticks_until_its_first_step_and_so_do_its_forked_children(
        runtime_dir: Path, receiver: Receiver) -> None:
    proc = start("""
        import json, os, sys, time
        from gpuwatch import agent
        agent.tick_until_stepped()
        time.sleep(2.6)  # two ticks, at 1 s and 2 s
        child = os.fork()
        if child == 0:
            time.sleep(2.5)  # its own thread ticks: it has not stepped
            print(json.dumps({"child": os.getpid()}))
            sys.stdout.flush()
            os._exit(0)
        agent.step(1)
        time.sleep(2.5)  # no tick after the step
        os.waitpid(child, 0)
        """, runtime_dir)
    out, err = receiver.drain_until_exit(proc)
    assert proc.returncode == 0, err
    child = json.loads(out)["child"]
    ticks = of_kind(receiver.reports, "tick", proc.pid)
    assert len(ticks) == 2, receiver.reports
    assert all("step" not in r[2] and r[2]["rss"] > 0 for r in ticks)
    steps = of_kind(receiver.reports, "step", proc.pid)
    assert [r[2]["step"] for r in steps] == [1]
    assert receiver.reports.index(ticks[-1]) < receiver.reports.index(steps[0])
    assert len(of_kind(receiver.reports, "tick", child)) == 2, receiver.reports


def test_the_tick_thread_never_keeps_a_program_alive(runtime_dir: Path, receiver: Receiver
                                                      ) -> None:
    proc = start("""
        import threading
        from gpuwatch import agent
        agent.tick_until_stepped()
        ticker, = [t for t in threading.enumerate() if t.name == "gpuwatch-agent-tick"]
        print(ticker.daemon)
        """, runtime_dir)
    out, err = wait_exit(proc, timeout=10)
    assert proc.returncode == 0, err
    assert out.split() == ["True"]
    assert err == ""


def test_finished_is_sent_at_once_with_the_newest_step(
        runtime_dir: Path, receiver: Receiver) -> None:
    proc = start("""
        import sys
        from gpuwatch import agent
        agent.step(1)
        agent.step(2)  # coalesced away: within 50 ms of the first report
        agent.finished()
        agent.finished()
        sys.stdin.read()
        """, runtime_dir, stdin=subprocess.PIPE)
    try:
        (pid, _, report), = receiver.wait_for(
            "a finished report while the program still runs",
            lambda rs: of_kind(rs, "finished"), proc=proc)
        assert proc.poll() is None
    finally:
        proc.communicate("")
    assert pid == proc.pid and report["step"] == 2
    assert len(of_kind(receiver.reports, "finished")) == 1


def test_finished_sent_into_a_full_queue_is_tried_again_until_the_daemon_drains_it(
        runtime_dir: Path) -> None:
    # The daemon's socket, here the program's own: its queue is filled by steps nobody reads,
    # and a thread starts draining it only once finished() has been dropped at least once.
    result = run("""
        import json, os, socket, threading, time
        from gpuwatch import agent
        rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        rx.bind(os.path.join(os.environ["GPUWATCH_RUNTIME_DIR"], "agent.sock"))
        agent.configure(min_interval=0)
        for i in range(200):
            agent.step(i)
        transport = agent._state.st.transport
        full = transport.dropped
        kinds = []

        def drain():
            deadline = time.monotonic() + 30
            while transport.dropped == full and time.monotonic() < deadline:
                time.sleep(0.001)
            rx.settimeout(5)
            while "finished" not in kinds:
                kinds.append(json.loads(rx.recv(65536))["kind"])

        t = threading.Thread(target=drain)
        t.start()
        agent.finished()
        t.join(30)
        print(json.dumps({"full": full, "dropped": transport.dropped, "kinds": kinds}))
        """, runtime_dir)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    seen = json.loads(result.stdout)
    assert seen["full"] > 0, "the queue never filled: nothing was tested"
    assert seen["dropped"] > seen["full"], "finished() was never dropped: nothing was tested"
    assert seen["kinds"].count("finished") == 1, seen["kinds"]


# ---- exit hygiene ------------------------------------------------------------------------------


def test_a_thread_left_running_at_exit_gets_an_exit_report_and_a_stderr_line(
        runtime_dir: Path, receiver: Receiver) -> None:
    proc = start("""
        import threading, time
        from concurrent.futures import ThreadPoolExecutor
        from gpuwatch import agent
        agent.step(5)
        agent.step(6)
        threading.Thread(target=time.sleep, args=(1.0,), name="heartbeat").start()
        threading.Thread(target=time.sleep, args=(30,), name="daemonic", daemon=True).start()
        pool = ThreadPoolExecutor(2, thread_name_prefix="prefetch")
        pool.submit(time.sleep, 0.5)
        """, runtime_dir)
    _, err = receiver.drain_until_exit(proc)
    assert proc.returncode == 0
    (pid, _, report), = of_kind(receiver.reports, "exit")
    assert pid == proc.pid and report["step"] == 6
    assert report["exit"] == {"threads": ["heartbeat"], "executors": 1, "process_group": False,
                              "thread_pools": [{"workers": 1, "threads": ["prefetch_0"]}]}
    # The coalesced last step went out before the exit report.
    assert [r[2]["step"] for r in of_kind(receiver.reports, "step")] == [5, 6]
    lines = err.splitlines()
    assert ("gpuwatch: at exit, non-daemon thread 'heartbeat' is still running: the process will "
            "not exit until it stops") in lines
    assert any(line.startswith("gpuwatch: at exit, a ThreadPoolExecutor with 1 live worker "
                               "thread ('prefetch_0') was never shut down") for line in lines)
    assert len(lines) == 2


def test_a_process_group_never_destroyed_is_reported_at_exit(
        runtime_dir: Path, receiver: Receiver) -> None:
    # Stands in for torch.distributed where torch is not installed: the agent only ever looks
    # at what the program itself imported.
    proc = start("""
        import sys, types
        dist = types.ModuleType("torch.distributed")
        dist.is_available = lambda: True
        dist.is_initialized = lambda: True
        sys.modules["torch.distributed"] = dist
        from gpuwatch import agent
        agent.step(1)
        """, runtime_dir)
    _, err = receiver.drain_until_exit(proc)
    (_, _, report), = of_kind(receiver.reports, "exit")
    assert report["exit"] == {"threads": [], "executors": 0, "process_group": True}
    assert "torch.distributed process group was never destroyed" in err


@pytest.mark.sigint
def test_importing_the_agent_alone_changes_nothing_in_the_process(runtime_dir: Path) -> None:
    result = run("""
        import atexit, json, os, signal, sys, threading
        def state():
            fds = sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                         if os.path.exists(f"/proc/self/fd/{fd}"))
            return {"fds": [fd for fd in fds if "socket" in fd],
                    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                    "atexit": atexit._ncallbacks(),
                    "threading_atexit": len(threading._threading_atexits),
                    "threads": threading.active_count()}
        before = state()
        import gpuwatch.agent
        after = state()
        heavy = [m for m in ("psutil", "prometheus_client", "pynvml", "typer", "torch",
                             "concurrent.futures.thread") if m in sys.modules]
        print(json.dumps({"same": before == after, "before": before, "after": after,
                          "heavy": heavy}))
        threading.Thread(target=lambda: None).start()
        """, runtime_dir)
    assert result.returncode == 0 and result.stderr == ""
    state = json.loads(result.stdout)
    assert state["same"], state
    assert state["heavy"] == []


# ---- graceful_shutdown -------------------------------------------------------------------------


@pytest.mark.sigint
def test_first_sigint_runs_the_cleanups_in_order_and_exits_130(runtime_dir: Path) -> None:
    done = runtime_dir / "cleanups"
    proc = start(f"""
        import threading
        from gpuwatch import agent
        def write(tag):
            with open({str(done)!r}, "a") as f:
                f.write(tag)
        def broken():
            raise RuntimeError("checkpoint disk full")
        agent.graceful_shutdown(lambda: write("1"), broken, lambda: write("2"))
        # A thread that never ends would hold a plain interpreter exit forever.
        threading.Thread(target=threading.Event().wait, name="heartbeat").start()
        print("ready", flush=True)
        threading.Event().wait()
        """, runtime_dir)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    _, err = wait_exit(proc)
    assert proc.returncode == 130
    assert done.read_text() == "12"
    assert "RuntimeError: checkpoint disk full" in err
    assert "gpuwatch: interrupted: running 3 cleanups" in err


@pytest.mark.sigint
def test_second_sigint_during_a_slow_cleanup_exits_at_once(runtime_dir: Path) -> None:
    started, finished = runtime_dir / "started", runtime_dir / "finished"
    proc = start(f"""
        import time
        from gpuwatch import agent
        def slow_cleanup():
            open({str(started)!r}, "w").close()
            time.sleep(60)
            open({str(finished)!r}, "w").close()
        agent.graceful_shutdown(slow_cleanup)
        print("ready", flush=True)
        while True:
            time.sleep(1)
        """, runtime_dir)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    wait_file(started, proc)
    proc.send_signal(signal.SIGINT)
    wait_exit(proc, timeout=10)
    assert proc.returncode == 130
    assert not finished.exists()


@pytest.mark.sigint
def test_graceful_shutdown_takes_sigint_even_where_it_was_ignored(runtime_dir: Path) -> None:
    # A `python train.py &` in a job script starts with SIGINT ignored; the program asked for
    # its cleanups on Ctrl+C all the same. Its forked children get the ignoring back.
    done = runtime_dir / "cleanup"
    program = textwrap.dedent(f"""
        import os, signal, time
        print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)
        from gpuwatch import agent
        agent.graceful_shutdown(lambda: open({str(done)!r}, "w").close())
        child = os.fork()
        if child == 0:
            os._exit(0 if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else 1)
        _, status = os.waitpid(child, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
        while True:
            time.sleep(1)
        """)
    env = {**os.environ, "GPUWATCH_RUNTIME_DIR": str(runtime_dir), "PYTHONPATH": str(REPO)}
    # The trap is what the shell does for `cmd &` in a script; exec keeps the disposition.
    proc = subprocess.Popen(["sh", "-c", 'trap "" INT; exec "$@"', "sh", sys.executable, "-c",
                             program], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "True\n"  # started with SIGINT ignored
    assert proc.stdout.readline() == "0\n"  # its forked child: ignored again
    proc.send_signal(signal.SIGINT)
    wait_exit(proc)
    assert proc.returncode == 130
    assert done.exists()


# ---- with torch, where it is installed ---------------------------------------------------------


def test_torch_tensors_are_sized_by_their_own_bytes(runtime_dir: Path, receiver: Receiver
                                                    ) -> None:
    pytest.importorskip("torch")
    report = first_step_report("""
        import collections, sys, torch
        from gpuwatch import agent
        storage = torch.zeros(1000, 256)
        fetch = collections.deque((torch.zeros(64, 3, 32, 32), torch.zeros(64, dtype=torch.long))
                                  for _ in range(10))
        agent.watch("fetch_buffer", fetch)
        agent.watch("views", [storage[:10]] * 5)  # a view holds its own size, not the storage's
        agent.step(1)
        sys.stdin.read()
        """, runtime_dir, receiver)
    assert report["buffers"]["fetch_buffer"] == {"items": 10,
                                                 "bytes": 10 * (64 * 3 * 32 * 32 * 4 + 64 * 8)}
    assert report["buffers"]["views"] == {"items": 5, "bytes": 5 * 10 * 256 * 4}
    assert "cuda" not in report  # CUDA never initialised, so never asked


def test_a_real_torch_process_group_left_initialised_is_reported_at_exit(
        runtime_dir: Path, receiver: Receiver) -> None:
    pytest.importorskip("torch.distributed")
    store = runtime_dir / "store"
    proc = start(f"""
        import torch.distributed as dist
        from gpuwatch import agent
        dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
        agent.step(1)
        """, runtime_dir, env_extra={"GLOO_SOCKET_IFNAME": "lo"})
    _, err = receiver.drain_until_exit(proc, timeout=60)
    (_, _, report), = of_kind(receiver.reports, "exit")
    assert report["exit"]["process_group"] is True
    assert "torch.distributed process group was never destroyed" in err


# ---- the caching allocator's figures, and never importing torch --------------------------------

# A stand-in for torch where torch cannot be installed: only what the agent reads, with the
# allocator's statistics keys as torch.cuda.memory_stats() names them.
_FAKE_TORCH = """
import sys, types
torch = types.ModuleType("torch")
torch.cuda = types.SimpleNamespace(
    is_initialized=lambda: True,
    memory_stats=lambda: {"allocated_bytes.all.current": 3 << 30,
                          "reserved_bytes.all.current": 5 << 30,
                          "active_bytes.all.current": (3 << 30) + 4096,
                          "allocation.all.current": 812,
                          "num_alloc_retries": 0})
sys.modules["torch"] = torch
"""


def test_the_caching_allocators_figures_go_out_with_the_sized_reports(
        runtime_dir: Path, receiver: Receiver) -> None:
    report = first_step_report(_FAKE_TORCH + """
from gpuwatch import agent
agent.step(1)
sys.stdin.read()
""", runtime_dir, receiver)
    assert report["cuda"] == {"allocated": 3 << 30, "reserved": 5 << 30,
                              "active": (3 << 30) + 4096, "allocations": 812}


def test_a_program_that_never_imported_torch_does_not_import_it(
        runtime_dir: Path, receiver: Receiver) -> None:
    # Discovery passes, sized reports, finished and the exit check: none may import torch (a
    # lazy module's __getattr__ that imports it on access is the trap discovery must not spring).
    result = run("""
        import json, sys, time, types
        from gpuwatch import agent
        lazy = types.ModuleType("lazy_frameworks")
        def __getattr__(name):
            import torch  # noqa
        lazy.__getattr__ = __getattr__
        sys.modules["lazy_frameworks"] = lazy
        cache = []
        # Until discovery has made two passes (a loaded machine takes longer), at most 30 s.
        deadline = time.monotonic() + 30
        step = 0
        while time.monotonic() < deadline and not (
                agent._st.scanner is not None and agent._st.scanner.stats["passes"] >= 2):
            cache.append(bytes(1024))
            agent.step(step)
            step += 1
            time.sleep(0.01)
        agent.finished()
        print(json.dumps({"torch": "torch" in sys.modules,
                          "scanned": agent._st.scanner is not None
                          and agent._st.scanner.stats["passes"]}))
        """, runtime_dir)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out == {"torch": False, "scanned": out["scanned"]} and out["scanned"] >= 2


def test_a_real_cuda_process_reports_the_caching_allocator(
        runtime_dir: Path, receiver: Receiver) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    report = first_step_report("""
        import sys, torch
        from gpuwatch import agent
        held = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        freed = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
        del freed  # cached by the allocator: reserved, not allocated
        agent.step(1)
        sys.stdin.read()
        """, runtime_dir, receiver, timeout=60)
    cuda = report["cuda"]
    print(f"real allocator figures: {cuda}")
    assert cuda["allocated"] >= 256 << 20 and cuda["reserved"] >= cuda["allocated"] + (512 << 20)
    assert cuda["active"] >= cuda["allocated"] and cuda["allocations"] >= 1


def test_buffers_are_sized_for_at_most_one_report_in_size_interval(
        runtime_dir: Path, receiver: Receiver) -> None:
    result = run("""
        import json, time
        from gpuwatch import agent
        agent.configure(min_interval=0.02, discovery=False)
        agent.watch("fetch_buffer", [bytes(4096)] * 16)
        started = time.monotonic()
        step = 0
        while time.monotonic() - started < 1.0:
            agent.step(step)
            step += 1
            time.sleep(0.001)
        print(json.dumps({"elapsed": time.monotonic() - started, "interval": agent.SIZE_INTERVAL}))
        """, runtime_dir)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    steps = receiver.wait_for("the reports", lambda rs: len(rs) >= 10 and of_kind(rs, "step"))
    sized = [r for r in steps if "buffers" in r[2]]
    assert sized[0] is steps[0]
    assert len(steps) >= 3 * len(sized)  # a fast loop: most reports are not sized
    assert len(sized) <= figures["elapsed"] / figures["interval"] + 2
    assert all(r[2]["buffers"]["fetch_buffer"] == {"items": 16, "bytes": 16 * 4096}
               for r in sized)


# ---- the daemon's requests ---------------------------------------------------------------------


@contextmanager
def stepping(runtime_dir: Path, receiver: Receiver, env_extra: Optional[dict[str, str]] = None
             ) -> Iterator[tuple[subprocess.Popen[str], Any]]:
    """A program stepping every 20 ms, and its reply address: what the daemon sees as the sender
    of its reports."""
    proc = start("""
        import time
        from gpuwatch import agent
        step = 0
        while True:
            agent.step(step)
            step += 1
            time.sleep(0.02)
        """, runtime_dir, env_extra=env_extra)
    try:
        receiver.wait_for("a step report", lambda rs: of_kind(rs, "step")[:1], proc=proc)
        receiver.sock.settimeout(5)
        _, _, _, address = receiver.sock.recvmsg(65536, 64)
        yield proc, address
    finally:
        proc.kill()
        proc.communicate()


def trace_request(steps: int) -> bytes:
    return json.dumps({"v": 1, "kind": "trace", "steps": steps}).encode()


def test_a_request_is_obeyed_only_from_the_daemons_socket(
        runtime_dir: Path, receiver: Receiver) -> None:
    with stepping(runtime_dir, receiver) as (proc, address):
        assert isinstance(address, bytes) and address.startswith(b"\0")
        # From anyone else (an abstract socket of the same user): ignored. Had it been obeyed,
        # the first trace would be 2 steps long and the daemon's request refused as busy.
        forger = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        forger.bind("")
        forger.sendto(trace_request(2), address)
        forger.close()
        time.sleep(1.2)  # past two request checks: a forged request would have started by now
        # From the socket the reports go to: obeyed.
        receiver.sock.sendto(trace_request(3), address)
        (_, _, answer), = receiver.wait_for("a trace report",
                                            lambda rs: of_kind(rs, "trace")[:1], proc=proc)
    assert answer["trace"]["status"] == "done" and answer["trace"]["steps"] == 3


def search_request(seconds: int) -> bytes:
    return json.dumps({"v": 1, "kind": "search", "seconds": seconds}).encode()


def test_a_search_request_raises_discoverys_share_for_the_seconds_asked_then_not_again_soon(
        runtime_dir: Path, receiver: Receiver) -> None:
    # Every slice's budget is recorded; the program stops once told to (stdin closed) and its
    # faster search, if any, has been over for a while.
    proc = start("""
        import json, sys, threading, time
        from gpuwatch import agent
        from gpuwatch.agent import _discovery

        budgets = []
        slice_ = _discovery.Scanner.slice

        def recorded(self, step, budget=None):
            budgets.append((time.monotonic(), budget))
            return slice_(self, step, budget)

        _discovery.Scanner.slice = recorded
        told = threading.Event()
        threading.Thread(target=lambda: (sys.stdin.read(), told.set()), daemon=True).start()
        searches = []
        step = 0
        while not (told.is_set() and time.monotonic() > agent._st.search_until + 0.6):
            agent.step(step)
            if not searches or searches[-1][1] != agent._st.search_until:
                searches.append((agent._st.search_began, agent._st.search_until))
            step += 1
            time.sleep(0.02)
        print(json.dumps({"budgets": budgets, "searches": searches[1:]}))
        """, runtime_dir, stdin=subprocess.PIPE)
    try:
        receiver.wait_for("a step report", lambda rs: of_kind(rs, "step")[:1], proc=proc)
        receiver.sock.settimeout(5)
        _, _, _, address = receiver.sock.recvmsg(65536, 64)
        # A search and a trace sent together, as the daemon sends them when a leak is raised:
        # both are obeyed.
        receiver.sock.sendto(search_request(2), address)
        receiver.sock.sendto(trace_request(3), address)
        receiver.wait_for("a trace report", lambda rs: of_kind(rs, "trace")[:1], proc=proc)
        # A second search within the agent's cooldown is ignored; the trace sent with it is
        # refused (its own cooldown), which says the agent read both.
        receiver.sock.sendto(search_request(30), address)
        receiver.sock.sendto(trace_request(3), address)
        receiver.wait_for("a refused trace", lambda rs: [
            r for r in of_kind(rs, "trace") if r[2]["trace"]["status"] == "refused"], proc=proc)
        out, err = proc.communicate("", timeout=60)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 0, err
    figures = json.loads(out)
    (began, until), = figures["searches"]
    assert until - began == pytest.approx(2.0)
    during = [b for t, b in figures["budgets"] if began <= t < until]
    after = [b for t, b in figures["budgets"] if t >= until]
    # 6% of the 0.25 s between slices instead of 1%; at most SEARCH_BUDGET_MAX a slice.
    assert len(during) >= 4 and sorted(during)[len(during) // 2] >= 0.01, during
    assert max(during) <= 0.04
    assert after and max(after) <= 0.005, after


def test_tracing_can_be_refused_from_the_environment(
        runtime_dir: Path, receiver: Receiver) -> None:
    with stepping(runtime_dir, receiver, {"GPUWATCH_AGENT_TRACING": "0"}) as (proc, address):
        receiver.sock.sendto(trace_request(2), address)
        (_, _, answer), = receiver.wait_for("a trace report",
                                            lambda rs: of_kind(rs, "trace")[:1], proc=proc)
    assert answer["trace"] == {"status": "refused", "why": "GPUWATCH_AGENT_TRACING=0"}


# ---- where reports go: only to the daemon (docs/security.md, rule 3) -------------------------


def test_reports_go_only_to_a_socket_of_root_this_user_or_the_daemon_where_no_one_else_writes(
        runtime_dir: Path) -> None:
    from gpuwatch.agent._transport import (
        Refused,
        check_private_dir,
        check_socket,
        checked_directory,
    )

    if os.geteuid() != 0:
        pytest.skip("needs root to give files to another user")
    other = 65534
    runtime_dir.chmod(0o755)
    ok = runtime_dir / "ok"
    ok.mkdir(mode=0o755)
    daemons = Receiver(ok / "agent.sock")
    try:
        assert checked_directory(str(ok)) == (str(ok), frozenset({0}))
        check_socket(str(ok / "agent.sock"), frozenset({0}))
        # A link is followed, and what is checked and sent to is the directory it names.
        link = runtime_dir / "link"
        link.symlink_to(ok)
        assert checked_directory(str(link))[0] == str(ok)
        # The daemon's account's directory, where root put it (the directory above is root's
        # alone): its sockets are believed.
        theirs = ok / "placed"
        theirs.mkdir(mode=0o755)
        os.chown(theirs, other, other)
        assert checked_directory(str(theirs)) == (str(theirs), frozenset({0, other}))

        anyones = runtime_dir / "anyones"
        anyones.mkdir()
        anyones.chmod(0o777)
        with pytest.raises(Refused, match=r"writable by others \(mode 0777\)"):
            checked_directory(str(anyones))
        with pytest.raises(Refused, match="not sticky"):
            checked_directory(str(anyones / "below"))
        # Another user's directory where any user may make one (a sticky one, as /tmp).
        sticky = runtime_dir / "sticky"
        sticky.mkdir()
        sticky.chmod(0o1777)
        planted = sticky / "run"
        planted.mkdir(mode=0o755)
        os.chown(planted, other, other)
        with pytest.raises(Refused, match="in a directory any user may create in"):
            checked_directory(str(planted))

        os.chown(ok / "agent.sock", other, other)
        with pytest.raises(Refused, match=r"owned by .*uid 65534.*not by root"):
            check_socket(str(ok / "agent.sock"), frozenset({0}))
        private = ok / "agent.d"
        private.mkdir(mode=0o755)
        os.chown(private, other, other)
        with pytest.raises(Refused, match="owned by"):
            check_private_dir(str(private), frozenset({0}))
        os.chown(private, 0, 0)
        private.chmod(0o777)
        with pytest.raises(Refused, match="writable by others"):
            check_private_dir(str(private), frozenset({0}))
    finally:
        daemons.close()


def test_a_socket_in_a_runtime_directory_anyone_may_write_gets_no_report_and_one_line_why(
        runtime_dir: Path, receiver: Receiver) -> None:
    """Anyone could have put agent.sock, or agent.d/<uid>.sock, in a directory of mode 0777:
    not one report goes there, the program runs on, and stderr says why once."""
    (runtime_dir / "agent.d").mkdir(mode=0o777)
    mine = Receiver(runtime_dir / "agent.d" / f"{os.geteuid()}.sock")
    runtime_dir.chmod(0o777)
    try:
        result = run(_no_daemon_program(3000), runtime_dir)
        assert result.returncode == 0, result.stderr
        stats = json.loads(result.stdout)
        assert stats["sent"] == 0 and stats["refused"] >= 1 and stats["failed"] >= 1
        lines = result.stderr.splitlines()
        assert len(lines) == 1, result.stderr
        assert f"the runtime directory {runtime_dir} is writable by others" in lines[0]
        for ear in (receiver, mine):
            assert not ear._receive(0.2), ear.reports
    finally:
        mine.close()
