"""The threat model's proof (docs/security.md): each rule, attacked by a real unprivileged user.

The attacker is a local account with no privileges (`mallory`); the victim is another (`alice`);
the daemon runs as an account of its own (`daemon`, the unit's `gpuwatch` user) or as root, as the
row says. The accounts are real (tests/localusers.py): they are made with useradd where the suite
runs as root (as CI does), and every test here skips, saying why, where it cannot.

One section per rule of docs/security.md, in its order. Each test names the attack it makes and
fails on a daemon that does not hold the rule.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Optional
from urllib.parse import urlencode, urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuwatch.config import EXIT_CONFIG
from gpuwatch.frozen import evolve
from gpuwatch.model import NodeReport
from gpuwatch.protocol import SOCKET_NAME as AGENT_SOCKET
from gpuwatch.runtime_dir import DAEMON_INFO_NAME, LOCK_NAME
from gpuwatch.simulate.demo import DemoError, wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from gpuwatch.simulate.job import launch_env
from gpuwatch.sinks.document import bounded_json, status_document
from gpuwatch.sources.proc_static import CMDLINE_BYTES, CMDLINE_CUT
from tests import leakreports
from tests.daemonproc import (
    WAIT,
    DaemonReader,
    RunningDaemon,
    Samples,
    WatchedNode,
    by_pid,
    pids_with_series,
    running_daemon,
    shared_node,
    value,
    wait_first_poll,
)
from tests.localusers import LocalUser, local_user
from tests.protected import (
    SYSTEM_PYTHON,
    WORKER,
    exe_setter,
    roots_own_program,
    users_directory,
    users_orphan,
)
from tests.realprocs import GIB, MIB, gpuwatch, status_json, terminate
from tests.scenarios import START_TIMEOUT, _orphan, clean_env, comm, running, wait_not_running


@pytest.fixture
def alice() -> LocalUser:
    return local_user("alice")


@pytest.fixture
def mallory() -> LocalUser:
    return local_user("mallory")


@pytest.fixture
def daemon_user() -> LocalUser:
    return local_user("daemon")


# =================================================================================================
# Rule 1. Bytes, not entries: every text a user controls is cut at the read; caches and the
# status document are bounded in bytes; memory comes back when the processes are gone.
# =================================================================================================

#: An argument of just under the kernel's most (MAX_ARG_STRLEN, 128 KiB); 15 of them and a 64 KiB
#: environment make a command line as long as ARG_MAX (2 MiB) lets one be.
_LONG_ARG = "m" * 128_000
_LONG_ARGS = 15
#: mallory's processes: BATCHES of PER_BATCH at a time, each batch ended before the next starts.
BATCHES, PER_BATCH = 4, 50
#: The daemon's RSS with mallory's processes alive, at most, and how far above its RSS before
#: them it may stay once they are gone.
RSS_LIMIT = 128 * MIB
RSS_BACK_WITHIN = 8 * MIB


def _rss(pid: int) -> int:
    found = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    assert found is not None
    return int(found.group(1)) * 1024


def _document(runtime: Path) -> bytes:
    """The status document as the daemon's state socket serves it, byte for byte."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(runtime / "state.sock"))
        s.sendall(b"status\n")
        chunks = []
        while chunk := s.recv(1 << 20):
            chunks.append(chunk)
    return b"".join(chunks)


def _reporting(agent_sock: Path) -> Callable[[], None]:
    """What mallory's process does before it execs its long command line: one step report to
    agent.sock, which makes it a process the daemon reads at every poll (gpuwatch/poll.py). The
    kernel stamps the datagram with the PID it keeps across the exec."""
    report = json.dumps({"v": 1, "kind": "step", "seq": 0, "step": 0}).encode()
    path = str(agent_sock)

    def send() -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(report, path)
    return send


def _all_read(runtime: Path, pids: list[int], batch: int
              ) -> Optional[tuple[bytes, dict[int, Any]]]:
    """The document and its processes by PID once it shows each of `pids` with what it runs;
    None until then."""
    body = _document(runtime)
    shown = {p["pid"]: p for p in json.loads(body)["processes"]}
    return (body, shown) if all(
        pid in shown and shown[pid]["cmdline"][3:4] == [f"flood-{batch}-{i}"]
        for i, pid in enumerate(pids)) else None


