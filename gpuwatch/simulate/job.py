"""A small, real distributed job for the simulated node and the tests.

`python -m gpuwatch.simulate.job --workers 2 --ready FILE` starts a launcher that spawns worker
processes the way torchrun does (one per local rank, with the distributed-launch variables set),
writes `{"launcher": PID, "workers": [PID, ...], "run_id": ID, "helpers": {ROLE: PID}}` to FILE
once they are all up (each has reported that its signal handling is in place), and waits on them.
Workers idle until signalled. Who holds how much GPU memory is written to the fake driver's state
by whoever started the job: the processes here are real, the GPU is not.

The launcher, its workers and its helpers share one process group (the launcher's): start the
launcher as a group leader (`start_new_session=True`) and a signal to that group is a Ctrl+C in
the terminal that ran it.

Launcher options that reproduce what is seen on real nodes:

`--helpers redis,actor,preprocessor`
    Also start one non-GPU helper per role (`python -m gpuwatch.simulate.job --helper ROLE`), with
    the launcher's environment minus the per-worker rank variables, the way a job script starts a
    redis server or a Ray actor next to its trainer.
`--trainer-exit-after SECONDS`
    Workers finish (exit 0) after SECONDS: SECONDS from their start, or, with
    `--trainer-exit-clock sigusr1`, from the SIGUSR1 each is sent (a driver that gives the worker
    its GPU memory first, then starts its clock). With `--launcher-waits-for helpers` (the
    default) the launcher then keeps waiting for the helpers, which never finish by themselves; with
    `--launcher-waits-for workers` it exits at once and the helpers are left behind, reparented.
`--stubborn-rank R`
    Worker R runs a non-daemon heartbeat thread. On Ctrl+C its main thread catches
    KeyboardInterrupt and returns, and the interpreter then waits forever to join the heartbeat:
    the process outlives its job. The same happens on SIGTERM (SystemExit takes the same way out);
    only SIGKILL ends it.
`-- COMMAND...`
    Workers run COMMAND (a training script, as torchrun runs one) instead of idling, each with
    the distributed-launch variables of its rank. They report nothing: the job is ready as soon
    as they are started and the helpers are up.
`--sigint-grace SECONDS` (default 2)
    On SIGINT the launcher does not signal anyone (the terminal already sent Ctrl+C to the whole
    group; a second SIGINT would break the stubborn worker out of its join). It waits up to SECONDS
    for the workers, then exits with 130 and leaves the ones still running to whoever adopts them.
    SIGTERM is forwarded to every worker and helper, and the launcher waits for them.

`python -m gpuwatch.simulate.job subreaper --ready FILE -- LAUNCHER OPTIONS...` runs a child
subreaper (PR_SET_CHILD_SUBREAPER), as a service manager or a container's init is: it starts the
launcher (with LAUNCHER OPTIONS, in a session of its own), writes
`{"subreaper": PID, "launcher": PID}` to FILE, then reaps every child that exits, its own and
adopted ones, until it is killed. When the launcher dies its workers are reparented to the
subreaper rather than to PID 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn, Optional

from gpuwatch.launch_env import TORCHELASTIC_RUN_ID_KEY
from gpuwatch.subreaper import become_subreaper, exited_children

# Set by the launcher for one worker only; a helper started next to the workers has none of these.
PER_WORKER_VARIABLES = ("LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "LOCAL_WORLD_SIZE",
                        "WORLD_SIZE", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")

WAIT_CHOICES = ("helpers", "workers")


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
        TORCHELASTIC_RUN_ID_KEY: run_id,
    })
    return env


def helper_env(base: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The launcher's environment as a helper it starts gets it: no rank of its own."""
    env = dict(os.environ if base is None else base)
    for name in PER_WORKER_VARIABLES:
        env.pop(name, None)
    return env


def _write_atomically(path: Path, payload: dict[str, object]) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _spawn(role_args: list[str], env: dict[str, str], ready_fd: int) -> subprocess.Popen[bytes]:
    # No new session or group: the launcher's group is the job's, as with torchrun.
    return subprocess.Popen(
        [sys.executable, "-m", "gpuwatch.simulate.job", *role_args, "--ready-fd", str(ready_fd)],
        env=env, pass_fds=(ready_fd,))


def _report_ready(fd: Optional[int]) -> None:
    if fd is not None:
        os.write(fd, b"ready\n")
        os.close(fd)


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal N reads as 128+N, as in a shell


