"""The daemon's poll against nvitop-exporter's per-process collection alone: equal work, in one run.

exporter_vs_nvitop.py compares each tool at its defaults, where nvitop-exporter also gathers ~22
gauges per GPU and the host's CPU, memory, disk and network on every collection, which gpuwatch
does not. Here nvitop-exporter does only the part of a collection that matches what a gpuwatch
poll gathers (GPU processes and their host figures), on the same simulated node of 8 fake GPUs
with 64, then 512, real processes holding memory.

Each side runs in a fresh worker process of its own, as each tool's daemon does (its own heap,
its own garbage collector). The workers take turns, one collection at a time, for many rounds
(each side's collection right after the other's), so that whatever else the machine does hits
both alike; each times its own collection in CPU time (time.process_time) and the medians are
reported. Collections run back to back, without the interval's sleep, as in bench/poll_cost.py.

nvitop-exporter, per collection, per device (nvitop_exporter/exporter.py, version 1.7.2,
PrometheusExporter.update_device):
  included: the device's index, name and uuid, the labels of every per-process series (lines
    544-548; name and uuid are cached by nvitop after the first call); and lines 595-684, the
    per-process part: `device.processes()` inside `GpuProcess.failsafe()` (NVML's compute and
    graphics process lists, each asked twice to size then fill, and process utilisation samples;
    a GpuProcess per PID), then for each process `process.oneshot()`, `username()`,
    `host_snapshot()` (status, name, cmdline, command, CPU percent, memory percent, RSS, running
    time, through psutil), `process_info` set and the nine per-process gauges set (running time,
    CPU %, RSS, memory %, GPU memory, SM / memory / encoder / decoder utilisation), and the
    series of PIDs gone since the last collection removed. These are nvitop's own functions and
    the exporter's own gauges (a PrometheusExporter built on a private registry), called as
    update_device calls them; before timing, the worker checks that they leave exactly the
    per-process series that the exporter's own update_device leaves. nvitop caches GpuProcess
    and HostProcess instances in weak dictionaries and the exporter keeps none between
    collections, so each collection builds them again (a psutil.Process each, its CPU-percent
    baseline, its user looked up); the worker keeps none either, as the exporter does.
  excluded: update_host (host uptime, CPU, memory, swap, load, network, disk gauges) and the
    per-device gauges of update_device (lines 550-593). Rendering /metrics too: nvitop-exporter
    renders at each scrape, outside its collection. The whole collection (update_host and every
    update_device, what PrometheusExporter.collect runs each interval) is timed alongside, in the
    same worker, for context only.
gpuwatch, per poll (as bench/poll_cost.py times it, detectors at full work from the first poll):
  included: Poller.poll (NVML's device count, per GPU its memory, utilisation and compute and
    graphics process lists; for every process read, its /proc/PID/stat line (state, RSS, CPU,
    parent), with what never changes for a process (command line, user, cgroup, launch
    environment) read once per process and cached; the GPU holders' job trees and ancestors up
    to PID 1; memory available, cgroup memory, `gpuwatch run` supervisors), then assess (the
    history recorded, every detector run, findings stamped, job labels). "No detectors" is
    Poller.poll alone.
  excluded: the daemon's render of /metrics and its sinks, which it runs after each poll.
Neither side is a perfect subset of the other: gpuwatch also reads per-GPU memory and utilisation
(two NVML calls a GPU) and the processes of the holders' job trees (here the launcher shell and
its ancestors), and nvitop reads NVML's per-process utilisation samples, and status, command
line, CPU times and memory of each process afresh on every collection. The fake NVML driver
checks /proc/PID/stat of every process it lists inside each process-list call, which a real
driver does not; both sides pay it.

    python bench/equal_work.py [--rounds 300] [--gpu-procs 64,512] [--gpus 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Optional

from cmdline import options, parse_args, write_figures
from node import BenchNode, bench_node, cli_env

if TYPE_CHECKING:
    from nvitop import Device
    from nvitop_exporter.exporter import PrometheusExporter

#: A worker's collections by name: each returns its figures, in milliseconds of CPU.
Collections = dict[str, Callable[[], dict[str, float]]]
#: What a worker sets up: its collections, what they saw (filled in as they run), and a check
#: to run once warmed up, before the rounds.
Setup = tuple[Collections, dict[str, Any], Optional[Callable[[], None]]]

clock = time.process_time


# -- gpuwatch's worker ----------------------------------------------------------------------------

# The tools are imported inside their workers only: the driver never loads NVML or either tool.

def gpuwatch_worker() -> Setup:
    from gpuwatch.config import DetectorConfig
    from gpuwatch.detectors import assess
    from gpuwatch.history import History
    from gpuwatch.poll import Poller

    # As poll_cost.py: every detector at full work from the first poll, no warm-up span, the
    # steady-state cost of a daemon that has run for hours.
    poller, history = Poller(), History()
    config = DetectorConfig(leak_warmup_seconds=0, leak_min_span_seconds=1, min_age=0)
    seen: dict[str, Any] = {}

    def poll() -> dict[str, float]:
        c0 = clock()
        snapshot = poller.poll(watch=history.watch_pids())
        c1 = clock()
        assess(snapshot, history, config)
        c2 = clock()
        seen.update(holders=len(snapshot.gpu_holders), processes=len(snapshot.processes),
                    errors=[e.message for e in snapshot.errors])
        return {"gpuwatch_ms": (c2 - c0) * 1e3, "gpuwatch_no_detectors_ms": (c1 - c0) * 1e3}

    return {"gpuwatch": poll}, seen, None


# -- nvitop-exporter's worker ---------------------------------------------------------------------

def per_process_collection(exporter: PrometheusExporter, device: Device) -> int:
    """The per-process part of `exporter.update_device(device)` (nvitop_exporter/exporter.py
    lines 544-548 and 595-684), through the exporter's own gauges and nvitop's own calls, in
    the order update_device makes them. Returns the number of GPU processes seen."""
    from nvitop import GpuProcess, MiB

    index = (str(device.index) if isinstance(device.index, int)
             else ":".join(map(str, device.index)))
    name, uuid = device.name(), device.uuid()
    alive = exporter.alive_pids[device]
    before = alive.copy()
    alive.clear()
    with GpuProcess.failsafe():
        # Keyed by (PID, user) as the exporter keys them: the keys are its alive set.
        snapshots: dict[tuple[int, str], Any] = {}
        for pid, process in device.processes().items():
            with process.oneshot():
                username = process.username()
                key = (pid, username)
                if key not in snapshots:
                    snapshots[key] = process.host_snapshot()
                host = snapshots[key]
                labels = {"hostname": exporter.hostname, "index": index, "devicename": name,
                          "uuid": uuid, "pid": pid, "username": username}
                exporter.process_info.labels(**labels).info(
                    {"status": host.status, "command": host.command})
                running = host.running_time.total_seconds() if host.running_time else float("nan")
                for gauge, value in (
                        (exporter.process_running_time, running),
                        (exporter.process_cpu_percent, host.cpu_percent),
                        (exporter.process_rss_memory, host.host_memory / MiB),
                        (exporter.process_memory_percent, float(host.memory_percent)),
                        (exporter.process_gpu_memory, process.gpu_memory() / MiB),
                        (exporter.process_gpu_sm_utilization, float(process.gpu_sm_utilization())),
                        (exporter.process_gpu_memory_utilization,
                         float(process.gpu_memory_utilization())),
                        (exporter.process_gpu_encoder_utilization,
                         float(process.gpu_encoder_utilization())),
                        (exporter.process_gpu_decoder_utilization,
                         float(process.gpu_decoder_utilization()))):
                    gauge.labels(**labels).set(value)
    alive.update(snapshots)
    for pid, username in before - alive:
        for collector in process_collectors(exporter):
            with contextlib.suppress(KeyError):
                collector.remove(exporter.hostname, index, name, uuid, pid, username)
    return len(snapshots)


def process_collectors(exporter: PrometheusExporter) -> tuple[Any, ...]:
    return (exporter.process_info, exporter.process_running_time, exporter.process_cpu_percent,
            exporter.process_rss_memory, exporter.process_memory_percent,
            exporter.process_gpu_memory, exporter.process_gpu_sm_utilization,
            exporter.process_gpu_memory_utilization, exporter.process_gpu_encoder_utilization,
            exporter.process_gpu_decoder_utilization)


def per_process_series(exporter: PrometheusExporter) -> dict[tuple[str, tuple[Any, ...]], float]:
    """Every per-process sample the exporter holds: name and labels -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for collector in process_collectors(exporter)
            for family in collector.collect() for s in family.samples}


