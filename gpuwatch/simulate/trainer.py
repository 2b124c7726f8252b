"""A training loop instrumented with gpuwatch.agent, for the simulated node and the tests.

    python -m gpuwatch.simulate.trainer --pattern leak --leak-mib 4 --step-seconds 0.05

Each step really allocates what the pattern says, so the RSS the daemon reads from /proc moves as
the agent's reports say:
- `leak`: the consumer's fetch cache keeps every batch (the incident this exists for): RSS and the
  `fetch_buffer` grow by `--leak-mib` a step;
- `steady`: the cache is bounded; allocator noise (`--noise-mib`) comes and goes;
- `sawtooth`: memory grows for a few steps, then is released;
- `plateau`: memory grows for the first steps only (a cache filling, pages touched after a fork),
  then stays level.
`--stall-at STEP` stops stepping at that step (a trainer starved of data) for `--stall-seconds`.
The current step is written to `--progress FILE` after each step, for a test to follow.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import deque
from pathlib import Path
from typing import Optional

MIB = 1 << 20
PATTERNS = ("leak", "steady", "sawtooth", "plateau")


def _block(mib: float) -> bytes:
    # Multiplying writes every byte, so the pages are really resident (unlike a zeroed calloc).
    return b"\x01" * int(mib * MIB)


def train(pattern: str, steps: int, step_seconds: float, leak_mib: float, noise_mib: float,
          stall_at: Optional[int], stall_seconds: float, finish: bool, linger: float,
          progress: Optional[Path], seed: int) -> int:
    from gpuwatch import agent

    rng = random.Random(seed)
    fetch_buffer: list[bytes] = []
    prefetch: deque[bytes] = deque(maxlen=4)
    agent.watch("fetch_buffer", fetch_buffer)
    agent.watch("prefetch", prefetch)
    agent.watch("queue_depth", lambda: rng.randint(0, 8))
    step = 0
    while steps == 0 or step < steps:
        if stall_at is not None and step == stall_at:
            time.sleep(stall_seconds)
            stall_at = None
        if pattern == "leak":
            fetch_buffer.append(_block(leak_mib))
        elif pattern == "sawtooth":
            fetch_buffer.append(_block(leak_mib))
            if len(fetch_buffer) >= 5:
                fetch_buffer.clear()
        elif pattern == "plateau" and step < 8:
            fetch_buffer.append(_block(leak_mib))
        prefetch.append(_block(0.25))
        noise = _block(rng.uniform(0, noise_mib)) if noise_mib else b""
        agent.step(step)
        del noise
        if progress is not None:
            tmp = progress.with_name(progress.name + ".tmp")
            tmp.write_text(str(step))
            os.replace(tmp, progress)
        time.sleep(step_seconds)
        step += 1
    if finish:
        agent.finished()
    time.sleep(linger)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuwatch.simulate.trainer")
    parser.add_argument("--pattern", choices=PATTERNS, default="steady")
    parser.add_argument("--steps", type=int, default=0, help="0: step until killed")
    parser.add_argument("--step-seconds", type=float, default=0.5)
    parser.add_argument("--leak-mib", type=float, default=4.0)
    parser.add_argument("--noise-mib", type=float, default=2.0)
    parser.add_argument("--stall-at", type=int, default=None)
    parser.add_argument("--stall-seconds", type=float, default=3600.0)
    parser.add_argument("--finish", action="store_true", help="call agent.finished() at the end")
    parser.add_argument("--linger", type=float, default=0.0,
                        help="seconds to stay alive after the last step")
    parser.add_argument("--progress", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    return train(a.pattern, a.steps, a.step_seconds, a.leak_mib, a.noise_mib, a.stall_at,
                 a.stall_seconds, a.finish, a.linger, a.progress, a.seed)


if __name__ == "__main__":
    sys.exit(main())
