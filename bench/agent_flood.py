"""One local user floods agent.sock; the daemon's memory, /metrics and a second user's leak.

600 real processes of one user (forked from this script: the daemon takes each report's PID and
UID from the kernel, so 600 reporters must be 600 processes) each send 520 step reports of 64
buffers, then stay alive. Meanwhile a process of a second user (UID 65534, when this runs as
root) reports a host-memory leak of 4 MiB a step, 10 steps a second, as the agent would. Prints
the daemon's RSS before, at its peak and after the flooders exit, what it accepted, rejected and
evicted, the size of /metrics and how long a scrape takes with the flooders alive, and when the
second user's leak was found.

    python bench/agent_flood.py [--processes 600] [--reports 520] [--buffers 64] [--rate 0]
                                [--discovered 0]
    python bench/agent_flood.py --junk --processes 2000

--junk: each flooder sends a 4-byte datagram that is no report, over and over, blocking on a
full queue, until the end (the kernel queue, not the daemon's budgets, is what is flooded); the
second user's leak is then first timed alone, unloaded, and then under the flood, side by side.

--rate paces each flooder (reports a second; 0: as fast as the socket takes them);
--discovered adds that many discovered containers with fresh 128-character names to each report
(the most the protocol allows is 8; with --processes 1024, every bound is reached at once).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from cmdline import arguments, write_figures
from node import (
    MIB,
    bench_node,
    check_room_for,
    cli_env,
    free_port,
    rss_bytes,
    scrape,
    start_daemon,
    stop,
    wait_http,
)

NOBODY = 65534
#: The flooders' user when this runs as root: a user of its own, not root (which may write to
#: any socket), as a hostile local user would be.
FLOODER_UID = 4243
LEAK_PER_STEP = 4 * MIB
VICTIM_STEPS_PER_SECOND = 10


def _child(body: Any) -> int:
    """Fork; the child runs `body()` and exits without running this process's cleanup."""
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        body()
    except BaseException:  # a child reports nothing: its exit code says it failed
        code = 1
    finally:
        os._exit(code)


def _flooder(path: str, index: int, reports: int, buffers: int, discovered: int, rate: float,
             go: int, done: int) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    # Blocking, with no timeout: a full queue puts the sender to sleep in the kernel. (With a
    # timeout, Python polls the socket, which an unconnected datagram socket answers as
    # writable at once: 600 senders would spin on the CPU the daemon needs.)
    sock.connect(path)
    names = [f"flood.{index}.buffer_{j}" for j in range(buffers)]
    os.read(go, 1)
    started = time.monotonic()
    for step in range(reports):
        report: dict[str, Any] = {
            "v": 1, "kind": "step", "seq": step, "step": step, "rss": 1 << 30,
            "buffers": {name: {"items": step + j, "bytes": (step + j) << 10}
                        for j, name in enumerate(names)}}
        if discovered:  # fresh names each time: every one interned, every one a new series
            report["discovered"] = {f"flood.{index}.{step}.{j}.".ljust(128, "d"): {
                "items": step, "bytes": step << 10} for j in range(discovered)}
        sock.send(json.dumps(report).encode())
        if rate:
            time.sleep(max(0.0, started + (step + 1) / rate - time.monotonic()))
    os.write(done, b"x")
    signal.pause()  # alive, so that the daemon keeps what it took from this process


def _junk_flooder(path: str, go: int) -> None:
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(FLOODER_UID)
        os.setuid(FLOODER_UID)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # blocking: sleeps on a full queue
    os.read(go, 1)
    while True:
        with contextlib.suppress(OSError):
            sock.sendto(b"junk", path)


def _leak_found(url: str, victim: int, started: float, limit: float) -> Optional[float]:
    """Seconds from `started` until the daemon reports `victim`'s leak, None past `limit`."""
    while time.monotonic() - started < limit:
        s = samples(scrape(url)[1])
        if any(f'pid="{victim}"' in k and 'kind="leak"' in k
               for k in by_label(s, "gpuwatch_finding")):
            return time.monotonic() - started
        time.sleep(0.1)
    return None


