"""Real process scenarios from the field, for the detector tests: orphans, zombies, leftovers.

Each context manager starts real processes, yields once /proc shows the scenario in place, and on
the way out kills everything it started with SIGKILL (process groups first, then what is left by
PID) and waits until none of it is running. Tests change the scenario with real signals:
`ctrl_c` and `sigkill_launcher`, or os.kill.

PIDs are always as this (the host's) /proc shows them, which is what NVML reports and what
gpuwatch reads, also for a job started inside a PID namespace.

Orphans here: PID 1 of this machine is the sandbox's init (`process_api --firecracker-init`),
which reaps orphans, but lazily (seconds later). So a process orphaned here gets PPid 1, and once
it is killed it may stay a zombie of PID 1 for a while; a zombie is not running, and cleanup only
waits until nothing it started is running. Where the test run itself sits under a child subreaper
(a `systemd --user` session, say) orphans go to that instead: `orphan_adopter()` says which.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from gpuwatch.simulate.demo import read_json, wait_for
from gpuwatch.simulate.fakenvml import FakeNvmlBuildError, _find_compiler
from gpuwatch.simulate.job import launch_env

PROGRAMS = Path(__file__).parent / "programs"
START_TIMEOUT = 60.0
GONE_TIMEOUT = 30.0

# What a distributed launcher or a batch system puts in a process's environment.
LAUNCH_VARIABLES = frozenset({
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "NODE_RANK", "JOB_ID",
})
LAUNCH_VARIABLE_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_", "SLURM_", "OMPI_", "PMI_",
                            "PMIX_", "HOROVOD_", "I_MPI_", "MV2_", "MPI_", "LSB_", "PBS_")

VIAS = (None, "subreaper", "shell", "subreaper-shell", "container", "entrypoint")
#: The ways of starting a job whose launcher runs in a PID namespace of its own.
_IN_NAMESPACE = ("shell", "container")


# ---- reading /proc -------------------------------------------------------------------------------


def _stat(pid: int) -> Optional[list[str]]:
    """The fields of /proc/PID/stat after the command name: [state, ppid, pgrp, session, ...]."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def state(pid: int) -> Optional[str]:
    """'R', 'S', 'Z', ... or None once the PID is gone."""
    fields = _stat(pid)
    return fields[0] if fields else None


def parent(pid: int) -> Optional[int]:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def process_group(pid: int) -> Optional[int]:
    fields = _stat(pid)
    return int(fields[2]) if fields else None


def running(pid: int) -> bool:
    """Exists and is not a zombie (a zombie holds nothing but its PID)."""
    return state(pid) not in (None, "Z", "X")


def status_field(pid: int, name: str) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == name:
                    return value.strip()
    except OSError:
        pass
    return None


def threads(pid: int) -> Optional[int]:
    value = status_field(pid, "Threads")
    return int(value) if value is not None else None


def environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = f.read().split(b"\0")
    pairs = (item.decode(errors="replace").partition("=") for item in items if item)
    return {key: value for key, _, value in pairs}


def environ_while_running(pid: int) -> dict[str, str]:
    """`environ(pid)`, or nothing for a process that ended while being looked at (a shell's
    short-lived `$(...)` child)."""
    try:
        return environ(pid)
    except (FileNotFoundError, ProcessLookupError):
        return {}


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [arg.decode(errors="replace") for arg in f.read().split(b"\0")[:-1]]