def run_launcher(workers: int, ready: Path, run_id: str, helpers: Sequence[str] = (),
                 trainer_exit_after: Optional[float] = None, waits_for: str = "helpers",
                 trainer_exit_clock: str = "start",
                 stubborn_rank: Optional[int] = None, sigint_grace: float = 2.0,
                 command: Sequence[str] = ()) -> int:
    worker_procs: list[subprocess.Popen[bytes]] = []
    helper_procs: dict[str, subprocess.Popen[bytes]] = {}

    def forward(signum: int, _frame: object) -> None:
        for p in [*worker_procs, *helper_procs.values()]:
            if p.poll() is None:
                p.send_signal(signum)

    def interrupted(_signum: int, _frame: object) -> None:
        # Pressing Ctrl+C again while the grace runs out changes nothing, as with torchrun.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, interrupted)

    read_end, write_end = os.pipe()
    try:
        for rank in range(workers):
            if command:
                worker_procs.append(subprocess.Popen(list(command),
                                                     env=launch_env(rank, workers, run_id)))
                continue
            extra = ["--stubborn"] if rank == stubborn_rank else []
            if trainer_exit_after is not None:
                extra += ["--exit-after", repr(trainer_exit_after)]
                if trainer_exit_clock == "sigusr1":
                    extra.append("--exit-clock-signal")
            worker_procs.append(_spawn(["--worker", *extra],
                                       launch_env(rank, workers, run_id), write_end))
        for role in helpers:
            helper_procs[role] = _spawn(["--helper", role], helper_env(), write_end)
    finally:
        os.close(write_end)
    # Every child writes one line once its signal handling is in place, then closes its end.
    with os.fdopen(read_end, "rb") as reports:
        reported = reports.read().count(b"\n")
    if reported < (0 if command else len(worker_procs)) + len(helper_procs):
        forward(signal.SIGKILL, None)
        print("gpuwatch.simulate.job: a worker or helper died while starting", file=sys.stderr)
        return 1

    try:
        # Written inside the try: whoever reads it may press Ctrl+C at once.
        _write_atomically(ready, {"launcher": os.getpid(),
                                  "workers": [p.pid for p in worker_procs],
                                  "run_id": run_id,
                                  "helpers": {role: p.pid for role, p in helper_procs.items()}})
        codes = [p.wait() for p in worker_procs]
        if waits_for == "helpers":
            for p in helper_procs.values():
                p.wait()
    except KeyboardInterrupt:
        deadline = time.monotonic() + sigint_grace
        for p in worker_procs:
            # One still running after the grace is left so on purpose: that is how a worker
            # outlives its launcher.
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        return 130
    return max((_exit_status(c) for c in codes), default=0)


def _heartbeat(finished: threading.Event) -> None:
    while not finished.wait(1.0):
        pass  # a collective heartbeat or a watchdog would go here


def _handle_signals_like_a_terminal_program() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Python leaves SIGINT ignored when it starts with it ignored (a `cmd &` in a script);
    # Ctrl+C must behave the same however the job was started.
    signal.signal(signal.SIGINT, signal.default_int_handler)


def run_worker(ready_fd: Optional[int] = None, exit_after: Optional[float] = None,
               stubborn: bool = False, clock_on_signal: bool = False) -> int:
    _handle_signals_like_a_terminal_program()
    if clock_on_signal:  # blocked before the ready report, so that none sent after it is lost
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    finished = threading.Event()
    if stubborn:
        threading.Thread(target=_heartbeat, args=(finished,), name="heartbeat").start()
    try:
        _report_ready(ready_fd)  # in the try: a Ctrl+C may follow the report at once
        if exit_after is None:
            while True:  # a training step would go here; the simulated one only waits
                time.sleep(3600)
        if clock_on_signal:
            signal.sigwait({signal.SIGUSR1})
        time.sleep(exit_after)
    except KeyboardInterrupt:
        # The training loop's Ctrl+C path: it returns without stopping the heartbeat, which is
        # what keeps a stubborn worker alive in the interpreter's final join.
        return 130
    finished.set()
    return 0


def run_helper(role: str, ready_fd: Optional[int] = None) -> int:
    _handle_signals_like_a_terminal_program()
    try:
        _report_ready(ready_fd)
        while True:  # serving `role` would go here
            time.sleep(3600)
    except KeyboardInterrupt:
        return 130


