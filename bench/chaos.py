"""Chaos: the daemon under its systemd unit's limits while everything goes wrong on its node.

    sudo python bench/chaos.py [--minutes 2] [--quick] [--figures FILE] [--seed N] [--keep DIR]

The daemon runs as the unit runs it, emulated where systemd is absent: as uid 65534 with exactly
CAP_KILL, CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH (`setpriv`: ambient capabilities, that bounding
set, no_new_privs), systemd's default open-file limit (`prlimit`), UMask=0077, MemoryMax=512M and
TasksMax=64 (a memory and a pids cgroup of its own, cgroup v1 or v2), its runtime and state
directories its own. Its configuration: polls every 0.5 s, auto-reap on (orphans, 2 s after they
are found, a 4 s grace), detectors.min_age 3 s (a restarted daemon, without history, names an
orphan from its environment sooner), NVML retried at most 2 s apart, /metrics on 127.0.0.1.

For N minutes, bounded and on this machine only, at once:
- NVML calls fail at random: every error code nvidia-ml-py defines, on the calls gpuwatch makes,
  each fault transient (the next 1 to 3 matching calls), injected through the fake driver;
- the driver disappears (every call answers DRIVER_NOT_LOADED) for a few seconds and returns;
- 500 short-lived processes a second come and go (at most 1,000 alive), some holding GPU memory;
- four users flood agent.sock from processes of their own: valid reports at the size limit from
  many processes (history, series), one report each from many idle processes (the agent slots),
  and fuzzed datagrams (mutations, wrong types, deep nesting, oversize, passed descriptors);
- 200 idle TCP connections sit on the metrics port, half of them in a request never finished;
- the state directory (a tmpfs of its own) is filled to the last byte for a few seconds;
- the daemon's wall clock jumps an hour forward and back, then an hour back and forward (an
  LD_PRELOAD library, gpuwatch/simulate/clockjump.c: this machine's clock is never touched);
- an orphaned job (two GPU workers of another user, one ignoring SIGTERM) is auto-reaped, the
  daemon is SIGKILLed as soon as the first SIGTERM lands, inside the grace, and started again.
Innocents run through all of it and must never be flagged nor signalled: a healthy job (a
launcher and two GPU workers, one instrumented with the agent), a GPU-holding service under PID 1
with no job, another user's plain service, and a service that collects its short GPU subprocesses
lazily (each defunct for 1.5 s, inside zombie_grace). Each records every signal it gets, and its
sender; the storm's and the flooding users' processes are watched for findings and signals too.

Figures, each against its goal: polls done and failed; scrapes answered (a scraper GETs /metrics
every 0.5 s on a connection of its own: 100%, except while the bench itself has the daemon
down); wrong findings and wrong signals (0); audit lines lost (0: every process the daemon ended
has its result in reap.jsonl, and every signal it sent is in a line of the daemon that sent it);
peak memory against MemoryMax; threads against TasksMax; crashes; NVML back after the driver
returned and after the faults stopped. Exit status 1 when a goal is missed, 0 when all are met
or when the bench cannot run here (not root, no setpriv, no cgroups: it says why).

Safety on a shared machine: every process the bench starts runs under a numeric uid of its own
(61700 and up, checked unused), and the daemon's configuration protects every user named in
/etc/passwd (`detectors.protected_users`), so that it never reports nor reaps a process the bench
did not start. Whatever ends the bench (the end of the run, an error, Ctrl+C, SIGTERM, SIGHUP),
it ends every process it started (each is in a cgroup of the bench's, which is emptied), unmounts
its tmpfs, removes its cgroups and its temporary directory. A bench killed with SIGKILL leaves
them; the next run removes what such a run left (their names carry its PID and start time).

The clock jumps are the daemon's alone: its wall-clock reads move, the kernel's boot time in
/proc/stat does not (a real step moves both). The daemon reads the boot time once, at start, so
this differs from a real step only for a daemon started during a jump, which the bench never does.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import http.client
import json
import os
import pwd
import random
import re
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))  # harness.py and node.py, imported as modules

import harness  # noqa: E402
import node  # noqa: E402
from cmdline import columns, verdict  # noqa: E402
from harness import (  # noqa: E402
    GIB,
    MIB,
    Processes,
    RunOptions,
    Sampler,
    Samples,
    SharedNode,
    StormFeed,
    console,
    daemon_config,
    parse_metrics,
    read_json,
    run_arguments,
    running,
    signal_all,
    start_ticks,
    storm,
    total,
    unwind_on_signals,
    wait,
    work_dir,
    write_json,
)

from gpuwatch.simulate.clockjump import ClockJump  # noqa: E402
from gpuwatch.simulate.fakenvml import (  # noqa: E402
    DRIVER_NOT_LOADED,
    STATE_ENV,
    FakeFailure,
    FakeNode,
    FakeNvmlBuildError,
    _find_compiler,
    build_fake_nvml,
)
from gpuwatch.simulate.job import launch_env  # noqa: E402
from gpuwatch.subreaper import exited_children  # noqa: E402

# ---- the unit's limits (systemd/gpuwatch.service) ----------------------------------------------

MEMORY_MAX = 512 * MIB
TASKS_MAX = 64
#: systemd's default for services (DefaultLimitNOFILE=1024:524288); the hard limit no higher
#: than the bench's own (raising it takes CAP_SYS_RESOURCE, which a container's root may lack).
NOFILE = (1024, 524288)
DAEMON_UID = 65534
CAPABILITIES = ("kill", "sys_ptrace", "dac_read_search")
#: Restart=on-failure, RestartSec=5: what the unit does after a crash.
RESTART_SEC = 5.0

#: The bench's own processes run as numeric uids from here (no passwd entry, checked unused).
ACTOR_UID_BASE = 61700
UIDS = {"healthy": 0, "gpu-service": 1, "plain-service": 2, "storm": 3, "victim": 4,
        "flood-memory": 5, "flood-slots": 6, "flood-fuzz": 7, "flood-mixed": 8,
        "lazy-parent": 9}
#: A finding's `user` label (a uid without a name shows as its number) -> the bench's role.
ROLE_OF_UID = {str(ACTOR_UID_BASE + offset): role for role, offset in UIDS.items()}
NAME = "gpuwatch-chaos"
CGROUP_ROOT = Path("/sys/fs/cgroup")
STATE_TMPFS_SIZE = 4 * MIB
#: detectors.zombie_grace as the bench leaves it (the default).
ZOMBIE_GRACE = 10.0

#: Signals a sentinel does not wait for: faults of its own, and the two no process can catch.
_UNWAITED = {signal.SIGKILL, signal.SIGSTOP, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE,
             signal.SIGILL, signal.SIGTRAP, signal.SIGSYS}


# ---- options -----------------------------------------------------------------------------------


@dataclass
class ChaosOptions(RunOptions):
    duration: float = 120.0
    interval: float = 0.5
    storm_rate: float = 500.0
    storm_max_live: int = 1000
    storm_gpu_share: float = 0.02
    #: Processes of the flooding users: valid reports at the size limit from `memory_reporters`
    #: processes (together `memory_rate` a second), one report each from `slot_processes` idle
    #: ones, fuzz from `fuzz_processes` (`fuzz_rate` a second), and `mixed_processes` sending
    #: both (`mixed_rate` a second).
    memory_reporters: int = 200
    memory_rate: float = 1500.0
    slot_processes: int = 600
    fuzz_processes: int = 4
    fuzz_rate: float = 800.0
    mixed_processes: int = 20
    mixed_rate: float = 400.0
    idle_connections: int = 200
    scrape_every: float = 0.5
    #: Seconds between two random NVML faults (min, max); the most kept in the fault table.
    fault_gap: tuple[float, float] = (0.2, 1.2)
    fault_records: int = 24
    driver_gone: float = 4.0
    state_full: float = 6.0
    clock_jump: float = 3600.0
    clock_hold: float = 5.0
    #: auto-reap settings: after how long an orphan is reaped, and the grace after SIGTERM.
    auto_after: float = 2.0
    grace: float = 4.0


def quick_options(**changes: Any) -> ChaosOptions:
    """About 45 s, at a third of the flood: the smoke run (`--quick`)."""
    base = dict(duration=40.0, memory_reporters=60, memory_rate=800.0, slot_processes=150,
                fuzz_processes=2, fuzz_rate=500.0, mixed_processes=8, mixed_rate=200.0,
                driver_gone=3.0, state_full=4.0, clock_hold=4.0)
    base.update(changes)
    return ChaosOptions(**base)


def smoke_options() -> ChaosOptions:
    """Every episode once, each as short as it goes, a tenth of the flood or less (and 50
    short-lived processes a second): does it run (`--smoke`)."""
    return quick_options(duration=15.0, memory_reporters=20, memory_rate=100.0, slot_processes=40,
                         fuzz_rate=50.0, mixed_processes=4, mixed_rate=20.0, driver_gone=1.5,
                         state_full=1.5, clock_hold=1.5)


# ---- small helpers -----------------------------------------------------------------------------


def _read_int(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _keyed(path: Path, key: str) -> Optional[int]:
    """The value of `key` in a flat keyed cgroup file (memory.events, pids.events, ...)."""
    try:
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == key:
                return int(parts[1])
    except (OSError, ValueError):
        pass
    return None


def _become(uid: int) -> None:
    """Drop root for `uid` (its own group, no others): a forked child turning into a local user."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _nvml_error_codes() -> dict[int, str]:
    """Every NVML_ERROR_* constant of the installed nvidia-ml-py, code -> name."""
    import pynvml

    return {value: name for name, value in sorted(vars(pynvml).items())
            if name.startswith("NVML_ERROR_") and type(value) is int and value != 0}


def _nvml_calls() -> list[str]:
    """The NVML functions gpuwatch calls (the nvidia-ml-py functions its NVML source names), as
    fault-table prefixes that also match their versioned symbols (nvmlDeviceGetCount* matches
    nvmlDeviceGetCount_v2)."""
    import pynvml

    text = (ROOT / "gpuwatch" / "sources" / "nvml.py").read_text()
    names = {n for n in re.findall(r"\b(nvml[A-Z][A-Za-z0-9_]*)\b", text)
             if callable(getattr(pynvml, n, None)) and not isinstance(getattr(pynvml, n), type)}
    names.discard("nvmlErrorString")  # returns a string, not an nvmlReturn_t
    calls = sorted({re.sub(r"_v\d+$", "", n) + "*" for n in names})
    return calls or ["nvmlInit*", "nvmlDeviceGetCount*", "nvmlDeviceGetHandleByIndex*",
                     "nvmlDeviceGetMemoryInfo*", "nvmlDeviceGetComputeRunningProcesses*"]


# ---- why it cannot run here --------------------------------------------------------------------


