"""PID 1 of a test worker's own PID namespace: start the worker, reap every orphan, pass on signals.

tests/conftest.py starts each pytest-xdist worker as
`unshare --pid --fork --mount-proc --kill-child -- python -I tests/worker_init.py WORKER-ARGV...`
where the suite runs as root (tests/worlds.py). This program is then PID 1 of a PID namespace with
its own /proc: it runs the worker as its child (PID 1000), and, as an init does, reaps whatever is
reparented to it (a test's orphans get PPid 1 and are reaped at once, as under a real init) and
passes on the signals it is sent with kill(2) (a terminal's Ctrl+C reaches the worker itself, in
the same process group). It exits with the worker's status; the kernel then ends every process
left in the namespace, so nothing a worker started outlives it.

Standard library only, run with `-I`: it must not import the checkout or the test suite.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

#: Signals passed on to the worker when they come from kill(2), from this namespace or another.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGWINCH)
#: si_code of a signal the kernel sends itself: a terminal's SIGINT, SIGQUIT or SIGHUP, which
#: the worker (in the terminal's foreground process group too) gets anyway.
SI_KERNEL = 0x80
#: The worker's PID in its namespace.
FIRST_PID = 1000


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: worker_init.py PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    waited = {*FORWARDED, signal.SIGCHLD}
    # Blocked, then taken with sigwaitinfo: PID 1 drops a signal it has no handler for, but a
    # blocked one is always queued.
    signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    # The worker gets PID FIRST_PID, as a test run gets on a host (a test takes its own PID for
    # one no new namespace has, and PID 2, kthreadd's on a host, is one whose children gpuwatch
    # refuses to signal as kernel threads). Where ns_last_pid cannot be written, a first child
    # that exits at once takes PID 2 and the worker is PID 3.
    try:
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(FIRST_PID - 1))
    except OSError:
        placeholder = os.fork()
        if placeholder == 0:
            os._exit(0)
        os.waitpid(placeholder, 0)
    worker = os.fork()
    if worker == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        for name in ("SIGPIPE", "SIGXFSZ"):  # ignored by this interpreter; not by the worker
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_DFL)
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            print(f"worker_init.py: cannot run {argv[0]}: {exc}", file=sys.stderr)
            os._exit(127)
    # The pipes to the controller are the worker's alone: its exit closes them.
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    while True:
        info = signal.sigwaitinfo(waited)
        if info.si_signo != signal.SIGCHLD:
            if info.si_code != SI_KERNEL:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker, info.si_signo)
            continue
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == worker:
                code = os.waitstatus_to_exitcode(status)
                return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
