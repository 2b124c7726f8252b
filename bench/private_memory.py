"""What reading private memory (/proc/PID/smaps_rollup) costs, against a stat line.

(a) One read, by the process's RSS: a process holding 16 MiB, 256 MiB, 1 GiB (anonymous memory,
    touched), against reading its /proc/PID/stat line.
(b) A DataLoader node: a parent holding --parent-mib MiB (touched) that forks --workers workers
    (each counting the parent's pages in its RSS); CPU of one PrivateMemorySource.read() over the
    workers with its default budget (MAX_RSS_WALKED), and how many calls read every worker once.

    python bench/private_memory.py [--reads 200] [--sizes 16,256,1024] [--parent-mib 512]
        [--workers 8]
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from cmdline import options, parse_args, write_figures

from gpuwatch.model import HostProcess
from gpuwatch.sources.private_memory import MAX_RSS_WALKED, PrivateMemorySource
from gpuwatch.sources.processes import ProcessSource

_HOLDER = r"""
import os, sys, time
data = bytearray(b"\x01") * (int(sys.argv[1]) << 20)
pids = []
for _ in range(int(sys.argv[2])):
    pid = os.fork()
    if pid == 0:
        time.sleep(3600)
        os._exit(0)
    pids.append(pid)
print(os.getpid(), *pids, flush=True)
time.sleep(3600)
"""


@contextlib.contextmanager
def holder(mib: int, workers: int = 0) -> Iterator[list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(mib), str(workers)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        yield [int(p) for p in proc.stdout.readline().split()]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def cpu_per_call(fn: Callable[[], object], n: int) -> float:
    """CPU seconds of one call of `fn`, the median of `n`."""
    times = []
    for _ in range(n):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    times.sort()
    return times[len(times) // 2]


def _reading(procs: list[HostProcess], reader: PrivateMemorySource | None = None
             ) -> Callable[[], object]:
    """A call that reads `procs` (each due again at every call: the clock moves on)."""
    source = reader or PrivateMemorySource()
    return lambda: source.read(procs, now=time.monotonic())


def main() -> None:
    parser = options(__doc__, reads=200, sizes=([16, 256, 1024], "RSS of (a), MiB"),
                     parent_mib=(512, "(b): the parent's memory, MiB"),
                     workers=(8, "(b): workers forked"))
    args = parse_args(parser, quick={"reads": 20, "sizes": [16, 256], "parent_mib": 128,
                                     "workers": 4})
    source = ProcessSource()
    figures: dict[str, float] = {}
    print("(a) one read, CPU (median)")
    for mib in args.sizes:
        with holder(mib) as (pid,):
            rollup = cpu_per_call(_reading([source.read([pid]).processes[pid]]), args.reads)
            stat = cpu_per_call(lambda pid=pid: source.stat(pid), args.reads)
            print(f"  RSS {mib:>5} MiB: smaps_rollup {rollup * 1e3:8.2f} ms, stat line "
                  f"{stat * 1e6:6.1f} us")
            figures[f"rollup_ms_{mib}_mib"] = rollup * 1e3
    with holder(args.parent_mib, args.workers) as (_, *workers):
        procs = list(source.read(workers).processes[w] for w in workers)
        reader = PrivateMemorySource()
        calls = 0
        while reader.reads < len(workers):
            reader.read(procs, now=float(calls))
            calls += 1
        per_call = cpu_per_call(_reading(procs, reader), args.reads)
        print(f"(b) {args.workers} workers forked from a parent of {args.parent_mib} MiB, "
              f"budget {MAX_RSS_WALKED >> 20} MiB of RSS a call: {per_call * 1e3:.2f} ms CPU "
              f"a call; every worker read once in {calls} calls")
        figures["dataloader_ms_per_call"] = per_call * 1e3
        figures["dataloader_calls_per_round"] = calls
    write_figures(args.figures, figures)


if __name__ == "__main__":
    main()
