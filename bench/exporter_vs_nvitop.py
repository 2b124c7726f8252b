"""The daemon against nvitop-exporter on the same simulated node, side by side in one run.

Both watch 8 fake GPUs with 64, then 512, real processes holding memory, collecting at the same
interval. Figures: CPU per collection (process CPU time over a window / collections in it), RSS,
and /metrics scrape latency (scrapes alternate between the two, plain and gzipped as Prometheus
asks), with the size of what each serves and the number of per-process series in it. The daemon
renders /metrics once per poll and serves those bytes; nvitop-exporter (prometheus-client's
server) renders for each scrape: the daemon's render is in its CPU per poll. The bodies differ
in size (gpuwatch serves job trees and findings, nvitop-exporter ~22 gauges per GPU and host
figures), so scrape time per KB is given beside scrape time. Ratios are the headline; absolute
times depend on the machine.

    python bench/exporter_vs_nvitop.py [--interval 0.5] [--window 40] [--scrapes 50]
                                       [--gpu-procs 64,512] [--scraped]

--scraped scrapes both once an interval during the CPU window (gzipped, as Prometheus asks): the
CPU figures are then per poll with a scrape every poll.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from typing import Any

from cmdline import options, parse_args, write_figures
from node import (
    bench_node,
    cli_env,
    console_script,
    cpu_seconds_exact,
    free_port,
    polls_total,
    raw_get,
    rss_bytes,
    scrape,
    start_daemon,
    stop,
    wait_http,
)


def per_process_series(body: bytes) -> int:
    """Samples that carry a PID label: what grows with GPU processes."""
    return sum(1 for line in body.splitlines()
               if not line.startswith(b"#") and b'pid="' in line)


def per_kb(f: dict[str, Any]) -> float:
    """Microseconds of scrape per KB served (plain)."""
    return 1e3 * f["scrape_ms"] / (f["bytes"] / 1024)


def compare(args: argparse.Namespace, gpu_procs: int) -> dict[str, Any]:
    nvitop_exporter = console_script("nvitop-exporter")
    with bench_node(args.gpus, gpu_procs) as b:
        gw_port, nv_port = free_port(), free_port()
        gw = start_daemon(b, gw_port, args.interval)
        nv = subprocess.Popen(
            [nvitop_exporter, "--bind-address", "127.0.0.1", "--port", str(nv_port),
             "--interval", str(args.interval)], env=cli_env(b), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        try:
            gw_url = f"http://127.0.0.1:{gw_port}/metrics"
            nv_url = f"http://127.0.0.1:{nv_port}/metrics"
            wait_http(gw_url, gw)
            wait_http(nv_url, nv)
            time.sleep(3 * args.interval + 2)  # warm-up: caches filled, imports done
            t0, polls0 = time.monotonic(), polls_total(gw_url)
            gw_cpu0, nv_cpu0 = cpu_seconds_exact(gw.pid), cpu_seconds_exact(nv.pid)
            if args.scraped:  # both scraped once an interval, as a Prometheus at that interval
                deadline = time.monotonic() + args.window
                while (now := time.monotonic()) < deadline:
                    scrape(gw_url, gzipped=True)
                    scrape(nv_url, gzipped=True)
                    time.sleep(max(0.0, min(args.interval - (time.monotonic() - now),
                                            deadline - time.monotonic())))
            else:
                time.sleep(args.window)
            gw_cpu1, nv_cpu1 = cpu_seconds_exact(gw.pid), cpu_seconds_exact(nv.pid)
            t1, polls1 = time.monotonic(), polls_total(gw_url)
            gw_polls = polls1 - polls0
            nv_collections = (t1 - t0) / args.interval  # its loop sleeps to the next deadline
            gw_cpu = (gw_cpu1 - gw_cpu0) / gw_polls
            nv_cpu = (nv_cpu1 - nv_cpu0) / nv_collections
            if nv_cpu > args.interval:
                print(f"note: nvitop-exporter needs {nv_cpu:.3f} s a collection, more than the "
                      "interval: it is saturated and the figure is a lower bound")
            gw_lat, nv_lat, gw_zlat, nv_zlat = [], [], [], []
            gw_body = nv_body = gw_zbody = nv_zbody = b""
            for _ in range(args.scrapes):
                latency, gw_body = scrape(gw_url)
                gw_lat.append(latency)
                latency, nv_body = scrape(nv_url)
                nv_lat.append(latency)
                latency, gw_zbody = scrape(gw_url, gzipped=True)
                gw_zlat.append(latency)
                latency, nv_zbody = scrape(nv_url, gzipped=True)
                nv_zlat.append(latency)
            # A scraper with a rhythm, as Prometheus is (one scrape a second here): the daemon
            # renders ahead, and the scrape is served bytes. Timed from a bare socket, without
            # urllib's own cost; the first two, before the rhythm shows, are left out.
            paced = []
            for _ in range(args.paced + 2):
                due = time.monotonic() + 1.0
                paced.append(raw_get(gw_port)[0])
                time.sleep(max(0.0, due - time.monotonic()))
            gw_paced = statistics.median(paced[2:])
            gw_rss, nv_rss = rss_bytes(gw.pid), rss_bytes(nv.pid)
        finally:
            stop([gw, nv])
    return {
        "gpu_procs": gpu_procs,
        "gpuwatch": {"cpu_ms": gw_cpu * 1e3, "rss_mib": gw_rss / 2**20,
                     "scrape_ms": statistics.median(gw_lat) * 1e3, "bytes": len(gw_body),
                     "gzip_scrape_ms": statistics.median(gw_zlat) * 1e3,
                     "gzip_bytes": len(gw_zbody), "series": per_process_series(gw_body),
                     "paced_scrape_ms": gw_paced * 1e3},
        "nvitop-exporter": {"cpu_ms": nv_cpu * 1e3, "rss_mib": nv_rss / 2**20,
                            "scrape_ms": statistics.median(nv_lat) * 1e3, "bytes": len(nv_body),
                            "gzip_scrape_ms": statistics.median(nv_zlat) * 1e3,
                            "gzip_bytes": len(nv_zbody), "series": per_process_series(nv_body),
                            "saturated": nv_cpu > args.interval},
    }


def main() -> None:
    parser = options(
        __doc__, interval=0.5, window=40.0, scrapes=50,
        paced=(20, "scrapes of the daemon one a second, after the alternating ones"), gpus=8,
        gpu_procs=[64, 512],
        scraped=(False, "scrape both (gzipped) once an interval during the CPU window: CPU per "
                        "poll with a scrape every poll"))
    args = parse_args(parser, quick={"window": 4.0, "scrapes": 5, "paced": 3,
                                          "gpu_procs": [64]},
                      smoke={"window": 1.0, "scrapes": 2, "paced": 1})

    results = []
    for n in args.gpu_procs:
        r = compare(args, n)
        results.append(r)
        gw, nv = r["gpuwatch"], r["nvitop-exporter"]
        print(f"exporters on {args.gpus} fake GPUs x {n} real GPU processes, interval "
              f"{args.interval:g} s, {args.window:g} s window"
              f"{' (both scraped every interval)' if args.scraped else ''}, "
              f"{args.scrapes} scrapes each")
        print(f"{'':<18}{'CPU ms/collection':>18}{'RSS MiB':>9}{'scrape ms (median)':>20}"
              f"{'/metrics bytes':>16}{'us/KB':>7}{'gzip ms':>9}{'gzip bytes':>12}"
              f"{'PID series':>12}")
        for name, f in (("gpuwatch daemon", gw), ("nvitop-exporter", nv)):
            print(f"{name:<18}{f['cpu_ms']:>18.2f}{f['rss_mib']:>9.1f}{f['scrape_ms']:>20.2f}"
                  f"{f['bytes']:>16}{per_kb(f):>7.1f}{f['gzip_scrape_ms']:>9.2f}"
                  f"{f['gzip_bytes']:>12}{f['series']:>12}")
        print(f"gpuwatch daemon, a scrape a second ({args.paced}, bare socket, median): "
              f"{gw['paced_scrape_ms']:.2f} ms")
        print(f"ratio gpuwatch/nvitop-exporter: CPU {gw['cpu_ms'] / nv['cpu_ms']:.3f}x, "
              f"RSS {gw['rss_mib'] / nv['rss_mib']:.2f}x, "
              f"scrape {gw['scrape_ms'] / nv['scrape_ms']:.2f}x "
              "(goal: CPU <= 0.1x at 64 and 1,024, RSS <= 1x)\n", flush=True)
    write_figures(args.figures, {"interval": args.interval, "window": args.window,
                                 "scraped": args.scraped,
                                 "by_gpu_procs": {str(r["gpu_procs"]): r for r in results}})


if __name__ == "__main__":
    main()