def _victim(path: str, steps: int, report_to: int) -> None:
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    from gpuwatch.agent._transport import Transport

    # The agent's own transport: non-blocking (a full queue drops the report), an abstract
    # address, and its user's own socket once the daemon has made one.
    transport = Transport()
    started = time.monotonic()
    for step in range(steps):
        payload = json.dumps({"v": 1, "kind": "step", "seq": step, "step": step,
                              "rss": (1 << 30) + step * LEAK_PER_STEP, "buffers": {
                                  "fetch_buffer": {"items": step, "bytes": step * LEAK_PER_STEP},
                                  "queue": {"items": 3}}}).encode()
        transport.send(payload, path)
        sent, dropped = transport.sent, transport.attempts - transport.sent
        os.write(report_to, f"{step} {sent} {dropped}\n".encode())
        time.sleep(max(0.0, started + (step + 1) / VICTIM_STEPS_PER_SECOND - time.monotonic()))
    signal.pause()


class Peak(threading.Thread):
    """The highest RSS of a process, sampled every 50 ms."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.05):
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, rss_bytes(self.pid))


def samples(body: bytes) -> dict[str, float]:
    """{'name{labels}': value} of every sample line."""
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            key, _, number = line.rpartition(" ")
            out[key] = float(number)
    return out


def by_label(s: dict[str, float], name: str) -> dict[str, float]:
    """{label values: value} of one metric family (labels as written)."""
    return {key[len(name) + 1:-1]: v for key, v in s.items() if key.startswith(name + "{")}


def main() -> None:
    args = arguments(
        __doc__, quick={"processes": 60, "reports": 60},
        smoke={"processes": 8, "reports": 8, "interval": 0.5},
        processes=600, reports=520, buffers=64,
        discovered=(0, "discovered containers with fresh names in each report (max 8)"),
        rate=0.0, interval=2.0, victim_steps=600,
        junk=(False, "flood with junk datagrams until the end; time the second user's leak "
                     "unloaded first"))
    if args.junk:
        junk_main(args)
        return
    check_room_for(args.processes + 16)
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    with bench_node(gpus=2, gpu_procs=4) as b:
        daemon = start_daemon(b, port, args.interval)
        children: list[int] = []
        try:
            wait_http(url, daemon)
            os.chmod(b.tmp, 0o711)  # the second user must reach agent.sock inside it
            path = str(Path(cli_env(b)["GPUWATCH_RUNTIME_DIR"]) / "agent.sock")
            time.sleep(3 * args.interval)
            before = rss_bytes(daemon.pid)
            before_s = samples(scrape(url)[1])
            peak = Peak(daemon.pid)
            peak.start()

            go_r, go_w = os.pipe()
            done_r, done_w = os.pipe()
            for i in range(args.processes):
                children.append(_child(lambda i=i: _flooder(
                    path, i, args.reports, args.buffers, args.discovered, args.rate, go_r,
                    done_w)))
            victim_r, victim_w = os.pipe()
            victim = _child(lambda: _victim(path, args.victim_steps, victim_w))
            children.append(victim)
            os.close(victim_w)
            started = time.monotonic()
            os.write(go_w, b"g" * args.processes)

            # The second user's leak, found while the flood goes on.
            found_after: Optional[float] = None
            found_step: Optional[int] = None
            victim_line = b""
            done = 0
            os.set_blocking(done_r, False)
            os.set_blocking(victim_r, False)
            flood_seconds: Optional[float] = None
            while time.monotonic() - started < 600:
                with contextlib.suppress(BlockingIOError):
                    done += len(os.read(done_r, 4096))
                if done >= args.processes and flood_seconds is None:
                    flood_seconds = time.monotonic() - started
                with contextlib.suppress(BlockingIOError):
                    victim_line = (victim_line + os.read(victim_r, 1 << 16))[-4096:]
                if found_after is None:
                    s = samples(scrape(url)[1])
                    leak = [k for k in by_label(s, "gpuwatch_finding")
                            if f'pid="{victim}"' in k and 'kind="leak"' in k]
                    if leak:
                        found_after = time.monotonic() - started
                        found_step = int(victim_line.split(b"\n")[-2].split()[0])
                if flood_seconds is not None and found_after is not None:
                    break
                time.sleep(0.25)
            time.sleep(2 * args.interval)  # the flooders held: what the daemon keeps of them

            held = rss_bytes(daemon.pid)
            times, body = [], b""
            for _ in range(5):
                seconds, body = scrape(url)
                times.append(seconds)
            during = samples(body)
            series = len(during)
            victim_step = by_label(during, "gpuwatch_agent_step")
            seen_step = next((v for k, v in victim_step.items() if f'pid="{victim}"' in k), None)
            with contextlib.suppress(BlockingIOError):
                victim_line = (victim_line + os.read(victim_r, 1 << 16))[-4096:]
            v_step, v_sent, v_dropped = (int(x) for x in victim_line.split(b"\n")[-2].split())

            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for pid in children:
                os.waitpid(pid, 0)
            children = []
            time.sleep(5 * args.interval)
            after = rss_bytes(daemon.pid)
            peak.stopping.set()
            peak.join()
            after_s = samples(scrape(url)[1])
        finally:
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for pid in children:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
            stop([daemon])

    def delta(name: str) -> dict[str, float]:
        was = by_label(before_s, name)
        return {k: v - was.get(k, 0.0) for k, v in by_label(after_s, name).items()
                if v - was.get(k, 0.0)}

    accepted = (after_s.get("gpuwatch_agent_reports_total", 0)
                - before_s.get("gpuwatch_agent_reports_total", 0))
    rejected = delta("gpuwatch_agent_reports_rejected_total")
    evicted = delta("gpuwatch_agent_evicted_total")
    refused = delta("gpuwatch_agent_history_refused_total")
    memory = by_label(during, "gpuwatch_agent_memory_bytes")
    budget = during.get("gpuwatch_agent_memory_budget_bytes", 0)
    mib = 2 ** 20
    user = "a second user (UID 65534)" if os.geteuid() == 0 else "another process (same UID)"
    pace = f"{args.rate:g}/s each" if args.rate else "as fast as the socket takes them"
    more = f" and {args.discovered} new discovered names" if args.discovered else ""
    print(f"{args.processes} processes of one user x {args.reports} step reports of "
          f"{args.buffers} buffers{more} ({pace}); "
          f"{user} leaking {LEAK_PER_STEP // mib} MiB a step, {VICTIM_STEPS_PER_SECOND} steps/s")
    print(f"daemon RSS: before {before / mib:.0f} MiB, peak {peak.peak / mib:.0f} MiB, "
          f"flooders alive {held / mib:.0f} MiB, after they exited {after / mib:.0f} MiB")
    print(f"flood sent in {flood_seconds or float('nan'):.1f} s; reports accepted "
          f"{accepted:.0f}, rejected {json.dumps(rejected)}")
    print(f"agent memory (charged): {json.dumps({k: round(v / mib, 1) for k, v in memory.items()})}"
          f" MiB of a {budget / mib:.0f} MiB budget; evicted {json.dumps(evicted)}, "
          f"refused {json.dumps(refused)}")
    print(f"/metrics with the flooders alive: {series} series, {len(body) / 1024:.0f} KiB, "
          f"scrape {1000 * statistics.median(times):.0f} ms (max {1000 * max(times):.0f} ms); "
          f"agent series dropped by the per-user cap: "
          f"{during.get('gpuwatch_agent_series_dropped_total', 0):.0f}")
    found = (f"found {found_after:.1f} s after it started (its step {found_step})"
             if found_after is not None else "NOT FOUND")
    print(f"second user's leak: {found}; it sent {v_sent} reports ({v_dropped} dropped by a "
          f"full socket queue), the daemon's newest step for it {seen_step} of {v_step}")
    write_figures(args.figures, {
        "processes": args.processes, "reports": args.reports, "buffers": args.buffers,
        "rss_before_mib": before / mib, "rss_peak_mib": peak.peak / mib,
        "rss_held_mib": held / mib, "rss_after_mib": after / mib,
        "series": series, "metrics_kib": len(body) / 1024,
        "scrape_ms": 1000 * statistics.median(times), "scrape_max_ms": 1000 * max(times),
        "accepted": accepted, "rejected": rejected, "evicted": evicted, "refused": refused,
        "victim_found_after_s": found_after, "victim_dropped": v_dropped,
        "flood_seconds": flood_seconds})
    if found_after is None:
        sys.exit(1)


def _victim_process(path: str, steps: int) -> tuple[int, int]:
    """The second user's leaking process; (its PID, the read end of its progress pipe)."""
    victim_r, victim_w = os.pipe()
    victim = _child(lambda: _victim(path, steps, victim_w))
    os.close(victim_w)
    os.set_blocking(victim_r, False)
    return victim, victim_r