@contextlib.contextmanager
def _long_command_lines(mallory: LocalUser, agent_sock: Path, batch: int
                        ) -> Iterator[list[int]]:
    """PER_BATCH processes of mallory's, each a shell with a 2 MiB command line (its own: its
    first argument names it) and a 64 KiB environment, reporting to agent.sock; ended (with the
    sleep each waits on) on leaving."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(PER_BATCH):
            procs.append(mallory.popen(
                ["/bin/sh", "-c", "sleep 600; :", f"flood-{batch}-{i}", *[_LONG_ARG] * _LONG_ARGS],
                env={"PATH": "/usr/bin:/bin", "PAD": f"{i:02d}" * 32_768, "SLURM_JOB_ID": "77"},
                preexec_fn=_reporting(agent_sock), start_new_session=True,
                stdin=subprocess.DEVNULL))
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()
        wait_not_running([p.pid for p in procs])


def test_2_mib_command_lines_of_mallorys_leave_the_daemon_small_and_are_shown_cut(
        mallory: LocalUser, fake_nvml_lib: Path) -> None:
    """mallory starts 200 processes with 2 MiB command lines, 50 at a time, each of them an
    agent reporter (read at every poll): the daemon reads 4 KiB of each, shows them cut and
    counts them; its RSS stays under 128 MiB and comes back to within 8 MiB of where it was
    once they are gone; its status document stays under 8 MiB."""
    with shared_node(fake_nvml_lib, 0, 0) as (_node, env), \
            running_daemon(env, Path(env["HOME"]) / "daemon") as daemon:
        runtime = daemon.runtime_dir
        agent_sock = runtime / AGENT_SOCKET
        wait_for("agent.sock", lambda: agent_sock.exists() or None, WAIT, alive=daemon.proc)
        before = _rss(daemon.proc.pid)
        largest_document = 0
        peak = before
        for batch in range(BATCHES):
            with _long_command_lines(mallory, agent_sock, batch) as pids:
                body, shown = wait_for(
                    f"batch {batch}'s processes read",
                    functools.partial(_all_read, runtime, pids, batch), WAIT, alive=daemon.proc)
                peak = max(peak, _rss(daemon.proc.pid))
                assert peak < RSS_LIMIT, f"daemon RSS {peak / MIB:.0f} MiB"
                assert len(body) < 8 * MIB, f"status document of {len(body) / MIB:.0f} MiB"
                largest_document = max(largest_document, len(body))
                for pid in pids:
                    p = shown[pid]
                    assert p["cmdline"][:3] == ["/bin/sh", "-c", "sleep 600; :"]
                    assert p["cmdline"][-1] == CMDLINE_CUT
                    assert len("\0".join(p["cmdline"][:-1]).encode()) <= CMDLINE_BYTES
                    assert "SLURM_JOB_ID" not in p["launch_env"]  # past the 32 KiB read
                    assert any("environment cut at 32 KiB" in e for e in p["read_errors"])
            wait_for(f"batch {batch} gone from the document", lambda: None if any(
                p["pid"] in pids for p in json.loads(_document(runtime))["processes"]) else True,
                WAIT, alive=daemon.proc)
        after = wait_for("the daemon's RSS back near where it was", lambda: (
            rss if (rss := _rss(daemon.proc.pid)) <= before + RSS_BACK_WITHIN else None),
            WAIT, alive=daemon.proc)
        assert after <= before + RSS_BACK_WITHIN
        cut = daemon.wait_for_metrics("the cuts counted", lambda s: (
            n if (n := value(s, "gpuwatch_text_truncated_total", what="command_line") or 0)
            >= BATCHES * PER_BATCH else None))
        assert cut >= BATCHES * PER_BATCH


def test_a_process_name_completed_from_argv_0_is_no_longer_than_a_file_name(
        mallory: LocalUser, fake_nvml_lib: Path, tmp_path: Path) -> None:
    """A name the kernel cut at 15 bytes is completed from argv[0]'s basename, as psutil does;
    argv[0] is mallory's to write (4 KiB of it read), and the name is kept with each process's
    history, alive and departed. Her process run through a link of 16 characters, with an
    argv[0] of 4,000 that starts the same, is named by its 15 bytes of comm."""
    with users_directory(mallory) as home, \
            _watched_shared_node(fake_nvml_lib, tmp_path) as (node, env, daemon):
        link = home / ("n" * 16)
        link.symlink_to("/bin/sleep")
        long_name = mallory.popen(["n" * 4000, "300"], executable=str(link), cwd="/")
        try:
            node.hold(long_name.pid, device=0, used=1 * GIB)
            shown = wait_for("mallory's process in the document", lambda: next((
                p for p in status_json(env)[1]["processes"] if p["pid"] == long_name.pid), None),
                WAIT, alive=daemon.proc)
            assert shown["name"] == "n" * 15
        finally:
            long_name.kill()
            long_name.wait()

# (section 1 ends)


# =================================================================================================
# Rule 2. Authority from what users cannot set: a protected process is known by its executable,
# its uid or its unit, never by comm or argv.
# =================================================================================================

RULE2_DETECTORS = """
[detectors]
min_age = 0
"""


def _reap(args: Sequence[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """`gpuwatch reap ARGS` as an epilog runs it: as root, no terminal."""
    return subprocess.run([sys.executable, "-m", "gpuwatch", "reap", "--grace", "1", *args],
                          env=dict(env), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=120)


def _named(pid: int, name: str) -> None:
    wait_for(f"PID {pid} to name itself {name}",
             lambda: True if comm(pid) == name[:15] else None, START_TIMEOUT)


@contextlib.contextmanager
def _watched(fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path,
             config: str = "") -> Iterator[tuple[WatchedNode, dict[str, str]]]:
    """A daemon (as root) on the fake node, and the CLI's environment reading its config file,
    as `reap` in an epilog reads /etc/gpuwatch/gpuwatch.toml."""
    with running_daemon(cli_env, tmp_path / "daemon", config=RULE2_DETECTORS + config) as daemon:
        env = {**cli_env, "GPUWATCH_CONFIG": str(daemon.config_path)}
        yield WatchedNode(fake_node, env, daemon), env


def test_a_users_orphans_named_xorg_nvidia_persistenced_and_gpuwatch_are_reported_and_reaped(
        mallory: LocalUser, fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    # Three ranks of mallory's job, orphaned, each holding GPU memory under a protected name:
    # Xorg by prctl(PR_SET_NAME), nvidia-persistenced by a link of that name to the system's
    # Python, gpuwatch by her own copy of it (a file named gpuwatch, hers).
    run_id = f"rule2-{uuid.uuid4().hex[:8]}"
    with users_directory(mallory) as home:
        made = mallory.run(["sh", "-c", f"ln -s {SYSTEM_PYTHON} {home}/nvidia-persistenced && "
                                        f"cp {os.path.realpath(SYSTEM_PYTHON)} {home}/gpuwatch"],
                           cwd="/")
        assert made.returncode == 0, made.stderr
        ranks = [([SYSTEM_PYTHON, "-c", WORKER, "Xorg"], "Xorg"),
                 ([f"{home}/nvidia-persistenced", "-c", WORKER], "nvidia-persistenced"),
                 ([f"{home}/gpuwatch", "-c", WORKER], "gpuwatch")]
        with contextlib.ExitStack() as stack:
            pids = []
            for rank, (argv, name) in enumerate(ranks):
                env = launch_env(rank, len(ranks), run_id, base=clean_env())
                pid = stack.enter_context(users_orphan(mallory, argv, env, f"mallory's {name}"))
                _named(pid, name)
                fake_node.hold(pid, device=0, used=2 * GIB)
                pids.append(pid)
            with _watched(fake_node, cli_env, tmp_path) as (watched, env):
                orphans = watched.findings_of("orphan", pids)
                assert {orphans[pid]["name"] for pid in pids} == {
                    "Xorg", "nvidia-persistenced", "gpuwatch"}
                result = _reap(["--job", run_id, "--yes"], env)
                assert result.returncode == 0, result.stdout + result.stderr
                wait_not_running(pids, what="mallory's ranks to end")
                assert result.stdout.count("GPU memory released") == 3, result.stdout
                assert "no GPU memory the plan named is still held" in result.stdout


def test_reap_pid_ends_a_users_orphan_named_xorg_and_refuses_roots_xorg_saying_so(
        mallory: LocalUser, fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    run_id = f"rule2-{uuid.uuid4().hex[:8]}"
    with roots_own_program("Xorg") as xorg, contextlib.ExitStack() as stack:
        env = launch_env(0, 2, run_id, base=clean_env())
        fake = stack.enter_context(users_orphan(mallory, [SYSTEM_PYTHON, "-c", WORKER, "Xorg"],
                                                env, "mallory's Xorg"))
        _named(fake, "Xorg")
        # Root's Xorg: the file is root's where only root may write, whatever it does.
        real = stack.enter_context(_orphan([str(xorg), "600"], launch_env(1, 2, run_id,
                                                                          base=clean_env()),
                                           "root's Xorg", lambda pid: comm(pid) == "Xorg"))
        for pid in (fake, real):
            fake_node.hold(pid, device=0, used=2 * GIB)
        with _watched(fake_node, cli_env, tmp_path) as (watched, cli):
            watched.findings_of("orphan", [fake])
            assert real not in by_pid(watched.holding(real), "orphan")

            ended = _reap(["--pid", str(fake), "--yes"], cli)
            assert ended.returncode == 0, ended.stdout + ended.stderr
            wait_not_running([fake], what="mallory's Xorg to end")
            assert "GPU memory released" in ended.stdout

            refused = _reap(["--pid", str(real), "--yes"], cli)
            assert refused.returncode == 4, refused.stdout + refused.stderr
            assert f"PID {real}" in refused.stdout and "protected" in refused.stdout
            assert f"GPU memory still held by PID {real}" in refused.stdout
            assert running(real)


def test_reap_job_names_the_roots_programs_it_leaves_holding_gpu_memory_and_exits_4(
        mallory: LocalUser, fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    # The incident: a reap of the job that leaves GPU memory held must not read "nothing held".
    run_id = f"rule2-{uuid.uuid4().hex[:8]}"
    with roots_own_program("Xorg") as xorg, roots_own_program("gpu-agent") as agent, \
            contextlib.ExitStack() as stack:
        fake = stack.enter_context(users_orphan(
            mallory, [SYSTEM_PYTHON, "-c", WORKER, "Xorg"],
            launch_env(0, 3, run_id, base=clean_env()), "mallory's Xorg"))
        _named(fake, "Xorg")
        roots = [stack.enter_context(_orphan([str(program), "600"],
                                             launch_env(rank, 3, run_id, base=clean_env()),
                                             f"root's {program.name}",
                                             lambda pid, n=program.name: comm(pid) == n))
                 for rank, program in ((1, xorg), (2, agent))]
        for pid in (fake, *roots):
            fake_node.hold(pid, device=0, used=2 * GIB)
        listed = f"protected_executables = [{json.dumps(str(agent))}]\n"
        with _watched(fake_node, cli_env, tmp_path, listed) as (watched, cli):
            watched.findings_of("orphan", [fake])
            doc = watched.holding(*roots)
            assert not set(roots) & set(by_pid(doc, "orphan"))

            result = _reap(["--job", run_id, "--yes"], cli)
            assert result.returncode == 4, result.stdout + result.stderr
            wait_not_running([fake], what="mallory's Xorg to end")
            for pid, why in zip(roots, ("root's Xorg (detectors.protected_names)",
                                        "(detectors.protected_executables)")):
                line = next(ln for ln in result.stdout.splitlines() if f"PID {pid}" in ln)
                assert "protected" in line and why in line, result.stdout
                assert running(pid)
            assert "GPU memory still held by PID " + ", ".join(map(str, sorted(roots))) in (
                result.stdout)

            as_json = json.loads(_reap(["--job", run_id, "--yes", "--json"], cli).stdout)
            assert sorted(s["pid"] for s in as_json["protected"]) == sorted(roots)
            assert as_json["still_held"] == sorted(roots)


def test_a_user_running_roots_own_xorg_is_reported_and_reaped_like_any_other(
        mallory: LocalUser, fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    # Root's Xorg (a file only root may write) is anyone's to run, with code of their own in it
    # (LD_PRELOAD, its modules): what mallory's orphaned rank runs proves nothing of her.
    run_id = f"rule2-{uuid.uuid4().hex[:8]}"
    with roots_own_program("Xorg") as xorg, users_orphan(
            mallory, [str(xorg), "600"], launch_env(0, 1, run_id, base=clean_env()),
            "mallory's rank running root's Xorg") as pid:
        fake_node.hold(pid, device=0, used=2 * GIB)
        with _watched(fake_node, cli_env, tmp_path) as (watched, cli):
            assert watched.findings_of("orphan", [pid])[pid]["user"] == mallory.name
            ended = _reap(["--pid", str(pid), "--yes"], cli)
            assert ended.returncode == 0, ended.stdout + ended.stderr
            wait_not_running([pid], what="mallory's Xorg to end")


def test_a_users_process_that_points_its_executable_link_at_roots_xorg_is_still_reported(
        mallory: LocalUser, fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    # /proc/PID/exe is the kernel's, but prctl(PR_SET_MM_MAP) rewrites it for a process that has
    # CAP_CHECKPOINT_RESTORE in its own user namespace, and any user may make one: mallory's
    # rank, a `sleep`, points its link at root's Xorg (a file only root may write) and holds GPU
    # memory. The link then names root's file in root's directory; the namespace gives it away.
    run_id = f"rule2-{uuid.uuid4().hex[:8]}"
    with roots_own_program("Xorg") as xorg, users_directory(mallory) as home:
        library = exe_setter(home)
        env = {**launch_env(0, 1, run_id, base=clean_env()), "LD_PRELOAD": str(library),
               "GWTEST_EXE": str(xorg)}
        with users_orphan(mallory, ["/bin/sleep", "600"], env, "mallory's rank posing as Xorg",
                          runs=str(xorg)) as pid:
            fake_node.hold(pid, device=0, used=2 * GIB)
            with _watched(fake_node, cli_env, tmp_path) as (watched, cli):
                orphan = watched.findings_of("orphan", [pid])[pid]
                assert orphan["user"] == mallory.name
                process = next(p for p in status_json(cli)[1]["processes"] if p["pid"] == pid)
                assert process["exe"] == {"path": str(xorg), "owner_uid": 0,
                                          "root_controlled": False}


# (section 2 ends)


# =================================================================================================
# Rule 3. No path followed where another user can write: runtime and state directories, the lock,
# and what the CLI trusts.
# =================================================================================================

#: What an attack's daemon has to do at most before the test looks at what it did.
ATTACK_WAIT = 30.0
#: The daemon's exit code for a directory another user can write: sysexits' EX_CONFIG.
EXIT_UNSAFE_DIRECTORY = 78


@pytest.fixture
def sticky_tmp() -> Iterator[Path]:
    """A directory like /tmp (root's, mode 1777): any user may create in it, and only an entry's
    owner may rename or remove it. Removed afterwards, whoever made what is in it."""
    base = Path(tempfile.mkdtemp(prefix="gpuwatch-rule3-", dir="/tmp"))
    base.chmod(0o1777)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def as_mallory(mallory: LocalUser, script: str, *args: str) -> None:
    """Run `script` (Python) as mallory, to the end; it must succeed."""
    done = mallory.run([SYSTEM_PYTHON, "-c", script, *args], timeout=60)
    assert done.returncode == 0, done.stderr


@contextlib.contextmanager
def mallory_runs(mallory: LocalUser, script: str, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """`script` as mallory, in the background until the block ends; it prints `ready` once set
    up, and the block starts only then."""
    proc = mallory.popen([SYSTEM_PYTHON, "-c", script, *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == b"ready", (line, proc.stderr.read() if proc.stderr else b"")
        yield proc
    finally:
        terminate(proc)


def mallorys_runtime_dir(mallory: LocalUser, base: Path, mode: int = 0o777) -> Path:
    """A runtime directory mallory made in a sticky directory: hers, mode `mode`."""
    run = base / "run"
    as_mallory(mallory, "import os, sys; os.mkdir(sys.argv[1]); "
               f"os.chmod(sys.argv[1], {mode:#o})", str(run))
    return run


@contextlib.contextmanager
def daemon_on(env: dict[str, str], runtime: Path, where: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`gpuwatch daemon` as root on `runtime`, until the block ends. The block starts once it
    has exited or serves (its daemon.json written)."""
    where.mkdir(parents=True, exist_ok=True)
    with open(where / "daemon.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch", "daemon", "--listen", "127.0.0.1:0",
             "--interval", "0.2", "--runtime-dir", str(runtime), "--state-dir",
             str(where / "state")], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for("the daemon to exit or serve", lambda: True if proc.poll() is not None or (
            runtime / DAEMON_INFO_NAME).exists() else None, ATTACK_WAIT)
        yield proc
    finally:
        terminate(proc)


def daemon_log(where: Path) -> str:
    return (where / "daemon.log").read_text(errors="replace")


def holds_lock(path: str) -> str:
    """mallory's program: open `path` read-only (its mode 0644 lets anyone) and hold an
    exclusive flock on it."""
    return ("import fcntl, sys, time\n"
            f"f = open({path!r}, 'rb')\n"
            "fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
            "print('ready', flush=True)\n"
            "time.sleep(600)\n")


@pytest.mark.parametrize("made", ["owned by mallory", "mode 0777"])
def test_a_root_daemon_refuses_a_runtime_dir_another_user_can_write_with_exit_78_naming_it(
        made: str, mallory: LocalUser, cli_env: dict[str, str], sticky_tmp: Path,
        tmp_path: Path) -> None:
    """mallory makes the runtime directory herself (and holds a daemon.lock she put in it), or
    root's directory is mode 0777: either way the daemon would write where she decides."""
    run = sticky_tmp / "run"
    attack: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if made == "owned by mallory":
        as_mallory(mallory, "import os, sys; os.mkdir(sys.argv[1], 0o755); "
                   "open(os.path.join(sys.argv[1], 'daemon.lock'), 'w').write('1\\n'); "
                   "os.chmod(os.path.join(sys.argv[1], 'daemon.lock'), 0o644)", str(run))
        attack = mallory_runs(mallory, holds_lock(str(run / "daemon.lock")))
        why = f"owned by {mallory.name} (uid {mallory.uid})"
    else:
        run.mkdir()
        run.chmod(0o777)
        why = "writable by others (mode 0777)"
    with attack, daemon_on(cli_env, run, tmp_path / "d") as proc:
        proc.wait(ATTACK_WAIT)
        assert proc.returncode == EXIT_UNSAFE_DIRECTORY, daemon_log(tmp_path / "d")
    message = daemon_log(tmp_path / "d").strip()
    assert f"daemon.runtime_dir {run}: {why}" in message, message
    # Nothing of the daemon's in it: it refused before the first file.
    assert sorted(p.name for p in run.iterdir()) == (
        ["daemon.lock"] if made == "owned by mallory" else [])


def test_links_planted_in_a_writable_runtime_dir_redirect_no_write_and_no_chmod(
        mallory: LocalUser, cli_env: dict[str, str], sticky_tmp: Path, tmp_path: Path) -> None:
    """daemon.json.tmp -> a root-only file (the daemon would write its JSON into it), agent.d ->
    a 0700 directory (the daemon would open it to 0755 at mallory's first report)."""
    victim = tmp_path / "root-only"
    victim.write_text("root's secret\n")
    victim.chmod(0o600)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "key").write_text("secret key\n")
    private.chmod(0o700)
    tmp_path.chmod(0o755)  # so that mallory's links resolve for whoever follows them
    run = mallorys_runtime_dir(mallory, sticky_tmp)
    as_mallory(mallory, "import os, sys; run = sys.argv[1]; "
               "os.symlink(sys.argv[2], os.path.join(run, 'daemon.json.tmp')); "
               "os.symlink(sys.argv[3], os.path.join(run, 'agent.d'))",
               str(run), str(victim), str(private))
    report = ("import json, socket, sys\n"
              "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
              "s.sendto(json.dumps({'v': 1, 'kind': 'step', 'step': 1}).encode(), sys.argv[1])\n")
    with daemon_on(cli_env, run, tmp_path / "d") as proc:
        if proc.poll() is None:  # it serves: mallory reports, and waits for the chmod
            as_mallory(mallory, report, str(run / "agent.sock"))
            with contextlib.suppress(DemoError):
                wait_for("agent.d's chmod", lambda: True if stat.S_IMODE(
                    private.stat().st_mode) != 0o700 else None, 10)
    assert victim.read_text() == "root's secret\n"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert proc.returncode == EXIT_UNSAFE_DIRECTORY, daemon_log(tmp_path / "d")