def comm(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().rstrip("\n")
    except OSError:
        return None


def wait_not_running(pids: Iterable[int], timeout: float = GONE_TIMEOUT,
                     what: str = "the processes to end") -> None:
    pids = list(pids)
    wait_for(what, lambda: True if not any(running(p) for p in pids) else None, timeout)


def clean_env(base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """`base` (default: this process's environment) without any launcher or batch variable."""
    env = dict(os.environ if base is None else base)
    return {k: v for k, v in env.items()
            if k not in LAUNCH_VARIABLES and not k.startswith(LAUNCH_VARIABLE_PREFIXES)}


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and parent(int(entry.name)) == pid:
            out.append(int(entry.name))
    return out


def _children_with(pid: int, variable: str) -> list[int]:
    return [child for child in _children(pid) if variable in environ_while_running(child)]


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = _children(todo.pop())
        found += kids
        todo += kids
    return found


def descendants(pid: int) -> list[int]:
    """Every descendant of `pid` now, by the parent PIDs /proc shows."""
    return _descendants(pid)


def _kill(pid: Optional[int]) -> None:
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _killpg(pgid: Optional[int]) -> None:
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def _reap_in_background(proc: subprocess.Popen[Any]) -> None:
    # The harness reaps its child as soon as it exits, as the shell that ran it would; otherwise
    # a killed launcher would linger as our zombie and still have its /proc entry.
    threading.Thread(target=proc.wait, name=f"reap-{proc.pid}", daemon=True).start()


def _unique(tmp_path: Path, stem: str, suffix: str = "") -> Path:
    return tmp_path / f"{stem}-{uuid.uuid4().hex[:8]}{suffix}"


# ---- orphans -------------------------------------------------------------------------------------


def _double_fork(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Start `argv` as a daemon does (fork, setsid, exec) from a parent that exits at once; the
    PID returned is already an orphan, adopted by `orphan_adopter()`."""
    code = ("import json, os, sys\n"
            "argv, env = json.loads(sys.argv[1])\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os.setsid()\n"
            "    null = os.open(os.devnull, os.O_RDWR)\n"
            "    os.dup2(null, 0)\n"
            "    os.dup2(null, 1)\n"
            "    os.execve(argv[0], argv, env)\n"
            "print(pid, flush=True)\n")
    # stdout is a pipe read to its end: the daemon must not keep it open. Its stderr stays
    # the test's, so that a failure to start shows.
    middle = subprocess.run([sys.executable, "-c", code, json.dumps([list(argv), dict(env)])],
                            stdout=subprocess.PIPE, text=True, timeout=START_TIMEOUT, check=True)
    # The middle process has been reaped, so the orphan's PPid is already its adopter's.
    return int(middle.stdout)


@functools.cache
def orphan_adopter() -> int:
    """The PID that orphans of this test run are reparented to: 1 unless a subreaper is above."""
    pid = _double_fork([sys.executable, "-c", "import time; time.sleep(60)"], clean_env())
    try:
        adopter = parent(pid)
    finally:
        _kill(pid)
    assert adopter is not None
    return adopter


@contextlib.contextmanager
def _orphan(argv: Sequence[str], env: Mapping[str, str], what: str,
            started: Callable[[int], bool]) -> Iterator[int]:
    pid = _double_fork(argv, env)
    try:
        wait_for(what, lambda: True if running(pid) and started(pid) else None, START_TIMEOUT)
        yield pid
    finally:
        _kill(pid)
        wait_not_running([pid], what=f"{what}: PID {pid} to end")


SERVICE_BODY = """\
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:  # serving notebooks would go here
    time.sleep(3600)
"""


@contextlib.contextmanager
def plain_service(tmp_path: Path, name: str = "jupyter-lab",
                  args: Sequence[str] = ("--no-browser",)) -> Iterator[int]:
    """A long-running service that is not part of any job: no launcher or batch variable in its
    environment (see `clean_env`), started as a daemon (fork, setsid, exec from a parent that
    exits) so that its parent is PID 1 (`orphan_adopter()`).

    It is a Python console script named `name`, run through its `#!python` line, so that its
    comm is `name` and its cmdline `python /.../name ARGS` exactly as a pip-installed
    `jupyter-lab` looks. Yields its PID.
    """
    script = _unique(tmp_path, "service") / name
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\n{SERVICE_BODY}")
    script.chmod(0o755)
    with _orphan([str(script), *args], clean_env(), f"the {name} service",
                 lambda pid: comm(pid) == name[:15]) as pid:
        yield pid


# ---- services: long-lived parents of GPU holders that are not one job -------------------------

SERVICE_TREE = """\
import json, os, signal, subprocess, sys
spec = json.loads(sys.argv[1])
if spec["title"]:
    import setproctitle
    setproctitle.setproctitle(spec["title"])
children = [subprocess.Popen(argv) for argv in spec["children"]]
restarts = 0

def write_ready():
    tmp = spec["ready"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "children": [c.pid for c in children],
                   "restarts": restarts}, f)
    os.replace(tmp, spec["ready"])

def stop(*_):
    for c in children:
        c.kill()
    os._exit(0)

signal.signal(signal.SIGTERM, stop)
write_ready()
while True:  # the service's own work would go here; it reaps and, if asked, restarts children
    pid, _ = os.wait()
    for i, c in enumerate(children):
        if c.pid == pid:
            c.returncode = 0
            if spec["restart"]:
                children[i] = subprocess.Popen(spec["children"][i])
                restarts += 1
                write_ready()
"""

TITLED_SLEEP = """\
import setproctitle, sys, time
setproctitle.setproctitle(sys.argv[1])
while True:
    time.sleep(3600)
"""

#: A stand-in for ipykernel's launcher module, run as `python -m ipykernel_launcher -f FILE`.
KERNEL_BODY = """\
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:  # executing cells would go here
    time.sleep(3600)
"""


@dataclass
class ServiceTree:
    """A service and its children, in host PIDs; `children` as the service's ready file says
    now (a restarted child has a new PID there)."""

    service: int
    ready: Path
    _proc: subprocess.Popen[bytes] = field(repr=False, compare=False)

    def children(self) -> list[int]:
        info = read_json(self.ready)
        assert info is not None
        return [int(pid) for pid in info["children"]]

    def restarts(self) -> int:
        info = read_json(self.ready)
        return int(info["restarts"]) if info is not None else 0


@contextlib.contextmanager
def _service_tree(argv: Sequence[str], children: Sequence[Sequence[str]], ready: Path,
                  env: Mapping[str, str], what: str, title: Optional[str] = None,
                  restart: bool = False) -> Iterator[ServiceTree]:
    spec = json.dumps({"title": title, "children": [list(c) for c in children],
                       "ready": str(ready), "restart": restart})
    top = subprocess.Popen([*argv, spec], env=dict(env), stdin=subprocess.DEVNULL,
                           start_new_session=True)
    _reap_in_background(top)
    try:
        info = wait_for(what, lambda: read_json(ready), START_TIMEOUT, alive=top)
        tree = ServiceTree(top.pid, ready, top)
        kids = [int(pid) for pid in info["children"]]
        wait_for(f"{what}: its children to start", lambda: True if all(
            running(pid) and cmdline(pid) and cmdline(pid) != cmdline(top.pid)
            for pid in kids) else None, START_TIMEOUT)
        yield tree
    finally:
        _end_job(top, top.pid, [], what)


@contextlib.contextmanager
def raylet_like(tmp_path: Path, actor_title: str = "ray::Actor") -> Iterator[ServiceTree]:
    """A Ray node's manager as `ray start` leaves it: a process titled `raylet` (setproctitle,
    as comm and command line show it) whose children are its agents, titled
    `ray::DashboardAgent` and `ray::RuntimeEnvAgent`, and a worker running an actor, titled
    `actor_title`. Children in that order; a killed child is not restarted (a detached actor
    `ray.kill`ed stays dead). Clean environment: no launcher variable anywhere."""
    titled = [sys.executable, "-c", TITLED_SLEEP]
    children = [[*titled, "ray::DashboardAgent"], [*titled, "ray::RuntimeEnvAgent"],
                [*titled, actor_title]]
    with _service_tree([sys.executable, "-c", SERVICE_TREE], children,
                       _unique(tmp_path, "raylet", ".json"), clean_env(), "the raylet",
                       title="raylet") as tree:
        wait_for("the raylet's title", lambda: True if comm(tree.service) == "raylet" and all(
            (comm(pid) or "").startswith("ray::") for pid in tree.children()) else None,
            START_TIMEOUT)
        yield tree


@contextlib.contextmanager
def notebook_server_like(tmp_path: Path, kernels: int = 3) -> Iterator[ServiceTree]:
    """A notebook server as a pip-installed `jupyter-lab` runs (a console script through its
    `#!python` line: comm `jupyter-lab`) with `kernels` kernels, each exactly as the server
    starts one: `python -m ipykernel_launcher -f /.../kernel-<id>.json`. A kernel that exits is
    started again with the same command line, as the server's restarter does after a kernel
    died or was restarted from the notebook. Clean environment."""
    home = _unique(tmp_path, "jupyter")
    (home / "site").mkdir(parents=True)
    (home / "site" / "ipykernel_launcher.py").write_text(KERNEL_BODY)
    runtime = home / "runtime"
    runtime.mkdir()
    server = home / "jupyter-lab"
    server.write_text(f"#!{sys.executable}\n{SERVICE_TREE}")
    server.chmod(0o755)
    children = [[sys.executable, "-m", "ipykernel_launcher", "-f",
                 str(runtime / f"kernel-{uuid.uuid4()}.json")] for _ in range(kernels)]
    env = {**clean_env(), "PYTHONPATH": str(home / "site")}
    with _service_tree([str(server)], children, home / "ready.json", env,
                       "the notebook server", restart=True) as tree:
        yield tree


# ---- the real programs, where installed (too large to be the suite's dependencies) --------------


def installed_program(name: str, imports: str) -> tuple[Path, str]:
    """`name` on PATH and the Python its `#!` line runs, which must import `imports`; the test
    is skipped where either is missing ("ray not installed")."""
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{imports} not installed ({name} is not on PATH)")
    first = Path(found).read_text(errors="replace").split("\n", 1)[0]
    python = first[2:].strip() if first.startswith("#!") else sys.executable
    probe = subprocess.run([python, "-c", f"import {imports}"], capture_output=True,
                           timeout=START_TIMEOUT)
    if probe.returncode != 0:
        pytest.skip(f"{imports} not installed for {python}")
    return Path(found), python


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RealNotebookServer:
    """A real `jupyter-server` and the kernels it started, in host PIDs."""

    server: int
    url: str
    token: str

    def _call(self, method: str, path: str) -> Any:
        import urllib.request
        request = urllib.request.Request(f"{self.url}{path}", method=method, data=(
            b"{}" if method == "POST" else None), headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=START_TIMEOUT) as response:
            body = response.read()
        return json.loads(body) if body else None

    def start_kernel(self) -> str:
        return str(self._call("POST", "/api/kernels")["id"])

    def restart_kernel(self, kernel_id: str) -> None:
        self._call("POST", f"/api/kernels/{kernel_id}/restart")

    def kernel_pids(self) -> dict[str, int]:
        """{kernel id: PID} of the server's children running a kernel (its connection file,
        `kernel-<id>.json`, names it)."""
        found: dict[str, int] = {}
        for child in _children(self.server):
            try:
                args = cmdline(child)
            except OSError:
                continue
            if "ipykernel_launcher" in args and "-f" in args[:-1]:
                name = Path(args[args.index("-f") + 1]).name
                if name.startswith("kernel-") and name.endswith(".json"):
                    found[name[len("kernel-"):-len(".json")]] = child
        return found


@contextlib.contextmanager
def real_notebook_server(tmp_path: Path) -> Iterator[RealNotebookServer]:
    """`jupyter-server` (jupyter_server, with ipykernel for its kernels) as a user runs it, on a
    free port, its runtime and data directories under `tmp_path`. Skipped where not installed."""
    program, _ = installed_program("jupyter-server", "jupyter_server, ipykernel")
    home = _unique(tmp_path, "jupyter-home")
    home.mkdir()
    port, token = _free_port(), uuid.uuid4().hex
    env = {**clean_env(), "HOME": str(home), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
           "JUPYTER_DATA_DIR": str(home / "data"), "JUPYTER_CONFIG_DIR": str(home / "config")}
    top = subprocess.Popen([str(program), "--no-browser", "--allow-root", f"--port={port}",
                            "--ip=127.0.0.1", f"--IdentityProvider.token={token}",
                            f"--ServerApp.root_dir={home}"],
                           env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    _reap_in_background(top)
    server = RealNotebookServer(top.pid, f"http://127.0.0.1:{port}", token)

    def answers() -> Optional[bool]:
        try:
            server._call("GET", "/api/status")
            return True
        except OSError:
            return None

    try:
        wait_for("the notebook server to answer", answers, START_TIMEOUT, alive=top)
        yield server
    finally:
        _end_job(top, top.pid, [], "the notebook server")


RAY_DRIVER = """\
import os, sys, ray
ray.init(address=sys.argv[1], namespace="gpuwatch-test", log_to_driver=False)

