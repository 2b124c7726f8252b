"""What agent.step() costs the training thread, next to a bare non-blocking sendto of a report.

Three watched buffers (a list of 1 MiB bytes objects, a deque of batch-like tuples, a callable
returning a queue's depth), a daemon-like receiver in another process, and:
- a coalesced step (the usual case: it records the step and returns),
- a step that sends (min_interval 0: it measures the buffers, reads RSS, encodes, sends), and
  building that report alone,
- a bare sendto of the same datagram on a non-blocking Unix datagram socket,
- a 10 kHz training loop, each step timed: the amortised cost with coalescing at 50 ms,
- no daemon listening (a coalesced step, and the one failed send per backoff period).

    python bench/agent_step.py [--batches 400]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from node import parse_args, write_figures

from gpuwatch import agent

MIB = 1 << 20
SEND_BATCH = 4  # sends per timed batch: below the kernel's default queue of 10 datagrams

_RECEIVER = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
s.bind(sys.argv[1])
print("ready", flush=True)
while True:
    s.recv(65536)
"""


def per_call_ns(fn: Callable[[], object], calls: int, batches: int,
                settle: float = 0.0) -> float:
    """Median over batches of the time of `calls` calls, per call. `settle` pauses between
    batches, so that the receiver empties its queue and no send meets a full one."""
    samples = []
    for _ in range(batches):
        started = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - started) / calls)
        if settle:
            time.sleep(settle)
    return statistics.median(samples)


def paced_loop_ns(rate_hz: float, steps: int) -> tuple[float, float, int]:
    """A training loop at `rate_hz`, each step() timed on its own: (mean, median, reports)."""
    timer = min(_timer_overhead() for _ in range(5))
    period = int(1e9 / rate_hz)
    sent_before = agent._stats()["sent"]
    costs = []
    next_step = time.perf_counter_ns()
    for i in range(steps):
        while time.perf_counter_ns() < next_step:
            pass
        next_step += period
        t0 = time.perf_counter_ns()
        agent.step(i)
        costs.append(time.perf_counter_ns() - t0 - timer)
    return statistics.fmean(costs), statistics.median(costs), agent._stats()["sent"] - sent_before


def _timer_overhead() -> float:
    samples = []
    for _ in range(2000):
        t0 = time.perf_counter_ns()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--rate", type=float, default=10_000, help="steps/s of the paced loop")
    args = parse_args(parser, quick={"batches": 40})

    fetch = [bytes(MIB) for _ in range(64)]
    batches = collections.deque((bytes(4096), i) for i in range(256))
    work = queue.Queue()
    for i in range(32):
        work.put(i)
    agent.watch("fetch_buffer", fetch)
    agent.watch("batches", batches)
    agent.watch("queue_depth", lambda: work.qsize())

    with tempfile.TemporaryDirectory(prefix="gw-bench-", dir="/tmp") as tmp:
        path = str(Path(tmp) / "agent.sock")
        receiver = subprocess.Popen([sys.executable, "-c", _RECEIVER, path],
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert receiver.stdout is not None and receiver.stdout.readline() == "ready\n"
            rows, extra = measure(path, Path(tmp) / "nobody.sock", args.batches, args.rate)
        finally:
            receiver.kill()
            receiver.wait()
    report(rows, extra)
    write_figures(args.figures, {"ns": rows, **extra})


def measure(path: str, missing: Path, batches: int, rate: float
            ) -> tuple[dict[str, float], dict[str, float]]:
    rows: dict[str, float] = {}
    gc.disable()  # a collection inside one batch is noise that no step() causes
    try:
        agent.configure(socket_path=path, min_interval=0)
        payload = agent._report("step", 123456)
        assert payload is not None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        full = 0

        def bare_sendto() -> None:
            nonlocal full
            try:
                sock.sendto(payload, path)
            except BlockingIOError:
                full += 1

        rows["bare sendto"] = per_call_ns(bare_sendto, SEND_BATCH, batches, settle=0.002)
        dropped = agent._stats()["dropped"]
        rows["step() that sends"] = per_call_ns(lambda: agent.step(1), SEND_BATCH, batches,
                                                settle=0.002)
        full += agent._stats()["dropped"] - dropped
        rows["  of which building the report"] = per_call_ns(lambda: agent._report("step", 1),
                                                           SEND_BATCH, batches, settle=0.002)

        agent.configure(socket_path=path)  # coalescing at the default 50 ms
        rows["step() coalesced"] = per_call_ns(lambda: agent.step(1), 1000, batches)
        mean, median, sent = paced_loop_ns(rate, int(rate))
        rows[f"step() in a {rate / 1000:g} kHz loop, amortised"] = mean
        paced_median = median

        agent.configure(socket_path=str(missing))
        attempts = agent._stats()["attempts"]
        rows["step() with no daemon"] = per_call_ns(lambda: agent.step(1), 1000, batches)
        no_daemon_attempts = agent._stats()["attempts"] - attempts
        nobody = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        nobody.setblocking(False)

        def failed_sendto() -> None:
            with contextlib.suppress(FileNotFoundError):
                nobody.sendto(payload, str(missing))

        rows["failed sendto (no daemon)"] = per_call_ns(failed_sendto, 100, batches)
    finally:
        gc.enable()
    extra = {"payload": len(payload), "full": full, "sent": sent, "paced_median": paced_median,
             "no_daemon_attempts": no_daemon_attempts, "no_daemon_steps": 1000 * batches}
    return rows, extra


def report(rows: dict[str, float], extra: dict[str, float]) -> None:
    bare = rows["bare sendto"]
    print(f"agent.step(): 3 watched buffers (64 x 1 MiB list, deque of 256 batches, a callable), "
          f"a {extra['payload']}-byte report, a receiver in another process")
    print(f"{'':<38} {'ns/call (median)':>17} {'x bare sendto':>14}")
    for label, ns in rows.items():
        print(f"{label:<38} {ns:>17,.0f} {ns / bare:>14.2f}")
    print(f"the paced loop sent {extra['sent']:.0f} reports in 1 s; median step there "
          f"{extra['paced_median']:,.0f} ns")
    print(f"with no daemon, the agent tried {extra['no_daemon_attempts']:.0f} send(s) in "
          f"{extra['no_daemon_steps']:,.0f} steps (then it backs off, 1 s doubling to 30 s)")
    if extra["full"]:
        print(f"note: {extra['full']:.0f} sends met a full receiver queue and were dropped")


if __name__ == "__main__":
    main()
