"""A small PyTorch job for the `gpu` tests: a launcher that starts its workers the way torchrun
does, workers that each hold a set amount of CUDA memory and idle, and an instrumented worker
that allocates step by step under gpuwatch.agent.

    python gpu_job.py launch --mib 1024,1536,2048 --ready FILE [--stubborn-rank R]
                             [--sigint-grace SECONDS] [--cpu]
    python gpu_job.py worker --mib 1024 --report-fd FD [--stubborn] [--cpu]
    python gpu_job.py agent-worker [--phases 3] [--steps-per-phase 10] [--mib-per-step 16] [--cpu]

`launch` starts one worker per entry of --mib (rank = its position) with the variables torchrun
sets (LOCAL_RANK, RANK, WORLD_SIZE, MASTER_ADDR, TORCHELASTIC_RUN_ID, ...), in the launcher's own
process group, as torchrun does. Worker N uses GPU N % (number of GPUs). Each worker reports once
it holds its memory; then the launcher writes
`{"launcher": PID, "run_id": ID, "workers": [PID, ...], "reports": [{...}, ...]}` to --ready and
waits on its workers. On SIGINT (Ctrl+C reaches the whole group) it signals nobody, waits up to
--sigint-grace seconds for its workers and exits with 130, leaving behind whichever still runs.
SIGTERM is forwarded to the workers.

`--stubborn-rank R` gives worker R a non-daemon heartbeat thread, as NCCL's watchdog keeps a
trainer alive: on Ctrl+C or SIGTERM its main thread returns and the interpreter then waits forever
to join the heartbeat, holding its CUDA memory, until SIGKILL.

`agent-worker` is one process that imports gpuwatch.agent, allocates --mib-per-step x (phase + 1)
MiB of CUDA memory a step and calls agent.step() after each; after each phase it prints
`{"phase": P, "step": S, "allocated": BYTES, "reserved": BYTES, "tensors": N}` (its own
torch.cuda.memory_allocated() and memory_reserved()) and pauses until a line arrives on stdin.
EOF on stdin ends it.

`--cpu` replaces every CUDA allocation with host memory (a bytearray) and never imports torch:
the process structure, the variables and the reports without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

MIB = 1 << 20
EXIT_INTERRUPTED = 130

#: What the tensors and buffers are kept in: module-level, so that nothing a worker holds is
#: freed when its main function returns (a stubborn worker must keep its memory in its final join).
HELD: list[Any] = []


# ---- the launcher ------------------------------------------------------------------------------


def worker_env(rank: int, world_size: int, run_id: str, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "LOCAL_RANK": str(rank),
        "RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(world_size),
        "WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        # CUDA's default order is fastest first, NVML's is PCI bus order: the same index must
        # name the same GPU to both.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    })
    return env


def _write_atomically(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def launch(mib: list[int], ready: Path, stubborn_rank: Optional[int], sigint_grace: float,
           cpu: bool) -> int:
    workers: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: object) -> None:
        for p in workers:
            if p.poll() is None:
                p.send_signal(signum)

    def interrupted(_signum: int, _frame: object) -> None:
        # A second Ctrl+C while the grace runs out changes nothing, as with torchrun.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, interrupted)
    run_id = f"gpu-test-{uuid.uuid4().hex[:12]}"
    # No rendezvous happens; the port only has to look like one.
    port = 29500 + os.getpid() % 1000
    read_end, write_end = os.pipe()
    try:
        for rank, amount in enumerate(mib):
            argv = [sys.executable, os.path.abspath(__file__), "worker", "--mib", str(amount),
                    "--report-fd", str(write_end)]
            if rank == stubborn_rank:
                argv.append("--stubborn")
            if cpu:
                argv.append("--cpu")
            # No new session or group: the launcher's group is the job's, as with torchrun.
            workers.append(subprocess.Popen(argv, env=worker_env(rank, len(mib), run_id, port),
                                            pass_fds=(write_end,)))
    finally:
        os.close(write_end)
    # One line from each worker once it holds its memory; EOF once every worker has closed its
    # end, by reporting or by dying.
    with os.fdopen(read_end, "rb") as pipe:
        lines = pipe.read().splitlines()
    reports = [json.loads(line) for line in lines if line.strip()]
    if len(reports) < len(workers):
        forward(signal.SIGKILL, None)
        print(f"gpu_job: {len(workers) - len(reports)} worker(s) died before holding their "
              "memory", file=sys.stderr, flush=True)
        return 1
    reports.sort(key=lambda r: int(r["rank"]))
    try:
        # Written inside the try: whoever reads it may press Ctrl+C at once.
        _write_atomically(ready, {"launcher": os.getpid(), "run_id": run_id,
                                  "workers": [p.pid for p in workers], "reports": reports})
        codes = [p.wait() for p in workers]
    except KeyboardInterrupt:
        deadline = time.monotonic() + sigint_grace
        for p in workers:
            # One still running after the grace is left so on purpose: that is how a worker
            # outlives its launcher.
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        return EXIT_INTERRUPTED
    return max((128 - c if c < 0 else c for c in codes), default=0)


# ---- the workers -------------------------------------------------------------------------------


def _handle_signals_like_a_training_script() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Python keeps SIGINT ignored when it starts with it ignored (`cmd &` in a script); Ctrl+C
    # must reach the training loop however the job was started.
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _heartbeat(stop: threading.Event) -> None:
    while not stop.wait(1.0):
        pass  # a collective watchdog would check its peers here


def _allocate(nbytes: int, cpu: bool, device: Optional[int]) -> None:
    if cpu:
        HELD.append(bytearray(nbytes))
        return
    import torch

    HELD.append(torch.empty(nbytes, dtype=torch.uint8, device=device))


def _cuda_device(cpu: bool) -> Optional[int]:
    if cpu:
        return None
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"gpu_job: PyTorch {torch.__version__} sees no CUDA device")
    device = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(device)
    return device


def _memory_figures(cpu: bool) -> tuple[int, int]:
    """(allocated, reserved) as the worker's own allocator counts them."""
    if cpu:
        total = sum(len(b) for b in HELD)
        return total, total
    import torch

    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated()), int(torch.cuda.memory_reserved())


