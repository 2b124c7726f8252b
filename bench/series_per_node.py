"""What one node costs Prometheus: the series a daemon exposes, by metric family.

    python bench/series_per_node.py [--gpus 8] [--procs 8 64]

For each count of GPU processes it starts a simulated node (fake GPUs, real processes holding
memory on them) and a real daemon, scrapes /metrics once the daemon sees every holder, then kills
the holders' launcher so that every holder becomes an orphan finding and scrapes again. It prints
the series per family and in total, with and without the per-process families: docs/fleet.md
quotes the figures.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client.parser import text_string_to_metric_families

from bench.node import bench_node, free_port, scrape, start_daemon, wait_http
from gpuwatch.sources.proc_stat import PPID, parse_stat

#: Families with a series per process, per finding or per watched buffer: they grow with the
#: node's work, the rest with its GPUs.
PER_PROCESS = frozenset({
    "gpuwatch_process_gpu_memory_bytes", "gpuwatch_process_resident_memory_bytes",
    "gpuwatch_process_start_time_seconds", "gpuwatch_finding", "gpuwatch_finding_info",
    "gpuwatch_finding_gpu_memory_bytes", "gpuwatch_agent_step",
    "gpuwatch_agent_step_timestamp_seconds", "gpuwatch_agent_buffer_items",
    "gpuwatch_agent_buffer_bytes", "gpuwatch_leak_growth_bytes_per_step",
    "gpuwatch_leak_projected_oom_step", "gpuwatch_leak_growth_bytes_per_second",
    "gpuwatch_leak_projected_oom_timestamp_seconds"})


def families(text: str) -> Counter[str]:
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        counts[family.name] += len(family.samples)
    return counts


def scrape_when(url: str, ready: Callable[[Counter[str]], bool], timeout: float = 60
                ) -> Counter[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = families(scrape(url)[1].decode())
        if ready(counts):
            return counts
        time.sleep(0.2)
    raise RuntimeError("the daemon did not reach the state to measure")


def report(label: str, counts: Counter[str]) -> tuple[int, int]:
    total = sum(counts.values())
    per_process = sum(n for name, n in counts.items() if name in PER_PROCESS)
    print(f"\n{label}: {total} series ({per_process} per process or finding, "
          f"{total - per_process} per node and GPU)")
    for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:5d}  {name}")
    return total, per_process


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--procs", type=int, nargs="+", default=[8, 64])
    args = parser.parse_args()
    rows = []
    for procs in args.procs:
        with bench_node(gpus=args.gpus, gpu_procs=procs) as b:
            port = free_port()
            daemon = start_daemon(b, port, interval=0.5)
            url = f"http://127.0.0.1:{port}/metrics"
            try:
                wait_http(url, daemon)
                healthy = scrape_when(
                    url, lambda c, n=procs: c["gpuwatch_process_gpu_memory_bytes"] == n)
                with open(f"/proc/{b.holders[0]}/stat", "rb") as f:
                    parent = int(parse_stat(f.read())[1][PPID])
                os.kill(parent, signal.SIGKILL)
                orphaned = scrape_when(url, lambda c, n=procs: c["gpuwatch_finding"] == n)
            finally:
                daemon.terminate()
                daemon.wait(30)
        rows.append((procs, report(f"{args.gpus} GPUs, {procs} GPU processes", healthy),
                     report("the same, every GPU process an orphan", orphaned)))
    print(f"\n{'GPU processes':>14}  {'healthy':>8}  {'all orphaned':>12}")
    for procs, (healthy, _), (orphaned, _) in rows:
        print(f"{procs:>14}  {healthy:>8}  {orphaned:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
