"""The agent's threads in a program that never asked for them (the bootstrap's timer, the ticker
that reports until the first step): a signal sent to the program is never taken by one of them.

The kernel hands a signal sent to a process to any of its threads that does not block it, and
passes over the main thread while a signal is already pending there (just continued after a
SIGCONT, a SIGINT not yet handled). Python runs its handlers in the main thread alone, when that
thread next runs bytecode: one asleep in `signal.pause()` (or a long `time.sleep`) sleeps on
through a SIGTERM an agent's thread took."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpuwatch.launch_env import AGENT_BOOTSTRAP_DIR
from gpuwatch.simulate.demo import wait_for
from tests.realprocs import BLOCKABLE_SIGNALS, blocked_signals, threads_of
from tests.scenarios import state

#: Under the bootstrap: the ticker started at once (not after the bootstrap's 5 s), a SIGTERM
#: handler, then the main thread asleep in signal.pause(), as a server waits for its end.
PAUSES = """\
import os, signal, sys
import gpuwatch.agent
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
gpuwatch.agent.tick_until_stepped()
print(os.getpid(), flush=True)
while True:
    signal.pause()
"""


@contextmanager
def paused_programs(tmp_path: Path, n: int) -> Iterator[list[subprocess.Popen[str]]]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GPUWATCH_AGENT")}
    env.update(PYTHONPATH=os.pathsep.join([AGENT_BOOTSTRAP_DIR, os.getcwd()]),
               GPUWATCH_AGENT="auto", GPUWATCH_RUNTIME_DIR=str(tmp_path / "no-daemon"))
    procs = [subprocess.Popen([sys.executable, "-c", PAUSES], env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(n)]
    try:
        for p in procs:
            assert p.stdout is not None and int(p.stdout.readline()) == p.pid
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_the_agents_threads_block_every_signal_and_the_main_thread_none(tmp_path: Path) -> None:
    with paused_programs(tmp_path, 1) as (proc,):
        # The bootstrap's timer thread and the ticker beside the main thread.
        threads = wait_for("the agent's threads", lambda: t if len(t := threads_of(proc.pid)) >= 3
                           else None, 30)
        assert not blocked_signals(proc.pid, proc.pid) & BLOCKABLE_SIGNALS
        for tid in threads:
            if tid != proc.pid:
                assert blocked_signals(proc.pid, tid) >= BLOCKABLE_SIGNALS, f"thread {tid}"


def test_a_sigterm_that_waited_while_the_program_was_stopped_ends_it_when_continued(
        tmp_path: Path) -> None:
    """A SIGTERM sent while the program is stopped waits for whichever thread runs first once
    it is continued: the main thread alone may take it."""
    with paused_programs(tmp_path, 8) as procs:
        for p in procs:
            wait_for("the agent's threads", lambda p=p: len(threads_of(p.pid)) >= 3 or None, 30)
            os.kill(p.pid, signal.SIGSTOP)
            wait_for("the program stopped", lambda p=p: state(p.pid) == "T" or None, 10)
            os.kill(p.pid, signal.SIGTERM)
            os.kill(p.pid, signal.SIGCONT)
        for p in procs:
            assert p.wait(20) == 0