def uids_in_use() -> Optional[str]:
    """A process of someone else's already running under one of the bench's uids, or None."""
    mine = {str(ACTOR_UID_BASE + offset) for offset in UIDS.values()}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError), \
                open(f"/proc/{entry.name}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    if line.split()[1] in mine:
                        return f"PID {entry.name} already runs as uid {line.split()[1]}"
                    break
    return None


def uids_in_use_after(seconds: float) -> Optional[str]:
    """uids_in_use(), given `seconds` for the processes of a run that just ended to go: the
    kernel takes a moment to tear down what a cgroup's kill ended."""
    deadline = time.monotonic() + seconds
    while (why := uids_in_use()) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    return why


def cannot_run() -> Optional[str]:
    """Why the bench cannot run on this machine (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (to run the daemon as its unit's user, make cgroups and mount a tmpfs)"
    for tool in ("setpriv", "prlimit", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"no `{tool}` (util-linux) on PATH"
    try:
        _find_compiler()
    except FakeNvmlBuildError as exc:
        return str(exc)
    why = Cgroups.unavailable()
    if why is not None:
        return why
    for uid in range(ACTOR_UID_BASE, ACTOR_UID_BASE + len(UIDS)):
        try:
            return f"uid {uid} belongs to {pwd.getpwuid(uid).pw_name}: the bench needs its own"
        except KeyError:
            pass
    try:
        pwd.getpwuid(DAEMON_UID)
    except KeyError:
        return f"no user with uid {DAEMON_UID} to run the daemon as"
    return None


# ---- cgroups: MemoryMax and TasksMax for the daemon, a net for everything else -----------------


class Cgroups:
    """`<name>/daemon` (the unit's MemoryMax and TasksMax) and `<name>/actors` (every other
    process the bench starts, so that none can escape its end), in the v1 memory and pids
    hierarchies or in the unified one."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = ""
        self.dirs: list[Path] = []  # every directory made, parents first
        self.daemon_procs: list[Path] = []
        self.actor_procs: list[Path] = []
        self.memory: Optional[Path] = None
        self.pids: Optional[Path] = None

    @staticmethod
    def _v2_ready() -> bool:
        try:
            controllers = (CGROUP_ROOT / "cgroup.subtree_control").read_text().split()
        except OSError:
            return False
        return {"memory", "pids"} <= set(controllers)

    @staticmethod
    def _v1_ready() -> bool:
        return all((CGROUP_ROOT / h / "cgroup.procs").exists()
                   and not (CGROUP_ROOT / h / "cgroup.controllers").exists()
                   for h in ("memory", "pids"))

    @classmethod
    def unavailable(cls) -> Optional[str]:
        if cls._v1_ready() or cls._v2_ready():
            return None
        return (f"no memory and pids cgroup controllers to use under {CGROUP_ROOT} (cgroup v1 "
                "hierarchies, or v2 with both enabled in the root's cgroup.subtree_control)")

    def _mkdir(self, path: Path) -> Path:
        path.mkdir()
        self.dirs.append(path)
        return path

    def create(self) -> None:
        if self._v1_ready():
            self.mode = "cgroup v1"
            self.memory = self._mkdir(CGROUP_ROOT / "memory" / self.name)
            (self.memory / "memory.limit_in_bytes").write_text(str(MEMORY_MAX))
            pids = self._mkdir(CGROUP_ROOT / "pids" / self.name)
            self.pids = self._mkdir(pids / "daemon")
            (self.pids / "pids.max").write_text(str(TASKS_MAX))
            actors = self._mkdir(pids / "actors")
            self.daemon_procs = [self.memory / "cgroup.procs", self.pids / "cgroup.procs"]
            self.actor_procs = [actors / "cgroup.procs"]
        else:
            self.mode = "cgroup v2"
            top = self._mkdir(CGROUP_ROOT / self.name)
            (top / "cgroup.subtree_control").write_text("+memory +pids")
            daemon = self._mkdir(top / "daemon")
            (daemon / "memory.max").write_text(str(MEMORY_MAX))
            if (daemon / "memory.swap.max").exists():
                (daemon / "memory.swap.max").write_text("0")
            (daemon / "pids.max").write_text(str(TASKS_MAX))
            actors = self._mkdir(top / "actors")
            self.memory = self.pids = daemon
            self.daemon_procs = [daemon / "cgroup.procs"]
            self.actor_procs = [actors / "cgroup.procs"]

    # -- what they measured ----------------------------------------------------------------
    def peak_memory(self) -> Optional[int]:
        if self.memory is None:
            return None
        name = "memory.max_usage_in_bytes" if self.mode == "cgroup v1" else "memory.peak"
        return _read_int(self.memory / name)

    def oom_kills(self) -> Optional[int]:
        if self.memory is None:
            return None
        if self.mode == "cgroup v1":
            return _keyed(self.memory / "memory.oom_control", "oom_kill")
        return _keyed(self.memory / "memory.events", "oom_kill")

    def memory_limit_hits(self) -> Optional[int]:
        if self.memory is None:
            return None
        if self.mode == "cgroup v1":
            return _read_int(self.memory / "memory.failcnt")
        return _keyed(self.memory / "memory.events", "max")

    def tasks_limit_hits(self) -> Optional[int]:
        """Forks and thread creations the pids limit refused."""
        return None if self.pids is None else _keyed(self.pids / "pids.events", "max")

    # -- the end ---------------------------------------------------------------------------
    def empty(self, timeout: float = 10.0) -> list[int]:
        """SIGKILL every process left in the bench's cgroups until none is left; the PIDs that
        would not go."""
        deadline = time.monotonic() + timeout
        while True:
            left: set[int] = set()
            for procs in {*self.daemon_procs, *self.actor_procs}:
                with contextlib.suppress(OSError, ValueError):
                    left.update(int(x) for x in procs.read_text().split())
            left.discard(0)  # cgroup v2's member outside this PID namespace: kill(0) is ours
            signal_all(left)
            if not left or time.monotonic() >= deadline:
                return sorted(left)
            time.sleep(0.1)

    def remove(self) -> list[str]:
        problems = []
        self.empty()
        for path in reversed(self.dirs):
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)  # a member just killed may take a moment to leave
            else:
                problems.append(f"cannot remove {path}")
        return problems


def pid_namespace() -> int:
    """The inode of this process's PID namespace (0 where it cannot be read): a PID and its
    start time name a process only inside its namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner_tag() -> str:
    """This process, as the names of what the bench makes carry it: PID, start time and PID
    namespace (cgroups are the host's: two benches in two PID namespaces may share a PID)."""
    return f"{os.getpid()}-{start_ticks(os.getpid())}-{pid_namespace()}"


def clean_stale(say: Callable[[str], None]) -> None:
    """Remove what an earlier bench killed with SIGKILL left: its cgroups and its tmpfs, whose
    names carry the PID, start time and PID namespace of the bench that made them. Only those of
    a bench of this PID namespace that is gone (another one running at the same time keeps its
    own, and one of another namespace cannot be judged from here)."""
    own_namespace = pid_namespace()

    def gone(pid: str, ticks: str, namespace: str) -> bool:
        return int(namespace) == own_namespace and not running(int(pid), int(ticks))

    pattern = re.compile(rf"^{NAME}-(\d+)-(\d+)-(\d+)$")
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        mounts = []
    for line in mounts:
        parts = line.split()
        if len(parts) < 3 or parts[2] != "tmpfs":
            continue
        target = Path(parts[1].replace("\\040", " "))
        m = re.match(rf"^{NAME}-(\d+)-(\d+)-(\d+)-", target.parent.name)
        if target.name == "state" and m and gone(*m.groups()):
            subprocess.run(["umount", "-l", str(target)], check=False, capture_output=True)
            shutil.rmtree(target.parent, ignore_errors=True)
            say(f"removed the tmpfs {target} of an earlier run")
    for top in (CGROUP_ROOT / "memory", CGROUP_ROOT / "pids", CGROUP_ROOT):
        with contextlib.suppress(OSError):
            for entry in top.iterdir():
                m = pattern.match(entry.name)
                if not m or not entry.is_dir() or not gone(*m.groups()):
                    continue
                stale = Cgroups(entry.name)
                stale.dirs = sorted({p for p in [entry, *entry.glob("**/")] if p.is_dir()},
                                    key=lambda p: len(p.parts))
                stale.actor_procs = [p / "cgroup.procs" for p in stale.dirs]
                for problem in stale.remove():
                    say(f"stale cgroup: {problem}")
                say(f"removed the cgroup {entry} of an earlier run")


# ---- the processes the bench starts ------------------------------------------------------------


def in_cgroups(procs_files: list[Path], argv: list[str], umask: Optional[str] = None
               ) -> list[str]:
    """`argv`, started by a shell that first moves itself into the cgroups."""
    script = "".join(f'echo $$ > "{p}" || exit 97; ' for p in procs_files)
    if umask is not None:
        script += f"umask {umask}; "
    return ["/bin/sh", "-c", script + 'exec "$@"', "sh", *argv]


def as_user(uid: int, argv: list[str]) -> list[str]:
    """`argv` as `uid` (and its own group). CAP_DAC_READ_SEARCH only so that the interpreter,
    which may live under /root, can be read: it lets the process read files, not signal."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", "--", *argv]


def nofile() -> tuple[int, int]:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return NOFILE
    return min(NOFILE[0], hard), min(NOFILE[1], hard)


def _python(*args: str) -> list[str]:
    return [sys.executable, str(HERE), *args]


# ---- the sentinel: an innocent (or a victim) that records every signal it gets -------------------


def _waited_signals() -> set[int]:
    return {s for s in signal.valid_signals() if s not in _UNWAITED}


def _log_line(fd: int, payload: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(payload) + "\n").encode())


def _sentinel_loop(log: Path, on_term: str, reap_children: bool) -> None:
    """Wait for signals for ever, writing each (its number and sender) to `log`. SIGTERM ends
    the process with `on_term == "exit"`; otherwise it is recorded and ignored, as by a worker
    stuck in a collective. SIGCHLD only makes it collect its children, recording how they
    ended."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    waited = _waited_signals()
    signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    while True:
        info = signal.sigwaitinfo(waited)
        if info.si_signo == signal.SIGCHLD:
            if reap_children:
                for pid, status in exited_children():
                    _log_line(fd, {"child": pid, "status": status, "at": time.time()})
            continue
        _log_line(fd, {"signal": info.si_signo, "name": signal.Signals(info.si_signo).name,
                       "pid": info.si_pid, "uid": info.si_uid, "at": time.time()})
        if info.si_signo == signal.SIGTERM and on_term == "exit":
            os._exit(0)


def _step_agent() -> None:
    """A training loop as the agent sees it: a step every 0.1 s, memory steady."""
    from gpuwatch import agent

    batches = [b"\x01" * 65536 for _ in range(16)]
    agent.watch("batch_queue", batches)
    step = 0
    while True:
        agent.step(step)
        step += 1
        time.sleep(0.1)


def _sentinel_main(a: argparse.Namespace) -> int:
    # Blocked before any thread starts, so that each inherits the mask: signals go to
    # sigwaitinfo in the main thread only.
    signal.pthread_sigmask(signal.SIG_BLOCK, _waited_signals())
    if a.agent:
        threading.Thread(target=_step_agent, name="train", daemon=True).start()
    if a.ready:
        write_json(Path(a.ready), {"pid": os.getpid()})
    _sentinel_loop(Path(a.log), a.on_term, reap_children=False)
    return 0


def _launcher_main(a: argparse.Namespace) -> int:
    """A launcher as torchrun is one: workers with the distributed-launch variables, in its
    process group; then it waits, recording signals and collecting its workers."""
    folder = Path(a.dir)
    workers = []
    for rank in range(a.workers):
        argv = [sys.executable, str(HERE), "_sentinel",
                "--log", str(folder / f"{a.name}-worker{rank}.jsonl"),
                "--ready", str(folder / f"{a.name}-worker{rank}.ready"),
                "--on-term", "exit" if rank in a.exit_on_term else "record"]
        if rank == a.agent_rank:
            argv.append("--agent")
        env = launch_env(rank, a.workers, a.run_id, dict(os.environ))
        workers.append(subprocess.Popen(argv, env=env))
    pids = wait("the workers", lambda: [
        (read_json(folder / f"{a.name}-worker{r}.ready") or {}).get("pid")
        for r in range(a.workers)] if all(
        (folder / f"{a.name}-worker{r}.ready").exists() for r in range(a.workers)) else None, 60)
    write_json(Path(a.ready), {"launcher": os.getpid(), "workers": pids})
    _sentinel_loop(folder / f"{a.name}-launcher.jsonl", "record", reap_children=True)
    return 0


def _service_main(a: argparse.Namespace) -> int:
    """A service as a daemon starts one: fork, setsid, fork; it ends up under PID 1 (or the
    nearest subreaper), with no job."""
    ready = Path(a.ready)
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1):
            os.dup2(null, fd)
        write_json(ready, {"pid": os.getpid()})
        try:
            _sentinel_loop(Path(a.log), "record", reap_children=False)
        finally:
            os._exit(1)
    os.waitpid(child, 0)
    wait("the service", lambda: ready.exists(), 30)
    return 0


# ---- the storm: short-lived processes, bounded -------------------------------------------------


def _storm_main(a: argparse.Namespace) -> int:
    """harness.storm as `uid`, at most `max_live` alive. At SIGTERM, writes how many were spawned
    and how many ended by a signal nobody here sent (a wrong signal)."""
    _become(a.uid)
    report = Path(a.report)
    write_json(report, storm(a.rate, a.gpu_share, a.gpus, a.seed, max_live=a.max_live,
                             env={"PATH": "/usr/bin:/bin"},
                             progress=lambda so_far: write_json(report, so_far)))
    return 0


def _lazy_parent_main(a: argparse.Namespace) -> int:
    """A service that runs GPU work as short subprocesses and collects them on its own schedule:
    a child a second, each holding GPU memory for 1.5 s, collected 1.5 s after it exits.
    Defunct for 1.5 s each time, well inside detectors.zombie_grace (10 s): never a zombie
    finding. Prints harness.StormFeed's lines for the fake driver."""
    _become(a.uid)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    rng = random.Random(a.seed)
    env = {"PATH": "/usr/bin:/bin"}
    children: list[tuple[float, int]] = []
    while not stopping.wait(1.0):
        pid = os.posix_spawn("/bin/sleep", ["sleep", "1.5"], env)
        children.append((time.monotonic(), pid))
        print(f"H {pid} {rng.randrange(a.gpus)} {GIB}", flush=True)
        while children and time.monotonic() - children[0][0] >= 3.0:
            _, pid = children.pop(0)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            print(f"R {pid}", flush=True)
    harness.collect(pid for _, pid in children)
    return 0


# ---- the flood: users sending to agent.sock ----------------------------------------------------


def _buffer_name(i: int) -> str:
    return (f"chaos.buffer.{i:02d}." + "p" * 64)[:64]


def _discovered_name(i: int) -> str:
    return (f"chaos.module.Registry{i}.entries." + "d" * 128)[:128]


