"""The healthy seeded programs of tests/test_culprit_seeds.py as real PyTorch training processes
with no line of gpuwatch, for bench/seeded_auto.py. Run with the agent's bootstrap first on
PYTHONPATH and GPUWATCH_AGENT=auto (as `gpuwatch run` runs a job), the agent counts each one's
optimizer steps.

    python bench/seeded_program.py --seeds 0-99 [--leaking 100-104] --parallel 8 --steps 80
        --step-seconds 0.25 --events FILE

It imports torch once, then forks one process per seed (`--parallel` at a time), as a launcher
forks its workers: each is a real process of the job, loaded by the bootstrap, whose agent
reports as itself. A seed's program draws, as the seed test's Program does (its healthy side),
a bounded LRU that is full before the daemon's warm-up ends, a scratch list kept or cleared every
step, a ring buffer, registries filled at import and over the first steps, a jittering work
list, memory noise (a buffer of a random size held for one step) and, at 8% of the steps, 30 to
100 MiB of garbage held for one step (what a GC frees). Its modules are made at run time (the
program's own, walked every discovery pass). Each step trains a tiny model one optimizer step.
Sizes are those of the seed test scaled down (an LRU entry at most 1 MiB rather than 4) so that
`--parallel` programs fit a shared machine's memory.

`--leaking` seeds are controls: the same programs that also keep 1 to 4 entries of 1 to 4 MiB a
step in `seeded.infra.rpc.rtensor._fetch_buffer` from step 10 on, run after the others.

`--events` gets one line a program: `start SEED PID` once it is forked, `end SEED PID STATUS`
once it has exited.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time
import types
from typing import Any

MIB = 1 << 20
#: The daemon's default leak_warmup_steps: a healthy LRU is full by then.
WARMUP = 10


def seeds(text: str) -> list[int]:
    """'0-99' or '3,5,8' -> the seeds."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def program(seed: int, steps: int, step_seconds: float, leaking: bool = False) -> None:
    """One seed's healthy program: `steps` optimizer steps, `step_seconds` each. `leaking`: a
    control that also keeps 1 to 4 entries of 1 to 4 MiB a step in `_fetch_buffer`, from the
    end of the daemon's warm-up on (the seed incident)."""
    import torch

    torch.set_num_threads(1)
    rng = random.Random(seed)
    lru_fill = rng.randint(1, 4)
    lru_cap = rng.randint(4, lru_fill * WARMUP)
    lru_entry = rng.randint(4 << 10, MIB)
    scratch_items = rng.randint(1, 64)
    scratch_kept = rng.random() < 0.5
    noise = rng.uniform(0.5, 4) * MIB
    lru: collections.OrderedDict[Any, bytearray] = collections.OrderedDict()
    scratch: list[bytearray] = []
    ring: collections.deque[bytearray] = collections.deque(maxlen=rng.randint(2, WARMUP))
    work: list[int] = []
    registry = {f"op{i}": i for i in range(rng.randint(10, 500))}
    late_registry: dict[str, int] = {}
    fetch: dict[Any, bytearray] = {}
    entries, entry_bytes = rng.randint(1, 4), rng.randint(MIB, 4 * MIB)
    for name, attrs in (("seeded.infra.rpc.rtensor", {"_fetch_buffer": fetch}),
                        ("seeded.infra.cache", {"_lru": lru}),
                        ("seeded.ops", {"REGISTRY": registry, "_late": late_registry}),
                        ("seeded.train", {"scratch": scratch, "ring": ring, "work": work})):
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    held: list[bytearray] = []  # noise and garbage, for one step
    for step in range(steps):
        started = time.monotonic()
        held.clear()
        if leaking and step >= WARMUP:
            for k in range(entries):
                fetch[(step, k)] = _touched(entry_bytes)
        for k in range(lru_fill):
            lru[(step, k)] = _touched(lru_entry)
            while len(lru) > lru_cap:
                lru.popitem(last=False)
        if step < 6:
            late_registry.update({f"{step}.{i}": i for i in range(rng.randint(1, 50))})
        scratch.clear()
        scratch.extend(_touched(64 << 10) for _ in range(rng.randint(1, scratch_items)))
        if not scratch_kept:
            scratch.clear()
        ring.append(_touched(MIB))
        del work[rng.randint(0, len(work)):]
        work.extend(range(rng.randint(0, 20)))
        held.append(_touched(max(0, int(abs(rng.gauss(0, noise))))))
        if rng.random() < 0.08:
            held.append(_touched(rng.randint(30, 100) * MIB))
        optimizer.zero_grad()
        model(torch.randn(8, 16)).sum().backward()
        optimizer.step()
        time.sleep(max(0.0, step_seconds - (time.monotonic() - started)))


def _touched(n: int) -> bytearray:
    """n bytes whose pages are resident (written), as a loaded batch's are."""
    buf = bytearray(n)
    buf[::4096] = b"\1" * len(range(0, n, 4096))
    return buf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=seeds, default=seeds("0-99"))
    parser.add_argument("--leaking", type=seeds, default=[],
                        help="seeds that also leak (controls), run after --seeds")
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--step-seconds", type=float, default=0.25)
    parser.add_argument("--events", required=True)
    args = parser.parse_args()
    import torch.optim  # noqa: F401  (once, before the forks: the bootstrap's hook is in place)

    running: dict[int, int] = {}
    todo = list(args.seeds) + [s for s in args.leaking if s not in args.seeds]
    leaking = set(args.leaking)
    with open(args.events, "a", buffering=1) as events:
        while todo or running:
            while todo and len(running) < args.parallel:
                seed = todo.pop(0)
                pid = os.fork()
                if pid == 0:
                    status = 0
                    try:
                        program(seed, args.steps, args.step_seconds, seed in leaking)
                    except BaseException as exc:
                        print(f"seed {seed}: {type(exc).__name__}: {exc}", file=sys.stderr)
                        status = 1
                    finally:
                        os._exit(status)
                running[pid] = seed
                events.write(f"start {seed} {pid}\n")
            pid, status = os.wait()
            seed = running.pop(pid, -1)
            events.write(f"end {seed} {pid} {os.waitstatus_to_exitcode(status)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
