"""`gpuwatch demo`: the daemon on a simulated node, for trying gpuwatch without a GPU.

The GPUs are simulated by the fake NVML driver (built here with the system C compiler); the jobs
are real: each is a launcher named `torchrun` (gpuwatch.simulate.job under that name) with its
workers and helpers, registered with the fake driver as holding GPU memory. The daemon is the real
one, in its own process, loading the fake driver through LD_LIBRARY_PATH exactly as it would load
NVIDIA's.

However the demo ends (Ctrl+C, SIGTERM, SIGHUP when its terminal closes, `--duration` running out,
an error of its own), it ends everything it started: the daemon, every launcher, every worker and
helper, the orphans among them now under PID 1, and anything they forked. It freezes them
(SIGSTOP) until no new process appears among them, so that none can fork one out of reach, then
kills them by identity (PID and start time, through gpuwatch.actions.signals, so that a reused
PID is never signalled), waits on its own children and until the others are gone, and removes its
temporary directory. It takes its stop signals synchronously (blocked, and waited for where it
waits), so a signal never interrupts it halfway through starting or ending something.

A SIGKILL of the demo runs none of that. What the kernel still does: each child was started with
PR_SET_PDEATHSIG, so the daemon gets SIGKILL (and port 9966 is free again) and each launcher
SIGTERM, which it forwards to its workers and helpers. What survives: job A's workers and helper
once the story has killed their launcher (orphans: nothing of the demo is left to signal them;
`gpuwatch reap` or `kill` ends them), and the temporary directory (`gpuwatch-demo-*` in $TMPDIR).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TextIO, TypeVar

import gpuwatch
from gpuwatch.actions.signals import SAME, ProcessRef, Signaller
from gpuwatch.config import DEFAULT_PORT, split_listen
from gpuwatch.daemon_info import DaemonInfo
from gpuwatch.protocol import RUNTIME_DIR_VARIABLE
from gpuwatch.runtime_dir import DAEMON_INFO_NAME
from gpuwatch.simulate.fakenvml import STATE_ENV, FakeNode, FakeNvmlBuildError, build_fake_nvml
from gpuwatch.sinks.text import wrap_text
from gpuwatch.sources.processes import ProcessSource
from gpuwatch.units import plural
from gpuwatch.vocabulary import ProcState

T = TypeVar("T")
GIB = 1 << 30

#: What ends the demo besides --duration: Ctrl+C, `kill`, and its terminal closing.
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
#: How long the daemon gets to stop on SIGTERM before it is killed.
DAEMON_STOP_TIMEOUT = 10.0
#: How long the demo waits for what it killed to be gone.
GONE_TIMEOUT = 10.0
#: How long it keeps freezing what it started before it kills what it has frozen.
FREEZE_TIMEOUT = 2.0

# `python -I -c _WITH_DEATH_SIGNAL SIGNUM PARENT PROGRAM [ARG...]`: asks the kernel to send SIGNUM
# when PARENT (the demo) dies, even of a SIGKILL, then becomes PROGRAM (same PID). A wrapper rather
# than a preexec_fn: running Python between fork and exec is unsafe where the parent has threads
# (the tests run simulated_node in pytest's process). It also undoes the demo's blocking of its
# stop signals, which a child would otherwise inherit through exec. The kernel sends SIGNUM when
# the thread that started the child ends, so a node must be started from a thread that outlives it.
_WITH_DEATH_SIGNAL = f"""\
import ctypes, os, signal, sys
signum, parent = int(sys.argv[1]), int(sys.argv[2])
ctypes.CDLL(None, use_errno=True).prctl(1, signum, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    sys.exit(1)  # the parent died before prctl: no signal would ever come
signal.pthread_sigmask(signal.SIG_UNBLOCK, {sorted(int(s) for s in STOP_SIGNALS)})
os.execvp(sys.argv[3], sys.argv[3:])
"""

# The launcher under the name a real one has, so that ps and `gpuwatch status` show `torchrun` at
# the root of each job (a script run through its #! line takes the script's name as its comm).
_TORCHRUN = """\
#!{python}
import sys
sys.path.insert(0, {root!r})
from gpuwatch.simulate.job import main
sys.exit(main())
"""


class DemoError(RuntimeError):
    pass


class DemoStopped(BaseException):
    """A stop signal arrived. Like KeyboardInterrupt, out of reach of `except Exception`."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def wait_for(what: str, probe: Callable[[], Optional[T]], timeout: float,
             alive: Optional[subprocess.Popen[bytes]] = None,
             pause: Callable[[float], None] = time.sleep) -> T:
    """Poll `probe` until it returns something, failing clearly at the deadline. `pause` waits
    between probes (the demo's also watches for its stop signals)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value is not None:
            return value
        if alive is not None and alive.poll() is not None:
            raise DemoError(f"{what}: the process exited with code {alive.returncode}")
        pause(0.05)
    raise DemoError(f"{what}: not ready after {timeout:g} s")


def read_json(path: Path) -> Optional[dict[str, Any]]:
    """The JSON object in `path`, or None while it is not (completely) written yet."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _metrics_url(runtime: Path) -> Optional[str]:
    """Where the daemon of `runtime` serves /metrics, once its daemon.json is written."""
    doc = read_json(runtime / DAEMON_INFO_NAME)
    return DaemonInfo.from_json(doc).metrics_url if doc is not None else None


