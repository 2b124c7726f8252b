"""CPU and wall time of one poll on a simulated node of 8 fake GPUs, as the node grows two ways.

(a) GPU processes grow: 8, 64, 512 real processes holding memory, on a quiet host.
(b) Host processes grow: 64 GPU processes, plus 200, 2,000, 10,000 real idle processes in another
    process tree, as on a shared host. A poll reads GPU holders, their jobs and ancestors only,
    so (b) should stay flat while (a) grows.
(c) Against floors, in the same process, alternating: the NVML calls a poll makes (through
    pynvml, as any client makes them) plus an open().read() of /proc/PID/stat for every process
    the poll reads (the stat-only floor: the daemon caches the rest per process), and the same
    with status and cmdline too (the floor of a reader that caches nothing). Also NVML's share
    of a poll (the daemon's own NVML read alone), and a cold poll (a fresh process source and
    history: every process seen for the first time), whose excess over a warm one, per process,
    is what the first sighting of a process costs; beside it, that sighting's floor: the files
    a process seen first needs beyond a warm poll's stat line (status, cmdline, cgroup, environ,
    its children), read through os.open/os.read and nothing else.
    Each variant runs in blocks of back-to-back runs, the blocks taking turns: a warm figure is
    the median of a block's runs after its first, whose code and data the other variants, a
    poll's several times their size, have pushed out of the CPU's caches. Those first runs are
    reported too ("after"): one run each of variants as different as these, in turn, measures
    which of them the caches favour, never a warm poll. Cold polls run in blocks of three: the
    first sighting is the data a poll meets for the first time, with its code warm.
(d) A dataloader node: 8 ranks holding GPU memory, each with 16 dataloader workers that hold
    none. Steady, and churning: every few polls one rank's workers are killed and the rank starts
    new ones, as a DataLoader does each epoch; the excess CPU over the steady polls, per process
    that appeared, is the first sighting in the daemon's own loop.
(e) Churn inside a job: 256 GPU processes under one rank, which runs short-lived programs in a
    loop (`/bin/true`, `/bin/sleep 0.01`: about 150 processes a second), polls 1 s apart as the
    daemon's; blocks with the loop running and stopped (SIGSTOP) alternate. CPU per poll,
    churning against steady: the job's tree is followed through the new PIDs, most of them
    gone by the poll, rather than walked again.

A poll here is what the daemon does each interval: read NVML and /proc, update the history, run
every detector. Polls here run back to back, with the CPU's caches warm; the daemon's, one an
interval, cost more for waking to cold caches (bench/daemon_poll.py measures both). Each size is
measured in a fresh child process. The fake NVML driver asks whether each process it lists
still runs (a pidfd each, all in one poll() at most once per 20 ms), which a real driver
(asking the kernel module) does not; its share of a poll is therefore reported on its own, and
the floors make the same calls.

    python bench/poll_cost.py [--polls 300] [--gpu-procs 8,64,512] [--host-procs 200,2000,10000]
        [--ratio-procs 64,512] [--rounds 60] [--churn-rounds 4] [--against DIR]

--against DIR measures (c), (d) and (e) for the gpuwatch package in DIR too (another revision's
checkout), alternating with this one in the same run: before/after ratios on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from cmdline import options, parse_args, write_figures
from node import (
    FakeNode,
    bench_node,
    churning_node,
    dataloader_node,
    settle,
    unrelated_host_processes,
)

ROOT = Path(__file__).resolve().parent.parent

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


# (c): the poll against its floors, alternating, in one process.
_RATIOS = r"""
import json, os, sys, time
import pynvml
from gpuwatch.config import DetectorConfig
from gpuwatch.detectors import assess
from gpuwatch.history import History
from gpuwatch.poll import Poller
rounds, cold_every, block = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
clock = time.process_time
config = DetectorConfig(leak_warmup_seconds=0, leak_min_span_seconds=1, min_age=0)
poller, history = Poller(), History()
for _ in range(5):
    report = assess(poller.poll(watch=history.watch_pids()), history, config)
pids = sorted(report.snapshot.processes)
handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]

def nvml_calls():
    pynvml.nvmlDeviceGetCount()
    for h in handles:
        pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        pynvml.nvmlDeviceGetUtilizationRates(h)
        pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)

def read(names):
    for pid in pids:
        for name in names:
            try:
                with open(f"/proc/{pid}/{name}", "rb") as f:
                    f.read()
            except OSError:
                pass

