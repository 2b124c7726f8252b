"""One-shot views of the same simulated node: `gpuwatch status --json`, asking a running daemon and
polling itself (`--poll`), against `gpustat --json` and `nvitop -1`; wall time from fork to exit
and CPU time (user + system of the process), side by side. gpustat sleeps 0.1 s per GPU to sample
CPU percentages, so its wall time is mostly that sleep: a wall-time win over gpustat says nothing
about cost, and CPU time is the figure that compares like with like.

Each run is a fresh process, as a user at a shell starts it: interpreter start-up and imports count.
The tools take turns (one run of each, round after round) so that a noisy neighbour slows all of
them alike; the figure is each tool's median. A gpuwatch daemon runs on the node throughout (it
polls once a second, the same for every tool): `gpuwatch status --json` reads its state socket,
`--poll` polls the node itself, as the peers do.

    python bench/oneshot.py [--rounds 15] [--gpu-procs 64]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cmdline import arguments, write_figures
from node import bench_node, cli_env, console_script, free_port, start_daemon

from gpuwatch.serve.state_client import STATE_SOCKET_NAME, StateUnavailable, fetch_status

OURS = "gpuwatch status --json"
OURS_POLL = "gpuwatch status --json --poll"


def tools() -> dict[str, list[str]]:
    gpuwatch = console_script("gpuwatch")
    return {
        OURS: [gpuwatch, "status", "--json"],
        OURS_POLL: [gpuwatch, "status", "--json", "--poll"],
        "gpustat --json": [console_script("gpustat"), "--json"],
        "nvitop -1": [console_script("nvitop"), "-1"],
        # What any of them pays before its first line of its own: the floor.
        "python -c pass": [sys.executable, "-c", "pass"],
    }


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of one run; CPU from the kernel's own account of the child (wait4),
    which includes every thread it ran."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    errors = proc.stderr.read()  # before waiting: a full pipe would stall the child
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stderr.close()
    # gpuwatch status exits 4 when some NVML call failed: still a full view, still timed.
    if proc.returncode not in (0, 4):
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: "
                           f"{errors.decode(errors='replace')[-500:]}")
    return elapsed, usage.ru_utime + usage.ru_stime


def wait_for_daemon(env: dict[str, str], daemon: subprocess.Popen[bytes],
                    timeout: float = 60) -> None:
    """Until the daemon's state socket serves a document: before its first poll, `status` would
    fall back to polling itself and time the wrong thing."""
    path = Path(env["GPUWATCH_RUNTIME_DIR"]) / STATE_SOCKET_NAME
    deadline = time.monotonic() + timeout
    while True:
        if daemon.poll() is not None:
            raise RuntimeError(f"the daemon exited with {daemon.returncode}")
        try:
            if fetch_status(path)["source"] == "daemon":
                return
        except StateUnavailable:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"no daemon answered at {path} in {timeout:.0f} s")
        time.sleep(0.1)


def main() -> None:
    args = arguments(__doc__, quick={"rounds": 2},
                     smoke={"rounds": 1}, rounds=15, gpus=8, gpu_procs=64)
    commands = tools()
    wall: dict[str, list[float]] = {name: [] for name in commands}
    cpu: dict[str, list[float]] = {name: [] for name in commands}
    with bench_node(args.gpus, args.gpu_procs) as b:
        env = cli_env(b)
        daemon = start_daemon(b, free_port(), 1.0)
        try:
            wait_for_daemon(env, daemon)
            for argv in commands.values():
                run_once(argv, env)  # page cache and .pyc files warm for everyone
            for _ in range(args.rounds):
                for name, argv in commands.items():
                    w, c = run_once(argv, env)
                    wall[name].append(w)
                    cpu[name].append(c)
        finally:
            daemon.terminate()
            daemon.wait(30)
    wall_ms = {name: statistics.median(t) * 1e3 for name, t in wall.items()}
    cpu_ms = {name: statistics.median(t) * 1e3 for name, t in cpu.items()}
    print(f"one-shot views of {args.gpus} fake GPUs x {args.gpu_procs} real GPU processes, "
          f"{args.rounds} interleaved rounds, a fresh process each run, a daemon running")
    print(f"{'':<32}{'wall ms':>9}{'min':>7}{'max':>7}{'CPU ms':>9}"
          f"{'daemon path / this':>21}{'--poll / this':>15}")
    print(f"{'':<32}{'(median)':>9}{'':>14}{'(median)':>9}{'wall':>12}{'CPU':>9}"
          f"{'wall':>8}{'CPU':>7}")
    for name, t in wall.items():
        print(f"{name:<32}{wall_ms[name]:>9.0f}{min(t) * 1e3:>7.0f}{max(t) * 1e3:>7.0f}"
              f"{cpu_ms[name]:>9.0f}{wall_ms[OURS] / wall_ms[name]:>12.2f}"
              f"{cpu_ms[OURS] / cpu_ms[name]:>9.2f}{wall_ms[OURS_POLL] / wall_ms[name]:>8.2f}"
              f"{cpu_ms[OURS_POLL] / cpu_ms[name]:>7.2f}")
    print("gpustat's wall time is mostly its 0.1 s sleep per GPU (its CPU-percent sample): "
          "compare CPU with it.")
    figures: dict[str, Any] = {"rounds": args.rounds, "gpus": args.gpus,
                               "gpu_procs": args.gpu_procs, "wall_ms": wall_ms, "cpu_ms": cpu_ms}
    write_figures(args.figures, figures)


if __name__ == "__main__":
    main()