@ray.remote(num_cpus=0)
class Holder:
    def pid(self):
        return os.getpid()

actor = Holder.options(name="holder", lifetime="detached").remote()
print(ray.get(actor.pid.remote()), flush=True)
sys.stdin.readline()
ray.kill(actor)
print("killed", flush=True)
"""


@dataclass
class RealRayNode:
    """A real Ray head node (`ray start --head --block`), in host PIDs."""

    start: int
    address: str
    python: str

    def raylet(self) -> Optional[int]:
        return next((pid for pid in _descendants(self.start) if comm(pid) == "raylet"), None)


@contextlib.contextmanager
def real_ray_node(tmp_path: Path) -> Iterator[RealRayNode]:
    """`ray start --head --block` on a free port, its temp dir short (Ray's socket paths must
    fit 107 bytes), usage stats off. Skipped where Ray is not installed."""
    import tempfile
    program, python = installed_program("ray", "ray")
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    port = _free_port()
    env = {**clean_env(), "RAY_USAGE_STATS_ENABLED": "0"}
    top = subprocess.Popen([str(program), "start", "--head", f"--port={port}", "--num-cpus=1",
                            "--include-dashboard=false", f"--temp-dir={temp}", "--block"],
                           env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    _reap_in_background(top)
    node = RealRayNode(top.pid, f"127.0.0.1:{port}", python)
    try:
        wait_for("the raylet and its agents", lambda: True if (raylet := node.raylet()) and sum(
            (comm(pid) or "").startswith("ray::") for pid in _children(raylet)) >= 2 else None,
            START_TIMEOUT * 2, alive=top)
        yield node
    finally:
        _end_job(top, top.pid, [], "the Ray node")
        shutil.rmtree(temp, ignore_errors=True)


@contextlib.contextmanager
def real_ray_actor(node: RealRayNode) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """A driver that starts a detached actor on `node`: yields the actor's PID and the driver,
    which `ray.kill`s the actor when a line is written to its stdin, then prints "killed"."""
    driver = subprocess.Popen([node.python, "-c", RAY_DRIVER, node.address],
                              env={**clean_env(), "RAY_USAGE_STATS_ENABLED": "0"},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        assert driver.stdout is not None
        said = [driver.stdout.readline() for _ in range(1)]
        while said[-1] and not said[-1].strip().isdigit():  # Ray's own notices come first
            said.append(driver.stdout.readline())
        assert said[-1].strip().isdigit(), f"the Ray driver said {said!r}"
        yield int(said[-1]), driver
    finally:
        driver.kill()
        driver.wait(GONE_TIMEOUT)


#: A Ray job with a runtime environment of its own, as `ray job submit --working-dir` gives
#: one: Ray starts its workers for the job, with RAY_JOB_ID set to it. (Without one, a job's
#: actor runs in a worker Ray started beforehand, whose RAY_JOB_ID is the nil id `ffffffff`.)
RAY_JOB_DRIVER = """\
import os, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False,
         runtime_env={"env_vars": {"TRAINING_STAGE": "pretrain"}})

@ray.remote(num_cpus=0)
class Holder:
    def pid(self):
        return os.getpid()