def check_same_series(ours: PrometheusExporter, theirs: PrometheusExporter) -> int:
    """Fail unless per_process_collection left the very series update_device leaves, with the
    same values where they do not move between two reads (GPU memory, RSS, status, command)."""
    mine, real = per_process_series(ours), per_process_series(theirs)
    if mine.keys() != real.keys():
        raise SystemExit(f"per-process series differ from update_device's: "
                         f"{sorted(mine.keys() ^ real.keys())[:3]}")
    steady = ("process_info", "process_gpu_memory_MiB", "process_rss_memory_MiB")
    moved = [k for k in mine if k[0].startswith(steady) and mine[k] != real[k]]
    if moved:
        raise SystemExit(f"per-process values differ from update_device's: {moved[:3]}")
    return len(mine)


def nvitop_worker() -> Setup:
    from nvitop import Device
    from nvitop_exporter.exporter import PrometheusExporter
    from nvitop_exporter.utils import get_ip_address
    from prometheus_client import CollectorRegistry

    # The devices as nvitop-exporter's CLI lists them: every physical GPU and its MIG devices.
    physical = Device.from_indices(range(Device.count()))
    devices = [*physical, *(mig for device in physical for mig in device.mig_devices())]
    hostname = get_ip_address()
    # Private registries: the per-process-only exporter's series are not mixed with the whole
    # collection's, and nothing is registered globally.
    alone = PrometheusExporter(devices, hostname, registry=CollectorRegistry())
    whole = PrometheusExporter(devices, hostname, registry=CollectorRegistry())
    seen: dict[str, Any] = {}

    def processes() -> dict[str, float]:
        c0 = clock()
        n = sum(per_process_collection(alone, device) for device in devices)
        spent = clock() - c0
        seen["processes"] = n
        return {"nvitop_processes_ms": spent * 1e3}

    def full() -> dict[str, float]:
        # PrometheusExporter.collect's loop body, without its sleep to the next deadline.
        c0 = clock()
        whole.update_host()
        for device in devices:
            whole.update_device(device)
        return {"nvitop_full_ms": (clock() - c0) * 1e3}

    def check() -> None:
        seen["series"] = check_same_series(alone, whole)

    return {"nvitop_processes": processes, "nvitop_full": full}, seen, check