def free_listen(listen: str) -> str:
    """`listen` if its port is free, else the same host on a port the kernel picks."""
    host, port = split_listen(listen)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host or "0.0.0.0", port))
        except OSError:
            s.bind((host or "0.0.0.0", 0))
            return f"{host}:{s.getsockname()[1]}"
    return listen


# ---- processes by identity ---------------------------------------------------------------------


class StartedProcesses:
    """Every process a simulated node started, and every process those started, by identity
    (PID and start time: gpuwatch.actions.signals), so that a reused PID is never signalled."""

    def __init__(self) -> None:
        self._signals = Signaller()
        self._procs = ProcessSource()
        #: The node's own children: each is waited on, so none is left a zombie.
        self.children: list[subprocess.Popen[bytes]] = []
        #: PID -> identity of each process known to be ours, the children among them.
        self.known: dict[int, ProcessRef] = {}

    def spawn(self, args: Sequence[str], death_signal: int,
              **popen: Any) -> subprocess.Popen[bytes]:
        """Start `args` as a child that gets `death_signal` when this process dies."""
        proc = subprocess.Popen([sys.executable, "-I", "-c", _WITH_DEATH_SIGNAL,
                                 str(int(death_signal)), str(os.getpid()), *args], **popen)
        self.children.append(proc)
        # A child not yet waited on cannot have had its PID given to another process.
        ref = self._signals.ref(proc.pid)
        if ref is not None:
            self.known[proc.pid] = ref
        return proc

    def adopt_descendants(self) -> int:
        """Add every live descendant of a known live process; returns how many were new."""
        table = {pid: stat for pid in _pids() if (stat := self._procs.stat(pid)) is not None}
        children: dict[int, list[int]] = {}
        for pid, stat in table.items():
            children.setdefault(stat.ppid, []).append(pid)
        todo = [pid for pid, ref in self.known.items()
                if pid in table and table[pid].start_time == ref.start_time]
        added = 0
        while todo:
            for child in children.get(todo.pop(), ()):
                ref = ProcessRef(child, table[child].start_time)
                if self.known.get(child) != ref:
                    self.known[child] = ref
                    todo.append(child)
                    added += 1
        return added

    def still_running(self) -> list[int]:
        return sorted(pid for pid, ref in self.known.items()
                      if self._signals.state(ref) == SAME)

    def end_all(self, gracefully: Sequence[subprocess.Popen[bytes]] = ()) -> list[int]:
        """End them all: SIGTERM to `gracefully` (waiting for each), then SIGKILL to the rest,
        frozen first. Returns the PIDs still running after GONE_TIMEOUT (stuck in the kernel)."""
        self.adopt_descendants()
        for proc in gracefully:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(DAEMON_STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    proc.kill()
        # A process that runs can fork a child after the last look at its family and be killed
        # before that child is seen; stopped, it cannot. So: stop all, look again, until a look
        # finds nothing new and every one of them stopped (or the freeze runs out of time).
        freeze_until = time.monotonic() + FREEZE_TIMEOUT
        while True:
            added = self.adopt_descendants()
            thawed = [pid for pid in self.still_running()
                      if (stat := self._procs.stat(pid)) is not None
                      and stat.state not in (ProcState.STOPPED, ProcState.TRACING_STOP)]
            for pid in thawed:
                self._signals.send(self.known[pid], signal.SIGSTOP)
            if (not added and not thawed) or time.monotonic() >= freeze_until:
                break
            time.sleep(0.01)
        for pid in self.still_running():
            self._signals.send(self.known[pid], signal.SIGKILL)
        deadline = time.monotonic() + GONE_TIMEOUT
        for proc in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        while self.still_running() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.still_running()


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


# ---- the simulated node ------------------------------------------------------------------------


@dataclass
class SimulatedJob:
    #: The job's `torchrun`, a child of the node (the wrapper that started it became it).
    launcher: subprocess.Popen[bytes]
    workers: list[int]
    helpers: dict[str, int]
    #: TORCHELASTIC_RUN_ID of its workers.
    run_id: str = ""


@dataclass(frozen=True)
class Worker:
    """A worker of a simulated job: its launcher's child, not the node's."""
    pid: int


@dataclass
class SimulatedNode:
    work_dir: Path
    node: FakeNode
    #: Job A trains on; the story kills its launcher, orphaning its workers.
    training: SimulatedJob
    #: Job B's trainer finishes early and leaves its helpers running: leftovers.
    finishing: SimulatedJob
    #: Job C: one worker, a training loop instrumented with gpuwatch.agent whose fetch cache
    #: never lets go.
    instrumented: SimulatedJob
    daemon: subprocess.Popen[bytes]
    metrics_url: str
    processes: StartedProcesses = field(repr=False, default_factory=StartedProcesses)

    @property
    def runtime_dir(self) -> Path:
        return self.work_dir / "run"

    @property
    def leaking(self) -> Worker:
        """Job C's trainer, the process that leaks."""
        return Worker(self.instrumented.workers[0])


def _write_torchrun(work_dir: Path) -> list[str]:
    """The command that starts a launcher named `torchrun`."""
    script = work_dir / "bin" / "torchrun"
    script.parent.mkdir(parents=True, exist_ok=True)
    root = str(Path(gpuwatch.__file__).resolve().parent.parent)
    script.write_text(_TORCHRUN.format(python=sys.executable, root=root))
    script.chmod(0o755)
    # The kernel reads at most 255 bytes of a #! line, and splits no arguments out of it.
    if len(sys.executable) > 250 or any(c.isspace() for c in sys.executable):
        return [sys.executable, str(script)]
    return [str(script)]


def _run_id(name: str) -> str:
    # As a cluster names runs: the experiment, then something unique (torchrun's --rdzv-id).
    return f"{name}-{uuid.uuid4().hex[:6]}"


def _start_job(started: StartedProcesses, torchrun: list[str], work_dir: Path, name: str,
               run_id: str, pause: Callable[[float], None], *args: str,
               env: Optional[dict[str, str]] = None) -> SimulatedJob:
    ready = work_dir / f"{name}.json"
    # SIGTERM when the demo dies: the launcher forwards it to its workers and helpers.
    launcher = started.spawn([*torchrun, "--ready", str(ready), "--run-id", run_id, *args],
                             signal.SIGTERM, start_new_session=True, env=env)
    info = wait_for(f"simulated job {name}", lambda: read_json(ready), 20, alive=launcher,
                    pause=pause)
    started.adopt_descendants()
    return SimulatedJob(launcher, [int(p) for p in info["workers"]],
                        {role: int(pid) for role, pid in info.get("helpers", {}).items()},
                        run_id)


@contextlib.contextmanager
def simulated_node(work_dir: Path, listen: str = f"127.0.0.1:{DEFAULT_PORT}", gpus: int = 2,
                   workers: int = 2, interval: float = 1.0, pace: float = 5.0,
                   daemon_output: Optional[Any] = None, detectors: str = "",
                   pause: Callable[[float], None] = time.sleep) -> Iterator[SimulatedNode]:
    """Start the fake GPUs, three real jobs holding memory on them, and a daemon watching them;
    on the way out, end every process started here (see the module's docstring).

    `pace` is the story's unit of time: job B's trainer finishes after 3 units, and its helpers
    become leftovers 2 units later (the daemon's leftover grace); the leaking trainer takes five
    steps a unit. `detectors` adds lines to the daemon's [detectors] section. `pause` is how it
    waits while things start (see wait_for).
    """
    try:
        lib = build_fake_nvml()
    except FakeNvmlBuildError as exc:
        raise DemoError(str(exc)) from None
    node = FakeNode(work_dir / "nvml-state", lib, gpus=gpus)
    node.write()
    started = StartedProcesses()
    daemon: Optional[subprocess.Popen[bytes]] = None
    try:
        torchrun = _write_torchrun(work_dir)
        training = _start_job(started, torchrun, work_dir, "job-a", _run_id("pretrain-7b"),
                              pause, "--workers", str(workers), "--helpers", "dataloader")
        for rank, pid in enumerate(training.workers):
            node.hold(pid, device=rank % gpus, used=(12 + 2 * rank) * GIB)
        config = work_dir / "gpuwatch.toml"
        config.write_text(f"[detectors]\nleftover_grace = {2 * pace}\n{detectors}\n")
        runtime = work_dir / "run"
        env = node.env()
        env.setdefault("PYTHONUNBUFFERED", "1")
        # SIGKILL when the demo dies: nothing of the daemon must outlive it, its port least.
        daemon = started.spawn(
            [sys.executable, "-m", "gpuwatch", "daemon", "--config", str(config),
             "--listen", free_listen(listen), "--interval", str(interval),
             "--runtime-dir", str(runtime), "--state-dir", str(work_dir / "state")],
            signal.SIGKILL, env=env, stdout=daemon_output, stderr=daemon_output)
        metrics_url = wait_for("the daemon", lambda: _metrics_url(runtime), 30, alive=daemon,
                               pause=pause)
        # Job B starts once the daemon answers, and its trainer's 3 units are counted from when
        # it holds its GPU memory: the daemon must see that memory, or the helpers are no job's
        # leftovers (on a loaded machine, a daemon slow to start, or a job slow to get ready,
        # would otherwise miss the whole of the trainer's life).
        finishing = _start_job(started, torchrun, work_dir, "job-b", _run_id("rlhf"), pause,
                               "--workers", "1", "--helpers", "redis,actor,preprocessor",
                               "--trainer-exit-after", str(3 * pace),
                               "--trainer-exit-clock", "sigusr1")
        node.hold(finishing.workers[0], device=gpus - 1, used=20 * GIB)
        os.kill(finishing.workers[0], signal.SIGUSR1)
        # 2 MiB a step for 300 steps: visible, and bounded if the demo is left running.
        instrumented = _start_job(
            started, torchrun, work_dir, "job-c", _run_id("sft"), pause, "--workers", "1", "--",
            sys.executable, "-m", "gpuwatch.simulate.trainer", "--pattern", "leak",
            "--leak-mib", "2", "--noise-mib", "1", "--steps", "300", "--linger", "86400",
            "--step-seconds", str(pace / 5), env={**env, RUNTIME_DIR_VARIABLE: str(runtime)})
        node.hold(instrumented.workers[0], device=0, used=6 * GIB)
        yield SimulatedNode(work_dir, node, training, finishing, instrumented, daemon,
                            metrics_url, started)
    finally:
        left = started.end_all(gracefully=[daemon] if daemon is not None else [])
        if left:
            _say(f"gpuwatch demo: still running after SIGKILL (stuck in the kernel?): "
                 f"{' '.join(map(str, left))}", sys.stderr)


# ---- the demo ----------------------------------------------------------------------------------


def _say(text: str, stream: Optional[TextIO] = None) -> None:
    # The terminal may be gone (SIGHUP): losing a message must not stop the cleanup.
    with contextlib.suppress(OSError, ValueError):
        print(text, file=stream or sys.stdout, flush=True)


@contextlib.contextmanager
def _stop_signals() -> Iterator[Callable[[float], None]]:
    """Take the stop signals synchronously: blocked, and waited for by the `pause` yielded, which
    raises DemoStopped when one is pending. Handlers are installed too, because a disposition of
    SIG_IGN (inherited by a `cmd &` in a script, or from nohup) must not decide what stops it."""
    previous = {s: signal.signal(s, lambda *_: None) for s in STOP_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

    def pause(seconds: float) -> None:
        info = signal.sigtimedwait(STOP_SIGNALS, seconds)
        if info is not None:
            _say(f"\ngpuwatch demo: {signal.Signals(info.si_signo).name}: stopping its jobs "
                 "and its daemon", sys.stderr)
            raise DemoStopped(info.si_signo)

    try:
        yield pause
    finally:
        # What arrived while it was ending changes nothing any more.
        while signal.sigtimedwait(STOP_SIGNALS, 0) is not None:
            pass
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for s, handler in previous.items():
            if handler is not None:
                signal.signal(s, handler)


def _run(sim: SimulatedNode, args: list[str], env: dict[str, str],
         pause: Callable[[float], None]) -> int:
    proc = sim.processes.spawn(args, signal.SIGKILL, env=env)
    while proc.poll() is None:
        pause(0.05)
    return proc.returncode


def _reap(gpuwatch_cmd: list[str], sim: SimulatedNode, pause: Callable[[float], None]) -> None:
    """The end of the story: what an SRE (or a Slurm epilog) would run on the node."""
    env = {**sim.node.env(), RUNTIME_DIR_VARIABLE: str(sim.runtime_dir),
           "GPUWATCH_STATE_DIR": str(sim.work_dir / "state")}
    for args in (["reap", "--dry-run"], ["reap", "--yes", "--kind", "orphan", "--grace", "2"]):
        _say(f"\n$ gpuwatch {' '.join(args)}")
        _run(sim, [*gpuwatch_cmd, *args], env, pause)


def _play(work_dir: Path, listen: str, workers: int, duration: Optional[float], pace: float,
          pause: Callable[[float], None]) -> int:
    with simulated_node(work_dir, listen=listen, workers=workers, pace=pace,
                        pause=pause) as sim:
        beside = Path(sys.executable).with_name("gpuwatch")  # the venv's own script
        gpuwatch_cmd = [str(beside)] if beside.exists() else [sys.executable, "-m", "gpuwatch"]
        shown = " ".join(gpuwatch_cmd)
        a, b, c = sim.training, sim.finishing, sim.instrumented
        _say(f"""gpuwatch demo: no GPU needed. A simulated node: 2 GPUs behind a fake NVML driver,
three real jobs on them (each started by torchrun), watched by the real daemon \
(PID {sim.daemon.pid}).
  job A: launcher {a.launcher.pid}, workers {' '.join(map(str, a.workers))}, helper dataloader \
{a.helpers['dataloader']}; run {a.run_id}
  job B: launcher {b.launcher.pid}, trainer {b.workers[0]}, helpers \
{', '.join(f'{role} {pid}' for role, pid in b.helpers.items())}; run {b.run_id}
  job C: launcher {c.launcher.pid}, trainer {c.workers[0]}, instrumented with gpuwatch.agent; \
run {c.run_id}
         its fetch_buffer keeps every batch (2 MiB a step)

  metrics  {sim.metrics_url}

In another shell, this node's environment first (its fake NVML driver, its daemon's runtime and
state directories), so that every command there sees the node as the daemon does:
  {demo_environment(sim)}
  status   {shown} status
  JSON     {shown} status --json
  top      {shown} top
  doctor   {shown} doctor
  reap     {shown} reap --dry-run

What happens:
  after {3 * pace:g} s  job B's trainer finishes; {2 * pace:g} s later its helpers are leftovers
  after {4 * pace:g} s  job A's launcher is killed (kill -9): its workers become orphans
  after ~{4 * pace:g} s  job C's leak is named, with the buffer and the step it runs out at
  after {6 * pace:g} s  `gpuwatch reap --dry-run`, then `gpuwatch reap --yes --kind orphan`
Ctrl+C stops the demo and everything it started.""")
        started = time.monotonic()
        killed = reaped = False
        deadline = None if duration is None else started + duration
        while deadline is None or time.monotonic() < deadline:
            if sim.daemon.poll() is not None:
                # A Ctrl+C reaches the daemon too (same process group): then it is the Ctrl+C
                # that ends the demo, not the daemon.
                pause(0)
                _say(f"gpuwatch demo: the daemon exited with code {sim.daemon.returncode}",
                     sys.stderr)
                return 1
            if not killed and time.monotonic() - started >= 4 * pace:
                killed = True
                a.launcher.kill()
                a.launcher.wait()  # its exit status is ours to collect: no zombie of the demo's
                _say(f"gpuwatch demo: killed job A's launcher {a.launcher.pid}")
            if not reaped and time.monotonic() - started >= 6 * pace:
                reaped = True
                _reap(gpuwatch_cmd, sim, pause)
                _say(story_done(sim, duration, time.monotonic() - started, pause))
            pause(0.1)
    return 0


def demo_environment(sim: SimulatedNode) -> str:
    """The `export` line that gives another shell this node: the fake driver (without it,
    `doctor` and `status --poll` find no NVML library), the daemon's runtime directory (without
    it, `status` finds no daemon) and its state directory (the reap audit log)."""
    env = {"LD_LIBRARY_PATH": str(sim.node.lib_dir), STATE_ENV: str(sim.node.state_path),
           RUNTIME_DIR_VARIABLE: str(sim.runtime_dir),
           "GPUWATCH_STATE_DIR": str(sim.work_dir / "state")}
    return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())


def story_done(sim: SimulatedNode, duration: Optional[float], elapsed: float,
               pause: Callable[[float], None] = time.sleep) -> str:
    """What the story showed, as the daemon sees the node after its reap (its first poll
    since), and how to stop what is left of it."""
    from gpuwatch.serve.state_client import STATE_SOCKET_NAME, StateUnavailable, fetch_status

    since = time.time()

    def after_the_reap() -> Optional[dict[str, Any]]:
        try:
            doc = fetch_status(sim.runtime_dir / STATE_SOCKET_NAME)
        except StateUnavailable:
            return None
        return doc if doc.get("taken_at", 0) > since else None

    try:
        doc = wait_for("the daemon's poll after the reap", after_the_reap, 10, pause=pause)
    except DemoError as exc:
        shown = str(exc)
    else:
        kinds = [f["kind"] for f in doc["findings"]]
        orphans_left = sum(1 for k in kinds if k == "orphan")
        shown = (f"{plural(kinds.count('leftover'), 'leftover')} of job B, job A's orphans "
                 + ("reaped" if not orphans_left else f"reaped but {orphans_left} still there")
                 + (", job C's leak named with its buffer and the step it runs out at"
                    if "leak" in kinds else ", job C's leak not named yet (see `status`)"))
    stop = ("Ctrl+C stops the demo and everything it started" if duration is None else
            f"it stops by itself in {max(0.0, duration - elapsed):.0f} s, or at Ctrl+C, with "
            "everything it started")
    return "\n" + "\n".join(wrap_text(
        f"gpuwatch demo: story done: {shown}. The daemon and jobs B and C keep running for "
        f"status, top and doctor; {stop}.", 100))


def _keep_exit_quiet() -> None:
    # Python exits with status 120 when it cannot flush stdout at exit (the terminal is gone
    # after a SIGHUP); what is left to say then goes nowhere instead.
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        try:
            stream.flush()
        except (OSError, ValueError):
            with contextlib.suppress(OSError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, fd)
                os.close(devnull)


def run_demo(listen: str, workers: int, duration: Optional[float], pace: float = 5.0) -> int:
    """Play the story until `duration` runs out or a stop signal arrives, then end everything
    it started. Returns the exit status: 0 when `duration` ran out, 1 on an error, 128+N on
    signal N (130 on Ctrl+C, 143 on SIGTERM, 129 on SIGHUP), as a shell reports them."""
    try:
        with _stop_signals() as pause:
            work_dir = Path(tempfile.mkdtemp(prefix="gpuwatch-demo-"))
            try:
                return _play(work_dir, listen, workers, duration, pace, pause)
            except DemoStopped as exc:
                return 128 + exc.signum
            except DemoError as exc:
                _say(f"gpuwatch demo: {exc}", sys.stderr)
                return 1
            finally:
                shutil.rmtree(work_dir, ignore_errors=True)
    finally:
        _keep_exit_quiet()