def worker(mib: int, report_fd: int, stubborn: bool, cpu: bool) -> int:
    _handle_signals_like_a_training_script()
    stop = threading.Event()
    if stubborn:
        threading.Thread(target=_heartbeat, args=(stop,), name="heartbeat").start()
    device = _cuda_device(cpu)
    _allocate(mib * MIB, cpu, device)
    allocated, reserved = _memory_figures(cpu)
    report = {"rank": int(os.environ.get("RANK", "0")), "pid": os.getpid(), "device": device,
              "mib": mib, "allocated": allocated, "reserved": reserved, "stubborn": stubborn}
    try:
        # In the try: a Ctrl+C may follow the report at once.
        os.write(report_fd, (json.dumps(report) + "\n").encode())
        os.close(report_fd)
        while True:  # a training step would go here
            time.sleep(3600)
    except KeyboardInterrupt:
        # The training loop's Ctrl+C path returns without stopping the heartbeat: the final
        # join then keeps a stubborn worker alive.
        return EXIT_INTERRUPTED


def _line_arrived(timeout: float) -> bool:
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    return bool(ready)


def agent_worker(phases: int, steps_per_phase: int, mib_per_step: int, cpu: bool) -> int:
    from gpuwatch import agent

    _handle_signals_like_a_training_script()
    device = _cuda_device(cpu)
    agent.watch("held", HELD)
    step = 0
    for phase in range(phases):
        for _ in range(steps_per_phase):
            # Not a whole number of MiB: the allocator's own count must come through exactly.
            _allocate((phase + 1) * mib_per_step * MIB + 4096 * (step + 1), cpu, device)
            step += 1
            agent.step(step)
        allocated, reserved = _memory_figures(cpu)
        print(json.dumps({"phase": phase, "step": step, "allocated": allocated,
                          "reserved": reserved, "tensors": len(HELD)}), flush=True)
        # Paused on this step: a report goes out only from a step() call once the agent's
        # interval has passed, so the same step is recorded again until told to go on, and the
        # daemon's latest figures are the ones just printed.
        while not _line_arrived(0.02):
            agent.step(step)
        if not sys.stdin.readline():
            break
    agent.finished()
    return 0


# ---- command line ------------------------------------------------------------------------------


def _mib_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive MiB figures, got {text!r}")
    return values


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    roles = parser.add_subparsers(dest="role", required=True)
    p = roles.add_parser("launch", help="start the workers as torchrun does")
    p.add_argument("--mib", type=_mib_list, required=True,
                   help="CUDA memory each worker holds, MiB, comma-separated (one per rank)")
    p.add_argument("--ready", type=Path, required=True)
    p.add_argument("--stubborn-rank", type=int)
    p.add_argument("--sigint-grace", type=float, default=8.0)
    p.add_argument("--cpu", action="store_true", help="host memory instead of CUDA memory")
    w = roles.add_parser("worker", help="one rank: hold --mib MiB and idle")
    w.add_argument("--mib", type=int, required=True)
    w.add_argument("--report-fd", type=int, required=True)
    w.add_argument("--stubborn", action="store_true")
    w.add_argument("--cpu", action="store_true")
    a = roles.add_parser("agent-worker", help="allocate step by step under gpuwatch.agent")
    a.add_argument("--phases", type=int, default=3)
    a.add_argument("--steps-per-phase", type=int, default=10)
    a.add_argument("--mib-per-step", type=int, default=16)
    a.add_argument("--cpu", action="store_true")
    args = parser.parse_args(argv)
    if args.role == "launch":
        if args.stubborn_rank is not None and not 0 <= args.stubborn_rank < len(args.mib):
            parser.error(f"--stubborn-rank {args.stubborn_rank} is not a rank of "
                         f"{len(args.mib)} workers")
        return launch(args.mib, args.ready, args.stubborn_rank, args.sigint_grace, args.cpu)
    if args.role == "worker":
        return worker(args.mib, args.report_fd, args.stubborn, args.cpu)
    return agent_worker(args.phases, args.steps_per_phase, args.mib_per_step, args.cpu)


if __name__ == "__main__":
    sys.exit(main())
