"""A poll inside the daemon against the poll bench/poll_cost.py measures, on the same node.

poll_cost.py times `Poller.poll()` and the detectors. The daemon does more at each interval, and
runs threads beside its loop; this bench names each part, on 8 fake GPUs x 64 real processes:

(1) poll + detectors, as poll_cost.py times them (polls back to back), with the daemon's own
    detector settings;
(2) `Daemon.poll_once()` on a daemon object in the same process, alternating with (1): the same,
    plus what follows a poll (its counters, the audit log's tail, trace requests, the exporter's
    per-poll counts, /metrics rendered where a scrape is due: none is, here);
(1i), (2i) the same two, each after sleeping one interval, as the daemon polls: what the CPU's
    caches lost while the process slept costs the poll that wakes it;
(3) a `gpuwatch daemon` process polling the node: its CPU time over a window, divided by the polls
    in it (what exporter_vs_nvitop.py reports), nobody scraping meanwhile: (2i) plus its loop,
    its idle threads and the interpreter's housekeeping.

    python bench/daemon_poll.py [--rounds 200] [--idle-rounds 30] [--interval 0.5] [--window 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from cmdline import arguments, write_figures
from node import (
    bench_node,
    cli_env,
    cpu_seconds_exact,
    free_port,
    polls_total,
    start_daemon,
    stop,
    wait_http,
)

# Runs inside a child whose environment is the fake node's (cli_env).
_ALTERNATING = r"""
import json, sys, time
from gpuwatch.config import load_config
from gpuwatch.daemon import Daemon
from gpuwatch.detectors import assess
from gpuwatch.history import History
from gpuwatch.poll import Poller
rounds, idle_rounds, interval = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
config = load_config()
daemon = Daemon(config)
poller, history = Poller(), History(config.history.samples, config.history.max_processes)
clock = time.process_time
bare, whole = [], []
for i in range(rounds + 5):
    c0 = clock()
    assess(poller.poll(watch=history.watch_pids()), history, config.detectors)
    c1 = clock()
    daemon.poll_once()
    c2 = clock()
    if i >= 5:  # caches filled, imports done
        bare.append(c1 - c0)
        whole.append(c2 - c1)
bare_idle, whole_idle = [], []
for i in range(idle_rounds):
    time.sleep(interval)
    c0 = clock()
    assess(poller.poll(watch=history.watch_pids()), history, config.detectors)
    bare_idle.append(clock() - c0)
    time.sleep(interval)
    c0 = clock()
    daemon.poll_once()
    whole_idle.append(clock() - c0)
print(json.dumps({"bare": bare, "whole": whole, "bare_idle": bare_idle,
                  "whole_idle": whole_idle}))
"""


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with bench_node(args.gpus, args.gpu_procs) as b:
        env = cli_env(b)
        out = subprocess.run([sys.executable, "-c", _ALTERNATING, str(args.rounds),
                              str(args.idle_rounds), str(args.interval)], env=env,
                             check=True, capture_output=True, text=True).stdout
        alternating = json.loads(out)
        port = free_port()
        daemon = start_daemon(b, port, args.interval)
        try:
            url = f"http://127.0.0.1:{port}/metrics"
            wait_http(url, daemon)
            time.sleep(3 * args.interval + 2)  # warm-up
            polls0, cpu0 = polls_total(url), cpu_seconds_exact(daemon.pid)
            time.sleep(args.window)
            cpu1, polls1 = cpu_seconds_exact(daemon.pid), polls_total(url)
        finally:
            stop([daemon])
    def mean_ms(name: str) -> float:
        # Means, not medians: the process's figure is a mean, and a walk of the job trees
        # every 64 polls or a collection of the interpreter's garbage belongs in both.
        return statistics.mean(alternating[name]) * 1e3

    process = (cpu1 - cpu0) / (polls1 - polls0) * 1e3
    return {"gpus": args.gpus, "gpu_procs": args.gpu_procs, "interval": args.interval,
            "bare_ms": mean_ms("bare"), "poll_once_ms": mean_ms("whole"),
            "bare_idle_ms": mean_ms("bare_idle"), "poll_once_idle_ms": mean_ms("whole_idle"),
            "process_ms": process, "polls_in_window": polls1 - polls0}


def main() -> None:
    args = arguments(__doc__, quick={"rounds": 20, "idle_rounds": 4, "window": 4.0},
                     smoke={"rounds": 3, "idle_rounds": 1, "window": 1.0},
                     rounds=200, idle_rounds=30, interval=0.5, window=40.0, gpus=8, gpu_procs=64)
    f = measure(args)
    bare, idle = f["bare_ms"], f["poll_once_idle_ms"]
    print(f"one poll on {f['gpus']} fake GPUs x {f['gpu_procs']} real GPU processes (CPU ms, "
          f"means: {args.rounds} back to back, {args.idle_rounds} after {args.interval:g} s idle;"
          f" the process over {f['polls_in_window']:.0f} polls at {args.interval:g} s):")
    print(f"  (1)  poll + detectors, back to back (poll_cost.py)  {bare:8.2f}")
    print(f"  (2)  Daemon.poll_once(), back to back               {f['poll_once_ms']:8.2f}  "
          f"{f['poll_once_ms'] / bare:.2f}x (1)")
    print(f"  (1i) poll + detectors, after an idle interval      {f['bare_idle_ms']:8.2f}  "
          f"{f['bare_idle_ms'] / bare:.2f}x (1)")
    print(f"  (2i) Daemon.poll_once(), after an idle interval    {idle:8.2f}  "
          f"{idle / bare:.2f}x (1)")
    print(f"  (3)  the daemon process, CPU / polls               {f['process_ms']:8.2f}  "
          f"{f['process_ms'] / bare:.2f}x (1), {f['process_ms'] / idle:.2f}x (2i)")
    print(f"  what follows a poll: {f['poll_once_ms'] - bare:.2f} ms; caches lost while idle: "
          f"{idle - f['poll_once_ms']:.2f} ms; the loop, threads and housekeeping: "
          f"{f['process_ms'] - idle:.2f} ms")
    write_figures(args.figures, f)


if __name__ == "__main__":
    main()