actor = Holder.remote()
print(ray.get(actor.pid.remote()), ray.get_runtime_context().get_job_id(), flush=True)
sys.stdin.readline()
"""


@contextlib.contextmanager
def real_ray_job_actor(node: RealRayNode) -> Iterator[tuple[int, str]]:
    """A driver, a Ray job of `node` with a runtime environment (RAY_JOB_DRIVER), and an actor
    of its own (not detached): yields the actor's PID and the job's id as Ray gives it
    (`01000000`); the driver ends on the way out, and Ray ends the actor with it."""
    driver = subprocess.Popen([node.python, "-c", RAY_JOB_DRIVER, node.address],
                              env={**clean_env(), "RAY_USAGE_STATS_ENABLED": "0"},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    actor: Optional[int] = None
    try:
        assert driver.stdout is not None
        said = driver.stdout.readline().split()
        assert len(said) == 2 and said[0].isdigit(), f"the Ray driver said {said!r}"
        actor = int(said[0])
        yield actor, said[1]
    finally:
        driver.kill()
        driver.wait(GONE_TIMEOUT)
        if actor is not None:
            wait_not_running([actor])


@contextlib.contextmanager
def orphaned_worker_under_pid1(tmp_path: Path, local_rank: int = 3, world_size: int = 4,
                               run_id: str = "orphaned-run") -> Iterator[int]:
    """A worker whose launcher died before anyone watched: parent PID 1 (`orphan_adopter()`),
    started as `plain_service` is, `python -m gpuwatch.simulate.job --worker`, environment as the
    launcher set it (LOCAL_RANK=RANK=`local_rank`, WORLD_SIZE, TORCHELASTIC_RUN_ID=`run_id`,
    MASTER_ADDR=127.0.0.1, ...) over an otherwise clean one. Yields its PID."""
    env = launch_env(local_rank, world_size, run_id, base=clean_env())
    argv = [sys.executable, "-m", "gpuwatch.simulate.job", "--worker"]
    with _orphan(argv, env, f"the orphaned rank-{local_rank} worker",
                 lambda pid: "--worker" in cmdline(pid)) as pid:
        yield pid


# ---- a torchrun-like job -------------------------------------------------------------------------


@dataclass
class JobPids:
    """A running job, in host PIDs.

    `group` is the process group of the launcher, its workers and its helpers (the launcher's
    PID): the terminal's foreground group, which a Ctrl+C reaches. `via` is how it was started;
    `subreaper` and `shell` are the process that adopts the workers when the launcher dies, for
    the ways of starting that have one.
    """

    launcher: int
    workers: list[int]
    helpers: dict[str, int]
    run_id: str
    group: int
    via: Optional[str] = None
    subreaper: Optional[int] = None
    shell: Optional[int] = None
    _launcher_proc: Optional[subprocess.Popen[bytes]] = field(default=None, repr=False,
                                                              compare=False)

    @property
    def adopter(self) -> int:
        """Who the workers get as parent once the launcher is gone."""
        if self.shell is not None:
            return self.shell
        if self.subreaper is not None:
            return self.subreaper
        return orphan_adopter()

    @property
    def pids(self) -> list[int]:
        return [self.launcher, *self.workers, *self.helpers.values()]

    @property
    def launcher_returncode(self) -> Optional[int]:
        """The launcher's exit status, where the test harness is its parent (via=None)."""
        return None if self._launcher_proc is None else self._launcher_proc.returncode


@functools.cache
def pid_namespaces() -> Optional[str]:
    """None if this process may create PID namespaces (`unshare --pid`), else why not."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "no unshare(1) (util-linux) on PATH"
    try:
        probe = subprocess.run([unshare, "--pid", "--fork", "true"], capture_output=True,
                               text=True, timeout=START_TIMEOUT)
    except OSError as exc:
        return f"unshare --pid failed: {exc}"
    if probe.returncode != 0:
        return f"unshare --pid is not permitted here: {probe.stderr.strip()}"
    return None


def _host_pids(inside_of: int, ns_pids: Iterable[int]) -> Optional[dict[int, int]]:
    """{PID in the PID namespace of `inside_of`: host PID} for `ns_pids`, or None until all are
    found."""
    wanted = set(ns_pids)
    target = os.readlink(f"/proc/{inside_of}/ns/pid")
    found: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry.name}/ns/pid") != target:
                continue
        except OSError:
            continue
        nspid = status_field(int(entry.name), "NSpid")
        if nspid and int(nspid.split()[-1]) in wanted:
            found[int(nspid.split()[-1])] = int(entry.name)
    return found if set(found) == wanted else None


ENTRYPOINT = """\
import subprocess, sys
from gpuwatch.simulate.job import become_subreaper, reap_children_forever
become_subreaper()
subprocess.Popen([sys.executable, "-m", "gpuwatch.simulate.job", *sys.argv[1:]],
                 start_new_session=True)
