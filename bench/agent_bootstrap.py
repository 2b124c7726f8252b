"""What the agent's bootstrap (`gpuwatch run` puts gpuwatch/agent/bootstrap first on the job's
PYTHONPATH) costs every Python process at start: `python -c pass` without it, with it on
PYTHONPATH and GPUWATCH_AGENT unset (a Python that is not the job's, where a prolog exported the
path), and with GPUWATCH_AGENT=auto (the job's: the import hook waits for torch.optim, which this
program never imports). The three take turns, round after round, so that a noisy neighbour slows
all of them alike; the cost is the median (and p90) of each round's difference to the first.

With --against DIR (another bootstrap directory: a former version's sitecustomize.py), its two
rows are measured in the same rounds, side by side with this one's.

    python bench/agent_bootstrap.py [--rounds 200] [--against DIR]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

from cmdline import arguments, write_figures

from gpuwatch.launch_env import AGENT_BOOTSTRAP_DIR


def wall_ms(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True)
    return (time.perf_counter() - start) * 1e3


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    args = arguments(__doc__, quick={"rounds": 10}, smoke={"rounds": 2},
                     rounds=(200, "interleaved rounds"),
                     against=("", "another bootstrap directory, measured in the same rounds"))
    plain = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GPUWATCH_AGENT")}
    envs = {
        "python -c pass": plain,
        "bootstrap on PYTHONPATH, GPUWATCH_AGENT unset": {**plain,
                                                          "PYTHONPATH": AGENT_BOOTSTRAP_DIR},
        "bootstrap on PYTHONPATH, GPUWATCH_AGENT=auto": {**plain,
                                                         "PYTHONPATH": AGENT_BOOTSTRAP_DIR,
                                                         "GPUWATCH_AGENT": "auto"},
    }
    if args.against:
        envs.update({
            f"{args.against} on PYTHONPATH, GPUWATCH_AGENT unset": {
                **plain, "PYTHONPATH": args.against},
            f"{args.against} on PYTHONPATH, GPUWATCH_AGENT=auto": {
                **plain, "PYTHONPATH": args.against, "GPUWATCH_AGENT": "auto"},
        })
    argv = [sys.executable, "-c", "pass"]
    for env in envs.values():  # warm the page cache
        wall_ms(argv, env)
    walls: dict[str, list[float]] = {name: [] for name in envs}
    for _ in range(args.rounds):
        for name, env in envs.items():
            walls[name].append(wall_ms(argv, env))
    base = walls["python -c pass"]
    figures: dict[str, dict[str, float]] = {}
    print(f"`python -c pass`, wall from fork to exit, {args.rounds} interleaved rounds "
          f"({sys.executable}, Python {sys.version.split()[0]})")
    width = max(48, *(len(name) + 2 for name in envs))
    print(f"{'':{width}}{'median ms':>10}{'p90':>8}{'+ median':>10}{'+ p90':>8}")
    for name, values in walls.items():
        over = [v - b for v, b in zip(values, base)]
        figures[name] = {"median": statistics.median(values), "p90": quantile(values, 0.9),
                         "over_median": statistics.median(over), "over_p90": quantile(over, 0.9)}
        f = figures[name]
        print(f"{name:{width}}{f['median']:10.1f}{f['p90']:8.1f}{f['over_median']:10.2f}"
              f"{f['over_p90']:8.2f}")
    write_figures(args.figures, {"rounds": args.rounds, "wall_ms": figures})


if __name__ == "__main__":
    main()