def valid_report(seq: int, step: int, pid_salt: int, size: int = 16_000) -> bytes:
    """A valid step report at (about) `size` bytes: 64 buffers and 8 discovered containers, all
    steady (no leak to find), padded with a key the protocol ignores."""
    doc: dict[str, Any] = {
        "v": 1, "kind": "step", "seq": seq, "step": step, "rss": 512 * MIB + pid_salt,
        "cuda": {"allocated": GIB, "reserved": 2 * GIB, "active": GIB, "allocations": 100},
        "buffers": {_buffer_name(i): {"items": 1000 + i, "bytes": (i + 1) * MIB}
                    for i in range(64)},
        "discovered": {_discovered_name(i): {"items": 10 * i, "bytes": i * 4096}
                       for i in range(8)},
    }
    body = json.dumps(doc, separators=(",", ":"))
    room = size - len(body) - len(',"pad":""')
    if room > 0:
        body = body[:-1] + ',"pad":"' + "x" * room + '"}'
    return body.encode()


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value of any type; long containers only at the top (a few thousand values at
    most in all)."""
    kind = rng.randrange(9 if depth < 4 else 6)
    sizes = (0, 1, 3, 9, 17, 70) if depth == 0 else (0, 1, 3)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, 1, -1, 2**63 - 1, 2**63, 2**64, -(2**63), rng.randrange(10**6)])
    if kind == 3:
        return rng.choice([0.5, -0.0, float("nan"), float("inf"), float("-inf"), 1e308])
    if kind == 4:
        alphabet = "ab_./:-<>\x00\x1f\x7f\u00e9\u2028\ud7ff\U0001f600 \"\\"
        return "".join(rng.choice(alphabet) for _ in range(rng.choice([0, 1, 8, 65, 129, 300])))
    if kind == 5:
        return rng.choice(["step", "finished", "exit", "trace", "done", "refused", "failed", ""])
    if kind == 6:
        return [_random_value(rng, depth + 1) for _ in range(rng.choice(sizes))]
    return {str(_random_value(rng, depth + 1))[:80]: _random_value(rng, depth + 1)
            for _ in range(rng.choice(sizes))}


def fuzz_datagram(rng: random.Random, seq: int) -> bytes:
    """One datagram for the agent socket's parser to survive: random bytes, a valid report
    mutated (bits flipped, cut short, a field given another type or value), deep nesting, huge
    numbers, NaN, oversize, invalid UTF-8, malformed trace and exit reports."""
    base: dict[str, Any] = {"v": 1, "kind": "step", "seq": seq, "step": seq, "rss": 64 * MIB,
                            "buffers": {"queue": {"items": seq % 8, "bytes": 4096}}}
    encoded = json.dumps(base).encode()
    k = rng.randrange(12)
    if k == 0:
        return rng.randbytes(rng.choice([0, 1, 7, 100, 4000, 16_384, 16_385, 30_000]))
    if k == 1:
        data = bytearray(encoded)
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    if k == 2:
        return encoded[:rng.randrange(len(encoded))]
    if k == 3:
        depth = rng.choice([100, 1000, 5000])
        return rng.choice([b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth,
                           b'{"v":1,"kind":"step","step":1,"buffers":' + b"[" * depth])
    if k == 4:
        digits = "9" * rng.choice([19, 20, 400, 5000])
        return f'{{"v":1,"kind":"step","seq":{digits},"step":{digits}}}'.encode()
    if k == 5:
        token = rng.choice(["NaN", "Infinity", "-Infinity", "1e400", "-0", "1.5", "true"])
        key = rng.choice(["v", "seq", "step", "rss"])
        doc = json.dumps(base).replace(f'"{key}": ', f'"{key}": {token}, "_{key}": ', 1)
        return doc.encode()
    if k == 6:
        doc = dict(base)
        path = rng.choice(["v", "kind", "seq", "step", "rss", "cuda", "buffers", "discovered",
                           "exit", "trace", "buffers.queue", "buffers.queue.items"])
        target = doc
        *parents, last = path.split(".")
        for p in parents:
            target[p] = dict(target[p])
            target = target[p]
        target[last] = _random_value(rng)
        return json.dumps(doc).encode()
    if k == 7:
        return json.dumps({**base, "pad": "x" * rng.choice([16_300, 16_400, 40_000])}).encode()
    if k == 8:
        return rng.choice([b'{"v":1,"kind":"step","step":1,"buffers":{"\xff\xfe":{}}}',
                           b'{"v":1,"kind":"step","step":1,"buffers":{"\\ud800":{"items":1}}}',
                           b'\xef\xbb\xbf{"v":1,"kind":"step","step":1}',
                           b'{"v":1,"kind":"st\x00ep","step":1}'])
    if k == 9:
        trace = {"status": rng.choice(["done", "refused", "failed", "other", 1]),
                 "why": _random_value(rng), "steps": _random_value(rng),
                 "sites": [{"file": _random_value(rng), "line": _random_value(rng),
                            "bytes": _random_value(rng), "count": _random_value(rng)}
                           for _ in range(rng.choice([0, 1, 9]))],
                 "traceback": _random_value(rng)}
        return json.dumps({"v": 1, "kind": "trace", "seq": seq, "trace": trace}).encode()
    if k == 10:
        exit_report = {"threads": [_random_value(rng) for _ in range(rng.choice([0, 2, 65]))],
                       "executors": _random_value(rng), "process_group": _random_value(rng)}
        return json.dumps({"v": 1, "kind": "exit", "seq": seq, "exit": exit_report}).encode()
    buffers = {rng.choice(["ok", "bad name", "x" * 65, "", "\u00e9", "a/b:c-d.e_f"]):
               _random_value(rng) for _ in range(rng.choice([1, 3, 65]))}
    return json.dumps({**base, "buffers": buffers}).encode()


def _reporter(role: str, rate: float, sock_path: str, stop_path: str, stats_fd: int,
              seed: int) -> None:
    """One flooding process: sends as itself until SIGTERM, then writes its counts. A SIGTERM
    that comes before the bench's stop file exists is someone else's: recorded as such."""
    flags = {"stopping": False, "unexpected": False}

    def on_term(*_: Any) -> None:
        flags["stopping"] = True
        if not os.path.exists(stop_path):
            flags["unexpected"] = True

    signal.signal(signal.SIGTERM, on_term)
    rng = random.Random(seed)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    counts: Counter[str] = Counter()
    null_fd = os.open(os.devnull, os.O_RDONLY)
    pid = os.getpid()

    def send(payload: bytes, pass_fd: bool = False) -> None:
        try:
            if pass_fd:
                sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                          struct.pack("i", null_fd))], socket.MSG_DONTWAIT,
                             sock_path)
            else:
                sock.sendto(payload, socket.MSG_DONTWAIT, sock_path)
        except BlockingIOError:
            counts["queue_full"] += 1
        except (FileNotFoundError, ConnectionRefusedError):
            counts["unreachable"] += 1
        except OSError as exc:
            counts["too_big" if exc.errno == errno.EMSGSIZE else "send_error"] += 1
        else:
            counts["sent"] += 1

    step = 0
    if role == "slots":
        send(json.dumps({"v": 1, "kind": "step", "seq": 0, "step": 0, "rss": 32 * MIB}).encode())
        counts["valid"] += 1
        while not flags["stopping"]:
            time.sleep(0.5)
    else:
        period = 1.0 / rate
        next_at = time.monotonic() + rng.uniform(0, period)
        while not flags["stopping"]:
            now = time.monotonic()
            if now < next_at:
                time.sleep(min(next_at - now, 0.5))
                continue
            next_at = max(next_at + period, now - 1.0)
            step += 1
            fuzz = role == "fuzz" or (role == "mixed" and rng.random() < 0.5)
            if fuzz:
                counts["fuzz"] += 1
                pass_fd = rng.random() < 0.05
                counts["passed_fd"] += pass_fd
                send(fuzz_datagram(rng, step), pass_fd)
            else:
                counts["valid"] += 1
                send(valid_report(step, step, pid % 4096))
    counts["unexpected_sigterm"] += flags["unexpected"]
    os.write(stats_fd, (json.dumps({"pid": pid, **counts}) + "\n").encode())
    os._exit(3 if flags["unexpected"] else 0)


def _flood_user(user: dict[str, Any], sock_path: str, folder: Path, stop_path: str,
                seed: int) -> None:
    """A local user (a forked child that setuid()s): its reporting processes, watched until the
    bench stops them; a reporter ended by any signal before that was signalled by someone else."""
    _become(user["uid"])
    stopping = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stopping.update(now=True))
    stats_fd = os.open(folder / f"{user['role']}-stats.jsonl",
                       os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    children: dict[int, int] = {}
    per_process = user["rate"] / max(1, user["processes"])
    for i in range(user["processes"]):
        pid = os.fork()
        if pid == 0:
            try:
                _reporter(user["role"], per_process, sock_path, stop_path, stats_fd,
                          seed * 100_003 + i)
            finally:
                os._exit(1)
        children[pid] = i
    write_json(folder / f"{user['role']}-ready.json",
                {"pids": sorted(children), "user": os.getpid()})
    early: list[dict[str, Any]] = []
    exits: Counter[str] = Counter()

    def collect(block: bool) -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            children.pop(pid, None)
            how = (signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status)
                   else f"exit {os.WEXITSTATUS(status)}")
            exits[how] += 1
            if not stopping["now"]:
                early.append({"pid": pid, "how": how})

    while not stopping["now"]:
        collect(block=False)
        time.sleep(0.2)
    signal_all(list(children), signal.SIGTERM)
    deadline = time.monotonic() + 20
    while children and time.monotonic() < deadline:
        collect(block=False)
        time.sleep(0.05)
    signal_all(list(children))
    collect(block=True)
    write_json(folder / f"{user['role']}-report.json",
                {"early": early, "exits": dict(exits)})


def _flood_main(a: argparse.Namespace) -> int:
    plan = json.loads(Path(a.plan).read_text())
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    children = []
    for n, user in enumerate(plan["users"]):
        pid = os.fork()
        if pid == 0:
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                _flood_user(user, plan["socket"], Path(user["dir"]), plan["stop"],
                            plan["seed"] + n)
            finally:
                os._exit(0)
        children.append(pid)
    while not stopping.wait(0.5):
        pass
    Path(plan["stop"]).touch()
    signal_all(children, signal.SIGTERM)
    harness.collect(children)
    return 0


# ---- the daemon, as its unit runs it -----------------------------------------------------------


@dataclass
class Incarnation:
    n: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    started: float
    serving: Optional[float] = None
    ended: Optional[float] = None
    #: "killed by the bench", "crashed: ...", "stopped"
    end: str = ""
    expected_end: bool = False

    @property
    def pid(self) -> int:
        return self.proc.pid


class DaemonRunner:
    """Starts the daemon, restarts it after a crash as Restart=on-failure would, and kills it
    when the bench asks (the scrapes missed while the bench has it down are excused)."""

    def __init__(self, c: Chaos) -> None:
        self.c = c
        self.incarnations: list[Incarnation] = []
        self.lock = threading.RLock()
        #: Set while the bench itself has the daemon down (between its SIGKILL and the new one
        #: serving): the scraper and the connection holder wait.
        self.restarting = threading.Event()
        #: (from, to) monotonic windows the bench had the daemon down.
        self.excused: list[tuple[float, float]] = []
        self.crashes: list[str] = []

    @property
    def current(self) -> Optional[Incarnation]:
        return self.incarnations[-1] if self.incarnations else None

    def pids(self) -> set[int]:
        return {i.pid for i in self.incarnations}

    def argv(self) -> list[str]:
        caps = ",".join(f"+{c}" for c in CAPABILITIES)
        limits = ["prlimit", f"--nofile={nofile()[0]}:{nofile()[1]}", "--"]
        setpriv = ["setpriv", f"--reuid={DAEMON_UID}", f"--regid={DAEMON_UID}",
                   "--clear-groups", f"--inh-caps={caps}", f"--ambient-caps={caps}",
                   f"--bounding-set=-all,{caps}", "--no-new-privs", "--"]
        daemon = [sys.executable, "-m", "gpuwatch", "daemon", "--config", str(self.c.config)]
        return in_cgroups(self.c.cgroups.daemon_procs, [*limits, *setpriv, *daemon],
                                    umask="077")

    def start(self, timeout: float = 90.0) -> Incarnation:
        with self.lock:
            n = len(self.incarnations) + 1
            log_path = self.c.work / f"daemon-{n}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(self.argv(), env=self.c.daemon_env, stdout=log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, cwd="/")
            inc = Incarnation(n, proc, log_path, time.monotonic())
            self.incarnations.append(inc)
        info = self.c.run_dir / "daemon.json"

        def serving() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {proc.returncode} while starting: "
                                   + log_path.read_text(errors="replace")[-2000:])
            if (read_json(info) or {}).get("pid") != proc.pid:
                return False
            return self.c.probe()

        wait("the daemon serving /metrics", serving, timeout, step=0.1)
        inc.serving = time.monotonic()
        self.c.say(f"daemon {n} (PID {proc.pid}) serving {self.c.metrics_url}")
        return inc

    def kill_and_restart(self, why: str) -> tuple[Incarnation, Incarnation]:
        """SIGKILL the daemon now and start it again: the bench's own doing, excused."""
        with self.lock:
            old = self.current
            assert old is not None
            self.restarting.set()
            down = time.monotonic()
            old.expected_end = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(old.pid, signal.SIGKILL)
            old.proc.wait()
            old.ended = time.monotonic()
            old.end = f"SIGKILLed by the bench ({why})"
            try:
                with self.c.faults.quiet():
                    new = self.start()
            finally:
                self.excused.append((down, time.monotonic()))
                self.restarting.clear()
        return old, new

    def check(self) -> None:
        """A daemon that died on its own is a crash: recorded, and restarted after RestartSec."""
        with self.lock:
            inc = self.current
            if inc is None or inc.expected_end or inc.proc.poll() is None:
                return
            code = inc.proc.returncode
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
            oom = self.c.cgroups.oom_kills()
            inc.ended = time.monotonic()
            inc.end = f"crashed: {how}" + (f" (cgroup OOM kills so far: {oom})" if oom else "")
            inc.expected_end = True
            self.crashes.append(f"daemon {inc.n} (PID {inc.pid}) {inc.end}")
            self.c.say(f"daemon {inc.n} {inc.end}; restarting in {RESTART_SEC:g} s")
        time.sleep(RESTART_SEC)
        if not self.c.stop.is_set():
            with self.c.faults.quiet():
                self.start()

    def stop(self) -> Optional[int]:
        """SIGTERM, as systemctl stop; the exit code (None when it had to be SIGKILLed)."""
        with self.lock:
            inc = self.current
            if inc is None or inc.proc.poll() is not None:
                return None if inc is None else inc.proc.returncode
            inc.expected_end = True
            inc.proc.send_signal(signal.SIGTERM)
            try:
                code = inc.proc.wait(10)  # TimeoutStopSec=10
            except subprocess.TimeoutExpired:
                inc.proc.kill()
                inc.proc.wait()
                code = None
            inc.ended = time.monotonic()
            inc.end = "stopped" if code == 0 else f"stopped, exit {code}"
            return code


