"""One-shot views of the same simulated node: `gpuwatch status --json` against `gpustat --json` and
`nvitop -1`, wall time from fork to exit.

Each run is a fresh process, as a user at a shell starts it: interpreter start-up and imports count.
The tools take turns (one run of each, round after round) so that a noisy neighbour slows all of
them alike; the figure is each tool's median. No gpuwatch daemon runs, so `gpuwatch status` polls
the node itself, as the peers do.

    python bench/oneshot.py [--rounds 15] [--gpu-procs 64]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Any

from node import bench_node, cli_env, console_script, parse_args, write_figures


def tools() -> dict[str, list[str]]:
    return {
        "gpuwatch status --json": [console_script("gpuwatch"), "status", "--json"],
        "gpustat --json": [console_script("gpustat"), "--json"],
        "nvitop -1": [console_script("nvitop"), "-1"],
        # What any of them pays before its first line of its own: the floor.
        "python -c pass": [sys.executable, "-c", "pass"],
    }


def run_once(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - started
    # gpuwatch status exits 4 when some NVML call failed: still a full view, still timed.
    if done.returncode not in (0, 4):
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: "
                           f"{done.stderr.decode(errors='replace')[-500:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-procs", type=int, default=64)
    args = parse_args(parser, quick={"rounds": 2})
    commands = tools()
    times: dict[str, list[float]] = {name: [] for name in commands}
    with bench_node(args.gpus, args.gpu_procs) as b:
        env = cli_env(b)
        for argv in commands.values():
            run_once(argv, env)  # page cache and .pyc files warm for everyone
        for _ in range(args.rounds):
            for name, argv in commands.items():
                times[name].append(run_once(argv, env))
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    ours = medians["gpuwatch status --json"]
    print(f"one-shot views of {args.gpus} fake GPUs x {args.gpu_procs} real GPU processes, "
          f"{args.rounds} interleaved rounds, a fresh process each run")
    print(f"{'':<26}{'wall ms (median)':>17}{'min':>8}{'max':>8}{'gpuwatch / this':>17}")
    for name, t in times.items():
        print(f"{name:<26}{medians[name]:>17.0f}{min(t) * 1e3:>8.0f}{max(t) * 1e3:>8.0f}"
              f"{ours / medians[name]:>17.2f}")
    figures: dict[str, Any] = {"rounds": args.rounds, "gpu_procs": args.gpu_procs,
                               "wall_ms": medians}
    write_figures(args.figures, figures)


if __name__ == "__main__":
    main()