def run_subreaper(ready: Path, launcher_args: list[str]) -> int:
    become_subreaper()
    # A session of its own, as a service manager starts a unit: a Ctrl+C to the job's group
    # must not reach the subreaper.
    launcher = subprocess.Popen([sys.executable, "-m", "gpuwatch.simulate.job", *launcher_args],
                                start_new_session=True)
    _write_atomically(ready, {"subreaper": os.getpid(), "launcher": launcher.pid})
    reap_children_forever()


def reap_children_forever() -> NoReturn:
    """Collect every child that exits, as an init or a subreaper does. Called once the children
    are started, so that they do not inherit the blocked SIGCHLD; what exited before is
    collected by the first pass."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    while True:
        for _ in exited_children():
            pass
        signal.sigwait({signal.SIGCHLD})


def _roles(text: str) -> tuple[str, ...]:
    roles = tuple(r for r in (part.strip() for part in text.split(",")) if r)
    for role in roles:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", role):
            raise argparse.ArgumentTypeError(f"not a role name: {role!r}")
    if len(set(roles)) != len(roles):
        raise argparse.ArgumentTypeError("each role may be given once")
    return roles


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return value


def launcher_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gpuwatch.simulate.job",
        epilog="`python -m gpuwatch.simulate.job subreaper --ready FILE -- OPTIONS...` runs the "
               "launcher under a child subreaper.")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--helper", metavar="ROLE", help=argparse.SUPPRESS)
    parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--exit-after", type=_seconds, help=argparse.SUPPRESS)
    parser.add_argument("--stubborn", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--exit-clock-signal", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ready", type=Path, help="where to write the PIDs once all are up")
    parser.add_argument("--run-id", default=None, help="TORCHELASTIC_RUN_ID for the workers")
    parser.add_argument("--helpers", type=_roles, default=(), metavar="ROLE,...",
                        help="also start one non-GPU helper process per role")
    parser.add_argument("--trainer-exit-after", type=_seconds, metavar="SECONDS",
                        help="workers finish (exit 0) after SECONDS")
    parser.add_argument("--trainer-exit-clock", choices=("start", "sigusr1"), default="start",
                        help="count --trainer-exit-after from the worker's start (default) or "
                             "from the SIGUSR1 sent to it")
    parser.add_argument("--launcher-waits-for", choices=WAIT_CHOICES, default="helpers",
                        help="once the workers finish, wait for the helpers too (default) or exit")
    parser.add_argument("--stubborn-rank", type=int, metavar="R",
                        help="worker R survives Ctrl+C in its shutdown join")
    parser.add_argument("--sigint-grace", type=_seconds, default=2.0, metavar="SECONDS",
                        help="on SIGINT, wait this long for the workers, then exit 130")
    parser.add_argument("command", nargs="*", metavar="-- COMMAND",
                        help="what each worker runs (default: a worker that idles)")
    return parser


def _subreaper_main(argv: list[str]) -> int:
    own, launcher_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m gpuwatch.simulate.job subreaper",
                                     usage="%(prog)s --ready FILE -- LAUNCHER_OPTIONS...")
    parser.add_argument("--ready", type=Path, required=True,
                        help="where to write the subreaper's and the launcher's PIDs")
    args = parser.parse_args(own)
    # Checked here, so that a mistake fails now instead of leaving a subreaper with no job.
    checked = launcher_parser().parse_args(launcher_args)
    if checked.worker or checked.helper or checked.ready is None:
        parser.error("the launcher options after `--` must include --ready")
    return run_subreaper(args.ready, launcher_args)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["subreaper"]:
        return _subreaper_main(argv[1:])
    parser = launcher_parser()
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker(args.ready_fd, args.exit_after, args.stubborn, args.exit_clock_signal)
    if args.helper:
        return run_helper(args.helper, args.ready_fd)
    if args.ready is None:
        parser.error("--ready is required for the launcher")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.stubborn_rank is not None and not 0 <= args.stubborn_rank < args.workers:
        parser.error(f"--stubborn-rank must be a rank between 0 and {args.workers - 1}")
    if args.command and (args.stubborn_rank is not None or args.trainer_exit_after is not None):
        parser.error("--stubborn-rank and --trainer-exit-after apply to the idling workers only")
    return run_launcher(args.workers, args.ready, args.run_id or uuid.uuid4().hex[:12],
                        helpers=args.helpers, trainer_exit_after=args.trainer_exit_after,
                        trainer_exit_clock=args.trainer_exit_clock,
                        waits_for=args.launcher_waits_for, stubborn_rank=args.stubborn_rank,
                        sigint_grace=args.sigint_grace, command=args.command)


if __name__ == "__main__":
    sys.exit(main())