def test_a_lock_another_user_holds_on_the_daemons_own_lock_file_does_not_keep_it_from_starting(
        mallory: LocalUser, cli_env: dict[str, str], tmp_path: Path) -> None:
    """The directory is root's, mode 0755, and daemon.lock an earlier daemon's, mode 0644 (so
    that anyone is told who holds it): mallory opens it read-only, which flock needs no more
    than, and holds it. The daemon replaces the file, and says so."""
    base = Path(tempfile.mkdtemp(prefix="gpuwatch-rule3-lock-"))
    try:
        base.chmod(0o755)
        run = base / "run"
        run.mkdir(mode=0o755)
        (run / "daemon.lock").write_text("4242\n")
        (run / "daemon.lock").chmod(0o644)
        with mallory_runs(mallory, holds_lock(str(run / "daemon.lock"))), \
                daemon_on(cli_env, run, tmp_path / "d") as proc:
            assert proc.poll() is None, daemon_log(tmp_path / "d")
            assert (run / "daemon.lock").read_text() == f"{proc.pid}\n"
            assert (run / "daemon.lock").stat().st_uid == 0
            wait_first_poll(run, proc)
        log = daemon_log(tmp_path / "d")
        assert "was locked by PID" in log and mallory.name in log and "replaced" in log, log
    finally:
        shutil.rmtree(base, ignore_errors=True)


FORGED_SERVER = """
import socket, sys
doc = open(sys.argv[2], 'rb').read()
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1])
s.listen(8)
print('ready', flush=True)
while True:
    c, _ = s.accept()
    c.settimeout(5)
    try:
        c.recv(256)
        c.sendall(doc)
    except OSError:
        pass
    c.close()
"""


def test_reap_as_root_believes_no_state_sock_another_user_serves_and_kills_nothing(
        mallory: LocalUser, alice: LocalUser, fake_node: FakeNode, cli_env: dict[str, str],
        sticky_tmp: Path, tmp_path: Path) -> None:
    """mallory serves state.sock in a runtime directory of hers, with a status document naming
    a root process and alice's as orphans: `reap --yes` as root (a Slurm epilog) would kill
    both, and record them as the daemon's findings."""
    run = mallorys_runtime_dir(mallory, sticky_tmp, 0o755)
    roots = subprocess.Popen(["sleep", "600"])
    alices = alice.popen(["sleep", "600"])
    try:
        for pid in (roots.pid, alices.pid):
            fake_node.hold(pid, device=0, used=GIB)
        # The processes as a real poll sees them (their start times too), named orphans.
        polled = json.loads(gpuwatch(["status", "--poll", "--json"], cli_env).stdout)
        victims = [p for p in polled["processes"] if p["pid"] in (roots.pid, alices.pid)]
        assert len(victims) == 2, polled["processes"]
        forged = {**polled, "source": "daemon", "source_detail": None, "findings": [
            {"kind": "orphan", "severity": "critical", "pid": p["pid"],
             "start_time": p["start_time"], "name": p["name"], "user": p["user"],
             "job": p["job"], "gpus": [0], "gpu_memory_bytes": GIB,
             "reason": "parent 1234 (torchrun) exited", "since": time.time() - 3600,
             "details": {}} for p in victims]}
        document = sticky_tmp / "forged.json"
        document.write_text(json.dumps(forged))
        document.chmod(0o644)
        with mallory_runs(mallory, FORGED_SERVER, str(run / "state.sock"), str(document)):
            env = {**cli_env, "GPUWATCH_RUNTIME_DIR": str(run)}
            status = json.loads(gpuwatch(["status", "--json"], env).stdout)
            reap = gpuwatch(["reap", "--yes", "--json", "--grace", "1"], env)
        assert roots.poll() is None and alices.poll() is None, reap.stdout
        assert status["source"] == "poll", status["source"]
        assert "not believed" in status["source_detail"], status["source_detail"]
        assert f"owned by {mallory.name}" in status["source_detail"], status["source_detail"]
        out = json.loads(reap.stdout)
        assert out["source"] == "poll" and out["actions"] == [], out
    finally:
        for proc in (roots, alices):
            terminate(proc)