# ---- watching it -------------------------------------------------------------------------------


_SCRAPED = (b"gpuwatch_polls_total", b"gpuwatch_poll_errors_total", b"gpuwatch_nvml_up",
            b"gpuwatch_gpu_read_ok", b"gpuwatch_finding{", b"gpuwatch_agent_step{",
            b"gpuwatch_agent_reports", b"gpuwatch_process_gpu_memory_bytes",
            b"gpuwatch_last_poll_timestamp_seconds", b"gpuwatch_reaped_total",
            b"gpuwatch_process_series_dropped_total",
            b"process_resident_memory_bytes")


@dataclass
class Scrape:
    at: float
    wall: float
    pid: int
    samples: Samples


class Scraper(threading.Thread):
    """GETs /metrics every `every` s, on a connection of its own each time (as Prometheus does,
    with its 10 s timeout), and keeps what the figures need."""

    def __init__(self, c: Chaos) -> None:
        super().__init__(name="scraper", daemon=True)
        self.c = c
        self.attempts: list[tuple[float, float, bool, str]] = []  # start, end, ok, error
        self.skipped = 0
        self.latest: Optional[Scrape] = None
        self.lock = threading.Lock()
        #: Highest polls_total and poll error counts seen, per daemon PID.
        self.polls: dict[int, float] = {}
        self.poll_errors: dict[tuple[int, str], float] = {}
        self.accepted: dict[int, float] = {}
        self.series_dropped: dict[int, float] = {}
        self.rejected: dict[tuple[int, str], float] = {}
        #: (kind, pid label, name label) -> (first seen at, owner, user, reason, times seen)
        self.findings: dict[tuple[str, str, str], list[Any]] = {}
        #: The innocent agent's step: (daemon pid, polls, step) of the last scrape; the longest
        #: run of polls without it advancing; scrapes without its series once seen.
        self._agent_last: Optional[tuple[int, float, float, float]] = None
        self.agent_still_polls = 0.0
        self.agent_seen = 0
        self.agent_absent = 0
        self.agent_absent_excused = 0
        self.holders_seen: set[int] = set()
        #: Offsets of the daemon's clock seen (last poll timestamp - our clock).
        self.clock_offsets: list[tuple[float, float]] = []

    def run(self) -> None:
        next_at = time.monotonic()
        while not self.c.stop.is_set():
            if self.c.daemon.restarting.is_set():
                self.skipped += 1
            else:
                self.scrape_once()
            next_at = max(next_at + self.c.opts.scrape_every, time.monotonic())
            self.c.stop.wait(max(0.0, next_at - time.monotonic()))

    def scrape_once(self, count: bool = True) -> Optional[Scrape]:
        inc = self.c.daemon.current
        started = time.monotonic()
        try:
            body = self.c.get_metrics(timeout=10)
        except Exception as exc:  # any failure at all is what this counts
            if count:
                self.attempts.append((started, time.monotonic(), False, repr(exc)[:200]))
            return None
        if count:
            self.attempts.append((started, time.monotonic(), True, ""))
        text = b"\n".join(line for line in body.split(b"\n") if line.startswith(_SCRAPED))
        try:
            samples = parse_metrics(text.decode(errors="replace"))
        except Exception as exc:
            self.c.say(f"note: a scrape could not be parsed: {exc!r}")
            return None
        scrape = Scrape(started, time.time(), inc.pid if inc else 0, samples)
        self._take(scrape, findings=count)
        return scrape

    def _take(self, s: Scrape, findings: bool = True) -> None:
        """What the figures need of one scrape; with `findings`, the findings it shows too (not
        those of the last scrape, taken after the bench stopped its actors: whatever their
        ending left is not a scenario of the run)."""
        polls = total(s.samples, "gpuwatch_polls_total")
        with self.lock:
            self.latest = s
            self.polls[s.pid] = max(self.polls.get(s.pid, 0.0), polls)
            for source in ("nvml", "procfs", "poll"):
                key = (s.pid, source)
                self.poll_errors[key] = max(self.poll_errors.get(key, 0.0), total(
                    s.samples, "gpuwatch_poll_errors_total", source=source))
            self.accepted[s.pid] = max(self.accepted.get(s.pid, 0.0),
                                       total(s.samples, "gpuwatch_agent_reports_total"))
            self.series_dropped[s.pid] = max(self.series_dropped.get(s.pid, 0.0), total(
                s.samples, "gpuwatch_process_series_dropped_total"))
            for (name, labels), value in s.samples.items():
                d = dict(labels)
                if name == "gpuwatch_agent_reports_rejected_total":
                    key2 = (s.pid, d.get("reason", ""))
                    self.rejected[key2] = max(self.rejected.get(key2, 0.0), value)
                elif name == "gpuwatch_finding" and value and findings:
                    key3 = (d.get("kind", ""), d.get("pid", ""), d.get("name", ""))
                    seen = self.findings.get(key3)
                    if seen is None:
                        owner = self.c.owner_of(key3[1], d.get("user", ""))
                        self.findings[key3] = [s.at, owner, d.get("user", ""),
                                               d.get("reason", ""), 1]
                    else:
                        seen[4] += 1
                elif name == "gpuwatch_process_gpu_memory_bytes":
                    with contextlib.suppress(ValueError):
                        self.holders_seen.add(int(d.get("pid", "")))
            stamp = total(s.samples, "gpuwatch_last_poll_timestamp_seconds")
            if stamp:
                self.clock_offsets.append((s.at, stamp - s.wall))
            self._follow_agent(s, polls)

    def _follow_agent(self, s: Scrape, polls: float) -> None:
        """The innocent trainer's step as served: is it still heard through the flood? Scrapes
        while NVML is down (no GPU holder is known, so no process is read), or in the first
        3 s of a daemon (it has yet to hear from the trainer), are counted apart."""
        pid = self.c.innocent_agent_pid
        if pid is None:
            return
        steps = [v for (n, ls), v in s.samples.items()
                 if n == "gpuwatch_agent_step" and dict(ls).get("pid") == str(pid)]
        inc = self.c.daemon.current
        settled = inc is not None and inc.serving is not None and s.at - inc.serving > 3
        nvml_up = total(s.samples, "gpuwatch_nvml_up") == 1
        if not steps:
            if self.agent_seen:
                if settled and nvml_up:
                    self.agent_absent += 1
                else:
                    self.agent_absent_excused += 1
            return
        self.agent_seen += 1
        step = steps[0]
        last = self._agent_last
        if last is None or last[0] != s.pid or step != last[2] or not nvml_up:
            self._agent_last = (s.pid, polls, step, s.at)
            return
        self.agent_still_polls = max(self.agent_still_polls, polls - last[1])

    def holding(self, pid: int) -> bool:
        with self.lock:
            return pid in self.holders_seen

    def clock_offset_near(self, since: float, want: float, tolerance: float = 60.0) -> bool:
        with self.lock:
            return any(at >= since and abs(off - want) <= tolerance
                       for at, off in self.clock_offsets)

    def nvml_ok_after(self, since: float) -> Optional[float]:
        """When a scrape taken after `since` first showed NVML up and every GPU read."""
        s = self.latest
        if s is None or s.at < since:
            return None
        up = total(s.samples, "gpuwatch_nvml_up") == 1
        ok = [v for (n, _), v in s.samples.items() if n == "gpuwatch_gpu_read_ok"]
        return s.at if up and len(ok) == self.c.opts.gpus and all(ok) else None

    def nvml_down_since(self, since: float) -> bool:
        s = self.latest
        return s is not None and s.at >= since and \
            total(s.samples, "gpuwatch_nvml_up") == 0


class FaultInjector(threading.Thread):
    """A transient fault on a random NVML call gpuwatch makes, with a random error code of the
    bindings', every fault_gap seconds: the next 1 to 3 matching calls fail."""

    def __init__(self, c: Chaos) -> None:
        super().__init__(name="nvml-faults", daemon=True)
        self.c = c
        self.rng = random.Random(c.opts.seed + 1)
        self.codes = _nvml_error_codes()
        self.calls = _nvml_calls()
        self.injected: Counter[str] = Counter()
        self.by_call: Counter[str] = Counter()
        self.stopping = threading.Event()
        self.paused = 0
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """No random fault meanwhile, and none left armed: for what must be measured alone (the
        driver gone and back) or must start clean (a restarted daemon would meet every fault
        of the table afresh: the fake driver counts `times` per process)."""
        with self.lock:
            self.paused += 1
        self.c.shared.clear_transient()
        try:
            yield
        finally:
            with self.lock:
                self.paused -= 1

    def run(self) -> None:
        order = list(self.codes)
        self.rng.shuffle(order)
        n = 0
        while not self.stopping.wait(self.rng.uniform(*self.c.opts.fault_gap)):
            # Every code in turn first, then at random.
            with self.lock:
                if self.paused:
                    continue
            code = order[n] if n < len(order) else self.rng.choice(order)
            n += 1
            call = self.rng.choice(self.calls)
            device = self.rng.randrange(self.c.opts.gpus) if (
                call.startswith("nvmlDevice") and self.rng.random() < 0.5) else None
            f = FakeFailure(call, code, device, times=self.rng.randint(1, 3))
            self.c.shared.add_failure(f, keep=self.c.opts.fault_records)
            self.injected[self.codes[code]] += 1
            self.by_call[call] += 1


class IdleConnections(threading.Thread):
    """`n` TCP connections to the metrics port that never finish a request: half send nothing,
    half a request line and a header with no end. One the daemon closes is opened again."""

    def __init__(self, c: Chaos, n: int) -> None:
        super().__init__(name="idle-connections", daemon=True)
        self.c = c
        self.n = n
        self.socks: list[socket.socket] = []
        self.opened = 0
        self.closed_by_daemon = 0
        self.connect_failed = 0
        self.held: list[int] = []  # how many were open, at each look
        self._i = 0

    def _open(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.connect(("127.0.0.1", self.c.port))
            if self._i % 2:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        except OSError:
            self.connect_failed += 1
            s.close()
            return
        self._i += 1
        s.setblocking(False)
        self.socks.append(s)
        self.opened += 1

    def _close_all(self) -> None:
        for s in self.socks:
            s.close()
        self.socks = []

    def run(self) -> None:
        try:
            while not self.c.stop.wait(0.5):
                if self.c.daemon.restarting.is_set():
                    self._close_all()
                    continue
                alive = []
                if self.socks:
                    readable, _, _ = select.select(self.socks, [], [], 0)
                    gone = set()
                    for s in readable:
                        try:
                            data = s.recv(65536)
                        except OSError:
                            data = b""
                        if not data:  # closed (or reset) by the daemon
                            gone.add(s)
                    for s in self.socks:
                        if s in gone:
                            self.closed_by_daemon += 1
                            s.close()
                        else:
                            alive.append(s)
                self.socks = alive
                for _ in range(self.n - len(self.socks)):
                    if self.c.stop.is_set():
                        break
                    self._open()
                self.held.append(len(self.socks))
        finally:
            self._close_all()


# ---- the run -----------------------------------------------------------------------------------


@dataclass
class Victim:
    pid: int
    ticks: Optional[int]
    rank: int
    on_term: str
    log: Path
    ended_by_bench: bool = False
    gone_at: Optional[float] = None


@dataclass
class ReapScenario:
    victims: list[Victim] = field(default_factory=list)
    launcher: Optional[int] = None
    orphaned_at: Optional[float] = None
    first_sigterm_at: Optional[float] = None
    daemon_killed_at: Optional[float] = None
    killed_daemon: Optional[int] = None
    restarted_daemon: Optional[int] = None
    done_at: Optional[float] = None
    problem: str = ""


@dataclass
class Episode:
    kind: str
    started: float
    seconds: float = 0.0
    detail: str = ""
    seen: Optional[bool] = None
    recovered_after: Optional[float] = None
    polls_during: Optional[float] = None


@dataclass
class ChaosResult:
    options: ChaosOptions
    skipped: str = ""
    elapsed: float = 0.0
    limits: str = ""
    cgroup_mode: str = ""
    reap: Optional[ReapScenario] = None
    episodes: list[Episode] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["met"] is False]

    def row(self, key: str) -> dict[str, Any]:
        return next(r for r in self.rows if r["key"] == key)


