"""What agent.step() costs the training thread, next to a bare non-blocking sendto of a report.

Three parts, measured separately because they run at different times:

1. The send path. Three watched buffers (a list of 1 MiB bytes objects, a deque of batch-like
   tuples, a callable returning a queue's depth), a daemon-like receiver in another process, and:
   - a coalesced step (the usual case: it records the step and returns),
   - a step that sends (min_interval 0: RSS, encode, send; buffers measured at most every
     SIZE_INTERVAL), a step that sends and sizes the buffers, and building that report alone,
   - a bare sendto of the same datagram on a non-blocking Unix datagram socket,
   - a 10 kHz training loop, each step timed: the amortised cost with coalescing at 50 ms,
   - no daemon listening (a coalesced step, and the one failed send per backoff period).
2. Discovery: `--modules` generated modules imported (2,000 by default, `--objects` module-level
   objects in all: dicts, lists, sets, instances holding containers, classes with class-level
   containers, functions), then the scanner's slices at the agent's budget: the time of a slice,
   of a full pass, and the share of the training thread at the default cadence; and a 100 Hz
   loop calling step() with discovery on, each step timed.
3. Tracing: an allocation-heavy step with and without tracemalloc on (as a daemon's request
   turns it on), and the final snapshot and comparison that end a trace.

    python bench/agent_step.py [--batches 400] [--modules 2000] [--objects 100000]
"""

from __future__ import annotations

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

from cmdline import arguments, write_figures

from gpuwatch import agent
from gpuwatch.agent import _reports

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
    args = arguments(
        __doc__, quick={"batches": 40, "modules": 200, "objects": 10_000},
        smoke={"batches": 5, "modules": 20, "objects": 1_000}, batches=400,
        rate=(10_000.0, "steps/s of the paced loop"), modules=(2000, "generated modules loaded"),
        objects=(100_000, "module-level objects in the generated modules, in all"))

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
            scan = discovery(path, Path(tmp) / "generated", args.modules, args.objects)
        finally:
            receiver.kill()
            receiver.wait()
    tracing = trace_costs(args.quick)
    report(rows, extra)
    report_discovery(scan)
    report_tracing(tracing)
    write_figures(args.figures, {"ns": rows, **extra, "discovery": scan, "tracing": tracing})


def measure(path: str, missing: Path, batches: int, rate: float
            ) -> tuple[dict[str, float], dict[str, float]]:
    rows: dict[str, float] = {}
    gc.disable()  # a collection inside one batch is noise that no step() causes
    try:
        # Discovery's slices run in their own step() calls and are measured on their own.
        agent.configure(socket_path=path, min_interval=0, discovery=False)
        payload = agent._report("step", 123456, time.monotonic())
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
        size_interval = _reports.SIZE_INTERVAL
        rows["step() that sends"] = per_call_ns(lambda: agent.step(1), SEND_BATCH, batches,
                                                settle=0.002)
        _reports.SIZE_INTERVAL = 0.0  # every report sizes the buffers
        rows["step() that sends and sizes"] = per_call_ns(lambda: agent.step(1), SEND_BATCH,
                                                          batches, settle=0.002)
        full += agent._stats()["dropped"] - dropped
        rows["  of which building the sized report"] = per_call_ns(
            lambda: agent._report("step", 1, time.monotonic()), SEND_BATCH, batches,
            settle=0.002)
        _reports.SIZE_INTERVAL = size_interval

        agent.configure(socket_path=path, discovery=False)  # coalescing at the default 50 ms
        rows["step() coalesced"] = per_call_ns(lambda: agent.step(1), 1000, batches)
        mean, median, sent = paced_loop_ns(rate, int(rate))
        rows[f"step() in a {rate / 1000:g} kHz loop, amortised"] = mean
        paced_median = median

        agent.configure(socket_path=str(missing), discovery=False)
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
    print(f"buffers are sized for at most one report in {agent.SIZE_INTERVAL:g} s: a step that "
          "sends and sizes is the first kind, one that only sends the second")
    if extra["full"]:
        print(f"note: {extra['full']:.0f} sends met a full receiver queue and were dropped")


# ---- discovery ---------------------------------------------------------------------------------


# One module-level object each, in turn; {k} is its number in the module.
_GLOBALS = ("d{k} = {{i: i for i in range({k} % 17)}}", "l{k} = list(range({k} % 23))",
            "s{k} = set(range({k} % 7))", "h{k} = Holder({k} % 5)",
            "def f{k}(x):\n    return x + {k}", "q{k} = collections.deque(range({k} % 11))",
            "t{k} = ({k}, 'x{k}')", "v{k} = {k}", "w{k} = {k}", "u{k} = {k}")


