"""What a poll costs on this node's real GPUs: gpuwatch's poll (gpuwatch.poll.Poller) next to the
NVML part of it (NvmlSource.read) and to `nvidia-smi --query-compute-apps`, while N PyTorch
processes hold CUDA memory, all measured in the same run.

    python3 bench/real_nvml.py [--procs 4] [--mib 512] [--polls 200] [--smi-runs 20]
                               [--figures FILE]

gpuwatch need not be installed (the repository is put on the path). The holders need PyTorch with
CUDA; `--procs 0` measures with none (and without PyTorch). Each row is the median and the 90th
percentile of CPU and wall time per call; nvidia-smi's CPU is its own (a child's rusage). Exits 0
with the table; exits 3, saying why, where there is no GPU to measure on (no nvidia-smi, NVML does
not initialise, or a holder cannot use CUDA) - 3 as `gpuwatch status` exits without NVML.

Not part of `bench/run.py`, whose benches run on the simulated node on any machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import select
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors import assess
from gpuwatch.history import History
from gpuwatch.model import NvmlReading
from gpuwatch.poll import Poller
from gpuwatch.sources.nvml import NvmlSource

EXIT_NO_GPU = 3
START_TIMEOUT = 180.0
GONE_TIMEOUT = 60.0
WARMUP = 5

# One rank's worth of a job: CUDA memory on GPU rank % count, held until stdin closes.
HOLDER = r"""
import sys, torch
device = int(sys.argv[1]) % torch.cuda.device_count()
torch.cuda.set_device(device)
held = torch.empty(int(sys.argv[2]) << 20, dtype=torch.uint8, device=device)
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.read()
"""


class NoGpu(Exception):
    pass


Timings = tuple[list[float], list[float]]  # (CPU seconds, wall seconds) per call


def nvml_holders(reading: NvmlReading) -> set[int]:
    return {u.pid for g in reading.gpus for u in g.processes}


def check_gpu(nvml: NvmlSource) -> NvmlReading:
    if shutil.which("nvidia-smi") is None:
        raise NoGpu("nvidia-smi is not on PATH: no NVIDIA driver here")
    reading = nvml.read()
    if not reading.status.available:
        raise NoGpu(f"NVML does not initialise: {reading.status.error}")
    if not reading.gpus:
        raise NoGpu("NVML lists no GPU")
    return reading


@contextlib.contextmanager
def holders(n: int, mib: int, nvml: NvmlSource) -> Iterator[list[int]]:
    """`n` PyTorch processes holding `mib` MiB each, once NVML lists them all; killed (each in
    its own process group) and waited for until NVML lists none of them afterwards."""
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    procs = [subprocess.Popen([sys.executable, "-c", HOLDER, str(rank), str(mib)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              start_new_session=True) for rank in range(n)]
    pids = [p.pid for p in procs]
    try:
        deadline = time.monotonic() + START_TIMEOUT
        for p in procs:
            assert p.stdout is not None
            ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = p.stdout.readline() if ready else ""
            if line.strip() != "ready":
                code = p.poll()
                raise NoGpu(f"a PyTorch holder could not use CUDA (exit code {code}; its error "
                            "is above)" if code is not None else
                            f"a PyTorch holder was not ready after {START_TIMEOUT:g} s")
        while not set(pids) <= nvml_holders(nvml.read()):
            if time.monotonic() > deadline:
                raise NoGpu(f"NVML does not list the holders {pids} under their PIDs (another "
                            "PID namespace?)")
            time.sleep(0.1)
        yield pids
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            for stream in (p.stdin, p.stdout):
                if stream is not None:
                    stream.close()
        deadline = time.monotonic() + GONE_TIMEOUT
        while set(pids) & nvml_holders(nvml.read()) and time.monotonic() < deadline:
            time.sleep(0.1)


def timed(call: Callable[[], Any], runs: int) -> Timings:
    cpu, wall = [], []
    for _ in range(runs):
        c0, w0 = time.process_time(), time.perf_counter()
        call()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return cpu, wall


def timed_smi(runs: int) -> Timings:
    """nvidia-smi's own CPU (user + system of the child) and the wall time of running it."""
    argv = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    cpu, wall = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        w0 = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        wall.append(time.perf_counter() - w0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return cpu, wall


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def summary(t: Timings) -> dict[str, float]:
    cpu, wall = t
    return {"cpu_ms": statistics.median(cpu) * 1e3, "cpu_p90_ms": percentile(cpu, 0.9) * 1e3,
            "wall_ms": statistics.median(wall) * 1e3, "wall_p90_ms": percentile(wall, 0.9) * 1e3,
            "runs": len(cpu)}


def measure(args: argparse.Namespace, nvml: NvmlSource, pids: list[int]) -> dict[str, Any]:
    poller = Poller(nvml=nvml)
    history = History()
    # Every detector at full work from the first poll, as in bench/poll_cost.py.
    config = DetectorConfig(leak_warmup_seconds=0, leak_min_span_seconds=1, min_age=0)

    def daemon_poll() -> None:
        assess(poller.poll(watch=history.watch_pids()), history, config)

    for _ in range(WARMUP):
        daemon_poll()
    snapshot = poller.poll(watch=history.watch_pids())
    missing = set(pids) - {p.pid for p in snapshot.gpu_holders}
    if missing:
        raise NoGpu(f"gpuwatch's poll does not see the holders {sorted(missing)}")
    rows = {
        "gpuwatch poll (Poller.poll)": timed(lambda: poller.poll(watch=history.watch_pids()),
                                             args.polls),
        "poll + history + detectors (daemon)": timed(daemon_poll, args.polls),
        "NVML part (NvmlSource.read)": timed(nvml.read, args.polls),
        "nvidia-smi --query-compute-apps": timed_smi(args.smi_runs),
    }
    return {"snapshot_processes": len(snapshot.processes),
            "nvml_processes": len(snapshot.gpu_holders),
            "errors": [e.message for e in snapshot.errors],
            "rows": {label: summary(t) for label, t in rows.items()}}


def print_table(args: argparse.Namespace, reading: NvmlReading, figures: dict[str, Any]) -> None:
    names = sorted({g.name or "?" for g in reading.gpus})
    status = reading.status
    print(f"poll cost on real NVML: {len(reading.gpus)} GPU(s) ({', '.join(names)}), driver "
          f"{status.driver_version}, CUDA {status.cuda_driver_version}")
    print(f"{args.procs} PyTorch process(es) holding {args.mib} MiB each; NVML lists "
          f"{figures['nvml_processes']} process(es), a poll reads {figures['snapshot_processes']}"
          f" host process(es)\n")
    print(f"{'':<38} {'CPU ms':>8} {'p90':>8} {'wall ms':>8} {'p90':>8} {'runs':>5}")
    for label, s in figures["rows"].items():
        print(f"{label:<38} {s['cpu_ms']:>8.3f} {s['cpu_p90_ms']:>8.3f} {s['wall_ms']:>8.3f}"
              f" {s['wall_p90_ms']:>8.3f} {s['runs']:>5}")
    rows = figures["rows"]
    poll, smi = rows["gpuwatch poll (Poller.poll)"], rows["nvidia-smi --query-compute-apps"]
    print(f"\na poll's wall time is {poll['wall_ms'] / smi['wall_ms']:.3f}x that of one "
          "nvidia-smi query")
    if figures["errors"]:
        print(f"errors in the poll: {figures['errors'][:5]}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=4, help="PyTorch processes holding memory")
    parser.add_argument("--mib", type=int, default=512, help="CUDA memory each holds, MiB")
    parser.add_argument("--polls", type=int, default=200, help="polls (and NVML reads) timed")
    parser.add_argument("--smi-runs", type=int, default=20, help="nvidia-smi runs timed")
    parser.add_argument("--figures", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args(argv)
    nvml = NvmlSource()
    try:
        reading = check_gpu(nvml)
        with holders(args.procs, args.mib, nvml) as pids:
            figures = measure(args, nvml, pids)
    except NoGpu as exc:
        print(f"bench/real_nvml.py: nothing measured: {exc}", file=sys.stderr)
        return EXIT_NO_GPU
    finally:
        nvml.close()
    print_table(args, reading, figures)
    if args.figures is not None:
        args.figures.write_text(json.dumps({"procs": args.procs, "mib": args.mib, **figures},
                                           indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