def first_floor():
    # What a reader that keeps what never changes must read for a process it has not seen,
    # beyond the stat line a warm poll reads too: the four other files and its children, each
    # through the cheapest reads Python has.
    for pid in pids:
        for path in (f"/proc/{pid}/status", f"/proc/{pid}/cmdline", f"/proc/{pid}/cgroup",
                     f"/proc/{pid}/environ", f"/proc/{pid}/task/{pid}/children"):
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.read(fd, 65536)
            except OSError:
                pass
            finally:
                os.close(fd)

def warm():
    assess(poller.poll(watch=history.watch_pids()), history, config)

variants = {
    "poll": warm,
    "nvml_read": poller.nvml.read,
    "nvml_calls": nvml_calls,
    "floor": lambda: (nvml_calls(), read(("stat",))),
    "floor_full": lambda: (nvml_calls(), read(("stat", "status", "cmdline"))),
    "first_floor": first_floor,
}
# Each variant runs in a block of back to back runs: the first of a block follows the other
# variants (whose code and data evicted its own from the caches), the rest are warm. Both are
# kept: "after" the first, "times" the rest.
times = {name: [] for name in variants}
after = {name: [] for name in variants}
cold, cold_processes = [], 0
for i in range(rounds):
    for name, fn in variants.items():
        for j in range(block):
            c0 = clock()
            fn()
            (after if j == 0 else times)[name].append(clock() - c0)
    if i % cold_every == 0:
        for j in range(3):
            fresh, fresh_history = Poller(nvml=poller.nvml), History()
            c0 = clock()
            snap = fresh.poll(watch=fresh_history.watch_pids())
            assess(snap, fresh_history, config)
            if j:  # the first of the block warms the code
                cold.append(clock() - c0)
            cold_processes = len(snap.processes)
            fresh.processes.close()
times["cold"] = cold
print(json.dumps({"times": times, "after": after, "processes": len(pids),
                  "cold_processes": cold_processes}))
"""

# (d): a dataloader node, steady and churning, in alternating blocks of polls.
_DATALOADER = r"""
import json, os, sys, time
from gpuwatch.config import DetectorConfig
from gpuwatch.detectors import assess
from gpuwatch.history import History
from gpuwatch.poll import Poller
rounds, block, every = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ranks, workers = [int(pid) for pid in sys.argv[4].split(",")], int(sys.argv[5])
clock = time.process_time
config = DetectorConfig(leak_warmup_seconds=0, leak_min_span_seconds=1, min_age=0)
poller, history = Poller(), History()

def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []

def poll():
    return assess(poller.poll(watch=history.watch_pids()), history, config)

def settle():
    # Until every rank has started all its workers again, then a poll that sees them (not
    # counted: the next block starts from a node that is what it looks like).
    deadline = time.monotonic() + 30
    while sum(len(children(r)) for r in ranks) < len(ranks) * workers:
        if time.monotonic() > deadline:
            raise SystemExit("the workers were not started again")
        time.sleep(0.01)
    return poll()

for _ in range(5):
    report = settle()
seen = {p.identity for p in report.snapshot.processes.values()}
steady, churn, polls, new = [], [], 0, 0
victim = 0
for r in range(rounds):
    for mode in ("steady", "churn"):
        spent = 0.0
        for i in range(block):
            if mode == "churn" and i % every == 0:
                for pid in children(ranks[victim % len(ranks)]):
                    os.kill(pid, 9)
                victim += 1
            c0 = clock()
            report = poll()
            spent += clock() - c0
            now = {p.identity for p in report.snapshot.processes.values()}
            if mode == "churn":
                new += len(now - seen)
            seen = now
        (steady if mode == "steady" else churn).append(spent / block)
        report = settle()
        seen = {p.identity for p in report.snapshot.processes.values()}
print(json.dumps({"steady": steady, "churn": churn, "new": new, "polls": rounds * block,
                  "processes": len(report.snapshot.processes)}))
"""


# (e): churn inside a job, polls an interval apart, in one process.
_CHURN = r"""
import json, os, signal, sys, time
from gpuwatch.config import DetectorConfig
from gpuwatch.detectors import assess
from gpuwatch.history import History
from gpuwatch.poll import Poller
rounds, block, interval, churner = (int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]),
                                    int(sys.argv[4]))
config = DetectorConfig(leak_warmup_seconds=0, leak_min_span_seconds=1, min_age=0)
poller, history = Poller(), History()