WORKERS: dict[str, Callable[[], Setup]] = {
    "gpuwatch": gpuwatch_worker, "nvitop": nvitop_worker,
}


def serve(kind: str, warmup: int) -> None:
    """A worker: warm up, say what it saw, then one collection for each name read on stdin."""
    # Results go out on a private copy of stdout: anything the tools print goes to stderr.
    out: IO[str] = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    collections, seen, check = WORKERS[kind]()
    # At least one: what the workers saw, and the check, come from it.
    for _ in range(max(1, warmup)):
        for collect in collections.values():
            collect()
    if check is not None:
        check()
    out.write(json.dumps(seen) + "\n")
    out.flush()
    while (line := sys.stdin.readline().strip()) in collections:
        out.write(json.dumps(collections[line]()) + "\n")
        out.flush()


# -- the driver -----------------------------------------------------------------------------------

class Worker:
    def __init__(self, b: BenchNode, kind: str, warmup: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", kind,
             "--warmup", str(warmup)], env=cli_env(b), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        self.seen: dict[str, Any] = self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.args} exited with {self.proc.wait()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def collect(self, name: str) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def compare(args: argparse.Namespace, gpu_procs: int) -> dict[str, Any]:
    with bench_node(args.gpus, gpu_procs) as b:
        gw, nv = Worker(b, "gpuwatch", args.warmup), Worker(b, "nvitop", args.warmup)
        try:
            # Each side's timed collection follows the other process's work, never its own:
            # neither starts with caches its previous collection left warm. The whole
            # collection, context only, follows the per-process one in the same process.
            steps = [(nv, "nvitop_full"), (gw, "gpuwatch"), (nv, "nvitop_processes")]
            times: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                for worker, name in steps:
                    for figure, ms in worker.collect(name).items():
                        times.setdefault(figure, []).append(ms)
        finally:
            gw.close()
            nv.close()
    return figures(times, gpu_procs, gw.seen, nv.seen)


def figures(times: dict[str, list[float]], gpu_procs: int, gw_seen: dict[str, Any],
            nv_seen: dict[str, Any]) -> dict[str, Any]:
    med = {name: statistics.median(xs) for name, xs in times.items()}
    paired = [g / n for g, n in zip(times["gpuwatch_ms"], times["nvitop_processes_ms"])]
    return {
        **med,
        "ratio": med["gpuwatch_ms"] / med["nvitop_processes_ms"],
        "ratio_no_detectors": med["gpuwatch_no_detectors_ms"] / med["nvitop_processes_ms"],
        # The median of each round's own ratio: what drift over the run leaves of the ratio.
        "paired_ratio": statistics.median(paired),
        "nvitop_processes_share": med["nvitop_processes_ms"] / med["nvitop_full_ms"],
        "gpuwatch_us_per_gpu_proc": med["gpuwatch_ms"] / gpu_procs * 1e3,
        "gpuwatch_no_detectors_us_per_gpu_proc": med["gpuwatch_no_detectors_ms"] / gpu_procs * 1e3,
        "nvitop_us_per_gpu_proc": med["nvitop_processes_ms"] / gpu_procs * 1e3,
        "rounds": len(paired),
        "gpuwatch_holders": gw_seen["holders"], "gpuwatch_processes_read": gw_seen["processes"],
        "gpuwatch_errors": gw_seen["errors"], "nvitop_processes": nv_seen["processes"],
        "nvitop_series": nv_seen["series"],
    }


def print_table(gpus: int, rounds: int, results: dict[int, dict[str, Any]]) -> None:
    print(f"equal work on {gpus} fake GPUs: gpuwatch's poll against nvitop-exporter's "
          f"per-process collection alone, {rounds} rounds alternating, CPU ms per collection "
          "(medians)")
    print(f"{'GPU procs':>9} {'gpuwatch':>9} {'no detect':>10} {'nvitop/proc':>12} "
          f"{'gw/nv':>7} {'nodet/nv':>9} {'paired':>7} {'us/proc gw':>11} {'nodet':>7} "
          f"{'nv':>7} {'nvitop whole':>13} {'proc share':>11}")
    for n, f in results.items():
        print(f"{n:>9} {f['gpuwatch_ms']:>9.2f} {f['gpuwatch_no_detectors_ms']:>10.2f} "
              f"{f['nvitop_processes_ms']:>12.2f} {f['ratio']:>6.2f}x "
              f"{f['ratio_no_detectors']:>8.2f}x {f['paired_ratio']:>6.2f}x "
              f"{f['gpuwatch_us_per_gpu_proc']:>11.1f} "
              f"{f['gpuwatch_no_detectors_us_per_gpu_proc']:>7.1f} "
              f"{f['nvitop_us_per_gpu_proc']:>7.1f} {f['nvitop_full_ms']:>13.2f} "
              f"{100 * f['nvitop_processes_share']:>10.0f}%")
    for n, f in results.items():
        print(f"{n} GPU processes: gpuwatch saw {f['gpuwatch_holders']} holders and read "
              f"{f['gpuwatch_processes_read']} processes (job trees, ancestors); nvitop saw "
              f"{f['nvitop_processes']} and holds {f['nvitop_series']} per-process samples")
        if f["gpuwatch_errors"]:
            print(f"  gpuwatch errors: {f['gpuwatch_errors'][:3]}")
    print(flush=True)


def main() -> None:
    parser = options(__doc__, rounds=(300, "rounds, each side's collection once a round"),
                     warmup=(5, "collections each worker makes before the rounds"), gpus=8,
                     gpu_procs=[64, 512])
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = parse_args(parser, quick={"rounds": 20, "warmup": 2, "gpu_procs": [64]},
                      smoke={"rounds": 3, "warmup": 1})
    if args.worker:
        serve(args.worker, args.warmup)
        return
    results = {n: compare(args, n) for n in args.gpu_procs}
    print_table(args.gpus, args.rounds, results)
    write_figures(args.figures, {"gpus": args.gpus, "rounds": args.rounds,
                                 "warmup": args.warmup,
                                 "by_gpu_procs": {str(n): f for n, f in results.items()}})


if __name__ == "__main__":
    main()
