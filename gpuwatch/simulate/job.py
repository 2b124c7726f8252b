"""A small, real distributed job for the simulated node and the tests.

`python -m gpuwatch.simulate.job --workers 2 --ready FILE` starts a launcher that spawns worker
processes the way torchrun does (one per local rank, with the distributed-launch variables set),
writes `{"launcher": PID, "workers": [PID, ...]}` to FILE once they are all up, and waits on them.
Workers idle until signalled. Who holds how much GPU memory is written to the fake driver's state
by whoever started the job: the processes here are real, the GPU is not.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Optional


def launch_env(rank: int, world_size: int, run_id: str,
               base: Optional[dict[str, str]] = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update({
        "LOCAL_RANK": str(rank),
        "RANK": str(rank),
        "GROUP_RANK": "0",
        "LOCAL_WORLD_SIZE": str(world_size),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": run_id,
    })
    return env


def _write_atomically(path: Path, payload: dict[str, object]) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def run_launcher(workers: int, ready: Path, run_id: str) -> int:
    procs = [
        subprocess.Popen([sys.executable, "-m", "gpuwatch.simulate.job", "--worker"],
                         env=launch_env(rank, workers, run_id))
        for rank in range(workers)
    ]
    _write_atomically(ready, {"launcher": os.getpid(), "workers": [p.pid for p in procs],
                              "run_id": run_id})

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [p.wait() for p in procs]
    return max(codes, default=0)


def run_worker() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:  # a training step would go here; the simulated one only waits
        time.sleep(3600)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuwatch.simulate.job")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ready", type=Path, help="where to write the PIDs once all are up")
    parser.add_argument("--run-id", default=None, help="TORCHELASTIC_RUN_ID for the workers")
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker()
    if args.ready is None:
        parser.error("--ready is required for the launcher")
    return run_launcher(args.workers, args.ready, args.run_id or uuid.uuid4().hex[:12])


if __name__ == "__main__":
    sys.exit(main())