def last_pid():
    with open("/proc/loadavg") as f:
        return int(f.read().split()[-1])

with open("/proc/sys/kernel/pid_max") as f:
    # PIDs handed out between two readings: past pid_max the kernel starts again at 300.
    PID_CYCLE = int(f.read()) - 300

def poll():
    c0 = time.process_time()
    assess(poller.poll(watch=history.watch_pids()), history, config)
    return time.process_time() - c0

os.kill(churner, signal.SIGSTOP)
for _ in range(3):
    poll()
found = {"steady": [], "churn": []}
pids = {"steady": 0, "churn": 0}
for _ in range(rounds):
    for mode in ("steady", "churn"):
        os.kill(churner, signal.SIGCONT if mode == "churn" else signal.SIGSTOP)
        time.sleep(interval)
        poll()  # the first of a block: the switch in between
        first = last_pid()
        for _ in range(block):
            time.sleep(interval)
            found[mode].append(poll())
        pids[mode] += (last_pid() - first) % PID_CYCLE
os.kill(churner, signal.SIGCONT)
print(json.dumps({**found, "pids": pids, "seconds": rounds * block * interval}))
"""

CHURN_HEADER = (f"{'':<26}{'steady ms':>10}{'churn ms':>11}{'churn/st':>10}"
                f"{'PIDs/s':>9}")


def run_child(script: str, args: list[str], node: FakeNode,
              code: Optional[Path] = None) -> dict[str, Any]:
    """`script` in a fresh interpreter on the node, importing gpuwatch from `code` (default:
    this checkout)."""
    env = node.env()
    env["PYTHONPATH"] = str(code or ROOT)
    with tempfile.TemporaryDirectory() as cwd:  # nothing importable where it runs
        out = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=cwd,
                             check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def ratios(r: dict[str, Any]) -> dict[str, float]:
    t = {name: median_ms(xs) for name, xs in r["times"].items()}
    a = {name: median_ms(xs) for name, xs in r["after"].items()}
    poll, nvml = t["poll"], t["nvml_read"]
    return {
        "poll_ms": poll, "floor_ms": t["floor"], "floor_full_ms": t["floor_full"],
        "nvml_read_ms": nvml, "nvml_calls_ms": t["nvml_calls"],
        "vs_floor": poll / t["floor"], "vs_floor_full": poll / t["floor_full"],
        "nvml_share": nvml / poll,
        # The same ratio with NVML taken out of both sides: the /proc and Python part alone.
        "vs_floor_without_nvml": (poll - nvml) / (t["floor"] - t["nvml_calls"]),
        "cold_ms": t["cold"], "processes": r["processes"],
        "first_sighting_us": (t["cold"] - poll) / r["cold_processes"] * 1e3,
        "first_floor_us": t["first_floor"] / r["processes"] * 1e3,
        "first_over_floor": ((t["cold"] - poll) / r["cold_processes"])
                            / (t["first_floor"] / r["processes"]),
        # The first run of each block: after the other variants, its caches taken by them.
        "poll_after_ms": a["poll"], "floor_after_ms": a["floor"],
        "vs_floor_after": a["poll"] / a["floor"],
    }


def dataloader_figures(r: dict[str, Any], every: int, workers: int) -> dict[str, float]:
    steady, churn = statistics.mean(r["steady"]), statistics.mean(r["churn"])
    return {
        "steady_ms": median_ms(r["steady"]), "churn_ms": median_ms(r["churn"]),
        "churn_over_steady": churn / steady, "new": r["new"], "polls": r["polls"],
        "per_new_us": (churn - steady) * r["polls"] / max(1, r["new"]) * 1e6,
        "every": every, "workers": workers, "processes": r["processes"],
    }


def print_ratios(label: str, f: dict[str, float]) -> None:
    print(f"{label:<24} {f['poll_ms']:>8.2f} {f['floor_ms']:>7.2f} {f['vs_floor']:>6.2f}x "
          f"{f['floor_full_ms']:>8.2f} {f['vs_floor_full']:>6.2f}x {f['nvml_read_ms']:>6.2f} "
          f"{100 * f['nvml_share']:>5.0f}% {f['vs_floor_without_nvml']:>7.2f}x "
          f"{f['cold_ms']:>7.2f} {f['first_sighting_us']:>8.1f} {f['first_floor_us']:>7.1f} "
          f"{f['first_over_floor']:>6.2f}x  {f['poll_after_ms']:>7.2f} {f['floor_after_ms']:>6.2f} "
          f"{f['vs_floor_after']:>6.2f}x", flush=True)


RATIO_HEADER = (f"{'':<24} {'poll ms':>8} {'floor':>7} {'/floor':>7} {'full fl.':>8} "
                f"{'/full':>7} {'NVML':>6} {'share':>6} {'-NVML':>8} {'cold ms':>7} "
                f"{'us/first':>8} {'floor':>7} {'/floor':>7}  {'after:':>7} {'floor':>6} "
                f"{'/floor':>7}")


def print_dataloader(label: str, f: dict[str, float]) -> None:
    print(f"{label:<24} {f['steady_ms']:>10.2f} {f['churn_ms']:>10.2f} "
          f"{f['churn_over_steady']:>8.2f}x {f['new']:>6.0f} {f['per_new_us']:>10.1f}",
          flush=True)


DATALOADER_HEADER = (f"{'':<24} {'steady ms':>10} {'churn ms':>10} {'churn/st':>9} "
                     f"{'new':>6} {'us/new':>10}")


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
    parser = options(
        __doc__, polls=300, gpus=8, gpu_procs=([8, 64, 512], "GPU process counts of sweep (a)"),
        host_procs=([200, 2000, 10000], "idle host process counts of sweep (b)"),
        base_gpu_procs=(64, "GPU processes during sweep (b)"),
        ratio_procs=([64, 512], "GPU process counts measured against the floors (c)"),
        rounds=(60, "rounds of (c), a block of runs of each variant a round; blocks of (d)"),
        ranks=8,
        workers=(16, "dataloader workers per rank"),
        churn_every=(5, "(d): one rank's workers replaced every this many polls"),
        churn_rounds=(4, "(e): rounds of a churning and a steady block of 10 polls, 1 s apart"),
        churn_procs=(256, "(e): GPU processes under the churning rank"),
        only_floors=(False, "(c) and (d) only, for a quick comparison (no figures written)"))
    parser.add_argument("--against", type=Path, default=None,
                        help="a directory holding another revision's gpuwatch package: (c) and "
                             "(d) for it too, alternating with this one")
    args = parse_args(parser, quick={"polls": 40, "gpu_procs": [8, 64], "host_procs": [200, 1000],
                                     "ratio_procs": [64], "rounds": 8, "churn_rounds": 1},
                      smoke={"polls": 5, "host_procs": [50, 100], "rounds": 5,
                             "churn_rounds": 1, "churn_procs": 16})
    if args.only_floors:
        floors(args)
        dataloader(args)
        churn(args)
        return
    for name in ("gpu_procs", "host_procs"):
        if len(set(getattr(args, name))) < 2:
            parser.error(f"--{name.replace('_', '-')} takes two sizes or more: its growth is "
                         "measured between the smallest and the largest")
    print(f"poll cost on {args.gpus} fake GPUs, {args.polls} polls per size; the median of "
          "each, in a fresh process\n")

    by_gpu: list[tuple[str, dict[str, Any]]] = []
    for n in args.gpu_procs:
        with bench_node(args.gpus, n) as b:
            by_gpu.append((f"{n} GPU processes", measure(b.node, args.polls)))
    print_rows("(a) GPU processes grow, quiet host", by_gpu)

    by_host: list[tuple[str, dict[str, Any]]] = []
    sizes = sorted(args.host_procs)
    # A smoke run's figures mean nothing: it need not wait for a loaded machine to calm down
    # (a minute per size on a busy CI host).
    calm = 1.0 if args.smoke else 60.0
    with bench_node(args.gpus, args.base_gpu_procs) as b, \
            unrelated_host_processes(sizes[0], calm):
        by_host.append((f"+{sizes[0]:,} idle host processes", measure(b.node, args.polls)))
        with contextlib.ExitStack() as spawned:
            running = sizes[0]
            for n in sizes[1:]:
                spawned.enter_context(unrelated_host_processes(n - running, calm))
                running = n
                by_host.append((f"+{n:,} idle host processes", measure(b.node, args.polls)))
        # The smallest size again once the others are gone: the machine drifts over a sweep
        # (a shared VM), and growth is measured against both ends of it.
        settle(calm)
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
    by_ratio = floors(args)
    loader = dataloader(args)
    churned = churn(args)
    write_figures(args.figures, {
        "ratios": by_ratio, "dataloader": loader, "churn": churned,
        "gpus": args.gpus, "polls": args.polls, "base_gpu_procs": args.base_gpu_procs,
        "by_gpu_procs": {str(n): summary(r) for n, (_, r) in zip(args.gpu_procs, by_gpu)},
        "by_host_procs": {str(n): summary(r)
                          for n, (_, r) in zip(sorted(args.host_procs), by_host)},
        "gpu_growth": gpu_growth, "host_growth": host_growth,
        "us_per_gpu_proc": per_gpu_proc * 1e3, "us_per_host_proc": per_host_proc * 1e3,
    })


#: (c): each variant runs this many times back to back a round, the first not counted as warm.
BLOCK = 5
#: (c): a block of cold polls every this many rounds.
COLD_EVERY = 2


def floors(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """(c), for this checkout and, alternating, for --against."""
    codes = [("", None)] + ([("against ", args.against)] if args.against else [])
    found: dict[str, dict[str, float]] = {}
    print(f"(c) against the floors, {args.rounds} rounds of a block of {BLOCK} runs of each "
          f"variant, the first a warm-up; medians; floor: NVML calls + stat of the same PIDs; "
          "full: + status + cmdline; -NVML: poll and floor without their NVML; cold: blocks of 3 "
          f"cold polls every {COLD_EVERY} rounds, the first a warm-up; after: the first runs of "
          "the blocks, each after the other variants")
    print(RATIO_HEADER)
    for n in args.ratio_procs:
        with bench_node(args.gpus, n) as b:
            for label, code in codes * (2 if args.against else 1):
                f = ratios(run_child(_RATIOS, [str(args.rounds), str(COLD_EVERY),
                                               str(BLOCK)], b.node, code))
                print_ratios(f"{label}{n} GPU processes", f)
                found.setdefault(f"{label}{n}", f)
    print(flush=True)
    return found


def dataloader(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """(d), for this checkout and, alternating, for --against."""
    codes = [("", None)] + ([("against", args.against)] if args.against else [])
    found: dict[str, dict[str, float]] = {}
    block = 4 * args.churn_every
    rounds = max(2, args.rounds * BLOCK // block)  # as many polls as (c) runs of each variant
    print(f"(d) dataloader node: {args.ranks} ranks x {args.workers} workers; {rounds} rounds of "
          f"{block} steady and {block} churning polls (one rank's workers replaced every "
          f"{args.churn_every} polls); CPU per poll, medians of the blocks")
    print(DATALOADER_HEADER)
    with dataloader_node(args.gpus, args.ranks, args.workers) as b:
        for label, code in codes * (2 if args.against else 1):
            r = run_child(_DATALOADER, [str(rounds), str(block), str(args.churn_every),
                                        ",".join(map(str, b.holders)), str(args.workers)],
                          b.node, code)
            f = dataloader_figures(r, args.churn_every, args.workers)
            print_dataloader(label or "this checkout", f)
            found.setdefault(label or "this", f)
    print(flush=True)
    return found



def churn(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """(e), for this checkout and, alternating, for --against."""
    codes = [("", None)] + ([("against", args.against)] if args.against else [])
    block, interval = (2, 0.2) if args.smoke else (10, 1.0)
    found: dict[str, dict[str, float]] = {}
    print(f"(e) churn inside a job: {args.churn_procs} GPU processes under one rank running "
          f"short-lived programs in a loop; {args.churn_rounds} rounds of {block} steady and "
          f"{block} churning polls, {interval:g} s apart; CPU per poll, medians")
    print(CHURN_HEADER)
    with churning_node(args.gpus, args.churn_procs) as (b, churner):
        for label, code in codes * (2 if args.against else 1):
            r = run_child(_CHURN, [str(args.churn_rounds), str(block), str(interval),
                                   str(churner)], b.node, code)
            steady, churning = median_ms(r["steady"]), median_ms(r["churn"])
            rate = r["pids"]["churn"] / r["seconds"]
            print(f"{label or 'this checkout':<26}{steady:>10.2f}{churning:>11.2f}"
                  f"{churning / steady:>9.2f}x{rate:>9.0f}", flush=True)
            found.setdefault(label or "this", {
                "steady_ms": steady, "churn_ms": churning, "churn_over_steady": churning / steady,
                "pids_per_second": rate})
    print(flush=True)
    return found


if __name__ == "__main__":
    main()
