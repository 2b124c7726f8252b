"""The harness bench/soak.py and bench/chaos.py share, for any bench that runs the daemon under
load: the options both take (RunOptions), /metrics read as samples (parse_metrics, total), the
fake driver's state written by several threads (SharedNode), the process storm and the feed that
tells the driver about it (storm, StormFeed), /proc readers, the processes a run starts, all
ended on the way out (Processes, signal_all, collect), a sampler of the daemon's threads, RSS
and VmHWM (Sampler), its configuration file's [daemon] section, and the command line both
scripts take (run_arguments, console, unwind_on_signals)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from prometheus_client.parser import text_string_to_metric_families

from gpuwatch.simulate.fakenvml import FakeFailure, FakeNode, FakeProcess
from gpuwatch.sources.proc_stat import START_TIME, STATE, STIME, UTIME, parse_stat
from gpuwatch.subreaper import exited_children

GIB = 1 << 30
MIB = 1 << 20

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]


@dataclass
class RunOptions:
    """What a soak and a chaos run both take (each script has its own defaults)."""

    duration: float = 600.0
    interval: float = 0.25
    gpus: int = 4
    storm_rate: float = 200.0
    #: Share of the storm's processes registered as GPU holders while they live.
    storm_gpu_share: float = 0.05
    #: Seconds between two faults (min, max).
    fault_gap: tuple[float, float] = (3.0, 8.0)
    scrape_every: float = 1.0
    seed: int = 0
    #: None: a temporary directory, removed at the end.
    work_dir: Optional[Path] = None
    #: Where progress lines go.
    log: Callable[[str], None] = field(default=lambda line: None)


# ---- reading /metrics ----------------------------------------------------------------------------


def parse_metrics(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of every sample of `name` whose labels include `labels` (0 when none)."""
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))


# ---- the fake driver's state, shared by every thread that changes it -----------------------------


class SharedNode:
    """One FakeNode written by several threads (GPU holders, fault records): every change and its
    write under one lock."""

    def __init__(self, node: FakeNode) -> None:
        self.node = node
        self._lock = threading.Lock()

    def hold(self, pid: int, device: int, used: int) -> None:
        with self._lock:
            self.node.hold(pid, device, used)

    def release(self, *pids: int) -> None:
        with self._lock:
            gone = set(pids)
            self.node.processes = [p for p in self.node.processes if p.pid not in gone]
            self.node.write()

    def apply(self, held: list[FakeProcess], released: set[int]) -> None:
        """A batch of storm changes in one write."""
        with self._lock:
            self.node.processes = [p for p in self.node.processes if p.pid not in released]
            self.node.processes.extend(held)
            self.node.write()

    def fail(self, failure: FakeFailure) -> None:
        with self._lock:
            self.node.failures = [failure]
            self.node.write()

    def clear_failures(self) -> None:
        with self._lock:
            self.node.clear_failures()

    def add_failure(self, f: FakeFailure, keep: int = 0) -> None:
        """Add a fault record; with `keep`, only the newest `keep` transient ones stay (the
        older have run their course, or soon will)."""
        with self._lock:
            self.node.failures.append(f)
            transient = [x for x in self.node.failures if x.times is not None]
            if keep and len(transient) > keep:
                old = {id(x) for x in transient[:-keep]}
                self.node.failures = [x for x in self.node.failures if id(x) not in old]
            self.node.write()

    def clear_transient(self) -> None:
        with self._lock:
            self.node.failures = [x for x in self.node.failures if x.times is None]
            self.node.write()

    def remove_failure(self, f: FakeFailure) -> None:
        with self._lock:
            self.node.failures = [x for x in self.node.failures if x is not f]
            self.node.write()


# ---- the storm: short-lived processes, and the feed that tells the driver which hold GPU memory -


class Pacer:
    """`rate` events a second, for a loop that also does other work between them."""

    def __init__(self, rate: float, stopping: threading.Event) -> None:
        self.period = 1.0 / rate
        self.stopping = stopping
        self.next_at = time.monotonic()

    def due(self) -> int:
        """How many events are due now. A late wake-up catches up, but never by more than a
        second's worth in one go."""
        now = time.monotonic()
        self.next_at = max(self.next_at, now - 1.0)
        n = 0
        while self.next_at <= now:
            self.next_at += self.period
            n += 1
        return n

    def wait(self) -> None:
        """Until the next event is due (at most 10 ms, so the loop's other work keeps up)."""
        self.stopping.wait(max(0.0, min(0.01, self.next_at - time.monotonic())))


