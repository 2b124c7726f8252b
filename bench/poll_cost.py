"""CPU time of one poll on a simulated node: 8 GPUs, 64 real processes holding GPU memory.

Run twice side by side: once on a quiet host, once with 2,000 extra idle host processes, to show
that a poll's cost follows GPU processes rather than every process on the host.

    python bench/poll_cost.py [--polls 300] [--gpu-procs 64] [--host-procs 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any

from node import FakeNode, bench_node, unrelated_host_processes

# Runs inside a child whose LD_LIBRARY_PATH points at the fake driver.
_MEASURE = r"""
import json, sys, time
from gpuwatch.config import DetectorConfig
from gpuwatch.detectors import assess
from gpuwatch.history import History
from gpuwatch.poll import Poller
polls = int(sys.argv[1])
# Every detector at full work from the first poll (no warm-up, no minimum span): the
# steady-state cost of a daemon that has run for hours, not that of its first minutes.
poller, history = Poller(), History()
config = DetectorConfig(leak_warmup_seconds=0, leak_min_span_seconds=1, min_age=0)
for _ in range(5):
    snap = poller.poll(watch=history.watch_pids())
    report = assess(snap, history, config)
cpu, wall, detect = [], [], []
for _ in range(polls):
    c0, w0 = time.process_time(), time.perf_counter()
    snap = poller.poll(watch=history.watch_pids())
    c1 = time.process_time()
    report = assess(snap, history, config)
    detect.append(time.process_time() - c1)
    cpu.append(time.process_time() - c0)
    wall.append(time.perf_counter() - w0)
print(json.dumps({"cpu": cpu, "wall": wall, "detect": detect,
                  "holders": len(snap.gpu_holders), "findings": len(report.findings),
                  "processes": len(snap.processes), "errors": [e.message for e in snap.errors]}))
"""


def measure(node: FakeNode, polls: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(polls)], env=node.env(),
                         check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--polls", type=int, default=300)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-procs", type=int, default=64)
    parser.add_argument("--host-procs", type=int, default=2000)
    args = parser.parse_args()

    with bench_node(args.gpus, args.gpu_procs) as b:
        rows = [("quiet host", measure(b.node, args.polls))]
        with unrelated_host_processes(args.host_procs):
            rows.append((f"+{args.host_procs} idle host processes", measure(b.node, args.polls)))

    print(f"poll cost: {args.gpus} fake GPUs, {args.gpu_procs} real GPU processes, "
          f"{args.polls} polls each; a poll here is read + history + detectors")
    print(f"{'host':<32} {'CPU ms/poll (median)':>21} {'p95':>7} {'of which detection':>19}"
          f" {'wall ms (median)':>17} {'procs in snapshot':>18}")
    for label, r in rows:
        cpu = sorted(r["cpu"])
        print(f"{label:<32} {statistics.median(cpu) * 1e3:>21.2f} "
              f"{cpu[int(len(cpu) * 0.95)] * 1e3:>7.2f} "
              f"{statistics.median(r['detect']) * 1e3:>19.2f} "
              f"{statistics.median(r['wall']) * 1e3:>17.2f} {r['processes']:>18}")
        if r["errors"]:
            print(f"  errors: {r['errors'][:3]}")
    quiet, busy = (statistics.median(r["cpu"]) for _, r in rows)
    share = statistics.median(rows[1][1]["detect"]) / busy
    print(f"ratio busy/quiet host: {busy / quiet:.2f}x; detection's share of a poll on the busy "
          f"host: {100 * share:.0f}%")


if __name__ == "__main__":
    main()