class Chaos:
    def __init__(self, opts: ChaosOptions, result: ChaosResult, stack: contextlib.ExitStack
                 ) -> None:
        self.opts = opts
        self.result = result
        self.stack = stack
        self.say = opts.log
        self.stop = threading.Event()
        self.rng = random.Random(opts.seed)
        self.cgroups = Cgroups(f"{NAME}-{owner_tag()}")
        self.daemon = DaemonRunner(self)
        self.innocents: dict[int, tuple[str, Optional[int], Optional[Path]]] = {}
        self.innocent_agent_pid: Optional[int] = None
        self.reporters: dict[str, set[int]] = {}
        self.storm_feed: Optional[StormFeed] = None
        self.lazy_feed: Optional[StormFeed] = None
        self.threads: list[threading.Thread] = []
        self.port = node.free_port()
        self.metrics_url = f"http://127.0.0.1:{self.port}/metrics"
        self.state_mounted = False
        self.audit_copy: Optional[Path] = None
        self.audit_text = ""
        self.logs: list[tuple[Incarnation, str]] = []
        self.daemon_exit: Optional[int] = None
        self.innocents_alive_at_end: dict[int, bool] = {}
        self.flood_users: list[dict[str, Any]] = []
        self.final_scrape_at: Optional[float] = None
        #: What the bench's processes wrote (signal logs, reports), read before the cleanup
        #: removes the work directory.
        self.files: dict[Path, str] = {}

    def text(self, path: Path) -> str:
        return self.files[path] if path in self.files else _file_text(path)

    def snapshot(self) -> None:
        actors = getattr(self, "actors", None)
        if actors is None:
            return
        for path in actors.rglob("*"):
            if path.is_file():
                self.files[path] = _file_text(path)

    # -- access to the daemon --------------------------------------------------------------
    def get_metrics(self, timeout: float) -> bytes:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}")
        if b"\ngpuwatch_polls_total " not in body:
            raise RuntimeError(f"an incomplete body ({len(body)} bytes)")
        return body

    def probe(self) -> bool:
        """One scrape for the bench's own use (not counted among the scraper's)."""
        try:
            self.get_metrics(timeout=5)
        except Exception:
            return False
        return True

    def owner_of(self, pid_label: str, user: str) -> str:
        """Whose a finding's process is, by its user: each of the bench's roles runs under a
        uid of its own (no PID reuse can confuse them). An innocent, a victim, the storm, a
        flooding user, or not the bench's at all."""
        if not pid_label:
            return "device"  # a GPU-level ghost: no process
        role = ROLE_OF_UID.get(user)
        if role is None:
            return "other"
        if role in ("healthy", "gpu-service", "plain-service"):
            with contextlib.suppress(ValueError):
                known = self.innocents.get(int(pid_label))
                if known is not None:
                    return f"innocent {known[0]}"
            return f"innocent {role} (another of its processes)"
        if role == "lazy-parent":
            return "innocent lazy parent (or its child)"
        return role  # victim, storm, flood-memory, flood-slots, flood-fuzz, flood-mixed

    # -- set-up ----------------------------------------------------------------------------
    def setup(self) -> None:
        opts = self.opts
        self.work = work_dir(opts.work_dir, f"{NAME}-{owner_tag()}-")
        if opts.work_dir is None:
            self.stack.callback(shutil.rmtree, self.work, ignore_errors=True)
        self.work.chmod(0o755)
        self.actor_log = self.stack.enter_context(open(self.work / "actors.log", "ab"))  # noqa: SIM115

        self.cgroups.create()
        self.stack.callback(self._remove_cgroups)
        self.result.cgroup_mode = self.cgroups.mode
        self.procs = Processes(
            wrap=lambda argv: in_cgroups(self.cgroups.actor_procs, argv),
            empty=self.cgroups.empty, stdout=subprocess.DEVNULL, stderr=self.actor_log,
            stdin=subprocess.DEVNULL)
        self.stack.callback(self.procs.kill_all)

        # The fake driver, readable by the daemon's user; the clock library.
        lib = shutil.copytree(build_fake_nvml(), self.work / "lib")
        self.node = FakeNode(self.work / "nvml.state", lib, gpus=opts.gpus)
        self.node.write()
        self.shared = SharedNode(self.node)
        self.clock = self.stack.enter_context(ClockJump(self.work))

        # Runtime and state directories, the daemon's own; the state directory a small tmpfs.
        self.run_dir = self.work / "run"
        self.state_dir = self.work / "state"
        for d, mode in ((self.run_dir, 0o755), (self.state_dir, 0o750)):
            d.mkdir()
            os.chown(d, DAEMON_UID, DAEMON_UID)
            d.chmod(mode)
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={STATE_TMPFS_SIZE},mode=0750,uid={DAEMON_UID},"
             f"gid={DAEMON_UID},nosuid,nodev,noexec", f"{NAME}-state", str(self.state_dir)],
            capture_output=True, text=True)
        if mounted.returncode == 0:
            self.state_mounted = True
            self.stack.callback(self._unmount)
        else:
            self.say(f"note: no tmpfs for the state directory ({mounted.stderr.strip()}): "
                     "it will not be filled")
        self.actors = self.work / "actors"
        self.actors.mkdir()
        self.actors.chmod(0o755)
        self.dirs: dict[str, Path] = {}
        for role, offset in UIDS.items():
            d = self.actors / role
            d.mkdir()
            os.chown(d, ACTOR_UID_BASE + offset, ACTOR_UID_BASE + offset)
            d.chmod(0o755)
            self.dirs[role] = d

        self.config = self.work / "gpuwatch.toml"
        protected = sorted({p.pw_name for p in pwd.getpwall()})
        self.config.write_text(
            daemon_config(f"127.0.0.1:{self.port}", opts.interval, self.run_dir, self.state_dir, 2)
            + "[detectors]\n"
            "# Everyone with a name: the daemon may only ever report (and reap) the bench's own.\n"
            f"protected_users = {json.dumps(protected)}\n"
            "min_age = 3\n"
            "[reaper]\n"
            "auto = true\n"
            'auto_kinds = ["orphan"]\n'
            f"auto_after = {opts.auto_after}\n"
            f"grace = {opts.grace}\n")
        self.config.chmod(0o644)
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
                "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        self.daemon_env = {**base, "HOME": str(self.work),
                           "LD_LIBRARY_PATH": str(lib), STATE_ENV: str(self.node.state_path),
                           **self.clock.env()}
        self.actor_env = {**base, "GPUWATCH_RUNTIME_DIR": str(self.run_dir)}
        self.result.limits = (
            f"uid {DAEMON_UID}, capabilities {', '.join(CAPABILITIES)} (ambient, bounding set, "
            f"no_new_privs), RLIMIT_NOFILE {nofile()[0]}:{nofile()[1]}, umask 077; "
            f"{self.cgroups.mode}: memory limit {MEMORY_MAX // MIB} MiB, pids limit {TASKS_MAX}")

        self._start_innocents()
        self.stack.callback(self._stop_daemon)
        self.daemon.start()

    def _env_for(self, role: str) -> dict[str, str]:
        return {**self.actor_env, "HOME": str(self.dirs[role])}

    def _start_innocents(self) -> None:
        # The healthy job: a launcher and two GPU workers, rank 0 instrumented with the agent.
        d = self.dirs["healthy"]
        uid = ACTOR_UID_BASE + UIDS["healthy"]
        launcher = self.procs.start(as_user(uid, _python(
            "_launcher", "--dir", str(d), "--name", "healthy", "--workers", "2",
            "--run-id", f"healthy-{os.getpid()}", "--agent-rank", "0",
            "--ready", str(d / "healthy.json"))), env=self._env_for("healthy"))
        # The job that will be orphaned, started now: Python starts slowly under the chaos.
        vd = self.dirs["victim"]
        self.victim_launcher = self.procs.start(as_user(
            ACTOR_UID_BASE + UIDS["victim"], _python(
                "_launcher", "--dir", str(vd), "--name", "victim", "--workers", "2",
                "--run-id", f"victim-{os.getpid()}", "--exit-on-term", "1",
                "--ready", str(vd / "victim.json"))), env=self._env_for("victim"))
        # Two services under PID 1: one holding GPU memory (a notebook server, say), another
        # user's with none.
        services = {}
        for role in ("gpu-service", "plain-service"):
            sd = self.dirs[role]
            services[role] = self.procs.start(as_user(ACTOR_UID_BASE + UIDS[role], _python(
                "_service", "--log", str(sd / f"{role}.jsonl"),
                "--ready", str(sd / f"{role}.json"))), env=self._env_for(role))
        job = wait("the healthy job", lambda: read_json(d / "healthy.json"), 90, step=0.1)
        self.innocents[launcher.pid] = ("healthy launcher", start_ticks(launcher.pid),
                                        d / "healthy-launcher.jsonl")
        for rank, pid in enumerate(job["workers"]):
            self.innocents[pid] = (f"healthy worker {rank}", start_ticks(pid),
                                   d / f"healthy-worker{rank}.jsonl")
            self.shared.hold(pid, device=rank % self.opts.gpus, used=(10 + rank) * GIB)
        self.innocent_agent_pid = job["workers"][0]
        for role, proc in services.items():
            sd = self.dirs[role]
            info = wait(role, lambda sd=sd, role=role: read_json(sd / f"{role}.json"), 60)
            proc.wait(30)
            pid = info["pid"]
            self.procs.adopt(pid)
            self.innocents[pid] = (role, start_ticks(pid), sd / f"{role}.jsonl")
            if role == "gpu-service":
                self.shared.hold(pid, device=self.opts.gpus - 1, used=4 * GIB)
        self.say(f"innocents: {', '.join(f'{v[0]} {k}' for k, v in self.innocents.items())}")

    def _start_actors(self) -> None:
        opts = self.opts
        # The storm.
        storm_report = self.dirs["storm"] / "storm.json"
        storm = self.procs.start(_python(
            "_storm", "--uid", str(ACTOR_UID_BASE + UIDS["storm"]), "--rate", str(opts.storm_rate),
            "--max-live", str(opts.storm_max_live), "--gpu-share", str(opts.storm_gpu_share),
            "--gpus", str(opts.gpus), "--seed", str(opts.seed), "--report", str(storm_report)),
            stdout=subprocess.PIPE, text=True, env=self.actor_env)
        self.storm, self.storm_report = storm, storm_report
        self.storm_feed = StormFeed(storm, self.shared)
        # An innocent that collects its GPU children lazily (defunct 1.5 s at a time).
        self.lazy = self.procs.start(_python(
            "_lazy_parent", "--uid", str(ACTOR_UID_BASE + UIDS["lazy-parent"]),
            "--gpus", str(opts.gpus), "--seed", str(opts.seed)),
            stdout=subprocess.PIPE, text=True, env=self.actor_env)
        self.lazy_feed = StormFeed(self.lazy, self.shared)
        self.lazy_feed.name = "lazy-feed"
        # The flooding users.
        users = []
        for role, count, rate in (("memory", opts.memory_reporters, opts.memory_rate),
                                  ("slots", opts.slot_processes, 0.0),
                                  ("fuzz", opts.fuzz_processes, opts.fuzz_rate),
                                  ("mixed", opts.mixed_processes, opts.mixed_rate)):
            if count:
                users.append({"role": role, "uid": ACTOR_UID_BASE + UIDS[f"flood-{role}"],
                              "processes": count, "rate": rate,
                              "dir": str(self.dirs[f"flood-{role}"])})
        plan = self.work / "flood.json"
        plan.write_text(json.dumps({"users": users, "socket": str(self.run_dir / "agent.sock"),
                                    "stop": str(self.work / "flood.stop"),
                                    "seed": opts.seed}))
        self.flood_users = users
        node.check_room_for(sum(u["processes"] for u in users) + opts.storm_max_live)
        self.flood = self.procs.start(_python("_flood", "--plan", str(plan)), env=self.actor_env)
        for u in users:
            ready = Path(u["dir"]) / f"{u['role']}-ready.json"
            info = wait(f"the {u['role']} flood", lambda ready=ready: read_json(ready), 120,
                         step=0.1)
            self.reporters[u["role"]] = {*info["pids"], info["user"]}
        self.say("flooding users: " + ", ".join(f"{u['role']} {u['processes']}" for u in users))

        self.scraper = Scraper(self)
        self.sampler = Sampler(lambda: None if self.daemon.current is None
                               else self.daemon.current.pid, 0.2, self.stop)
        self.faults = FaultInjector(self)
        self.idle = IdleConnections(self, opts.idle_connections)
        self.supervisor = threading.Thread(target=self._supervise, name="supervisor",
                                           daemon=True)
        self.threads = [self.storm_feed, self.lazy_feed, self.scraper, self.sampler, self.faults,
                        self.idle, self.supervisor]
        for t in self.threads:
            t.start()

    def _supervise(self) -> None:
        while not self.stop.wait(0.2):
            try:
                self.daemon.check()
            except Exception as exc:  # a daemon that cannot start again: said, and tried again
                self.say(f"restarting the daemon failed: {exc}")

    # -- the episodes ----------------------------------------------------------------------
    def run(self) -> None:
        opts = self.opts
        self.started = time.monotonic()
        self._start_actors()
        deadline = self.started + opts.duration
        hard_stop = deadline + 90
        plan: list[Callable[[], None]] = [self.reap_episode, self.driver_episode,
                                          self.fill_episode, lambda: self.clock_episode(+1),
                                          lambda: self.clock_episode(-1)]
        # Each episode once, whatever the duration; then again, but the reap, while time is
        # left for one.
        again: list[tuple[float, Callable[[], None]]] = [
            (opts.driver_gone + 12, self.driver_episode), (opts.state_full + 2, self.fill_episode),
            (opts.clock_hold + 2, lambda: self.clock_episode(+1)),
            (opts.clock_hold + 2, lambda: self.clock_episode(-1))]
        ran = 0
        self.stop.wait(2.0)
        while not self.stop.is_set():
            now = time.monotonic()
            if ran >= len(plan) and now >= deadline:
                break
            if now >= hard_stop:
                self.result.problems.append("not every episode could run in time")
                break
            if ran < len(plan):
                plan[ran]()
            else:
                needs, episode = again[(ran - len(plan)) % len(again)]
                if deadline - now > needs:
                    episode()
                else:
                    self.stop.wait(max(0.0, deadline - now))
            ran += 1
        self.result.elapsed = time.monotonic() - self.started
        self.finish()

    def _episode(self, kind: str, detail: str = "") -> Episode:
        e = Episode(kind, time.monotonic(), detail=detail)
        self.result.episodes.append(e)
        return e

    def driver_episode(self) -> None:
        """Every call fails with DRIVER_NOT_LOADED, init included, for a few seconds."""
        with self.faults.quiet():
            self._driver_episode()

    def _driver_episode(self) -> None:
        e = self._episode("driver gone")
        f = FakeFailure("*", DRIVER_NOT_LOADED)
        self.shared.add_failure(f)
        with contextlib.suppress(TimeoutError):
            wait("NVML down", lambda: self.scraper.nvml_down_since(e.started),
                  self.opts.driver_gone + 10, step=0.1)
        e.seen = self.scraper.nvml_down_since(e.started)
        self.stop.wait(max(0.0, e.started + self.opts.driver_gone - time.monotonic()))
        self.shared.remove_failure(f)
        cleared = time.monotonic()
        e.seconds = cleared - e.started
        try:
            back = wait("NVML back", lambda: self.scraper.nvml_ok_after(cleared), 30, step=0.1)
            e.recovered_after = back - cleared
        except TimeoutError:
            e.recovered_after = None
        self.say(f"driver gone {e.seconds:.1f} s: seen {e.seen}, back after "
                 f"{e.recovered_after}")

    def fill_episode(self) -> None:
        """The state directory full to the last byte for a few seconds."""
        if not self.state_mounted:
            self._episode("state directory full", "skipped: no tmpfs could be mounted")
            return
        e = self._episode("state directory full")
        polls = self._polls_now()
        junk = self.state_dir / "chaos-junk"
        written = 0
        fd = os.open(junk, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            for size in (65536, 1):  # then the last bytes of the last page
                while True:
                    try:
                        n = os.write(fd, b"\0" * size)
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        break
                    written += n
                    if n < size:
                        break
        finally:
            os.close(fd)
        st = os.statvfs(self.state_dir)
        e.detail = f"{written // 1024} KiB of junk, {st.f_bavail * st.f_frsize} bytes left"
        self.stop.wait(self.opts.state_full)
        junk.unlink()
        e.seconds = time.monotonic() - e.started
        e.polls_during = self._polls_now() - polls
        self.say(f"state directory full for {e.seconds:.1f} s ({e.detail}); "
                 f"{e.polls_during:g} polls meanwhile")

    def clock_episode(self, direction: int) -> None:
        """The daemon's wall clock steps by an hour, stays there a few seconds, steps back."""
        jump = direction * self.opts.clock_jump
        e = self._episode("clock jump", f"{jump:+g} s for {self.opts.clock_hold:g} s, then back")
        self.clock.set(jump)
        self.stop.wait(self.opts.clock_hold)
        # However busy the machine, the jump stays until the daemon has shown it (20 s at most).
        with contextlib.suppress(TimeoutError):
            wait("the jump seen", lambda: self.scraper.clock_offset_near(e.started, jump), 20,
                  step=0.1)
        e.seen = self.scraper.clock_offset_near(e.started, jump)
        self.clock.set(0)
        e.seconds = time.monotonic() - e.started
        self.stop.wait(1.0)
        self.say(f"clock jump {jump:+g} s: seen by the daemon {e.seen}")

    def _polls_now(self) -> float:
        s = self.scraper.latest
        return total(s.samples, "gpuwatch_polls_total") if s is not None else 0.0

    def reap_episode(self) -> None:
        """An orphaned job of another user, auto-reaped; the daemon SIGKILLed inside the grace
        as soon as the first SIGTERM lands, and started again; the reap carried to its end."""
        opts = self.opts
        r = ReapScenario()
        if self.result.reap is not None:
            return  # once per run: its audit figures are about this one
        self.result.reap = r
        e = self._episode("auto-reap, daemon SIGKILLed in the grace")
        d = self.dirs["victim"]
        launcher = self.victim_launcher
        r.launcher = launcher.pid
        try:
            job = wait("the job to orphan", lambda: read_json(d / "victim.json"), 60, step=0.1)
            for rank, pid in enumerate(job["workers"]):
                r.victims.append(Victim(pid, start_ticks(pid), rank,
                                        "exit" if rank == 1 else "ignore",
                                        d / f"victim-worker{rank}.jsonl"))
                self.procs.adopt(pid)
                self.shared.hold(pid, device=rank % opts.gpus, used=6 * GIB)
            wait("the job's workers seen holding GPU memory", lambda: all(
                self.scraper.holding(v.pid) for v in r.victims), 30, step=0.1)
            os.kill(launcher.pid, signal.SIGKILL)
            launcher.wait()
            r.orphaned_at = time.monotonic()
            self.say(f"auto-reap: launcher {launcher.pid} SIGKILLed "
                     f"{r.orphaned_at - e.started:.1f} s into the episode; workers "
                     f"{[v.pid for v in r.victims]} orphaned")
            daemon_pids = self.daemon.pids

            def first_sigterm() -> Optional[float]:
                for v in r.victims:
                    for entry in _signals_logged(_file_text(v.log)):
                        if entry.get("name") == "SIGTERM" and entry.get("pid") in daemon_pids():
                            return time.monotonic()
                return None

            r.first_sigterm_at = wait("the daemon's SIGTERM to the orphans", first_sigterm,
                                       opts.auto_after + 30, step=0.02)
            self.say(f"auto-reap: the daemon's first SIGTERM "
                     f"{r.first_sigterm_at - r.orphaned_at:.1f} s after the orphaning")
            # Long enough for every SIGTERM of the batch to go out, well inside the grace.
            time.sleep(min(0.3, opts.grace / 4))
            killed, new = self.daemon.kill_and_restart("inside an auto-reap's grace")
            r.daemon_killed_at = killed.ended
            r.killed_daemon, r.restarted_daemon = killed.pid, new.pid
            self.say(f"daemon {killed.n} SIGKILLed {killed.ended - r.first_sigterm_at:.2f} s "
                     f"after its first SIGTERM; daemon {new.n} serving")

            def all_gone() -> bool:
                for v in r.victims:
                    if v.gone_at is None and not running(v.pid, v.ticks):
                        v.gone_at = time.monotonic()
                return all(v.gone_at is not None for v in r.victims)

            wait("the restarted daemon to finish the reap", all_gone,
                  opts.auto_after + opts.grace + 45, step=0.1)
            r.done_at = time.monotonic()
        except (TimeoutError, RuntimeError) as exc:
            r.problem = str(exc)[:300]
            self.say(f"auto-reap: {exc}")
        finally:
            for v in r.victims:
                if running(v.pid, v.ticks):
                    v.ended_by_bench = True
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(v.pid, signal.SIGKILL)
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
            self.shared.release(*(v.pid for v in r.victims))
            e.seconds = time.monotonic() - e.started

    # -- the end ---------------------------------------------------------------------------
    def finish(self) -> None:
        """The faults stop; NVML must be read again; the last figures are taken."""
        self.faults.stopping.set()
        self.faults.join(5)
        self.shared.clear_failures()
        cleared = time.monotonic()
        e = self._episode("faults stopped")
        try:
            back = wait("NVML read again", lambda: self.scraper.nvml_ok_after(cleared), 20,
                         step=0.1)
            e.recovered_after = back - cleared
        except TimeoutError:
            e.recovered_after = None
        self.stop.set()
        # The storm and the flood write their reports on SIGTERM; the feed ends with the storm.
        for proc in (self.storm, self.flood, self.lazy):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        feeds = (self.storm_feed, self.lazy_feed)
        for t in self.threads:
            if t not in feeds:
                t.join(15)
        for proc in (self.storm, self.flood, self.lazy):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(40)
        for feed in feeds:
            if feed is not None:
                feed.join(10)
        self.scraper.scrape_once(count=False)  # the last counters, not a scrape of the figures
        self.final_scrape_at = time.monotonic()

    def _stop_daemon(self) -> None:
        self.stop.set()
        self.daemon_exit = self.daemon.stop()
        audit = self.state_dir / "reap.jsonl"
        if audit.exists():
            self.audit_copy = self.work / "reap.jsonl"
            shutil.copyfile(audit, self.audit_copy)
            self.audit_text = self.audit_copy.read_text(errors="replace")
        self.logs = [(i, i.log_path.read_text(errors="replace"))
                     for i in self.daemon.incarnations if i.log_path.exists()]

    def _unmount(self) -> None:
        for attempt in (["umount", str(self.state_dir)], ["umount", "-l", str(self.state_dir)]):
            if subprocess.run(attempt, capture_output=True).returncode == 0:
                return
        self.result.problems.append(f"could not unmount {self.state_dir}")

    def _remove_cgroups(self) -> None:
        self.result.figures["cgroups"] = {
            "peak_memory": self.cgroups.peak_memory(), "oom_kills": self.cgroups.oom_kills(),
            "memory_limit_hits": self.cgroups.memory_limit_hits(),
            "tasks_limit_hits": self.cgroups.tasks_limit_hits()}
        self.result.problems += self.cgroups.remove()


def _file_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _json_of(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _signals_logged(text: str) -> list[dict[str, Any]]:
    """The signals a sentinel recorded (its log's text)."""
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and "signal" in entry:
                out.append(entry)
    return out


# ---- figures -----------------------------------------------------------------------------------


def _when(c: Chaos, at: float) -> str:
    """`at` (monotonic) as seconds into the run, with the episodes under way then."""
    began = getattr(c, "started", at)
    during = [e.kind for e in c.result.episodes
              if e.started <= at <= e.started + max(e.seconds, 0.0) + 1.0]
    return f"{at - began:+.1f} s" + (f" during {', '.join(during)}" if during else "")


def _row(result: ChaosResult, key: str, figure: str, value: str, goal: str = "",
         met: Optional[bool] = None) -> None:
    result.rows.append({"key": key, "figure": figure, "value": value, "goal": goal,
                        "met": met})


def _audit_entries(text: str) -> tuple[list[dict[str, Any]], int]:
    entries, torn = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            torn += 1
            continue
        if isinstance(entry, dict):
            entries.append(entry)
        else:
            torn += 1
    return entries, torn


def analyse(c: Chaos) -> None:
    """The figures, each against its goal, from what the run recorded."""
    r = c.result
    o = c.opts
    f = r.figures
    sc = c.scraper
    f["elapsed_s"] = r.elapsed
    f["limits"] = r.limits
    pids = [i.pid for i in c.daemon.incarnations]

    # Polls.
    polls = sum(sc.polls.values())
    end = c.final_scrape_at or time.monotonic()
    uptime = sum(min(i.ended or end, end) - (i.serving or i.started)
                 for i in c.daemon.incarnations)
    failed_polls = sum(v for (_, src), v in sc.poll_errors.items() if src == "poll")
    nvml_errors = sum(v for (_, src), v in sc.poll_errors.items() if src == "nvml")
    procfs_errors = sum(v for (_, src), v in sc.poll_errors.items() if src == "procfs")
    f.update(polls=polls, polls_failed=failed_polls, nvml_errors=nvml_errors,
             procfs_errors=procfs_errors)
    _row(r, "polls", "polls done; failed (raised)",
         f"{polls:,.0f} in {uptime:.0f} s up at {o.interval:g} s ({len(pids)} daemon runs); "
         f"{failed_polls:g} failed; {nvml_errors:,.0f} NVML and {procfs_errors:,.0f} procfs "
         "errors counted", "0 failed", failed_polls == 0 and polls > 0)

    # Scrapes.
    excused = [a for a in sc.attempts if not a[2] and any(
        a[0] <= to and a[1] >= frm for frm, to in c.daemon.excused)]
    counted = [a for a in sc.attempts if a not in excused]
    ok = sum(1 for a in counted if a[2])
    failures = [a for a in counted if not a[2]]
    latencies = sorted(a[1] - a[0] for a in counted if a[2])
    f.update(scrapes_attempted=len(counted), scrapes_answered=ok,
             scrapes_excused=len(excused) + sc.skipped,
             scrape_failures=[a[3] for a in failures[:5]])
    share = ok / len(counted) if counted else 0.0
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else 0.0
    _row(r, "scrapes", "/metrics scrapes answered",
         f"{ok:,} of {len(counted):,} = {100 * share:.1f}% (a GET every {o.scrape_every:g} s, "
         f"each on a connection of its own, 10 s timeout; p99 {p99 * 1000:.0f} ms; "
         f"{len(excused) + sc.skipped} not counted while the bench had the daemon down)"
         + (f"; first failure: {failures[0][3]}" if failures else ""),
         "100%", bool(counted) and ok == len(counted))

    # Wrong findings.
    wrong: list[str] = []
    planted, others, wrong_kinds = Counter(), Counter(), Counter()
    storm_report = _json_of(c.text(c.storm_report)) or {}
    storm_stall = storm_report.get("max_stall", 0.0)
    by_time = sorted(sc.findings.items(), key=lambda item: item[1][0])
    for (kind, pid, name), (at, owner, _user, reason, times) in by_time:
        if owner == "storm" and kind == "zombie" and storm_stall >= ZOMBIE_GRACE:
            # The storm itself stopped collecting its children that long: real zombies.
            others[f"{kind} (storm, stalled {storm_stall:.0f} s)"] += 1
        elif owner.startswith(("innocent", "flood-memory", "flood-slots")) or owner in (
                "storm", "device"):
            wrong.append(f"{kind} on {owner} PID {pid or '-'} ({name}, {times} scrapes, first "
                         f"{_when(c, at)}): {reason[:160]}")
            wrong_kinds[f"{kind} on {owner}"] += 1
        elif owner == "victim":
            planted[kind] += 1
        else:
            others[f"{kind} ({owner}: {name}, user {_user or '?'})"] += 1
    f["findings"] = [{"kind": kind, "pid": pid, "name": name, "owner": owner, "user": user,
                      "scrapes": times, "reason": reason[:200]}
                     for (kind, pid, name), (_, owner, user, reason, times)
                     in sorted(sc.findings.items())][:200]
    f.update(wrong_findings=len(wrong), wrong_finding_examples=wrong[:10],
             planted_findings=dict(planted), other_findings=dict(others))
    f["wrong_findings_by_kind"] = dict(wrong_kinds)
    _row(r, "wrong_findings", "wrong findings",
         f"{len(wrong)}" + (" (" + ", ".join(f"{k}: {n}" for k, n in wrong_kinds.most_common())
                            + f"); first: {wrong[0]}" if wrong else "")
         + (f"; not counted: {dict(others)}" if others else "")
         + (f"; the storm's longest stall {storm_stall:.1f} s, ended "
            f"{storm_report.get('max_stall_ended', 0.0):.1f} s into it" if wrong else ""),
         "0", not wrong)

    # Wrong signals.
    wrong_signals: list[str] = []
    for pid, (label, _ticks, log) in c.innocents.items():
        for entry in _signals_logged(c.text(log)) if log else []:
            wrong_signals.append(f"{entry.get('name')} to {label} {pid} from PID "
                                 f"{entry.get('pid')} (uid {entry.get('uid')})")
        if c.innocents_alive_at_end.get(pid) is False:
            wrong_signals.append(f"{label} {pid} died before the end")
    storm = _json_of(c.text(c.storm_report)) or {}
    for sig, n in (storm.get("signalled") or {}).items():
        wrong_signals.append(f"{n} storm process(es) ended by {sig}")
    for u in c.flood_users:
        if u["role"] not in ("memory", "slots"):
            continue
        report = _json_of(c.text(Path(u["dir"]) / f"{u['role']}-report.json")) or {}
        for early in report.get("early", []):
            wrong_signals.append(f"flood-{u['role']} PID {early['pid']} ended early: "
                                 f"{early['how']}")
        stats = _flood_stats(c, u)
        if stats.get("unexpected_sigterm"):
            wrong_signals.append(f"{stats['unexpected_sigterm']} flood-{u['role']} processes "
                                 "got a SIGTERM nobody in the bench sent")
    f.update(wrong_signals=len(wrong_signals), wrong_signal_examples=wrong_signals[:10])
    _row(r, "wrong_signals", "wrong signals",
         f"{len(wrong_signals)}" + (f": {wrong_signals[0]}" if wrong_signals else ""), "0",
         not wrong_signals)

    # The auto-reap, the SIGKILL inside its grace, and the audit log.
    _reap_rows(c)

    # Memory and threads.
    cg = f.get("cgroups", {})
    peak = cg.get("peak_memory")
    hwm = max(c.sampler.hwm_kib.values(), default=0) * 1024
    oom = cg.get("oom_kills") or 0
    f.update(peak_memory_bytes=peak, vm_hwm_bytes=hwm, memory_max_bytes=MEMORY_MAX,
             oom_kills=oom, memory_limit_hits=cg.get("memory_limit_hits"))
    shown = peak if peak is not None else hwm
    _row(r, "memory", "peak memory (cgroup; VmHWM) / MemoryMax",
         f"{(peak or 0) / MIB:.0f} MiB; {hwm / MIB:.0f} MiB of {MEMORY_MAX // MIB} MiB "
         f"({100 * shown / MEMORY_MAX:.0f}%); {oom} OOM kill(s)",
         f"< {MEMORY_MAX // MIB} MiB, no OOM kill", shown < MEMORY_MAX and not oom)
    hits = cg.get("tasks_limit_hits") or 0
    f.update(max_threads=c.sampler.max_tasks, tasks_max=TASKS_MAX, tasks_limit_hits=hits)
    thread_errors = sum(text.count("can't start new thread") for _, text in c.logs)
    _row(r, "threads", "threads (most in /proc/PID/task) / TasksMax",
         f"{c.sampler.max_tasks} of {TASKS_MAX}; {hits} fork(s)/thread(s) refused by the "
         f"limit; {thread_errors} \"can't start new thread\" in the log",
         f"< {TASKS_MAX}, none refused", c.sampler.max_tasks < TASKS_MAX and not hits)

    # Crashes, exit, log.
    crashes = list(c.daemon.crashes)
    f.update(crashes=crashes, exit_code=c.daemon_exit)
    _row(r, "crashes", "daemon crashes; exit code on SIGTERM",
         f"{len(crashes)}" + (f" ({crashes[0]})" if crashes else "")
         + f"; {c.daemon_exit}", "0; 0", not crashes and c.daemon_exit == 0)
    tracebacks = [(i.n, line) for i, text in c.logs for line in text.splitlines()
                  if "Traceback" in line]
    f["tracebacks"] = len(tracebacks)
    first = ""
    if tracebacks:
        n, _ = tracebacks[0]
        text = dict((i.n, t) for i, t in c.logs)[n]
        after = text.split("Traceback", 1)[1].splitlines()
        first = next((line for line in reversed(after[:60]) if line and not line.startswith(
            " ")), "")
    _row(r, "tracebacks", "tracebacks in the daemon's log", f"{len(tracebacks)}"
         + (f" (e.g. {first.strip()[:120]})" if first else ""), "0", not tracebacks)

    # NVML.
    drivers = [e for e in r.episodes if e.kind == "driver gone"]
    backs = [e.recovered_after for e in drivers]
    after_faults = next((e.recovered_after for e in r.episodes if e.kind == "faults stopped"),
                        None)
    f.update(driver_gone=[{"seconds": e.seconds, "seen": e.seen, "back_after": e.recovered_after}
                          for e in drivers], nvml_back_after_faults=after_faults)
    _row(r, "nvml_driver_back", "NVML back after the driver returned",
         ", ".join("never" if b is None else f"{b:.1f} s" for b in backs) or "not run",
         "<= 10 s", bool(drivers) and all(b is not None and b <= 10 for b in backs))
    _row(r, "nvml_faults_back", "NVML back after the random faults stopped",
         "never (20 s)" if after_faults is None else f"after {after_faults:.1f} s", "<= 10 s",
         after_faults is not None and after_faults <= 10)

    # The innocent agent through the flood.
    f.update(agent_still_polls=sc.agent_still_polls, agent_absent_scrapes=sc.agent_absent,
             agent_absent_excused_scrapes=sc.agent_absent_excused,
             agent_seen_scrapes=sc.agent_seen,
             process_series_dropped=sum(sc.series_dropped.values()))
    _row(r, "innocent_agent", "an innocent user's agent through the flood",
         f"its step stood still for at most {sc.agent_still_polls:g} polls; its series was "
         f"missing from {sc.agent_absent} of {sc.agent_seen + sc.agent_absent} scrapes ("
         f"{sc.agent_absent_excused} more while NVML was down or the daemon just started); "
         f"{sum(sc.series_dropped.values()):,.0f} process series dropped at "
         "exporter.max_process_series",
         "<= 10 polls; 0",
         sc.agent_seen > 0 and sc.agent_still_polls <= 10 and sc.agent_absent == 0)

    _chaos_rows(c)
    _shorten(r)


def _shorten(r: ChaosResult) -> None:
    """A short value for each row, for bench/run.py's summary table (`short`)."""
    f = r.figures

    def seconds(x: Optional[float]) -> str:
        return "never" if x is None else f"{x:.1f} s"

    backs = [d["back_after"] for d in f.get("driver_gone", [])]
    storm = f.get("storm", {})
    flood = f.get("flood", {})
    episodes = f.get("episodes", [])
    fills = [e for e in episodes if e["kind"] == "state directory full"]
    jumps = [e for e in episodes if e["kind"] == "clock jump"]
    peak = f.get("peak_memory_bytes") or f.get("vm_hwm_bytes") or 0
    reap = ("not exercised" if not f.get("reap_exercised") else
            f"SIGKILLed {f.get('reap_sigkill_into_grace_s') or 0:.2f} s into the grace; "
            + ("finished" if f.get("reap_finished") else "NOT finished"))
    short = {
        "polls": f"{f.get('polls', 0):,.0f} done, {f.get('polls_failed', 0):g} failed",
        "scrapes": f"{f.get('scrapes_answered', 0):,} of {f.get('scrapes_attempted', 0):,}",
        "wrong_findings": str(f.get("wrong_findings")),
        "wrong_signals": str(f.get("wrong_signals")),
        "reap": reap,
        "audit_lost": str(f.get("audit_lost", "?")),
        "memory": f"{peak / MIB:.0f} of {MEMORY_MAX // MIB} MiB",
        "threads": f"{f.get('max_threads')} of {TASKS_MAX}",
        "crashes": f"{len(f.get('crashes', []))}; {f.get('exit_code')}",
        "tracebacks": str(f.get("tracebacks")),
        "nvml_driver_back": ", ".join(seconds(b) for b in backs) or "not run",
        "nvml_faults_back": seconds(f.get("nvml_back_after_faults")),
        "innocent_agent": f"{f.get('agent_still_polls', 0):g} polls; "
                          f"{f.get('agent_absent_scrapes', 0)} missing",
        "storm": f"{storm.get('spawned', 0):,} "
                 f"({storm.get('spawned', 0) / max(storm.get('seconds', 0), 1):.0f}/s)",
        "nvml_faults": f"{sum(f.get('nvml_faults', {}).values())} "
                       f"({len(f.get('nvml_faults', {}))} error codes)",
        "driver_gone": f"{len(backs)} x",
        "flood": f"{sum(v.get('sent', 0) for v in flood.values()):,} datagrams from "
                 f"{sum(v.get('processes', 0) for v in flood.values()):,} processes",
        "idle_connections": f"{f.get('idle_connections', {}).get('held_min', 0)} held",
        "state_full": f"{len(fills)} x",
        "clock_jumps": f"{len(jumps)} x, {sum(1 for e in jumps if e['seen'])} seen",
    }
    for row in r.rows:
        row["short"] = short.get(row["key"], row["value"])


def _flood_stats(c: Chaos, u: dict[str, Any]) -> Counter[str]:
    total: Counter[str] = Counter()
    for line in c.text(Path(u["dir"]) / f"{u['role']}-stats.jsonl").splitlines():
        with contextlib.suppress(ValueError):
            for k, v in json.loads(line).items():
                if k != "pid" and isinstance(v, int):
                    total[k] += v
    return total


def _reap_rows(c: Chaos) -> None:
    r, f = c.result, c.result.figures
    reap = r.reap
    entries, torn = _audit_entries(c.audit_text)
    phases = Counter(str(e.get("phase")) for e in entries)
    f["audit_lines"] = dict(phases)
    f["audit_torn_lines"] = torn
    if reap is None or not reap.victims:
        _row(r, "reap", "auto-reap, daemon SIGKILLed inside the grace", "not run"
             + (f": {reap.problem}" if reap and reap.problem else ""), "done", False)
        return
    daemon_pids = c.daemon.pids()
    ended = lost_results = signals = lost_signals = 0
    details: list[str] = []
    for v in reap.victims:
        about = [e for e in entries if e.get("pid") == v.pid and e.get("phase") != "planned"
                 and not e.get("dry_run")]
        everything = _signals_logged(c.text(v.log))
        logged = [s for s in everything if s.get("pid") in daemon_pids]
        for s in everything:
            if s.get("pid") not in daemon_pids:
                r.problems.append(f"the run was disturbed: {s.get('name')} to PID {v.pid} from "
                                  f"PID {s.get('pid')} (uid {s.get('uid')}), not the daemon")
        for s in logged:
            signals += 1
            sender = s.get("pid")
            recorded = any((e.get("reaper") or {}).get("pid") == sender
                           and s.get("name") in [x.get("signal") for x in e.get("sent") or []
                                                 if isinstance(x, dict)] for e in about)
            if not recorded:
                lost_signals += 1
                details.append(f"{s.get('name')} from daemon PID {sender} to PID {v.pid}: in "
                               "no audit line of that daemon")
        if v.gone_at is not None and not v.ended_by_bench:
            ended += 1
            if not any(e.get("result") not in (None, "planned") for e in about):
                lost_results += 1
                details.append(f"PID {v.pid} ended by the daemon: no result line")
    exercised = reap.daemon_killed_at is not None and reap.first_sigterm_at is not None
    into = (reap.daemon_killed_at - reap.first_sigterm_at) if exercised else None
    finished = reap.done_at is not None and all(not v.ended_by_bench for v in reap.victims)
    refused = [e for e in entries if e.get("refused") and e.get("pid") in
               {v.pid for v in reap.victims}]
    f.update(reap_exercised=exercised, reap_sigkill_into_grace_s=into, reap_finished=finished,
             processes_ended_by_daemon=ended, result_lines_lost=lost_results,
             daemon_signals_seen=signals, signal_lines_lost=lost_signals,
             audit_lost=lost_results + lost_signals, audit_lost_details=details[:10])
    what = (f"SIGKILLed {into:.2f} s into a {c.opts.grace:g} s grace; restarted; "
            + ("the reap finished" if finished else "the reap did NOT finish")) if exercised \
        else f"not exercised: {reap.problem or 'no SIGTERM came'}"
    if refused and not exercised:
        what += f" (refused: {refused[0]['refused']})"
    _row(r, "reap", "auto-reap, daemon SIGKILLed inside the grace", what,
         "exercised and finished", exercised and finished)
    _row(r, "audit_lost", "audit lines lost",
         f"{lost_results + lost_signals} ({ended} process(es) ended by the daemon, "
         f"{lost_results} without a result line; {signals} signal(s) from the daemon seen by "
         f"the processes, {lost_signals} in no line)" + (f"; {details[0]}" if details else "")
         + f"; reap.jsonl: {dict(phases)}", "0", exercised and lost_results + lost_signals == 0)


def _chaos_rows(c: Chaos) -> None:
    """What was done to the daemon: figures without a goal."""
    r, f = c.result, c.result.figures
    storm = _json_of(c.text(c.storm_report)) or {}
    spawned = storm.get("spawned", 0)
    f["storm"] = storm
    _row(r, "storm", "processes spawned by the storm",
         f"{spawned:,} in {storm.get('seconds', 0):.0f} s ("
         f"{spawned / max(storm.get('seconds', 0), 1):.0f}/s, at most {storm.get('max_live', 0)} "
         f"alive, {storm.get('holders', 0)} GPU holders, {storm.get('spawn_failed', 0)} "
         "spawns failed)")
    inj = c.faults.injected
    f["nvml_faults"] = dict(inj)
    f["nvml_fault_calls"] = dict(c.faults.by_call)
    _row(r, "nvml_faults", "NVML faults injected (transient, 1-3 calls each)",
         f"{sum(inj.values()):,} over {len(c.faults.by_call)} calls, {len(inj)} of "
         f"{len(c.faults.codes)} error codes")
    drivers = [e for e in r.episodes if e.kind == "driver gone"]
    _row(r, "driver_gone", "driver gone (DRIVER_NOT_LOADED on every call)",
         ", ".join(f"{e.seconds:.1f} s (daemon showed it: {'yes' if e.seen else 'no'})"
                   for e in drivers) or "not run")
    flood: dict[str, Any] = {}
    for u in c.flood_users:
        flood[u["role"]] = {"processes": u["processes"], **_flood_stats(c, u)}
    f["flood"] = flood
    accepted = sum(c.scraper.accepted.values())
    rejected: Counter[str] = Counter()
    for (_, reason), v in c.scraper.rejected.items():
        rejected[reason] += int(v)
    f.update(agent_reports_accepted=accepted, agent_reports_rejected=dict(rejected))
    sent = sum(s.get("sent", 0) for s in flood.values())
    full = sum(s.get("queue_full", 0) for s in flood.values())
    _row(r, "flood", "agent datagrams from 4 flooding users",
         f"{sent:,} sent by {sum(u['processes'] for u in c.flood_users):,} processes "
         "(" + ", ".join(f"{k} {v.get('processes')}" for k, v in flood.items()) + "); "
         f"{full:,} dropped on a full queue; daemon: {accepted:,.0f} accepted, "
         f"{sum(rejected.values()):,} rejected ("
         + ", ".join(f"{k} {v}" for k, v in sorted(rejected.items()) if v) + ")")
    idle = c.idle
    f["idle_connections"] = {"target": idle.n, "opened": idle.opened,
                             "closed_by_daemon": idle.closed_by_daemon,
                             "connect_failed": idle.connect_failed,
                             "held_min": min(idle.held, default=0)}
    _row(r, "idle_connections", f"idle connections on the metrics port (target {idle.n})",
         f"{idle.opened:,} opened, {idle.closed_by_daemon:,} closed by the daemon, "
         f"{idle.connect_failed:,} connects failed; at least {min(idle.held, default=0)} held")
    fills = [e for e in r.episodes if e.kind == "state directory full"]
    _row(r, "state_full", "state directory full", ", ".join(
        f"{e.seconds:.1f} s ({e.detail}; {e.polls_during or 0:g} polls meanwhile)"
        if not e.detail.startswith("skipped") else e.detail for e in fills) or "not run")
    jumps = [e for e in r.episodes if e.kind == "clock jump"]
    _row(r, "clock_jumps", "the daemon's clock jumps (LD_PRELOAD)",
         ", ".join(f"{e.detail} (seen by the daemon: {'yes' if e.seen else 'NO'})"
                   for e in jumps) or "not run")
    f["episodes"] = [{"kind": e.kind, "seconds": e.seconds, "detail": e.detail, "seen": e.seen,
                      "recovered_after": e.recovered_after} for e in r.episodes]


# ---- running it --------------------------------------------------------------------------------


def run_chaos(opts: ChaosOptions) -> ChaosResult:
    result = ChaosResult(opts)
    why = cannot_run()
    if why is None:
        clean_stale(opts.log)
        why = uids_in_use_after(30.0)
    if why is not None:
        result.skipped = why
        return result
    with contextlib.ExitStack() as stack:
        c = Chaos(opts, result, stack)
        try:
            c.setup()
            c.run()
        finally:
            # Nothing interrupts the cleanup: a second Ctrl+C would leave mounts and cgroups.
            previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM,
                                                         signal.SIGHUP)}
            if threading.current_thread() is threading.main_thread():
                for s in previous:
                    signal.signal(s, signal.SIG_IGN)
            try:
                c.stop.set()
                c.innocents_alive_at_end = {pid: running(pid, ticks) for pid, (_, ticks, _)
                                            in c.innocents.items()}
                c.snapshot()
                stack.close()
                # Gone when the bench returns, so that a run right after it finds its uids free.
                uids_in_use_after(30.0)
            finally:
                if threading.current_thread() is threading.main_thread():
                    for s, handler in previous.items():
                        signal.signal(s, handler)
    analyse(c)
    return result


