"""CPU and wall time of one poll on a simulated node of 8 fake GPUs, as the node grows two ways.

(a) GPU processes grow: 8, 64, 512 real processes holding memory, on a quiet host.
(b) Host processes grow: 64 GPU processes, plus 200, 2,000, 10,000 real idle processes in another
    process tree, as on a shared host. A poll reads GPU holders, their jobs and ancestors only,
    so (b) should stay flat while (a) grows.

A poll here is what the daemon does each interval: read NVML and /proc, update the history, run
every detector. Each size is measured in a fresh child process.

    python bench/poll_cost.py [--polls 300] [--gpu-procs 8,64,512] [--host-procs 200,2000,10000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from node import (
    FakeNode,
    bench_node,
    int_list,
    parse_args,
    settle,
    unrelated_host_processes,
    write_figures,
)

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
    result["host_total"] = sum(1 for e in os.scandir("/proc") if e.name.isdigit())
    return result


def summary(r: dict[str, Any]) -> dict[str, float]:
    cpu = sorted(r["cpu"])
    return {"cpu_ms": statistics.median(cpu) * 1e3, "cpu_p95_ms": cpu[int(len(cpu) * 0.95)] * 1e3,
            "detect_ms": statistics.median(r["detect"]) * 1e3,
            "wall_ms": statistics.median(r["wall"]) * 1e3, "snapshot": r["processes"],
            "host_total": r["host_total"]}


def print_rows(title: str, rows: list[tuple[str, dict[str, Any]]]) -> None:
    print(title)
    print(f"{'':<30} {'CPU ms/poll':>12} {'p95':>7} {'detectors':>10} {'wall ms':>8}"
          f" {'procs read':>11} {'procs on host':>14}")
    for label, r in rows:
        s = summary(r)
        print(f"{label:<30} {s['cpu_ms']:>12.2f} {s['cpu_p95_ms']:>7.2f} {s['detect_ms']:>10.2f}"
              f" {s['wall_ms']:>8.2f} {s['snapshot']:>11} {s['host_total']:>14}")
        if r["errors"]:
            print(f"  errors: {r['errors'][:3]}")
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--polls", type=int, default=300)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-procs", type=int_list, default=[8, 64, 512],
                        help="GPU process counts of sweep (a)")
    parser.add_argument("--host-procs", type=int_list, default=[200, 2000, 10000],
                        help="idle host process counts of sweep (b)")
    parser.add_argument("--base-gpu-procs", type=int, default=64,
                        help="GPU processes during sweep (b)")
    args = parse_args(parser, quick={"polls": 40, "gpu_procs": [8, 64], "host_procs": [200, 1000]})
    print(f"poll cost on {args.gpus} fake GPUs, {args.polls} polls per size; the median of "
          "each, in a fresh process\n")

    by_gpu: list[tuple[str, dict[str, Any]]] = []
    for n in args.gpu_procs:
        with bench_node(args.gpus, n) as b:
            by_gpu.append((f"{n} GPU processes", measure(b.node, args.polls)))
    print_rows("(a) GPU processes grow, quiet host", by_gpu)

    by_host: list[tuple[str, dict[str, Any]]] = []
    sizes = sorted(args.host_procs)
    with bench_node(args.gpus, args.base_gpu_procs) as b, \
            unrelated_host_processes(sizes[0]):
        by_host.append((f"+{sizes[0]:,} idle host processes", measure(b.node, args.polls)))
        with contextlib.ExitStack() as spawned:
            running = sizes[0]
            for n in sizes[1:]:
                spawned.enter_context(unrelated_host_processes(n - running))
                running = n
                by_host.append((f"+{n:,} idle host processes", measure(b.node, args.polls)))
        # The smallest size again once the others are gone: the machine drifts over a sweep
        # (a shared VM), and growth is measured against both ends of it.
        settle()
        again = measure(b.node, args.polls)
    print_rows(f"(b) host processes grow, {args.base_gpu_procs} GPU processes",
               [*by_host, (f"+{sizes[0]:,} again, after", again)])

    g0, g1 = summary(by_gpu[0][1]), summary(by_gpu[-1][1])
    h0, h1 = summary(by_host[0][1]), summary(by_host[-1][1])
    h0["cpu_ms"] = (h0["cpu_ms"] + summary(again)["cpu_ms"]) / 2
    gpu_growth, host_growth = g1["cpu_ms"] / g0["cpu_ms"], h1["cpu_ms"] / h0["cpu_ms"]
    # Cost of one more process of each kind: what a poll pays for a GPU process, and for a
    # process that has nothing to do with the GPUs.
    per_gpu_proc = (g1["cpu_ms"] - g0["cpu_ms"]) / (args.gpu_procs[-1] - args.gpu_procs[0])
    per_host_proc = (h1["cpu_ms"] - h0["cpu_ms"]) / (max(args.host_procs) - min(args.host_procs))
    print(f"{args.gpu_procs[-1] / args.gpu_procs[0]:g}x the GPU processes: {gpu_growth:.2f}x the "
          f"CPU ({per_gpu_proc * 1e3:.1f} us per GPU process); "
          f"{max(args.host_procs) / min(args.host_procs):g}x the host processes: "
          f"{host_growth:.2f}x the CPU ({per_host_proc * 1e3:.3f} us per host process)")
    write_figures(args.figures, {
        "gpus": args.gpus, "polls": args.polls, "base_gpu_procs": args.base_gpu_procs,
        "by_gpu_procs": {str(n): summary(r) for n, (_, r) in zip(args.gpu_procs, by_gpu)},
        "by_host_procs": {str(n): summary(r)
                          for n, (_, r) in zip(sorted(args.host_procs), by_host)},
        "gpu_growth": gpu_growth, "host_growth": host_growth,
        "us_per_gpu_proc": per_gpu_proc * 1e3, "us_per_host_proc": per_host_proc * 1e3,
    })


if __name__ == "__main__":
    main()