reap_children_forever()
"""


def _launcher_args(ready: Path, workers: int, helpers: Sequence[str],
                   trainer_exit_after: Optional[float], launcher_waits_for: str,
                   stubborn_rank: Optional[int], sigint_grace: float,
                   run_id: Optional[str], trainer_exit_clock: str = "start") -> list[str]:
    args = ["--workers", str(workers), "--ready", str(ready),
            "--launcher-waits-for", launcher_waits_for, "--sigint-grace", repr(sigint_grace)]
    if helpers:
        args += ["--helpers", ",".join(helpers)]
    if trainer_exit_after is not None:
        args += ["--trainer-exit-after", repr(trainer_exit_after),
                 "--trainer-exit-clock", trainer_exit_clock]
    if stubborn_rank is not None:
        args += ["--stubborn-rank", str(stubborn_rank)]
    if run_id is not None:
        args += ["--run-id", run_id]
    return args


@contextlib.contextmanager
def torchrun_job(tmp_path: Path, workers: int = 4, env: Optional[Mapping[str, str]] = None,
                 helpers: Sequence[str] = (), trainer_exit_after: Optional[float] = None,
                 launcher_waits_for: str = "helpers", stubborn_rank: Optional[int] = None,
                 via: Optional[str] = None, sigint_grace: float = 2.0,
                 run_id: Optional[str] = None, cgroup: Optional[Path] = None,
                 trainer_exit_clock: str = "start") -> Iterator[JobPids]:
    """A launcher with `workers` workers and one helper per role in `helpers` (see
    gpuwatch.simulate.job for `trainer_exit_after`, `trainer_exit_clock`, `launcher_waits_for`,
    `stubborn_rank` and `sigint_grace`), with `env` added to this process's environment. The
    launcher leads its own process group, which its workers and helpers share. `via` says what
    starts it:

    None
        This test process, with the launcher in a session of its own. Orphans go to
        `orphan_adopter()` (PID 1 here).
    "subreaper"
        `python -m gpuwatch.simulate.job subreaper`: a child subreaper, as a service manager or
        a container's init is. Orphans go to it (`JobPids.subreaper`), which reaps them.
    "shell"
        A shell that is PID 1 of its own PID namespace, as with `docker run IMAGE bash` where
        the user then types the torchrun command: bash with job control on (`set -m`) runs the
        launcher as its foreground job, in a group of its own, and waits at `read` as at its
        prompt. When the launcher dies the kernel gives its children to the namespace's init:
        the shell (`JobPids.shell`). Outside a namespace a shell never adopts anything (orphans
        go to the nearest subreaper or PID 1), so this is the case of workers reparented to the
        launching shell. Needs the right to create PID namespaces (root here); skipped where
        `unshare --pid` is refused.
    "subreaper-shell"
        The same shell and job, but the shell made a child subreaper before it is exec'd (the
        flag survives exec) instead of a namespace's init: the nearest stand-in where PID
        namespaces are refused. The shell is not PID 1 then.
    "container"
        `unshare --pid --fork --mount-proc bash -c 'LAUNCHER; sleep 600'`: a container whose
        command is a script around the launcher. Without job control the launcher runs in the
        group the shell was started in (`JobPids.group`, the `unshare` process's), and the
        workers with it; when the launcher dies the kernel gives them to the namespace's init,
        the shell (`JobPids.shell`), and nothing in their process group shows it. Skipped where
        `unshare --pid` is refused.
    "entrypoint"
        `entrypoint-x`, a small program that makes itself a child subreaper (prctl through
        ctypes), starts the launcher in a session of its own as a supervisor starts a service,
        and reaps whatever exits: a subreaper by what it does, under a name no list holds
        (`JobPids.subreaper`).

    `cgroup` (with `via` None): a cgroup directory the launcher joins before it starts, as a
    scheduler places a job's first process; everything it starts inherits the cgroup.

    Yields the job's PIDs once every worker and helper is up.
    """
    if via not in VIAS:
        raise ValueError(f"via must be one of {VIAS}, not {via!r}")
    if via in _IN_NAMESPACE and (why := pid_namespaces()) is not None:
        pytest.skip(f"via={via!r} needs a PID namespace: {why}")
    ready = _unique(tmp_path, "job", ".json")
    launcher_cmd = [sys.executable, "-m", "gpuwatch.simulate.job",
                    *_launcher_args(ready, workers, helpers, trainer_exit_after,
                                    launcher_waits_for, stubborn_rank, sigint_grace, run_id,
                                    trainer_exit_clock)]
    full_env = {**os.environ, **(env or {})}
    # The shell's foreground job, then the shell waits at its "prompt" until stdin closes.
    script = f"set -m\n{shlex.join(launcher_cmd)} </dev/null\nread -r _\n"
    bash = shutil.which("bash") or "bash"
    subreaper_ready = _unique(tmp_path, "subreaper", ".json")
    if via is None:
        join = (None if cgroup is None else
                lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid())))
        top = subprocess.Popen(launcher_cmd, env=full_env, start_new_session=True,
                               preexec_fn=join)
    elif via == "subreaper":
        top = subprocess.Popen([sys.executable, "-m", "gpuwatch.simulate.job", "subreaper",
                                "--ready", str(subreaper_ready), "--", *launcher_cmd[3:]],
                               env=full_env, start_new_session=True)
    elif via == "shell":
        top = subprocess.Popen([shutil.which("unshare") or "unshare", "--pid", "--fork",
                                "--kill-child", bash, "-c", script],
                               env=full_env, stdin=subprocess.PIPE, start_new_session=True)
    elif via == "container":
        around = f"{shlex.join(launcher_cmd)} </dev/null; sleep 600"
        top = subprocess.Popen([shutil.which("unshare") or "unshare", "--pid", "--fork",
                                "--mount-proc", "--kill-child", bash, "-c", around],
                               env=full_env, stdin=subprocess.DEVNULL, start_new_session=True)
    elif via == "entrypoint":
        entrypoint = _unique(tmp_path, "entrypoint") / "entrypoint-x"
        entrypoint.parent.mkdir()
        entrypoint.write_text(f"#!{sys.executable}\n{ENTRYPOINT}")
        entrypoint.chmod(0o755)
        top = subprocess.Popen([str(entrypoint), *launcher_cmd[3:]], env=full_env,
                               start_new_session=True)
    else:
        become = ("import os, sys\n"
                  "from gpuwatch.simulate.job import become_subreaper\n"
                  "become_subreaper()\n"
                  "os.execv(sys.argv[1], sys.argv[1:])\n")
        top = subprocess.Popen([sys.executable, "-c", become, bash, "-c", script],
                               env=full_env, stdin=subprocess.PIPE, start_new_session=True)
    if via is None:
        _reap_in_background(top)
    job: Optional[JobPids] = None
    shell: Optional[int] = None
    try:
        if via in _IN_NAMESPACE:
            shell = wait_for("the shell in its PID namespace",
                             lambda: (_children(top.pid) or [None])[0], START_TIMEOUT, alive=top)
        elif via == "subreaper-shell":
            shell = top.pid
        info = wait_for("the job to start", lambda: read_json(ready), START_TIMEOUT, alive=top)
        pids = {"launcher": int(info["launcher"]), "workers": [int(p) for p in info["workers"]],
                "helpers": {str(r): int(p) for r, p in info["helpers"].items()}}
        if via in _IN_NAMESPACE:
            assert shell is not None
            inside = [pids["launcher"], *pids["workers"], *pids["helpers"].values()]
            host = wait_for("the job's host PIDs", lambda: _host_pids(shell, inside),
                            START_TIMEOUT)
            pids = {"launcher": host[pids["launcher"]],
                    "workers": [host[p] for p in pids["workers"]],
                    "helpers": {r: host[p] for r, p in pids["helpers"].items()}}
        job = JobPids(launcher=pids["launcher"], workers=pids["workers"],
                      helpers=pids["helpers"], run_id=str(info["run_id"]),
                      group=top.pid if via == "container" else pids["launcher"], via=via,
                      subreaper=top.pid if via in ("subreaper", "entrypoint") else None,
                      shell=shell, _launcher_proc=top if via is None else None)
        assert process_group(job.launcher) == job.group, "the job's group is as documented"
        yield job
    finally:
        _end_job(top, job.group if job is not None else (top.pid if via is None else None),
                 job.pids if job is not None else [], "the job's processes")


@contextlib.contextmanager
def launcher_as_container_init(tmp_path: Path, workers: int = 2) -> Iterator[JobPids]:
    """A container whose command is the launcher itself (`docker run IMAGE torchrun ...`): a
    launcher named `torchrun` (gpuwatch.simulate.job under that name, as the demo runs it) that
    is PID 1 of its own PID namespace, its workers its children. Healthy: their parent is their
    launcher, though it is a namespace's init. Skipped where `unshare --pid` is refused."""
    if (why := pid_namespaces()) is not None:
        pytest.skip(f"a launcher as a container's init needs a PID namespace: {why}")
    torchrun = _unique(tmp_path, "bin") / "torchrun"
    torchrun.parent.mkdir()
    torchrun.write_text(f"#!{sys.executable}\nimport sys\n"
                        "from gpuwatch.simulate.job import main\nsys.exit(main())\n")
    torchrun.chmod(0o755)
    ready = _unique(tmp_path, "job", ".json")
    top = subprocess.Popen([shutil.which("unshare") or "unshare", "--pid", "--fork",
                            "--mount-proc", "--kill-child", str(torchrun), "--workers",
                            str(workers), "--ready", str(ready)],
                           stdin=subprocess.DEVNULL, start_new_session=True)
    job: Optional[JobPids] = None
    try:
        init = wait_for("the launcher in its PID namespace",
                        lambda: (_children(top.pid) or [None])[0], START_TIMEOUT, alive=top)
        info = wait_for("the job to start", lambda: read_json(ready), START_TIMEOUT, alive=top)
        inside = [int(info["launcher"]), *(int(w) for w in info["workers"])]
        host = wait_for("the job's host PIDs", lambda: _host_pids(init, inside), START_TIMEOUT)
        job = JobPids(launcher=host[inside[0]], workers=[host[w] for w in inside[1:]],
                      helpers={}, run_id=str(info["run_id"]), group=top.pid, via="container")
        assert job.launcher == init and comm(init) == "torchrun"
        yield job
    finally:
        _end_job(top, top.pid, job.pids if job is not None else [], "the container's job")


@contextlib.contextmanager
def shell_loop_as_container_init(ranks: int = 2) -> Iterator[JobPids]:
    """A container whose init starts the ranks itself: `bash -c 'for r in ...; do RANK=$r
    LOCAL_RANK=$r ... python ... & done; wait'` as PID 1 of its PID namespace, the ranks its
    children with rank variables a shell sets and none a launcher sets. Healthy. Skipped where
    `unshare --pid` is refused."""
    if (why := pid_namespaces()) is not None:
        pytest.skip(f"a shell loop as a container's init needs a PID namespace: {why}")
    rank = f"{shlex.quote(sys.executable)} -c 'import time; time.sleep(600)'"
    loop = (f"for r in $(seq 0 {ranks - 1}); do RANK=$r LOCAL_RANK=$r WORLD_SIZE={ranks} "
            f"MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 {rank} & done; wait")
    top = subprocess.Popen([shutil.which("unshare") or "unshare", "--pid", "--fork",
                            "--mount-proc", "--kill-child", "bash", "-c", loop],
                           stdin=subprocess.DEVNULL, start_new_session=True)
    job: Optional[JobPids] = None
    try:
        init = wait_for("the shell in its PID namespace",
                        lambda: (_children(top.pid) or [None])[0], START_TIMEOUT, alive=top)
        workers = wait_for("its ranks", lambda: (
            found if len(found := _children_with(init, "RANK")) == ranks else None),
            START_TIMEOUT, alive=top)
        job = JobPids(launcher=init, workers=sorted(workers), helpers={}, run_id="",
                      group=top.pid, via="container")
        yield job
    finally:
        _end_job(top, top.pid, job.pids if job is not None else [], "the container's ranks")


def _end_job(top: subprocess.Popen[Any], group: Optional[int], pids: Iterable[int],
             what: str) -> None:
    """Kill everything a scenario started under `top`: the job's process group, every
    descendant of `top`, the job's own PIDs (reparented ones too) and `top`; wait until none
    runs."""
    pids = list(pids)
    started = _descendants(top.pid)
    _killpg(group)
    for pid in [*started, *pids]:
        _kill(pid)
    _kill(top.pid)
    if top.stdin is not None:
        top.stdin.close()
    top.wait(GONE_TIMEOUT)
    wait_not_running([top.pid, *started, *pids], what=f"{what} to end")


def ctrl_c(job: JobPids) -> None:
    """SIGINT to the job's process group, as a terminal sends it on Ctrl+C: the launcher, its
    workers and its helpers all get it at once."""
    os.killpg(job.group, signal.SIGINT)


def wait_launcher_gone(job: JobPids, timeout: float = GONE_TIMEOUT) -> Optional[int]:
    """Wait until the launcher has exited and been reaped by its parent; its exit status where
    that parent is this test process, else None."""
    wait_for(f"the launcher {job.launcher} to be gone",
             lambda: True if state(job.launcher) is None else None, timeout)
    proc = job._launcher_proc
    if proc is not None:
        return wait_for("the launcher's exit status", lambda: proc.returncode, timeout)
    return None


def sigkill_launcher(job: JobPids) -> None:
    """SIGKILL the launcher alone, as the OOM killer or a `kill -9` does; returns once it is gone
    and its workers and helpers have been reparented."""
    os.kill(job.launcher, signal.SIGKILL)
    wait_launcher_gone(job)
    children = [*job.workers, *job.helpers.values()]
    wait_for("the workers to be reparented",
             lambda: True if all(parent(p) != job.launcher for p in children) else None,
             GONE_TIMEOUT)


# ---- a job under `gpuwatch run` ------------------------------------------------------------------

STAND_IN_SUPERVISOR = """\
import os, subprocess, sys
from gpuwatch.simulate.job import become_subreaper, reap_children_forever
from gpuwatch.sources.processes import ProcessSource

run_id, ready, *launcher_args = sys.argv[1:]
become_subreaper()
start = ProcessSource().stat(os.getpid()).start_time
env = {**os.environ, "GPUWATCH_RUN_ID": run_id,
       "GPUWATCH_RUN_SUPERVISOR": f"{os.getpid()}:{start!r}"}
subprocess.Popen([sys.executable, "-m", "gpuwatch.simulate.job", "--ready", ready,
                  *launcher_args], env=env, start_new_session=True)
reap_children_forever()
"""


@dataclass
class SupervisedJob(JobPids):
    """A job under a stand-in for `gpuwatch run`: `supervisor` is its host PID; the job's
    processes carry GPUWATCH_RUN_ID=`run_id` and GPUWATCH_RUN_SUPERVISOR=`named_pid`:`its start
    time`, where `named_pid` is the supervisor's PID as it sees it itself (in its PID namespace)."""

    supervisor: int = 0
    named_pid: int = 0


@contextlib.contextmanager
def supervised_job(tmp_path: Path, run_id: str, workers: int = 1,
                   helpers: Sequence[str] = ("redis",), in_pid_namespace: bool = False
                   ) -> Iterator[SupervisedJob]:
    """A stand-in for `gpuwatch run`: a child subreaper that starts a launcher with `workers`
    workers and one helper per role (gpuwatch.simulate.job) with the two variables `gpuwatch run`
    sets, its own PID and start time (as ProcessSource reads it) in the second, and then reaps
    whatever exits. The launcher leads its own session and group.

    `in_pid_namespace`: the stand-in runs as a container's command does, in a PID namespace of
    its own with its own /proc, under a shell that is the namespace's init (so that the stand-in
    is not PID 1 there, whose death would end the namespace); the PIDs it writes down are the
    namespace's. Needs the right to create PID and mount namespaces; skipped where `unshare
    --pid` is refused.

    Yields host PIDs once every worker and helper is up; everything is killed on the way out."""
    if in_pid_namespace and (why := pid_namespaces()) is not None:
        pytest.skip(f"in_pid_namespace needs a PID namespace: {why}")
    ready = _unique(tmp_path, "supervised", ".json")
    args = ["--workers", str(workers), "--run-id", f"{run_id}-elastic"]
    if helpers:
        args += ["--helpers", ",".join(helpers)]
    stand_in_cmd = [sys.executable, "-c", STAND_IN_SUPERVISOR, run_id, str(ready), *args]
    if in_pid_namespace:
        # The shell waits at `read` as at its prompt, adopting what the stand-in leaves behind.
        # With the namespace's own /proc, as a container has: /proc/PID is the PID it sees.
        top = subprocess.Popen([shutil.which("unshare") or "unshare", "--pid", "--fork",
                                "--mount-proc", "--kill-child", shutil.which("bash") or "bash",
                                "-c", f"{shlex.join(stand_in_cmd)} & read -r _"],
                               env=clean_env(), stdin=subprocess.PIPE, start_new_session=True)
    else:
        top = subprocess.Popen(stand_in_cmd, env=clean_env(), start_new_session=True)
        _reap_in_background(top)
    job: Optional[SupervisedJob] = None
    try:
        info = wait_for("the supervised job to start", lambda: read_json(ready), START_TIMEOUT,
                        alive=top)
        pids = {"launcher": int(info["launcher"]), "workers": [int(p) for p in info["workers"]],
                "helpers": {str(r): int(p) for r, p in info["helpers"].items()}}
        supervisor = top.pid
        if in_pid_namespace:
            shell = wait_for("the shell in its PID namespace",
                             lambda: (_children(top.pid) or [None])[0], START_TIMEOUT, alive=top)
            inside = [pids["launcher"], *pids["workers"], *pids["helpers"].values()]
            host = wait_for("the job's host PIDs", lambda: _host_pids(shell, inside),
                            START_TIMEOUT)
            pids = {"launcher": host[pids["launcher"]],
                    "workers": [host[p] for p in pids["workers"]],
                    "helpers": {r: host[p] for r, p in pids["helpers"].items()}}
            supervisor = parent(pids["launcher"]) or 0
        named = environ(pids["launcher"])["GPUWATCH_RUN_SUPERVISOR"].partition(":")[0]
        job = SupervisedJob(launcher=pids["launcher"], workers=pids["workers"],
                            helpers=pids["helpers"], run_id=run_id, group=pids["launcher"],
                            subreaper=supervisor, supervisor=supervisor, named_pid=int(named))
        yield job
    finally:
        _end_job(top, job.group if job is not None else None,
                 job.pids if job is not None else [], "the supervised job's processes")


def sigkill_supervisor(job: SupervisedJob) -> None:
    """SIGKILL the supervisor alone; returns once it is gone and its launcher reparented."""
    os.kill(job.supervisor, signal.SIGKILL)
    wait_for(f"the supervisor {job.supervisor} to be gone",
             lambda: True if not running(job.supervisor) else None, GONE_TIMEOUT)
    wait_for("the launcher to be reparented",
             lambda: True if parent(job.launcher) != job.supervisor else None, GONE_TIMEOUT)


# ---- scheduler cgroups ---------------------------------------------------------------------------
def unique_job_id(prefix: str) -> str:
    """A Slurm job id that starts with `prefix` and is this run's alone: host-wide things named
    by a job id (its cgroup) are not shared with a second suite on the host."""
    return f"{prefix}{uuid.uuid4().int % 10**6:06d}"


@contextlib.contextmanager
def slurm_job_cgroup(job_id: str) -> Iterator[Path]:
    """A real cgroup where Slurm's cgroup plugin puts a job step on a cgroup v1 host
    (`/slurm/uid_UID/job_ID/step_0` in the pids hierarchy), for a job to be started in; `job_id`
    unique to the run (`unique_job_id`), as two suites on one host share the hierarchy. Skips
    where this process may not create cgroups (not root, no writable v1 hierarchy)."""
    root = Path("/sys/fs/cgroup/pids")
    if os.geteuid() != 0 or not os.access(root, os.W_OK) or not (root / "cgroup.procs").exists():
        pytest.skip("cannot create a Slurm-like cgroup here (needs root and cgroup v1's pids "
                    "hierarchy writable)")
    parts = [root / "slurm", root / "slurm" / f"uid_{os.getuid()}",
             root / "slurm" / f"uid_{os.getuid()}" / f"job_{job_id}"]
    parts.append(parts[-1] / "step_0")
    made = [p for p in parts if not p.exists()]
    for p in made:
        with contextlib.suppress(FileExistsError):  # another run's job made it meanwhile
            p.mkdir()
    try:
        yield parts[-1]
    finally:
        def removed() -> Optional[bool]:
            for p in reversed(made):
                with contextlib.suppress(FileNotFoundError):
                    try:
                        p.rmdir()
                    except OSError:
                        if p in parts[-2:]:
                            return None  # busy until its last process is reaped
                        # /slurm/uid_UID holds another run's job too: that run removes it.
            return True

        wait_for("the job's cgroup to empty", removed, GONE_TIMEOUT)


# ---- zombies -------------------------------------------------------------------------------------

_built: dict[str, Path] = {}


def build_program(name: str, tmp_path: Path) -> Path:
    """tests/programs/NAME.c compiled with the system C compiler, once per test session (kept
    under the first `tmp_path` that asks). Skips the test where there is no compiler."""
    source = PROGRAMS / f"{name}.c"
    try:
        cc = _find_compiler()  # the same choice as for the fake driver: $CC, cc, gcc, clang
    except FakeNvmlBuildError as exc:
        pytest.skip(f"cannot build {source.name}: {exc}")
    key = hashlib.sha256(source.read_bytes() + "\0".join(cc).encode()).hexdigest()[:16]
    exe = _built.get(key)
    if exe is None or not exe.exists():
        exe = _unique(tmp_path, "programs") / name
        exe.parent.mkdir()
        subprocess.run([*cc, "-O2", "-Wall", "-Wextra", "-pthread", "-o", str(exe), str(source)],
                       check=True, capture_output=True, timeout=120)
        _built[key] = exe
    return exe


@contextlib.contextmanager
def zombie_leader(tmp_path: Path) -> Iterator[int]:
    """tests/programs/zombie_leader.c: a process whose main thread has exited (state 'Z' in
    /proc/PID/stat) while its second thread lives on ("Threads: 2"), as a trainer whose NCCL
    heartbeat thread outlived the main thread. Yields its PID once /proc shows exactly that."""
    exe = build_program("zombie_leader", tmp_path)
    proc = subprocess.Popen([str(exe)], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        announced = int(proc.stdout.readline() or b"0")
        assert announced == proc.pid, f"zombie_leader printed {announced}, is {proc.pid}"
        wait_for("the zombie leader with its live thread",
                 lambda: True if state(proc.pid) == "Z" and threads(proc.pid) == 2 else None,
                 START_TIMEOUT, alive=proc)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(GONE_TIMEOUT)
        if proc.stdout is not None:
            proc.stdout.close()


STUCK_JOB = """\
import signal, subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
stuck = [subprocess.Popen([sys.argv[1], "600"], stdout=subprocess.PIPE) for _ in range(2)]
print(worker.pid, *(int(p.stdout.readline()) for p in stuck), flush=True)
signal.pause()
"""


@contextlib.contextmanager
def job_with_processes_in_d_state(tmp_path: Path) -> Iterator[tuple[int, int, int]]:
    """A launcher with a worker and two helpers in uninterruptible sleep (state D, through
    tests/programs/vfork_waiter.c), as a process stuck in a kernel call is. Yields (worker, first
    stuck helper, second stuck helper) once /proc shows both helpers in D."""
    exe = build_program("vfork_waiter", tmp_path)
    launcher = subprocess.Popen([sys.executable, "-c", STUCK_JOB, str(exe)],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert launcher.stdout is not None
        worker, *stuck = (int(p) for p in launcher.stdout.readline().split())
        assert len(stuck) == 2, "the launcher did not report its processes"
        wait_for("the helpers in uninterruptible sleep",
                 lambda: True if all(state(p) == "D" for p in stuck) else None,
                 START_TIMEOUT, alive=launcher)
        yield worker, stuck[0], stuck[1]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        if launcher.stdout is not None:
            launcher.stdout.close()


UNREAPED_PARENT = """\
import os, signal, sys
signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # ignored, the kernel would reap for us
child = os.fork()
if child == 0:
    os._exit(0)
def stop(*_):
    os.waitpid(child, 0)  # leave no zombie behind once the scenario is over
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print(child, flush=True)
while True:
    signal.pause()
"""


@contextlib.contextmanager
def unreaped_child(tmp_path: Path, env: Optional[Mapping[str, str]] = None
                   ) -> Iterator[tuple[int, int]]:
    """A live parent (with `env` added to its environment) that never waits on its exited
    child. Yields (parent PID, child PID) once the child is a zombie ('Z') and the parent is
    running."""
    del tmp_path  # nothing to write; taken for the same signature as the other scenarios
    proc = subprocess.Popen([sys.executable, "-c", UNREAPED_PARENT], stdout=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, **(env or {})})
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline() or 0)
        assert child > 0, "the parent did not report its child"
        wait_for("the unreaped child to be a zombie",
                 lambda: True if state(child) == "Z" and running(proc.pid) else None,
                 START_TIMEOUT, alive=proc)
        yield proc.pid, child
    finally:
        proc.terminate()
        try:
            proc.wait(GONE_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def free_pid() -> int:
    """A PID no process has now (the highest free one, far from where new PIDs are handed out)."""
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    return next(pid for pid in range(pid_max - 1, 300, -1) if not Path(f"/proc/{pid}").exists())


@contextlib.contextmanager
def process_on_pid(pid: int, argv: Sequence[str]) -> Iterator[subprocess.Popen[bytes]]:
    """A new, unrelated process started on exactly `pid`: real PID reuse, made on purpose by
    setting the kernel's last-allocated PID (root only; other forks may race, so retry)."""
    import pytest

    last_pid = Path("/proc/sys/kernel/ns_last_pid")
    if not os.access(last_pid, os.W_OK):
        pytest.skip("cannot steer PID allocation here (needs root)")
    for _ in range(50):
        last_pid.write_text(str(pid - 1))
        proc = subprocess.Popen(list(argv))
        if proc.pid == pid:
            try:
                yield proc
            finally:
                proc.kill()
                proc.wait()
            return
        proc.kill()
        proc.wait()
    pytest.fail(f"could not get PID {pid} back after 50 tries")


#: A trainer that ends its script without shutting its executor down, while a worker of it is
#: blocked for good: the interpreter starts its exit (the agent sends its `exit` report) and then
#: waits on the worker forever, holding whatever the process holds.
HUNG_AT_EXIT_PROGRAM = """\
import threading
from concurrent.futures import ThreadPoolExecutor
from gpuwatch import agent
for step in range(3):
    agent.step(step)
reward_buffer = ThreadPoolExecutor(1, thread_name_prefix="reward_buffer")
reward_buffer.submit(threading.Event().wait)
print("training done", flush=True)
"""


@contextlib.contextmanager
def hung_at_exit(env: Mapping[str, str], program: str = HUNG_AT_EXIT_PROGRAM
                 ) -> Iterator[subprocess.Popen[str]]:
    """A real instrumented Python program hung at interpreter exit (HUNG_AT_EXIT_PROGRAM unless
    told), yielded once the agent has said on stderr what holds it; killed on the way out."""
    proc = subprocess.Popen([sys.executable, "-c", program], env=dict(env), text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert proc.stderr is not None
        said = proc.stderr.readline()  # the agent's line, written at exit (or EOF if it died)
        assert said.startswith("gpuwatch: at exit,"), said + proc.stderr.read()
        yield proc
    finally:
        proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


# ---- real torchrun -------------------------------------------------------------------------------

#: `accelerate launch` as accelerate runs it: torch.distributed.run's agent in its own process,
#: from a console script named `accelerate`: the stand-in where accelerate is not installed
#: (`real_torchrun(..., "accelerate (real)")` runs accelerate's own).
ACCELERATE_LIKE = """\
import sys
from torch.distributed.run import get_args_parser, run
assert sys.argv[1] == "launch"
run(get_args_parser().parse_args(sys.argv[2:]))
"""
REAL_WORKER = "import time\ntime.sleep(600)\n"
#: A worker that iterates a real torch DataLoader with two worker processes (forked, titled
#: `pt_data_worker`), as nearly every training script does.
REAL_WORKER_WITH_LOADER = """\
import time
from torch.utils.data import DataLoader, Dataset
class Endless(Dataset):
    def __len__(self):
        return 10**9
    def __getitem__(self, i):
        return i
batches = iter(DataLoader(Endless(), num_workers=2, persistent_workers=True))
while True:
    next(batches)
    time.sleep(0.5)
"""


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def real_torchrun(tmp_path: Path, launcher: str = "torchrun", worker: str = REAL_WORKER
                  ) -> Iterator[JobPids]:
    """torch's real torchrun (`launcher="torchrun"`, the console script) or an `accelerate
    launch` (`"accelerate"`, ACCELERATE_LIKE; `"accelerate (real)"`, accelerate's own, with two
    workers, skipped where it is not installed) with one worker, started without a run id as both
    are by default (its workers get TORCHELASTIC_RUN_ID=none), and its agent titled `pt_elastic`
    as torch titles it. `worker` is the worker's program. Yields once the worker runs; skips
    where torch is not installed. Its worker leads a session of its own (torch starts workers
    so): it and what it started are ended by PID on the way out."""
    pytest.importorskip("torch.distributed.run")
    worker_script = _unique(tmp_path, "train", ".py")
    worker_script.write_text(worker)
    args = ["--nnodes", "1", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
            "--master-port", str(_free_port()), str(worker_script)]
    nproc = 1
    if launcher == "torchrun":
        program = Path(sys.executable).with_name("torchrun")
        if not program.exists():
            pytest.skip(f"no torchrun beside {sys.executable}")
        argv = [str(program), *args]
    elif launcher == "accelerate (real)":
        # accelerate's own `accelerate launch`: on a node without GPUs --multi_gpu still runs
        # torch.distributed.run's agent in the accelerate process, as on a GPU node; it wants
        # at least 2 processes for it.
        program = Path(sys.executable).with_name("accelerate")
        if not program.exists():
            pytest.skip(f"accelerate not installed (no accelerate beside {sys.executable})")
        nproc = 2
        argv = [str(program), "launch", "--multi_gpu", "--num_processes", str(nproc),
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port()),
                str(worker_script)]
    else:
        program = _unique(tmp_path, "bin") / "accelerate"
        program.parent.mkdir()
        program.write_text(f"#!{sys.executable}\n{ACCELERATE_LIKE}")
        program.chmod(0o755)
        argv = [str(program), "launch", *args]
    proc = subprocess.Popen(argv, env=clean_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _reap_in_background(proc)
    workers: list[int] = []
    try:
        workers = wait_for(f"{launcher}'s workers", lambda: (
            found if len(found := _children_with(proc.pid, "TORCHELASTIC_RUN_ID")) >= nproc
            else None) if proc.poll() is None else [], START_TIMEOUT)
        assert workers, f"{launcher} exited with {proc.returncode} before starting its worker"
        wait_for(f"{launcher}'s title", lambda: True if comm(proc.pid) == "pt_elastic" else None,
                 START_TIMEOUT)
        assert environ(workers[0]).get("TORCHELASTIC_RUN_ID") == "none"
        yield JobPids(launcher=proc.pid, workers=workers, helpers={}, run_id="none",
                      group=proc.pid, _launcher_proc=proc)
    finally:
        started = [proc.pid, *workers, *(pid for w in workers for pid in _descendants(w))]
        for pid in started:
            _kill(pid)
        wait_not_running(started)
