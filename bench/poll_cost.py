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

from node import FakeNode, bench_node, idle_processes, stop

# Runs inside a child whose LD_LIBRARY_PATH points at the fake driver.
_MEASURE = r"""
import json, sys, time
from gpuwatch.poll import Poller
polls = int(sys.argv[1])
poller = Poller()
for _ in range(5):
    snap = poller.poll()
cpu, wall = [], []
for _ in range(polls):
    c0, w0 = time.process_time(), time.perf_counter()
    snap = poller.poll()
    cpu.append(time.process_time() - c0)
    wall.append(time.perf_counter() - w0)
print(json.dumps({"cpu": cpu, "wall": wall, "holders": len(snap.gpu_holders),
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
        idle = idle_processes(args.host_procs)
        try:
            rows.append((f"+{args.host_procs} idle host processes", measure(b.node, args.polls)))
        finally:
            stop(idle)

    print(f"poll cost: {args.gpus} fake GPUs, {args.gpu_procs} real GPU processes, "
          f"{args.polls} polls each")
    print(f"{'host':<32} {'CPU ms/poll (median)':>21} {'p95':>7} {'wall ms (median)':>17}"
          f" {'procs in snapshot':>18}")
    for label, r in rows:
        cpu = sorted(r["cpu"])
        print(f"{label:<32} {statistics.median(cpu) * 1e3:>21.2f} "
              f"{cpu[int(len(cpu) * 0.95)] * 1e3:>7.2f} {statistics.median(r['wall']) * 1e3:>17.2f}"
              f" {r['processes']:>18}")
        if r["errors"]:
            print(f"  errors: {r['errors'][:3]}")
    quiet, busy = (statistics.median(r["cpu"]) for _, r in rows)
    print(f"ratio busy/quiet host: {busy / quiet:.2f}x")


if __name__ == "__main__":
    main()