def format_rows(rows: list[dict[str, Any]]) -> str:
    """figure, goal and verdict, value: one line each."""
    if not rows:
        return "(no figures)"
    return columns([("figure", "goal", "value"), *(
        (r["figure"], "" if r["met"] is None else f"{verdict(r['met'])} ({r['goal']})",
         r["value"]) for r in rows)])


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    helpers = {"_sentinel": _sentinel_main, "_launcher": _launcher_main,
               "_service": _service_main, "_storm": _storm_main, "_flood": _flood_main,
               "_lazy_parent": _lazy_parent_main}
    if argv[:1] and argv[0] in helpers:
        p = argparse.ArgumentParser(prog=f"chaos.py {argv[0]}")
        p.add_argument("--log")
        p.add_argument("--ready")
        p.add_argument("--on-term", default="record", choices=("record", "exit"))
        p.add_argument("--agent", action="store_true")
        p.add_argument("--dir")
        p.add_argument("--name")
        p.add_argument("--workers", type=int, default=2)
        p.add_argument("--run-id")
        p.add_argument("--agent-rank", type=int, default=-1)
        p.add_argument("--exit-on-term", type=int, nargs="*", default=[])
        p.add_argument("--uid", type=int)
        p.add_argument("--rate", type=float)
        p.add_argument("--max-live", type=int)
        p.add_argument("--gpu-share", type=float)
        p.add_argument("--gpus", type=int)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--report")
        p.add_argument("--plan")
        return helpers[argv[0]](p.parse_args(argv[1:]))

    d = ChaosOptions()
    q = quick_options()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=d.duration / 60,
                   help="how long the chaos lasts (default 2)")
    p.add_argument("--storm-rate", type=float, default=d.storm_rate,
                   help="short-lived processes spawned a second")
    p.add_argument("--idle-connections", type=int, default=d.idle_connections)
    run_arguments(p, seed=d.seed, keep="daemon logs, reap.jsonl, signal logs")
    sys.argv = [sys.argv[0], *argv]
    a = node.parse_args(p, quick={"minutes": q.duration / 60},
                        smoke={"minutes": 0.25, "idle_connections": 50, "storm_rate": 50.0})
    say = console(a.quiet)

    base = smoke_options() if a.smoke else q if a.quick else d
    opts = ChaosOptions(**{**base.__dict__, "duration": a.minutes * 60,
                           "storm_rate": a.storm_rate, "idle_connections": a.idle_connections,
                           "seed": a.seed, "work_dir": a.keep, "log": say})
    unwind_on_signals(hangup=True)
    try:
        result = run_chaos(opts)
    except KeyboardInterrupt:
        print("chaos: interrupted; everything it started was ended and removed", file=sys.stderr)
        return 130
    if result.skipped:
        print(f"chaos: SKIPPED ({result.skipped})")
        node.write_figures(a.figures, {"skipped": result.skipped, "rows": [
            {"figure": "bench/chaos.py", "value": f"skipped: {result.skipped}", "goal": "",
             "met": None}]})
        return 0
    print(f"chaos: {result.elapsed:.0f} s; the daemon as its unit runs it: {result.limits}")
    print(format_rows(result.rows))
    for problem in result.problems:
        print(f"note: {problem}")
    failed = result.failed
    print("chaos: PASS" if not failed else
          f"chaos: FAIL ({len(failed)} goal(s) missed: "
          + "; ".join(r["figure"] for r in failed) + ")")
    node.write_figures(a.figures, {**result.figures, "rows": result.rows,
                                   "quick": bool(a.quick)})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