# ---- the checks themselves --------------------------------------------------------------------


def test_a_directory_and_everything_above_it_must_be_writable_by_root_and_this_user_alone(
        mallory: LocalUser, sticky_tmp: Path, tmp_path: Path) -> None:
    from gpuwatch.runtime_dir import UnsafeDirectory, open_private_dir

    ok = tmp_path / "ok"
    with open_private_dir(ok, create_mode=0o755) as made:  # made, and every parent as needed
        assert made.path == ok and made.owner == 0
    assert stat.S_IMODE(ok.stat().st_mode) == 0o755
    # A sticky world-writable directory above it is fine: /tmp.
    open_private_dir(sticky_tmp / "mine", create_mode=0o700).close()

    link = tmp_path / "link"
    link.symlink_to(ok)
    with pytest.raises(UnsafeDirectory, match="a symbolic link"):
        open_private_dir(link)
    # A link above it, in a directory that passed, is followed.
    open_private_dir(link / "below", create_mode=0o755).close()
    assert (ok / "below").is_dir()

    group = tmp_path / "group"
    group.mkdir()
    group.chmod(0o775)
    with pytest.raises(UnsafeDirectory, match=r"writable by its group \(mode 0775\)"):
        open_private_dir(group)
    with pytest.raises(UnsafeDirectory, match="above it is writable by its group"):
        open_private_dir(group / "run", create_mode=0o755)
    assert not (group / "run").exists()  # refused before anything is made below

    theirs = sticky_tmp / "theirs"
    as_mallory(mallory, "import os, sys; os.mkdir(sys.argv[1], 0o755)", str(theirs))
    with pytest.raises(UnsafeDirectory, match=f"owned by {mallory.name}"):
        open_private_dir(theirs)
    with pytest.raises(UnsafeDirectory, match=f"above it is owned by {mallory.name}"):
        open_private_dir(theirs / "run", create_mode=0o755)


def test_a_client_believes_a_directory_of_another_user_only_where_root_put_it(
        mallory: LocalUser, sticky_tmp: Path, tmp_path: Path) -> None:
    """/run/gpuwatch, the unit's gpuwatch account's, lies in /run, root's: only root could have
    put it there. The same account's directory in /tmp could be anyone's doing."""
    from gpuwatch.runtime_dir import UnsafeDirectory, daemon_peer_refusal, open_daemon_dir

    placed = tmp_path / "run"
    placed.mkdir(mode=0o755)
    os.chown(placed, mallory.uid, mallory.gid)  # root gave it to the daemon's account
    with open_daemon_dir(placed) as checked:
        assert checked.daemon_uids == {0, mallory.uid}
    assert daemon_peer_refusal(placed, mallory.uid) is None
    assert daemon_peer_refusal(placed, 0) is None
    refusal = daemon_peer_refusal(placed, 65534)
    assert refusal is not None and "runs as" in refusal and "not believed" in refusal

    theirs = sticky_tmp / "run"
    as_mallory(mallory, "import os, sys; os.mkdir(sys.argv[1], 0o755)", str(theirs))
    with pytest.raises(UnsafeDirectory, match="in a directory any user may create in"):
        open_daemon_dir(theirs)
    refusal = daemon_peer_refusal(theirs, mallory.uid)
    assert refusal is not None and f"owned by {mallory.name}" in refusal


def test_daemon_json_is_written_through_no_link_and_believed_only_from_the_daemons_user(
        mallory: LocalUser, tmp_path: Path) -> None:
    from gpuwatch.runtime_dir import open_private_dir, read_daemon_info

    victim = tmp_path / "victim"
    victim.write_text("untouched")
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    (run / "daemon.json.tmp").symlink_to(victim)  # as a stale one would lie there
    with open_private_dir(run) as directory:
        directory.write_file(DAEMON_INFO_NAME, b'{"pid": 1}')
    assert victim.read_text() == "untouched"
    assert not (run / "daemon.json").is_symlink()
    assert read_daemon_info(run) == ({"pid": 1}, None)

    os.chown(run / "daemon.json", mallory.uid, mallory.gid)
    info, why = read_daemon_info(run)
    assert info is None and why is not None and f"owned by {mallory.name}" in why
    (run / "daemon.json").unlink()
    (run / "daemon.json").symlink_to(victim)
    assert read_daemon_info(run)[0] is None


def test_a_lock_file_of_another_user_or_with_another_name_is_replaced_not_locked(
        mallory: LocalUser, tmp_path: Path) -> None:
    from gpuwatch.runtime_dir import lock_runtime_dir, open_private_dir

    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("root's\n")
    for plant in ("theirs", "hard link"):
        (run / LOCK_NAME).unlink(missing_ok=True)
        if plant == "theirs":
            (run / LOCK_NAME).write_text("1\n")
            os.chown(run / LOCK_NAME, mallory.uid, mallory.gid)
        else:
            os.link(elsewhere, run / LOCK_NAME)
        with open_private_dir(run) as directory:
            fd = lock_runtime_dir(directory)
            try:
                st = os.fstat(fd)
                assert (st.st_uid, st.st_nlink) == (0, 1), plant
            finally:
                os.close(fd)
    assert elsewhere.read_text() == "root's\n"


def test_the_audit_log_is_not_written_through_a_link_nor_in_a_directory_another_user_may_write(
        mallory: LocalUser, sticky_tmp: Path, tmp_path: Path) -> None:
    from gpuwatch.actions.reap_audit import AuditWriter

    victim = tmp_path / "victim"
    victim.write_text("root's\n")
    state = tmp_path / "state"
    state.mkdir(mode=0o750)
    (state / "reap.jsonl").symlink_to(victim)
    with pytest.raises(PermissionError, match="symbolic link"):
        AuditWriter(state / "reap.jsonl", "cli", 0).touch()
    theirs = mallorys_runtime_dir(mallory, sticky_tmp, 0o755)
    with pytest.raises(PermissionError, match=f"owned by {mallory.name}"):
        AuditWriter(theirs / "reap.jsonl", "cli", 0).touch()
    assert victim.read_text() == "root's\n"
    assert list(theirs.iterdir()) == []


# mallory's ear: binds a socket at each path of argv[1:] (making agent.d, mode 0777, as needed),
# prints `ready`, and receives until its stdin closes; then prints what it received, as JSON.
_EAR = """
import json, os, select, socket, sys
socks = []
for path in sys.argv[1:]:
    if os.path.basename(os.path.dirname(path)) == "agent.d":
        os.mkdir(os.path.dirname(path), 0o777)
        os.chmod(os.path.dirname(path), 0o777)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    os.chmod(path, 0o666)
    socks.append(s)
print("ready", flush=True)
got = []
while True:
    ready = select.select(socks + [sys.stdin], [], [])[0]
    for r in ready:
        if r is sys.stdin:
            if not os.read(0, 4096):
                print(json.dumps(got), flush=True)
                sys.exit(0)
        else:
            got.append(r.recv(65536).decode("utf-8", "replace"))
"""

# alice's training loop with the agent: a watched buffer, 3 s of steps (past the agent's look for
# its own socket, and two backoffs), finished(); then the agent's counters.
_ALICES_LOOP = """
import json, time
from gpuwatch import agent
agent.watch("alices_private_buffer", [bytes(1024)] * 4)
start = time.monotonic()
step = 0
while time.monotonic() - start < 3:
    agent.step(step)
    step += 1
    time.sleep(0.01)
agent.finished()
print(json.dumps(agent._stats()))
"""


@pytest.mark.parametrize("planted, mode", [("agent.sock", 0o777), ("agent.d", 0o777),
                                           ("agent.sock", 0o755)],
                         ids=["agent.sock, mode 0777", "agent.d, mode 0777",
                              "agent.sock, mallory's 0755"])
