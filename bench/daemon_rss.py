"""The daemon's RSS stays flat: RSS after 10,000 polls against RSS after 100.

The node is not static while it runs: every half second one GPU process exits and a new one takes
its place, so the per-identity caches and the history must forget as well as learn.

    python bench/daemon_rss.py [--polls 10000] [--interval 0.005]
"""

from __future__ import annotations

import os
import subprocess
import time

from cmdline import arguments, write_figures
from node import (
    GIB,
    bench_node,
    free_port,
    idle_processes,
    polls_total,
    rss_bytes,
    start_daemon,
    stop,
    wait_http,
)

from gpuwatch.simulate.fakenvml import FakeProcess


def main() -> None:
    args = arguments(__doc__, quick={"polls": 300, "early": 50},
                     smoke={"polls": 30, "early": 10}, polls=10_000, early=100,
                     interval=0.005)
    port = free_port()
    with bench_node() as b:
        url = f"http://127.0.0.1:{port}/metrics"
        daemon = start_daemon(b, port, args.interval)
        churned: list[subprocess.Popen[bytes]] = []
        try:
            wait_http(url, daemon)
            marks = [m for m in (args.early, 1_000, 3_000, 6_000) if m < args.polls]
            readings: list[tuple[float, int]] = []
            started = time.monotonic()
            replaced = 0
            while (polls := polls_total(url)) < args.polls:
                if marks and polls >= marks[0]:
                    readings.append((polls, rss_bytes(daemon.pid)))
                    marks.pop(0)
                victim = b.node.processes.pop(0)
                newcomer = idle_processes(1)[0]
                churned.append(newcomer)
                b.node.processes.append(FakeProcess(device=victim.device, pid=newcomer.pid,
                                                    used=GIB + replaced))
                b.node.write()
                os.kill(victim.pid, 9)
                for p in churned:
                    if p.pid == victim.pid:
                        p.kill()
                        p.wait()
                replaced += 1
                time.sleep(0.5)
            readings.append((polls, rss_bytes(daemon.pid)))
            elapsed = time.monotonic() - started
        finally:
            stop([daemon, *churned])
    print(f"daemon RSS on 8 fake GPUs x 64 GPU processes, {replaced} processes replaced "
          f"during the run ({elapsed:.0f} s)")
    for polls, rss in readings:
        print(f"after {polls:>6.0f} polls: {rss / 2**20:7.2f} MiB")
    (first_at, first), (last_at, last) = readings[0], readings[-1]
    growth = (last - first) / first
    print(f"growth from {first_at:.0f} to {last_at:.0f} polls: {100 * growth:+.1f}%"
          " (goal: within 5%)")
    write_figures(args.figures, {"readings": [[polls, rss / 2**20] for polls, rss in readings],
                                 "replaced": replaced, "seconds": elapsed, "growth": growth})


if __name__ == "__main__":
    main()
