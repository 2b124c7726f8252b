"""The daemon's RSS until its history is full, side by side with nvitop-exporter's.

The daemon keeps samples of each process over the history's span (1.5 x
detectors.leak_min_span_seconds: 900 s at the defaults), so a short window sees its RSS before
the history has filled. This bench runs the daemon and nvitop-exporter on the same node of 8 fake
GPUs and N real GPU processes, both at a 1 s interval and scraped every 15 s, for --duration
seconds (default: the history's span and a minute more), and reads both RSS every few seconds:
after warm-up (60 s), at the end, and the highest. Every size runs at once, each on a node of its
own (RSS does not depend on the neighbours' CPU), so the three sizes take one span. With
--against DIR, the gpuwatch package in DIR (another revision's) runs beside them on each node.

    python bench/rss_plateau.py [--gpu-procs 64,512,1024] [--duration 960] [--against DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

from cmdline import options, parse_args, write_figures
from node import (
    bench_node,
    cli_env,
    console_script,
    free_port,
    rss_bytes,
    stop,
    wait_http,
)

from gpuwatch.config import SPAN_COVER, DetectorConfig

#: The history's span at the defaults, and a minute more.
DEFAULT_DURATION = DetectorConfig().leak_min_span_seconds * SPAN_COVER + 60
WARM_UP = 60.0
SCRAPE_EVERY = 15.0


def _daemon(env: dict[str, str], port: int, interval: float,
            code: Optional[Path]) -> subprocess.Popen[bytes]:
    if code is not None:  # a runtime and state directory of its own
        run = Path(env["GPUWATCH_RUNTIME_DIR"])
        env = {**env, "PYTHONPATH": str(code), "GPUWATCH_RUNTIME_DIR": f"{run}-against",
               "GPUWATCH_STATE_DIR": f"{env['GPUWATCH_STATE_DIR']}-against"}
    return subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "daemon", "--listen", f"127.0.0.1:{port}",
         "--interval", str(interval), "--log-level", "warning"], env=env,
        cwd="/" if code is not None else None)


def _scrape(url: str) -> None:
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=10) as r:
        r.read()


def watch(args: argparse.Namespace, gpu_procs: int, out: dict[str, Any]) -> None:
    """One size: both tools (and --against) on a node of their own, RSS read every few s."""
    with bench_node(args.gpus, gpu_procs) as b:
        env = cli_env(b)
        tools: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
        try:
            port = free_port()
            tools["gpuwatch"] = (_daemon(env, port, args.interval, None),
                                 f"http://127.0.0.1:{port}/metrics")
            if args.against:
                port = free_port()
                tools["against"] = (_daemon(env, port, args.interval, args.against),
                                    f"http://127.0.0.1:{port}/metrics")
            port = free_port()
            tools["nvitop-exporter"] = (subprocess.Popen(
                [console_script("nvitop-exporter"), "--bind-address", "127.0.0.1", "--port",
                 str(port), "--interval", str(args.interval)], env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
                f"http://127.0.0.1:{port}/metrics")
            for proc, url in tools.values():
                wait_http(url, proc, timeout=120)
            started = time.monotonic()
            readings: dict[str, list[tuple[float, float]]] = {name: [] for name in tools}
            next_scrape = started
            while (now := time.monotonic()) - started < args.duration:
                if now >= next_scrape:
                    for _, url in tools.values():
                        _scrape(url)
                    next_scrape += SCRAPE_EVERY
                for name, (proc, _) in tools.items():
                    readings[name].append((now - started, rss_bytes(proc.pid) / 2**20))
                time.sleep(args.every)
        finally:
            stop([proc for proc, _ in tools.values()])
    out[str(gpu_procs)] = {name: summary(r, args.warm_up) for name, r in readings.items()}


def summary(readings: list[tuple[float, float]], warm_up: float) -> dict[str, float]:
    warm = next((rss for at, rss in readings if at >= warm_up), readings[-1][1])
    end = readings[-1][1]
    return {"warm_mib": warm, "end_mib": end, "max_mib": max(rss for _, rss in readings),
            "seconds": readings[-1][0], "after_warm_up": (end - warm) / warm}


def main() -> None:
    parser = options(__doc__, gpus=8, gpu_procs=[64, 512, 1024], interval=1.0,
                     duration=(DEFAULT_DURATION, "seconds each size runs (default: the "
                               "history's span at the defaults, and a minute more)"),
                     warm_up=(WARM_UP, "the reading RSS is compared from"),
                     every=(5.0, "seconds between RSS readings"))
    parser.add_argument("--against", type=Path, default=None,
                        help="also run the gpuwatch package in DIR (another revision's)")
    args = parse_args(parser, quick={"duration": 120.0, "gpu_procs": [64, 512]},
                      smoke={"duration": 6.0, "warm_up": 2.0, "every": 1.0, "gpu_procs": [8]})
    print(f"daemon and nvitop-exporter RSS, {args.gpus} fake GPUs, {args.interval:g} s interval, "
          f"a scrape every {SCRAPE_EVERY:g} s, {args.duration:.0f} s per size (all sizes at "
          f"once); load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    found: dict[str, Any] = {}
    threads = [threading.Thread(target=watch, args=(args, n, found)) for n in args.gpu_procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"{'':<34}{'at warm-up':>11}{'end':>8}{'max':>8}{'end/warm':>10}{'/nvitop':>9}")
    for n in args.gpu_procs:
        r = found.get(str(n))
        if r is None:
            print(f"{n} GPU processes: failed")
            continue
        peer = r["nvitop-exporter"]["end_mib"]
        for name, f in r.items():
            print(f"{f'{name}, {n} GPU processes':<34}{f['warm_mib']:>11.1f}{f['end_mib']:>8.1f}"
                  f"{f['max_mib']:>8.1f}{1 + f['after_warm_up']:>9.2f}x"
                  f"{f['end_mib'] / peer:>8.2f}x")
    write_figures(args.figures, {"gpus": args.gpus, "interval": args.interval,
                                 "duration": args.duration, "by_gpu_procs": found})
    if len(found) < len(args.gpu_procs):
        sys.exit(1)


if __name__ == "__main__":
    main()
