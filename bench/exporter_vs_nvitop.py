"""The daemon against nvitop-exporter on the same simulated node, side by side in one run.

Both watch 8 fake GPUs with 64 real processes holding memory, collecting at the same interval.
Figures: CPU per collection (process CPU time over a window / collections in it), RSS, and
/metrics scrape latency. Ratios are the headline; absolute times depend on the machine.

    python bench/exporter_vs_nvitop.py [--interval 0.5] [--window 40] [--scrapes 50]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from node import (
    bench_node,
    cpu_seconds,
    free_port,
    polls_total,
    rss_bytes,
    scrape,
    stop,
    wait_http,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--window", type=float, default=40.0)
    parser.add_argument("--scrapes", type=int, default=50)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-procs", type=int, default=64)
    args = parser.parse_args()
    nvitop_exporter = shutil.which("nvitop-exporter") or str(
        Path(sys.executable).parent / "nvitop-exporter")

    with bench_node(args.gpus, args.gpu_procs) as b:
        env = b.node.env()
        env.update(GPUWATCH_CONFIG="/dev/null", GPUWATCH_RUNTIME_DIR=str(b.tmp / "run"),
                   GPUWATCH_STATE_DIR=str(b.tmp / "gpuwatch-state"))
        gw_port, nv_port = free_port(), free_port()
        gw = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch", "daemon", "--listen", f"127.0.0.1:{gw_port}",
             "--interval", str(args.interval), "--log-level", "warning"], env=env)
        nv = subprocess.Popen(
            [nvitop_exporter, "--bind-address", "127.0.0.1", "--port", str(nv_port),
             "--interval", str(args.interval)], env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        try:
            gw_url = f"http://127.0.0.1:{gw_port}/metrics"
            nv_url = f"http://127.0.0.1:{nv_port}/metrics"
            wait_http(gw_url, gw)
            wait_http(nv_url, nv)
            time.sleep(3 * args.interval + 2)  # warm-up: caches filled, imports done
            t0, polls0 = time.monotonic(), polls_total(gw_url)
            gw_cpu0, nv_cpu0 = cpu_seconds(gw.pid), cpu_seconds(nv.pid)
            time.sleep(args.window)
            gw_cpu1, nv_cpu1 = cpu_seconds(gw.pid), cpu_seconds(nv.pid)
            t1, polls1 = time.monotonic(), polls_total(gw_url)
            gw_polls = polls1 - polls0
            nv_collections = (t1 - t0) / args.interval  # its loop sleeps to the next deadline
            gw_cpu = (gw_cpu1 - gw_cpu0) / gw_polls
            nv_cpu = (nv_cpu1 - nv_cpu0) / nv_collections
            if nv_cpu > args.interval:
                print(f"note: nvitop-exporter needs {nv_cpu:.3f} s a collection, more than the "
                      "interval: it is saturated and the figure is a lower bound")
            gw_lat, nv_lat, gw_size, nv_size = [], [], 0, 0
            for _ in range(args.scrapes):
                latency, body = scrape(gw_url)
                gw_lat.append(latency)
                gw_size = len(body)
                latency, body = scrape(nv_url)
                nv_lat.append(latency)
                nv_size = len(body)
            gw_rss, nv_rss = rss_bytes(gw.pid), rss_bytes(nv.pid)
        finally:
            stop([gw, nv])

    print(f"exporters on {args.gpus} fake GPUs x {args.gpu_procs} real GPU processes, interval "
          f"{args.interval:g} s, {args.window:g} s window, {args.scrapes} scrapes each")
    print(f"{'':<22}{'CPU ms/collection':>18}{'RSS MiB':>9}{'scrape ms (median)':>20}"
          f"{'/metrics bytes':>16}")
    for name, cpu, rss, lat, size in (("gpuwatch daemon", gw_cpu, gw_rss, gw_lat, gw_size),
                                      ("nvitop-exporter", nv_cpu, nv_rss, nv_lat, nv_size)):
        print(f"{name:<22}{cpu * 1e3:>18.2f}{rss / 2**20:>9.1f}"
              f"{statistics.median(lat) * 1e3:>20.2f}{size:>16}")
    print(f"ratio gpuwatch/nvitop-exporter: CPU {gw_cpu / nv_cpu:.2f}x, "
          f"RSS {gw_rss / nv_rss:.2f}x, "
          f"scrape {statistics.median(gw_lat) / statistics.median(nv_lat):.2f}x "
          f"(goal: CPU <= 0.33x, RSS <= 1x)")


if __name__ == "__main__":
    main()