def storm(rate: float, gpu_share: float, gpus: int, seed: int,
          max_live: Optional[int] = None, env: Optional[dict[str, str]] = None,
          progress: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
    """Spawn `rate` short-lived processes a second (at most `max_live` alive) until SIGTERM;
    print `S PID` for each, `H PID DEVICE BYTES` for the GPU holders and `R PID` once a holder
    has exited, for the caller to tell the driver. Returns what it did, with how many children
    ended by a signal nobody here sent and its longest stall between turns; `progress` is given
    the same, so far, about once a second (a storm stopped before its end still says what it
    did, its stalls included)."""
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    rng = random.Random(seed)
    live: dict[int, bool] = {}
    spawned = holders = failed = capped = most_alive = 0
    signalled: dict[str, int] = {}
    out = sys.stdout
    pacer = Pacer(rate, stopping)
    began = last_turn = reported = time.monotonic()
    max_stall = stall_ended = 0.0

    def so_far() -> dict[str, Any]:
        return {"seconds": time.monotonic() - began, "max_stall": max_stall,
                "max_stall_ended": stall_ended,
                "spawned": spawned, "holders": holders, "spawn_failed": failed,
                "capped": capped, "max_live": most_alive, "signalled": signalled}

    def turn() -> float:
        """A turn begins: the longest stall between turns, and when it ended (s since began)."""
        nonlocal max_stall, stall_ended, last_turn
        now = time.monotonic()
        if now - last_turn > max_stall:
            max_stall, stall_ended = now - last_turn, now - began
        last_turn = now
        return now

    while not stopping.is_set():
        now = turn()
        if progress is not None and now - reported >= 1.0:
            progress(so_far())
            reported = now
        for _ in range(pacer.due()):
            if max_live is not None and len(live) >= max_live:
                capped += 1
                continue
            holder = rng.random() < gpu_share
            lifetime = rng.uniform(0.5, 2.0) if holder else rng.uniform(0.02, 0.5)
            try:
                pid = os.posix_spawn("/bin/sleep", ["sleep", f"{lifetime:.3f}"],
                                     os.environ if env is None else env)
            except OSError:
                failed += 1
                continue
            spawned += 1
            live[pid] = holder
            most_alive = max(most_alive, len(live))
            if holder:
                holders += 1
                out.write(f"H {pid} {rng.randrange(gpus)} {rng.randrange(1, 8) * GIB}\n")
            else:
                out.write(f"S {pid}\n")
        for pid, status in exited_children():
            if os.WIFSIGNALED(status):
                name = signal.Signals(os.WTERMSIG(status)).name
                signalled[name] = signalled.get(name, 0) + 1
            if live.pop(pid, False):
                out.write(f"R {pid}\n")
        out.flush()
        pacer.wait()
    turn()  # a stall that SIGTERM interrupted counts too
    signal_all(live)
    collect(live)
    return so_far()


class StormFeed(threading.Thread):
    """Applies the storm worker's holds and releases to the fake driver, a batch per write."""

    def __init__(self, proc: subprocess.Popen[str], node: SharedNode) -> None:
        super().__init__(name="storm-feed", daemon=True)
        self.proc, self.node = proc, node
        self.pids: set[int] = set()
        self.holders = 0

    def run(self) -> None:
        assert self.proc.stdout is not None
        held: list[FakeProcess] = []
        released: set[int] = set()
        last = time.monotonic()
        for line in self.proc.stdout:
            parts = line.split()
            if not parts:
                continue
            pid = int(parts[1])
            if parts[0] == "S":
                self.pids.add(pid)
            elif parts[0] == "H":
                self.pids.add(pid)
                self.holders += 1
                held.append(FakeProcess(device=int(parts[2]), pid=pid, used=int(parts[3])))
            elif parts[0] == "R":
                released.add(pid)
            if (held or released) and time.monotonic() - last >= 0.05:
                self.node.apply(held, released)
                held, released, last = [], set(), time.monotonic()


# ---- /proc and small files -----------------------------------------------------------------------


def _stat_fields(pid: int) -> Optional[list[bytes]]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return parse_stat(f.read())[1]
    except (OSError, ValueError):
        return None


def start_ticks(pid: int) -> Optional[int]:
    """When the process started, in clock ticks since boot: with the PID, who it is."""
    fields = _stat_fields(pid)
    try:
        return None if fields is None else int(fields[START_TIME])
    except (IndexError, ValueError):
        return None


def running(pid: int, ticks: Optional[int] = None) -> bool:
    """Alive and not a zombie; with `ticks`, still the same process (not a reused PID)."""
    fields = _stat_fields(pid)
    if fields is None or fields[STATE].decode() in ("Z", "X"):
        return False
    return ticks is None or start_ticks(pid) == ticks


def status_kib(pid: int, key: str) -> Optional[int]:
    """A kB line of /proc/PID/status (VmRSS, VmHWM)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def tasks(pid: int) -> Optional[int]:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return None


def cpu_seconds(pid: int) -> Optional[float]:
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[UTIME]) + int(fields[STIME])) / os.sysconf("SC_CLK_TCK")


def write_json(path: Path, payload: Any) -> None:
    """Written whole or not at all: a reader never sees half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def wait(what: str, probe: Callable[[], Any], timeout: float, step: float = 0.05) -> Any:
    """What `probe()` returns once it is true; TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(step)


# ---- the processes a run starts ------------------------------------------------------------------


class Processes:
    """Every process a run starts, ended on the way out whatever happened: by process group (each
    is started as a group leader), those it adopted (not its children: double-forked, orphaned)
    by PID with their start time checked, then by `empty` (chaos.py empties its cgroups).
    `wrap` rewrites each command line (chaos.py's moves it into a cgroup first); `defaults` are
    Popen's keywords for every process."""

    def __init__(self, wrap: Optional[Callable[[list[str]], list[str]]] = None,
                 empty: Optional[Callable[[], Any]] = None, **defaults: Any) -> None:
        self.wrap = wrap
        self.empty = empty
        self.defaults = {"start_new_session": True, **defaults}
        self.procs: list[subprocess.Popen[Any]] = []
        #: Processes not our children: PID -> start ticks.
        self.loose: dict[int, Optional[int]] = {}
        self.lock = threading.Lock()

    def start(self, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(self.wrap(argv) if self.wrap else argv,
                                **{**self.defaults, **kw})
        with self.lock:
            self.procs.append(proc)
        return proc

    def adopt(self, *pids: int) -> None:
        with self.lock:
            for pid in pids:
                self.loose[pid] = start_ticks(pid)

    def kill_all(self) -> None:
        with self.lock:
            procs, loose = list(self.procs), dict(self.loose)
        for proc in reversed(procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)  # its children go with it
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    proc.kill()
        for pid, ticks in loose.items():
            if ticks is not None and start_ticks(pid) == ticks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.empty is not None:
            self.empty()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


def signal_all(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    """`sig` to each of `pids` still there."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def collect(pids: Iterable[int]) -> None:
    """Wait for each of `pids`, children of this process, to end."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


# ---- watching the daemon -------------------------------------------------------------------------


class Sampler(threading.Thread):
    """Every `every` s, the threads (/proc/PID/task), RSS and VmHWM of the daemon `pid_of()`
    names (None: none now)."""

    def __init__(self, pid_of: Callable[[], Optional[int]], every: float,
                 stop: threading.Event) -> None:
        super().__init__(name="sampler", daemon=True)
        self.pid_of, self.every, self.stop = pid_of, every, stop
        self.started = time.monotonic()
        #: (seconds since the sampler was made, RSS in bytes)
        self.rss: list[tuple[float, int]] = []
        self.max_tasks = 0
        self.hwm_kib: dict[int, int] = {}
        self.samples = 0

    def run(self) -> None:
        while not self.stop.wait(self.every):
            pid = self.pid_of()
            n = None if pid is None else tasks(pid)
            if pid is None or n is None:
                continue
            self.samples += 1
            self.max_tasks = max(self.max_tasks, n)
            rss = status_kib(pid, "VmRSS")
            if rss is not None:
                self.rss.append((time.monotonic() - self.started, rss * 1024))
            hwm = status_kib(pid, "VmHWM")
            if hwm is not None:
                self.hwm_kib[pid] = max(self.hwm_kib.get(pid, 0), hwm)


def daemon_config(listen: str, interval: float, run_dir: Path, state_dir: Path,
                  nvml_retry_max: float) -> str:
    """The [daemon] section both runs give the daemon: everything in the file, nothing on the
    command line, so that a reload rereads all of it."""
    return (f'[daemon]\nlisten = "{listen}"\ninterval = {interval}\n'
            f'runtime_dir = "{run_dir}"\nstate_dir = "{state_dir}"\n'
            f"nvml_retry_max = {nvml_retry_max}\n")


def work_dir(given: Optional[Path], prefix: str) -> Path:
    """`given` (made if need be, and it must be empty: an earlier run's files would be read as
    this run's), or a new temporary directory."""
    if given is None:
        return Path(tempfile.mkdtemp(prefix=prefix))
    given.mkdir(parents=True, exist_ok=True)
    if any(given.iterdir()):
        raise ValueError(f"the work directory {given} is not empty")
    return given


# ---- the command line ----------------------------------------------------------------------------


def run_arguments(parser: argparse.ArgumentParser, seed: int, keep: str) -> None:
    """--seed, --keep DIR and --quiet, as both scripts take them."""
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help=f"work in DIR and keep it ({keep})")
    parser.add_argument("-q", "--quiet", action="store_true")


def console(quiet: bool) -> Callable[[str], None]:
    """A progress line on stderr, stamped with the seconds since the start (nothing if quiet)."""
    started = time.monotonic()

    def say(line: str) -> None:
        if not quiet:
            print(f"[{time.monotonic() - started:6.1f}] {line}", file=sys.stderr, flush=True)

    return say


def unwind_on_signals(hangup: bool = False) -> None:
    """Started in the background (`&` leaves SIGINT ignored) or stopped by a supervisor, a run
    must still end everything it started: each signal unwinds through its cleanup."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if hangup:
        signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