def _victim_counts(fd: int) -> tuple[int, int, int]:
    """(step, sent, dropped) the victim last wrote."""
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 1 << 16):
            data = (data + chunk)[-4096:]
    lines = [line for line in data.split(b"\n") if line.strip()]
    if not lines:
        return (0, 0, 0)
    step, sent, dropped = (int(x) for x in lines[-1].split())
    return step, sent, dropped


def _end(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def junk_main(args: argparse.Namespace) -> None:
    check_room_for(args.processes + 16)
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    limit = 120.0
    rows = {}
    with bench_node(gpus=2, gpu_procs=4) as b:
        daemon = start_daemon(b, port, args.interval)
        children: list[int] = []
        try:
            wait_http(url, daemon)
            os.chmod(b.tmp, 0o711)  # the other users must reach agent.sock inside it
            path = str(Path(cli_env(b)["GPUWATCH_RUNTIME_DIR"]) / "agent.sock")
            time.sleep(2 * args.interval)
            before = rss_bytes(daemon.pid)

            victim, victim_r = _victim_process(path, args.victim_steps)
            found = _leak_found(url, victim, time.monotonic(), limit)
            rows["unloaded"] = (found, *_victim_counts(victim_r))
            _end([victim])
            os.close(victim_r)

            go_r, go_w = os.pipe()
            for _ in range(args.processes):
                children.append(_child(lambda: _junk_flooder(path, go_r)))
            peak = Peak(daemon.pid)
            peak.start()
            os.write(go_w, b"g" * args.processes)
            # The flood under way: the queue full from here on (a smoke run only checks it runs).
            time.sleep(1.0 if args.smoke else 3.0)
            victim, victim_r = _victim_process(path, args.victim_steps)
            children.append(victim)
            found = _leak_found(url, victim, time.monotonic(), limit)
            rows["flooded"] = (found, *_victim_counts(victim_r))
            flood_s = samples(scrape(url)[1])
            peak.stopping.set()
            peak.join()
        finally:
            _end(children)
            stop([daemon])
    rejected = {k: v for k, v in by_label(flood_s, "gpuwatch_agent_reports_rejected_total")
                .items() if v}
    mib = 2 ** 20
    user = "a second user (UID 65534)" if os.geteuid() == 0 else "another process (same UID)"
    print(f"{args.processes} processes of one user sending junk datagrams, blocking on a full "
          f"queue; {user} leaking {LEAK_PER_STEP // mib} MiB a step, "
          f"{VICTIM_STEPS_PER_SECOND} steps/s, sending as the agent does (non-blocking)")
    print(f"{'':10} {'leak found after':>17} {'reports sent':>13} {'dropped':>8}")
    for name, (found_after, _step, sent, dropped) in rows.items():
        shown = f"{found_after:.1f} s" if found_after is not None else "NOT FOUND"
        print(f"{name:10} {shown:>17} {sent:>13} {dropped:>8}")
    unloaded, flooded = rows["unloaded"][0], rows["flooded"][0]
    if unloaded and flooded:
        print(f"flooded / unloaded: {flooded / unloaded:.2f}x")
    print(f"daemon RSS {before / mib:.0f} MiB before, peak {peak.peak / mib:.0f} MiB; "
          f"rejected during the flood: {json.dumps(rejected)}")
    write_figures(args.figures, {
        "processes": args.processes, "unloaded_found_s": unloaded, "flooded_found_s": flooded,
        "flooded_dropped": rows["flooded"][3], "unloaded_dropped": rows["unloaded"][3],
        "rss_before_mib": before / mib, "rss_peak_mib": peak.peak / mib})
    if unloaded is None or flooded is None:
        sys.exit(1)


if __name__ == "__main__":
    main()