def test_alices_agent_sends_nothing_to_a_socket_mallory_planted_in_her_runtime_directory(
        mallory: LocalUser, alice: LocalUser, sticky_tmp: Path, planted: str,
        mode: int) -> None:
    """alice's GPUWATCH_RUNTIME_DIR is a directory mallory could write (or made): mallory binds
    agent.sock there, or agent.d/<alice's uid>.sock, to read alice's reports (her buffer names,
    culprits, threads) and answer them with trace requests. alice's program steps and finishes,
    and mallory's socket receives nothing."""
    run = mallorys_runtime_dir(mallory, sticky_tmp, mode)
    path = run / (AGENT_SOCKET if planted == "agent.sock" else f"agent.d/{alice.uid}.sock")
    ear = mallory.popen([SYSTEM_PYTHON, "-c", _EAR, str(path)], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert ear.stdout is not None and ear.stdin is not None
        line = ear.stdout.readline()
        assert line.strip() == b"ready", (line, ear.stderr.read() if ear.stderr else b"")
        repo = str(Path(__file__).resolve().parent.parent)
        loop = alice.run([SYSTEM_PYTHON, "-c", _ALICES_LOOP],
                         env={**clean_env(), "PYTHONPATH": repo, "GPUWATCH_RUNTIME_DIR": str(run)},
                         cwd="/", timeout=60)
        out, err = ear.communicate(b"", timeout=30)
    finally:
        terminate(ear)
    assert loop.returncode == 0, loop.stderr
    assert json.loads(out) == [], err
    stats = json.loads(loop.stdout)
    assert stats["sent"] == 0 and stats["refused"] >= 1, stats
    # Said once, naming the directory.
    said = [line for line in loop.stderr.splitlines() if line.startswith("gpuwatch:")]
    assert len(said) == 1 and str(run) in said[0], loop.stderr

# (section 3 ends)


# =================================================================================================
# Rule 4. The kernel outranks the agent: RSS from /proc, absurd figures rejected and counted, a
# per-user fair share of every table one user can fill.
# =================================================================================================

# `count` reporting processes (forked), each sending a step report every 0.1 s to agent.sock as
# a training loop's agent would, with the figures `mode` makes up; until stdin closes. Plain
# standard library: it runs as another user, under the system's python3.
_LIAR = r"""
import json, os, signal, socket, sys, time
path, mode, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
HUGE = (1 << 63) - 1

def report(step):
    r = {"v": 1, "kind": "step", "seq": step, "step": step}
    if mode == "rss":  # claims 8 MiB more every step; what it holds stays the same
        r["rss"] = (100 << 20) + step * (8 << 20)
    elif mode == "huge":  # a buffer of 2^63 bytes
        r["buffers"] = {"evil": {"items": 1, "bytes": HUGE}}
    elif mode == "buffer":  # a watched buffer "leaking" 2 MiB a step
        r["buffers"] = {"cache": {"items": step, "bytes": step << 21}}
    return json.dumps(r).encode()

def trace(step):
    return json.dumps({"v": 1, "kind": "trace", "seq": step, "step": step, "trace": {
        "status": "done", "steps": 10,
        "sites": [{"file": "evil.py", "line": 1, "bytes": HUGE, "count": 1}]}}).encode()

def run():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    step = 0
    while True:
        for payload in [report(step)] + ([trace(step)] if mode == "huge" else []):
            try:
                s.sendto(payload, path)
            except OSError:
                pass
        step += 1
        time.sleep(0.1)

children = []
for _ in range(count):
    pid = os.fork()
    if pid == 0:
        run()
    children.append(pid)
print(" ".join(map(str, children)), flush=True)
sys.stdin.read()
for pid in children:
    os.kill(pid, signal.SIGKILL)
for pid in children:
    os.waitpid(pid, 0)
"""


@contextlib.contextmanager
def _lying_agents(user: LocalUser, socket_path: Path, mode: str, count: int = 1
                  ) -> Iterator[list[int]]:
    """`count` processes of `user` reporting made-up figures (see _LIAR); their PIDs."""
    proc = user.popen(["/usr/bin/python3", "-c", _LIAR, str(socket_path), mode, str(count)],
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                      start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"the {mode} reporters did not start"
        yield [int(pid) for pid in line.split()]
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def _watched_shared_node(fake_nvml_lib: Path, tmp_path: Path, config: str = ""
                         ) -> Iterator[tuple[FakeNode, dict[str, str], RunningDaemon]]:
    """A fake node in a directory every user can reach, and a daemon (root) watching it."""
    with shared_node(fake_nvml_lib, 0, 0) as (node, env), \
            running_daemon(env, tmp_path, config=config) as daemon:
        yield node, env, daemon


def _agent_step(samples: Samples, pid: int) -> float:
    return value(samples, "gpuwatch_agent_step", pid=str(pid)) or -1.0


def test_an_agent_claiming_its_rss_grows_every_step_raises_no_leak_the_kernel_does_not_see(
        mallory: LocalUser, fake_nvml_lib: Path, tmp_path: Path) -> None:
    """mallory's process reports an RSS 8 MiB larger every step while what it holds stays the
    same: the leak test reads RSS from /proc, so no leak is found, and the claims the kernel
    does not bear out are counted."""
    with _watched_shared_node(fake_nvml_lib, tmp_path) as (_, env, daemon), \
            _lying_agents(mallory, daemon.runtime_dir / "agent.sock", "rss") as (liar,):
        # Well past the warm-up (10 steps) and the points a leak needs (8, and 8 a point
        # earlier): a daemon that believed the claims names the leak by step 20 or so.
        daemon.wait_for_metrics("60 steps of made-up RSS seen",
                                lambda s: _agent_step(s, liar) >= 60 or None)
        _, doc = status_json(env)
        assert doc["source"] == "daemon"
        assert liar not in by_pid(doc, "leak"), by_pid(doc, "leak")[liar]["reason"]
        (process,) = [p for p in doc["processes"] if p["pid"] == liar]
        assert process["rss_bytes"] < 100 << 20  # the kernel's figure, not the claim
        samples = daemon.wait_for_metrics("the claims counted", lambda s: s if (
            value(s, "gpuwatch_agent_rss_disagreements_total") or 0) >= 3 else None)
        assert value(samples, "gpuwatch_finding", kind="leak", pid=str(liar)) is None


def test_figures_of_2_to_the_63_bytes_are_rejected_counted_and_shown_nowhere(
        mallory: LocalUser, fake_nvml_lib: Path, tmp_path: Path) -> None:
    """mallory reports a watched buffer and a traced allocation site of 2^63 - 1 bytes: both
    are more than the node holds, so the reports are rejected as `implausible`, and no such
    figure reaches /metrics, `gpuwatch status` or the log."""
    with _watched_shared_node(fake_nvml_lib, tmp_path) as (_, env, daemon), \
            _lying_agents(mallory, daemon.runtime_dir / "agent.sock", "huge") as (liar,):
        samples = daemon.wait_for_metrics("the reports rejected as implausible", lambda s: s if (
            value(s, "gpuwatch_agent_reports_rejected_total", reason="implausible") or 0
        ) >= 20 else None)
        status = gpuwatch(["status"], env)
        text = daemon.scrape_text()
        assert "from the running daemon" in status.stdout
        for where, shown in (("/metrics", text), ("status", status.stdout),
                             ("the log", daemon.log())):
            assert "PiB" not in shown and "EiB" not in shown, where
        assert max(samples.values()) < 1 << 50
        assert _agent_step(samples, liar) == -1.0  # none of its reports was taken


def test_one_user_s_flood_of_fake_leaks_never_removes_another_user_s_gpu_series(
        alice: LocalUser, mallory: LocalUser, fake_nvml_lib: Path, tmp_path: Path) -> None:
    """alice holds GPU memory; mallory runs 24 reporting processes, each "leaking" a watched
    buffer (a leak finding each) on a daemon exporting at most 8 processes: alice's
    gpuwatch_process_gpu_memory_bytes series stays in every scrape, and mallory's processes
    left out are counted as over their user's share."""
    config = "[exporter]\nmax_process_series = 8\n"
    with _watched_shared_node(fake_nvml_lib, tmp_path, config) as (node, _, daemon):
        victim = alice.popen(["sleep", "300"])
        try:
            node.hold(victim.pid, device=0, used=4 << 30)

            def alice_exported(s: Samples) -> bool:
                return victim.pid in pids_with_series(s, "gpuwatch_process_gpu_memory_bytes")

            daemon.wait_for_metrics("alice's GPU series", lambda s: alice_exported(s) or None)
            with _lying_agents(mallory, daemon.runtime_dir / "agent.sock", "buffer",
                               24) as flood:
                scrapes = 0

                def flood_flagged() -> Optional[bool]:
                    nonlocal scrapes
                    s = daemon.scrape()
                    scrapes += 1
                    assert alice_exported(s), f"alice's series missing at scrape {scrapes}"
                    # A finding's series follow its process: mallory's findings beyond her
                    # share have none, and the count by kind still counts them all.
                    with_series = {int(dict(ls)["pid"]) for (n, ls), v in s.items()
                                   if n == "gpuwatch_finding" and dict(ls)["kind"] == "leak"}
                    assert len(with_series & set(flood)) <= 8, f"{len(with_series)} over the cap"
                    leaks = value(s, "gpuwatch_findings", kind="leak") or 0
                    dropped = value(s, "gpuwatch_process_series_dropped_total",
                                    reason="user_share") or 0
                    return True if leaks >= 8 and dropped > 0 else None

                wait_for("mallory's fake leaks over the cap", flood_flagged, WAIT,
                         alive=daemon.proc)
                for _ in range(10):  # and while the flood goes on
                    flood_flagged()
        finally:
            victim.kill()
            victim.wait()


# A launcher that forks its one rank (no launch variables: only its lineage shows it is a job's),
# prints the rank's PID and waits until killed.
_PLAIN_LAUNCHER = r"""
import os, sys, time
pid = os.fork()
if pid == 0:
    os.setsid()
    while True:
        time.sleep(3600)
print(pid, flush=True)
while True:
    time.sleep(3600)
"""


def test_one_user_s_many_processes_leave_another_user_s_history_and_her_orphan_is_found(
        alice: LocalUser, mallory: LocalUser, fake_nvml_lib: Path, tmp_path: Path) -> None:
    """The history keeps `history.max_processes` processes, and what it remembers of a process
    (the parent it was first seen under) is all that shows a rank without launch variables is
    orphaned. mallory runs a job of far more processes than the room (a GPU holder's children
    are read every poll): alice's histories stay, shared by user, and when her launcher dies her
    rank, still holding GPU memory, is an orphan."""
    config = "[detectors]\nmin_age = 0\n[history]\nmax_processes = 48\n"
    with _watched_shared_node(fake_nvml_lib, tmp_path, config) as (node, env, daemon):
        launcher = alice.popen([SYSTEM_PYTHON, "-c", _PLAIN_LAUNCHER], env=clean_env(),
                               stdout=subprocess.PIPE, cwd="/")
        flood = mallory.popen(["sh", "-c", "for i in $(seq 150); do sleep 600 & done; wait"],
                              env=clean_env(), cwd="/", start_new_session=True)
        assert launcher.stdout is not None
        rank = int(launcher.stdout.readline())
        try:
            node.hold(rank, device=0, used=4 * GIB)
            node.hold(flood.pid, device=0, used=1 * GIB)  # a job of hers: its children are read
            wait_for("mallory's 150 processes", lambda: True if len(subprocess.run(
                ["pgrep", "-u", mallory.name, "-x", "sleep"], capture_output=True, text=True
            ).stdout.split()) >= 150 else None, START_TIMEOUT)
            daemon.wait_for_metrics("alice's rank seen holding GPU memory", lambda s: rank in (
                pids_with_series(s, "gpuwatch_process_gpu_memory_bytes")) or None)
            polls = value(daemon.scrape(), "gpuwatch_polls_total") or 0
            daemon.wait_for_metrics("two more polls with the flood", lambda s: (
                value(s, "gpuwatch_polls_total") or 0) >= polls + 2 or None)
            launcher.kill()
            launcher.wait()
            orphan = wait_for("alice's rank reported as an orphan",
                              lambda: by_pid(status_json(env)[1], "orphan").get(rank), WAIT,
                              alive=daemon.proc)
            assert f"parent {launcher.pid} " in orphan["reason"]
        finally:
            for pid in (launcher.pid, rank):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            os.killpg(flood.pid, signal.SIGKILL)
            launcher.wait()
            flood.wait()
            wait_not_running([rank], what="alice's rank to end")


def test_a_status_document_over_its_bound_leaves_out_the_processes_of_the_user_with_most() -> None:
    """The status document is at most MAX_DOCUMENT_BYTES; past it, processes that hold no GPU
    memory and no finding names are left out. mallory's 4,000 such processes with short command
    lines and alice's 40 with long ones (her job's launcher and data loaders): mallory's go,
    however much larger each of alice's is. (A node of thousands of such processes is what
    this needs; the document is built from them as the daemon builds it.)"""
    report = leakreports.leak_report()
    alices = {pid: evolve(leakreports.process(pid), user="alice", uid=2001, gpu_usage=(),
                          cmdline=("python3", "/home/alice/loader.py", "--shard=" + "7" * 240))
              for pid in range(20_000, 20_040)}
    mallorys = {pid: evolve(leakreports.process(pid), user="mallory", uid=2002, gpu_usage=(),
                            cmdline=("sleep", "600"))
                for pid in range(30_000, 34_000)}
    snapshot = replace(report.snapshot, processes=MappingProxyType(
        {**report.snapshot.processes, **alices, **mallorys}))
    doc = status_document(NodeReport(snapshot, report.findings), source="daemon")
    limit = len(json.dumps(doc)) // 2
    body, cut = bounded_json(doc, limit)
    assert len(body) <= limit and cut is not None and "processes left out" in cut
    shown = {p["pid"] for p in json.loads(body)["processes"]}
    assert set(alices) <= shown
    assert not set(mallorys) <= shown

# Sends one step report to agent.sock (argv[1]) with SCM_CREDENTIALS naming each PID and UID of
# argv[2:] in turn (alice's process, then its own child), and prints the errno of each sendmsg.
_FORGER = r"""
import json, os, socket, struct, sys, time
path, claims = sys.argv[1], [tuple(map(int, c.split(":"))) for c in sys.argv[2:]]
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
claims.append((child, os.getuid()))
report = json.dumps({"v": 1, "kind": "step", "seq": 1, "step": 666}).encode()
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
for pid, uid in claims:
    creds = struct.pack("3i", pid, uid, os.getgid())
    try:
        s.sendmsg([report], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)], 0, path)
        print(0)
    except OSError as exc:
        print(exc.errno)
os.kill(child, 9)
os.waitpid(child, 0)
"""


def test_forged_credentials_are_refused_by_the_kernel_and_nothing_is_charged_to_alice(
        alice: LocalUser, mallory: LocalUser, fake_nvml_lib: Path, tmp_path: Path) -> None:
    """A report's PID and UID are the kernel's: mallory's SCM_CREDENTIALS naming alice's process,
    or her own child (a reporter that forks and reports as its child), fail at sendmsg with
    EPERM, and alice's process has no agent in the daemon's view."""
    with _watched_shared_node(fake_nvml_lib, tmp_path) as (node, env, daemon):
        victim = alice.popen(["sleep", "300"], cwd="/")
        try:
            node.hold(victim.pid, device=0, used=1 * GIB)
            sent = mallory.run([SYSTEM_PYTHON, "-c", _FORGER,
                                str(daemon.runtime_dir / AGENT_SOCKET),
                                f"{victim.pid}:{alice.uid}"], env=clean_env(), cwd="/")
            assert sent.returncode == 0, sent.stderr
            assert sent.stdout.split() == [str(errno.EPERM)] * 2, sent.stdout
            samples = daemon.wait_for_metrics("alice's process read", lambda s: s if victim.pid in (
                pids_with_series(s, "gpuwatch_process_gpu_memory_bytes")) else None)
            assert _agent_step(samples, victim.pid) == -1.0
            (process,) = [p for p in status_json(env)[1]["processes"] if p["pid"] == victim.pid]
            assert process["agent"] is None
        finally:
            victim.kill()
            victim.wait()

# One step report to agent.sock (argv[1]) of step 666, with a watched buffer; then it exits.
_ONE_REPORT = r"""
import json, socket, sys
report = {"v": 1, "kind": "step", "seq": 1, "step": 666,
          "buffers": {"planted": {"items": 1, "bytes": 4096}}}
socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(json.dumps(report).encode(), sys.argv[1])
"""


def _started_as(pid: int, start: Callable[[], subprocess.Popen[bytes]]
                ) -> Optional[subprocess.Popen[bytes]]:
    """`start()` with `pid` as the PID the kernel hands out next (ns_last_pid, root's): how a
    PID comes round again on a node whose pid_max is 32768. None when another process of the
    node took it first (the caller tries again)."""
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
    proc = start()
    if proc.pid == pid:
        return proc
    proc.kill()
    proc.wait()
    return None


def test_a_reporters_pid_reused_by_another_users_process_does_not_pass_on_its_reports(
        alice: LocalUser, mallory: LocalUser, fake_nvml_lib: Path, tmp_path: Path) -> None:
    """mallory's process reports step 666 and a watched buffer, then exits; before the next poll
    its PID is alice's process's, started within the second. The reports are mallory's (the
    kernel's UID of each): alice's process shows none of them, in `status` or on /metrics."""
    if not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("needs /proc/sys/kernel/ns_last_pid to hand out a chosen PID")
    # Polls 3 s apart: the PID goes from mallory's process to alice's between two of them.
    with shared_node(fake_nvml_lib, 0, 0) as (node, env), \
            running_daemon(env, tmp_path, args=("--interval", "3")) as daemon, \
            contextlib.ExitStack() as stack:
        sock = str(daemon.runtime_dir / AGENT_SOCKET)
        victim = None
        for _ in range(20):
            pid = 30000 - uuid.uuid4().int % 8000
            if os.path.exists(f"/proc/{pid}"):
                continue
            reporter = _started_as(pid, lambda: mallory.popen(
                [SYSTEM_PYTHON, "-c", _ONE_REPORT, sock], env=clean_env(), cwd="/"))
            if reporter is None:
                continue
            reporter.wait()
            victim = _started_as(pid, lambda: alice.popen(["sleep", "300"], cwd="/"))
            if victim is not None:
                break
        assert victim is not None, "no free PID could be handed out twice"
        stack.callback(victim.wait)
        stack.callback(victim.kill)
        node.hold(victim.pid, device=0, used=1 * GIB)
        daemon.wait_for_metrics("alice's process read", lambda s: victim.pid in (
            pids_with_series(s, "gpuwatch_process_gpu_memory_bytes")) or None)
        polls = value(daemon.scrape(), "gpuwatch_polls_total") or 0
        samples = daemon.wait_for_metrics("two more polls", lambda s: s if (
            value(s, "gpuwatch_polls_total") or 0) >= polls + 2 else None)
        assert _agent_step(samples, victim.pid) == -1.0
        (process,) = [p for p in status_json(env)[1]["processes"] if p["pid"] == victim.pid]
        assert process["user"] == alice.name and process["agent"] is None, process["agent"]

# (section 4 ends)


# =================================================================================================
# Rule 5. /metrics discloses identity, not private text.
# =================================================================================================

# alice's job: a launcher (`torchrun`, a script) starting a trainer (rank 0) and a helper whose
# command line carries an API key; it writes their PIDs to argv[1] and waits for its children.
_ALICE_LAUNCHER = r"""
import json, os, subprocess, sys
out, helper = sys.argv[1], sys.argv[2]
rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                           env={**os.environ, **rank})
aux = subprocess.Popen([sys.executable, helper, "--api-key=argv-s3cr3t-9f27c1"])
with open(out + ".tmp", "w") as f:
    json.dump({"launcher": os.getpid(), "trainer": trainer.pid, "helper": aux.pid}, f)
os.rename(out + ".tmp", out)
trainer.wait()
aux.wait()
"""
# An orphaned rank: forked, in a session of its own, from a parent that exits at once.
_ALICE_ORPHAN = r"""
import os, sys
pid = os.fork()
if pid == 0:
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.execv(sys.executable, [sys.executable, sys.argv[1], "--token=argv-s3cr3t-44d0be"])
print(pid, flush=True)
"""
_ALICE_ENV = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "424242",
              "AWS_SECRET_ACCESS_KEY": "env-s3cr3t-7b1e0a", "MASTER_ADDR": "10.98.76.54",
              "MASTER_PORT": "29517"}


def _scrape_as(user: LocalUser, url: str) -> str:
    """/metrics as `user` fetches it, with the system's python3 and nothing of gpuwatch."""
    done = user.run(["/usr/bin/python3", "-c", "import sys, urllib.request; sys.stdout.write("
                     "urllib.request.urlopen(sys.argv[1], timeout=30).read().decode())", url])
    assert done.returncode == 0, done.stderr
    return done.stdout


@dataclass
class _AlicesJob:
    """alice's job as the rule 5 scrapes find it: its trainer killed, its helper a leftover
    and a rank of hers an orphan (`doc`, the status document that shows both)."""

    home: Path
    daemon: RunningDaemon
    job: dict[str, int]
    orphan: int
    doc: dict[str, Any]


@contextlib.contextmanager
def _alices_job_with_findings(alice: LocalUser, fake_nvml_lib: Path, tmp_path: Path
                              ) -> Iterator[_AlicesJob]:
    """alice runs a job whose environment holds a secret and whose helper's command line holds
    an API key; its trainer ends (the helper is a leftover), and another rank of hers is
    orphaned (its reason names launch variables). Everything of hers ended on leaving."""
    config = "[detectors]\nleftover_grace = 0.5\nmin_age = 0\n"
    with _watched_shared_node(fake_nvml_lib, tmp_path, config) as (node, env, daemon):
        home = Path(env["HOME"])
        launcher_script, helper_script = home / "torchrun", home / "helper.py"
        # Where alice's launcher writes its PIDs: a directory of hers beside the daemon's
        # (theirs lie in the one above, which must stay root's: rule 3).
        alices = home / "alice"
        alices.mkdir()
        os.chown(alices, alice.uid, alice.gid)
        orphan_script, started = home / "rank3.py", alices / "job.json"
        launcher_script.write_text(_ALICE_LAUNCHER)
        for script in (helper_script, orphan_script):
            script.write_text("import time\ntime.sleep(600)\n")
        launcher = alice.popen(["/usr/bin/python3", str(launcher_script), str(started),
                                str(helper_script)], env=_ALICE_ENV, start_new_session=True)
        orphan: Optional[int] = None
        try:
            job = wait_for("alice's job", lambda: json.loads(started.read_text())
                           if started.exists() else None, WAIT, alive=launcher)
            forked = alice.run(["/usr/bin/python3", "-c", _ALICE_ORPHAN, str(orphan_script)],
                               env={**_ALICE_ENV, "RANK": "3", "LOCAL_RANK": "3",
                                    "WORLD_SIZE": "4"})
            assert forked.returncode == 0, forked.stderr
            orphan = int(forked.stdout)
            node.hold(job["trainer"], device=0, used=8 << 30)
            node.hold(orphan, device=1, used=6 << 30)
            reader = DaemonReader()
            reader.env, reader.daemon = env, daemon
            reader.doc_when("the trainer and the rank holding GPU memory", lambda d: {
                job["trainer"], orphan} <= {p["pid"] for p in d["processes"] if p["holds_gpu"]})
            os.kill(job["trainer"], signal.SIGKILL)
            doc = reader.doc_when("the helper a leftover and the rank an orphan", lambda d:
                                  job["helper"] in by_pid(d, "leftover")
                                  and orphan in by_pid(d, "orphan"))
            yield _AlicesJob(home, daemon, job, orphan, doc)
        finally:
            for pid in (orphan, *(job.values() if "job" in locals() else ())):
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            launcher.wait(30)
            if orphan is not None:
                wait_for(f"alice's orphan {orphan} to end",
                         lambda: None if _running(orphan) else True, WAIT)


def test_a_scraper_learns_alices_identity_never_her_command_lines_environment_or_paths(
        alice: LocalUser, mallory: LocalUser, fake_nvml_lib: Path, tmp_path: Path) -> None:
    """alice runs a job whose environment holds a secret and whose helper's command line holds
    an API key; its trainer ends (the helper is a leftover), and another rank of hers is
    orphaned (its reason names launch variables). mallory scrapes /metrics: alice's PIDs, user
    and job id are there, as `ps` would show them; none of her command lines, environment values
    (the job id aside) or source paths are."""
    with _alices_job_with_findings(alice, fake_nvml_lib, tmp_path) as alices:
        home, daemon, job, orphan, doc = (alices.home, alices.daemon, alices.job, alices.orphan,
                                          alices.doc)
        # The evidence in words quotes her command line and launch variables: it is on the
        # state socket (the daemon's group), as it should be.
        # (secret-looking values in it masked: tests/test_redact.py)
        assert "helper.py --api-key=" in by_pid(doc, "leftover")[job["helper"]]["reason"]
        assert "LOCAL_RANK=3" in by_pid(doc, "orphan")[orphan]["reason"]

        body = _scrape_as(mallory, daemon.metrics_url)
        # Identity, as ps shows it: PIDs, user, job id.
        for pid in (job["helper"], orphan):
            assert f'pid="{pid}"' in body
        assert f'user="{alice.name}"' in body and 'job_id="424242"' in body
        # Never private text.
        leaks = [text for text in (
            "s3cr3t", "--api-key", "--token", "import time", "sleep(600)", str(home),
            "helper.py", "rank3.py", "torchrun\"", "10.98.76.54", "29517",
            *(f"{k}={v}" for k, v in _ALICE_ENV.items()),
            "RANK=0", "RANK=3", "WORLD_SIZE=4") if text in body]
        assert not leaks, (leaks, [line for line in body.splitlines()
                                   if any(text in line for text in leaks)][:5])


#: What alice chose, in her command lines, environment and paths: never in a summary.
_ALICE_PRIVATE = ("s3cr3t", "--api-key", "--token", "import time", "sleep(600)", "helper.py",
                  "rank3.py", "10.98.76.54", "29517", "RANK=0", "RANK=3", "WORLD_SIZE=4",
                  *(f"{k}={v}" for k, v in _ALICE_ENV.items()))


def test_a_scraper_reads_each_of_alices_findings_summed_up_from_identity_and_figures_only(
        alice: LocalUser, mallory: LocalUser, fake_nvml_lib: Path, tmp_path: Path) -> None:
    """The same job as above: a leftover whose command line holds an API key, an orphaned rank
    whose environment holds a secret and launch variables. mallory's scrape carries each
    finding's evidence as `gpuwatch_finding_info{summary=...}`: what happened, in PIDs, process
    names, clock times and gpuwatch's words, as `gpuwatch status` gives it in `summary`; none of
    what her reasons quote (her command lines, environment values, paths)."""
    with _alices_job_with_findings(alice, fake_nvml_lib, tmp_path) as alices:
        home, daemon, job, orphan, doc = (alices.home, alices.daemon, alices.job, alices.orphan,
                                          alices.doc)
        leftover = by_pid(doc, "leftover")[job["helper"]]
        orphaned = by_pid(doc, "orphan")[orphan]
        # The reasons quote her command line and launch variables (the state socket's).
        assert "helper.py --api-key=" in leftover["reason"]
        assert "LOCAL_RANK=3" in orphaned["reason"]
        # The summaries say what happened by PID, process name and clock time.
        assert re.fullmatch(rf"still runs; its trainer {job['trainer']} \(python3\) ended "
                            r"after \d\d:\d\d:\d\dZ", leftover["summary"]), leftover
        # (the names of the variables that mark a worker, never their values)
        assert re.fullmatch(r"reparented to PID 1; environment has LOCAL_RANK, MASTER_ADDR, "
                            r"RANK, WORLD_SIZE|parent \d+ \(python3\) exited after "
                            r"\d\d:\d\d:\d\dZ; now under 1 \(\S+\)",
                            orphaned["summary"]), orphaned

        def served() -> Optional[dict[str, dict[str, str]]]:
            body = _scrape_as(mallory, daemon.metrics_url)
            info = {s.labels["pid"]: s.labels for family in text_string_to_metric_families(
                body) for s in family.samples if s.name == "gpuwatch_finding_info"}
            return info if {str(job["helper"]), str(orphan)} <= info.keys() else None

        info = wait_for("both findings on /metrics", served, WAIT)
        for finding, kind in ((leftover, "leftover"), (orphaned, "orphan")):
            labels = info[str(finding["pid"])]
            assert (labels["kind"], labels["user"], labels["summary"]) == (
                kind, alice.name, finding["summary"]), labels
        private = [(pid, text) for pid, labels in info.items() for text in _ALICE_PRIVATE
                   if text in labels["summary"] or str(home) in labels["summary"]]
        assert not private, (private, info)

def test_a_scraper_reads_the_kernels_15_byte_name_never_the_rest_of_argv_0(
        alice: LocalUser, fake_nvml_lib: Path, tmp_path: Path) -> None:
    """A process name longer than the kernel's 15 bytes is psutil's, completed from argv[0]'s
    basename: part of the command line. alice runs a program through a link whose name says
    whom the run is for; /metrics names her process by the 15 bytes `ps` shows anyone."""
    with users_directory(alice) as home, \
            _watched_shared_node(fake_nvml_lib, tmp_path) as (node, _, daemon):
        link = home / "train_for_customer_acme_7f3a"
        link.symlink_to("/bin/sleep")
        victim = alice.popen([str(link), "300"], cwd="/")
        try:
            node.hold(victim.pid, device=0, used=1 * GIB)
            daemon.wait_for_metrics("alice's process exported", lambda s: victim.pid in (
                pids_with_series(s, "gpuwatch_process_gpu_memory_bytes")) or None)
            text = daemon.scrape_text()
            assert f'pid="{victim.pid}"' in text and 'name="train_for_custo"' in text
            assert "customer_acme" not in text
        finally:
            victim.kill()
            victim.wait()


# (section 5 ends)


# =================================================================================================
# Rule 6. TLS as the exporter toolkit's web config allows; ECDHE with AEAD only by default.
# =================================================================================================

def _rsa_server_certificate(dir: Path) -> tuple[Path, Path]:
    """A self-signed RSA certificate for 127.0.0.1: with RSA, every kind of TLS 1.2 suite (RSA
    key exchange, ECDHE-RSA, DHE-RSA) could be negotiated, if the server offered it."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command makes the test certificate")
    dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    "server.key", "-out", "server.crt", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   cwd=dir, check=True, capture_output=True)
    return dir / "server.crt", dir / "server.key"


def _handshake(port: int, ciphers: str, version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2
               ) -> Optional[str]:
    """The suite a client offering only `ciphers` (OpenSSL's names) at `version` gets, or None
    when the server refuses it. The client offers anything it is told to (security level 0)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ctx.maximum_version = version
    ctx.set_ciphers(f"{ciphers}:@SECLEVEL=0")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        try:
            with ctx.wrap_socket(raw) as tls:
                return str(tls.cipher()[0])
        except (ssl.SSLError, ConnectionResetError):
            return None


def _daemon_port(daemon: RunningDaemon) -> int:
    return int(str(urlsplit(daemon.metrics_url).port))


def test_the_default_web_config_refuses_cbc_sha1_rsa_key_exchange_dhe_and_tls_1_1(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    cert, key = _rsa_server_certificate(tmp_path / "pki")
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n")
    with running_daemon(cli_env, tmp_path / "daemon",
                        args=("--interval", "0.2", "--web-config", str(web))) as daemon:
        port = _daemon_port(daemon)
        refused = {suite: _handshake(port, suite) for suite in (
            "AES128-SHA", "AES256-SHA",  # RSA key exchange, CBC with SHA-1
            "AES128-GCM-SHA256", "AES256-GCM-SHA384",  # RSA key exchange: no forward secrecy
            "ECDHE-RSA-AES128-SHA", "ECDHE-RSA-AES256-SHA",  # CBC with SHA-1
            "ECDHE-RSA-AES128-SHA256", "ECDHE-RSA-AES256-SHA384",  # CBC
            "DHE-RSA-AES128-GCM-SHA256", "DHE-RSA-AES256-GCM-SHA384")}  # not ECDHE
        assert refused == dict.fromkeys(refused), refused
        assert _handshake(port, "ALL", ssl.TLSVersion.TLSv1_1) is None
        assert _handshake(port, "ALL", ssl.TLSVersion.TLSv1) is None
        # What the default offers: ECDHE with an AEAD cipher, and TLS 1.3.
        assert _handshake(port, "ECDHE-RSA-AES128-GCM-SHA256") == "ECDHE-RSA-AES128-GCM-SHA256"
        assert _handshake(port, "ECDHE-RSA-CHACHA20-POLY1305") == "ECDHE-RSA-CHACHA20-POLY1305"
        assert _handshake(port, "ALL", ssl.TLSVersion.TLSv1_3) is not None


def test_cipher_suites_and_curve_preferences_narrow_what_the_daemon_offers(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    cert, key = _rsa_server_certificate(tmp_path / "pki")
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                   "  cipher_suites: [TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384]\n"
                   "  curve_preferences: [CurveP384, CurveP521]\n")
    with running_daemon(cli_env, tmp_path / "daemon",
                        args=("--interval", "0.2", "--web-config", str(web))) as daemon:
        port = _daemon_port(daemon)
        assert _handshake(port, "ECDHE-RSA-AES256-GCM-SHA384") == "ECDHE-RSA-AES256-GCM-SHA384"
        assert _handshake(port, "ECDHE-RSA-AES128-GCM-SHA256") is None
        assert _handshake(port, "ECDHE-RSA-CHACHA20-POLY1305") is None
        if shutil.which("openssl") is not None:
            def groups(name: str) -> int:
                return subprocess.run(
                    ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-groups", name,
                     "-brief"], input=b"", capture_output=True, timeout=30).returncode
            assert groups("X25519") != 0 and groups("P-256") != 0
            assert groups("P-384") == 0 and groups("P-521") == 0


def test_an_unknown_cipher_suite_or_curve_is_refused_naming_the_key(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    cert, key = _rsa_server_certificate(tmp_path / "pki")
    for extra, message in (
            ("cipher_suites: [AES128-SHA]", "tls_server_config.cipher_suites: 'AES128-SHA' is "
                                            "not a cipher suite's Go name"),
            ("cipher_suites: [TLS_RSA_WITH_3DES_EDE_CBC_SHA]",
             "tls_server_config.cipher_suites: TLS_RSA_WITH_3DES_EDE_CBC_SHA is one of Go's "
             "insecure suites"),
            ("curve_preferences: [secp256r1]", "tls_server_config.curve_preferences: "
                                               "'secp256r1' is not one of CurveP256")):
        web = tmp_path / "web.yml"
        web.write_text(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                       f"  {extra}\n")
        result = subprocess.run(
            [sys.executable, "-m", "gpuwatch", "daemon", "--listen", "127.0.0.1:0",
             "--web-config", str(web), "--runtime-dir", str(tmp_path / "run")],
            env=cli_env, capture_output=True, text=True, timeout=60)
        assert result.returncode == EXIT_CONFIG, result.stderr
        assert message in result.stderr

# (section 6 ends)


# =================================================================================================
# Rule 7. The small ones: /metrics?name[]= for every family; top ends with its terminal.
# =================================================================================================

def _families(text: str) -> dict[str, set[str]]:
    """{family name: the names of its samples} of an exposition."""
    return {f.name: {s.name for s in f.samples} for f in text_string_to_metric_families(text)}


def test_name_filter_returns_every_family_the_daemon_serves(cli_env: dict[str, str],
                                                            tmp_path: Path) -> None:
    with running_daemon(cli_env, tmp_path / "daemon") as daemon:
        served = _families(daemon.scrape_text())
        assert {"gpuwatch_build_info", "gpuwatch_last_poll_timestamp_seconds",
                "gpuwatch_polls", "gpuwatch_connections", "process_cpu_seconds"} <= set(served)
        missing = []
        for family, samples in sorted(served.items()):
            for name in sorted({family, *samples}):
                query = urlencode({"name[]": name})
                with urllib.request.urlopen(f"{daemon.metrics_url}?{query}", timeout=30) as r:
                    got = _families(r.read().decode())
                wanted = samples if name == family else {name}
                # The family, with the samples asked for (the family's name: all of them), and
                # nothing else.
                if set(got) != {family} or (wanted and not wanted & got[family]):
                    missing.append(f"name[]={name}: {got}")
        assert not missing, "\n".join(missing)


def test_top_ends_when_its_terminal_is_closed(cli_env: dict[str, str], tmp_path: Path) -> None:
    """A window closed under top, whose shell ignores the hangup: top gets no SIGHUP, and must
    see for itself that its terminal is gone (every read then fails at once: a loop that took
    that for "no key yet" spun at full CPU for ever)."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    work = tmp_path / "tmux"
    work.mkdir()
    pid_file = work / "top.pid"
    env = {**cli_env, "GPUWATCH_RUNTIME_DIR": str(tmp_path / "no-daemon"), "TERM": "xterm",
           "LANG": "C.UTF-8", "TMUX_TMPDIR": str(work), "HOME": str(work)}
    tmux = ["tmux", "-S", str(work / "tmux.sock"), "-f", "/dev/null"]
    script = work / "top.sh"
    script.write_text(f"echo $$ > {shlex.quote(str(pid_file))}\n"
                      f"exec {shlex.quote(sys.executable)} -m gpuwatch top\n")
    # The pane's shell runs top as a child, not by exec, and ignores the hangup: it neither
    # dies of it nor passes it on, and top gets no SIGHUP at all.
    leader_file = work / "leader.pid"
    shell = (f"echo $$ > {shlex.quote(str(leader_file))}; trap '' HUP; "
             f"sh {shlex.quote(str(script))}; echo top ended")
    subprocess.run([*tmux, "new-session", "-d", "-x", "100", "-y", "30", "-s", "top",
                    f"sh -c {shlex.quote(shell)}"], env=env, check=True, timeout=30)
    top_pid: Optional[int] = None
    try:
        def drawn() -> Optional[bool]:
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "top"], env=env,
                                    capture_output=True, text=True, timeout=30).stdout
            return True if "q quit" in screen else None

        wait_for("top's screen", drawn, 60)
        top_pid = int(pid_file.read_text())
        subprocess.run([*tmux, "kill-server"], env=env, check=True, timeout=30)
        wait_for(f"top ({top_pid}) to end after its terminal closed",
                 lambda: None if _running(top_pid) else True, 30)
    finally:
        subprocess.run([*tmux, "kill-server"], env=env, capture_output=True, timeout=30)
        if top_pid is not None and _running(top_pid):
            os.kill(top_pid, signal.SIGKILL)
        # The shell ends once top has.
        if leader_file.exists():
            leader = int(leader_file.read_text())
            wait_for(f"top's shell ({leader}) to end", lambda: None if _running(leader)
                     else True, 30)


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

# (section 7 ends)