def generate_modules(root: Path, modules: int, objects: int) -> list[str]:
    """`modules` importable modules with `objects` module-level objects among them, shaped like
    a real program's: containers of several kinds, instances holding containers one and two
    levels down, classes with class-level registries, functions and plain values."""
    root.mkdir(parents=True, exist_ok=True)
    per_module = max(10, objects // modules)
    names = []
    for m in range(modules):
        lines = ["import collections", "",
                 "class Holder:", "    registry = {}", "    hooks = []", "",
                 "    def __init__(self, n):", "        self.items = list(range(n))",
                 "        self.index = {i: str(i) for i in range(n)}",
                 "        self.child = Child(n)", "",
                 "class Child:", "    def __init__(self, n):",
                 "        self.cache = collections.OrderedDict((i, i) for i in range(n))", ""]
        for k in range(per_module):
            lines.append(_GLOBALS[k % len(_GLOBALS)].format(k=k))
        name = f"gwbench_mod_{m:05d}"
        (root / f"{name}.py").write_text("\n".join(lines) + "\n")
        names.append(name)
    return names


def discovery(path: str, root: Path, modules: int, objects: int) -> dict[str, float]:
    import importlib

    from gpuwatch.agent._discovery import Scanner

    names = generate_modules(root, modules, objects)
    sys.path.insert(0, str(root))
    started = time.perf_counter()
    for name in names:
        importlib.import_module(name)
    import_s = time.perf_counter() - started

    scanner = Scanner(budget=agent.SCAN_BUDGET)
    slices: list[float] = []
    passes = 0
    while passes < 3:
        t0 = time.perf_counter()
        done = scanner.slice(passes)
        slices.append(time.perf_counter() - t0)
        passes += done
    stats = dict(scanner.stats)

    # A 100 Hz training loop with discovery on at the default cadence, each step() timed.
    agent.configure(socket_path=path)
    rate, seconds = 100.0, 3.0
    costs = []
    next_step = time.perf_counter()
    for i in range(int(rate * seconds)):
        while time.perf_counter() < next_step:
            pass
        next_step += 1 / rate
        t0 = time.perf_counter_ns()
        agent.step(i)
        costs.append(time.perf_counter_ns() - t0)
    loop_scanner = agent._st.scanner
    loop_passes = loop_scanner.stats["passes"] if loop_scanner is not None else 0
    mean_slice = statistics.fmean(slices)
    return {"modules": len(sys.modules), "generated": modules, "objects": objects,
            "import_s": import_s, "slice_ms_median": 1e3 * statistics.median(slices),
            "slice_ms_max": 1e3 * max(slices), "slice_ms_mean": 1e3 * mean_slice,
            "pass_ms": 1e3 * stats.get("last_pass_seconds", float("nan")),
            "slices_per_pass": stats.get("slices_last_pass", float("nan")),
            "candidates": stats.get("candidates", float("nan")),
            "duty": mean_slice / agent.SCAN_INTERVAL,
            "loop_mean_us": statistics.fmean(costs) / 1e3,
            "loop_median_us": statistics.median(costs) / 1e3,
            "loop_max_ms": max(costs) / 1e6, "loop_passes": loop_passes,
            "loop_seconds": seconds}


def report_discovery(f: dict[str, float]) -> None:
    print()
    print(f"discovery: {f['generated']:,.0f} generated modules ({f['modules']:,.0f} loaded in "
          f"all, {f['objects']:,.0f} module-level objects generated), "
          f"{f['candidates']:,.0f} containers tracked")
    print(f"  a slice (budget {agent.SCAN_BUDGET * 1e3:g} ms): median {f['slice_ms_median']:.2f} "
          f"ms, max {f['slice_ms_max']:.2f} ms")
    print(f"  a full pass: {f['pass_ms']:.1f} ms of work in {f['slices_per_pass']:.0f} slices, "
          f"one slice every {agent.SCAN_INTERVAL:g} s: a pass every "
          f"{f['slices_per_pass'] * agent.SCAN_INTERVAL:.1f} s")
    print(f"  share of the training thread at the default cadence: {100 * f['duty']:.2f}% "
          f"(per 1 s step: {f['slice_ms_mean'] * min(1.0, 1 / agent.SCAN_INTERVAL):.2f} ms "
          f"at most; per 100 ms step: {f['duty'] * 100:.3f} ms on average)")
    print(f"  a 100 Hz loop with discovery on, {f['loop_seconds']:g} s: step() mean "
          f"{f['loop_mean_us']:.1f} us, median {f['loop_median_us']:.1f} us, max "
          f"{f['loop_max_ms']:.2f} ms; {f['loop_passes']:.0f} passes completed")


# ---- tracing -----------------------------------------------------------------------------------


def _allocating_step(kept: list[object]) -> None:
    """A Python-heavy training step: many short-lived small objects, a few kept."""
    batch = [{"id": i, "tokens": list(range(8)), "text": f"sample {i}"} for i in range(2000)]
    kept.extend(batch[:20])


def trace_costs(quick: bool) -> dict[str, float]:
    import tracemalloc

    from gpuwatch.agent._tracing import Tracer

    steps = 20 if quick else 100
    kept: list[object] = []

    def timed() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            _allocating_step(kept)
        return (time.perf_counter() - t0) / steps

    timed()  # warm
    off = min(timed() for _ in range(3))
    tracer = Tracer(cooldown=0.0)
    assert tracer.start(100, 0) is None
    on = min(timed() for _ in range(3))
    # What ends a trace: the final snapshot and the comparison, with the blocks kept meanwhile.
    live = tracemalloc.get_traced_memory()[0]
    kept.extend(bytearray(64) for _ in range(20_000 if quick else 100_000))
    t0 = time.perf_counter()
    body = tracer.on_step(100) or {}  # started at step 0 for 100 steps: this one ends it
    end_s = time.perf_counter() - t0
    return {"step_off_ms": off * 1e3, "step_on_ms": on * 1e3, "ratio": on / off,
            "end_ms": end_s * 1e3, "traced_mib": live / (1 << 20),
            "status": 1.0 if body.get("status") == "done" else 0.0}


def report_tracing(f: dict[str, float]) -> None:
    print()
    print(f"tracing: an allocation-heavy step {f['step_off_ms']:.2f} ms untraced, "
          f"{f['step_on_ms']:.2f} ms traced ({f['ratio']:.2f}x); ending a trace (snapshot and "
          f"comparison, {f['traced_mib']:.0f} MiB traced) {f['end_ms']:.0f} ms, once")


if __name__ == "__main__":
    main()
