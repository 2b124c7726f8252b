"""`gpuwatch doctor`: each check's ok path and its warn/fail path, for real where this machine
allows it (the fake NVML driver, a real daemon, real sockets and ports, `unshare` for a PID
namespace and a hidepid mount, another user for missing privileges), on fixture trees where it
cannot (capabilities, cgroup layouts, Slurm and kubelet processes, systemd).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuwatch import __version__
from gpuwatch.cli import EXIT_DOCTOR_FAILURES, EXIT_DOCTOR_WARNINGS, EXIT_OK, EXIT_USAGE
from gpuwatch.config import DEFAULT_CONFIG_PATH, Config, load_config
from gpuwatch.doctor import (
    CHECK_NAMES,
    FAIL,
    INIT_PID_NS_INODE,
    OK,
    SKIP,
    WARN,
    Check,
    Context,
    Spec,
    cgroup_layout,
    check_agent_socket,
    check_cgroups,
    check_config,
    check_daemon,
    check_executables,
    check_metrics,
    check_nvml,
    check_pid_namespace,
    check_privileges,
    check_proc_children,
    check_proc_mount,
    check_systemd,
    load_config_for_doctor,
    run_checks,
)
from gpuwatch.model import GpuDevice, GpuProcessUsage, NvmlReading, NvmlStatus
from gpuwatch.serve.state_socket import StateServer
from gpuwatch.simulate import fakenvml
from gpuwatch.simulate.fakenvml import FakeNode
from gpuwatch.sinks.doctor_view import render_doctor, summary_line
from tests.daemonproc import running_daemon, setpriv_or_skip
from tests.localusers import LocalUser, local_user
from tests.realprocs import GIB, gpuwatch, proc_without_children_files, real_nvml_present

ROOT = Path(__file__).resolve().parent.parent
CGROUP_SAMPLES = ROOT / "tests" / "fixtures" / "cgroup"
ALL_CAPS = "000001ffffffffff"
NO_CAPS = "0000000000000000"
#: A uid nobody runs the suite as, so fixture processes (owned by the runner) are "other users'".
STRANGER = 4242
NOBODY = 65534
PROC_MOUNT = "22 27 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:13 - proc proc {opts}"
OTHER_MOUNTS = (
    "27 1 259:1 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p1 rw",
    "23 27 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:2 - sysfs sysfs rw",
    # Another procfs elsewhere (a container's, bind-mounted for inspection) must not count.
    "301 27 0:61 / /var/lib/box/proc rw,relatime - proc proc rw,hidepid=invisible",
)


# ---- fixture trees -------------------------------------------------------------------------------
class FakeProc:
    """A /proc tree: /proc/self (status, ns/pid, mountinfo) and processes with comm, stat,
    cgroup and environ files. Its process directories belong to whoever runs the suite."""

    def __init__(self, root: Path, uid: Optional[int] = None, caps: str = ALL_CAPS,
                 groups: str = "", nspid: str = "1234", ns_inode: Optional[int] = INIT_PID_NS_INODE,
                 proc_options: Optional[str] = "rw") -> None:
        self.path = root / "proc"
        me = self.path / "self"
        (me / "ns").mkdir(parents=True)
        uid = os.geteuid() if uid is None else uid
        lines = ["Name:\tgpuwatch", f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}",
                 f"Gid:\t{uid}\t{uid}\t{uid}\t{uid}", f"Groups:\t{groups}", f"CapEff:\t{caps}"]
        if nspid:
            lines.append(f"NSpid:\t{nspid}")
        (me / "status").write_text("\n".join(lines) + "\n")
        if ns_inode is not None:
            os.symlink(f"pid:[{ns_inode}]", me / "ns" / "pid")
        mounts = list(OTHER_MOUNTS)
        if proc_options is not None:
            mounts.insert(1, PROC_MOUNT.format(opts=proc_options))
        (me / "mountinfo").write_text("\n".join(mounts) + "\n")

    def process(self, pid: int, comm: str, cgroup: str = "0::/init.scope\n",
                kernel_thread: bool = False) -> None:
        d = self.path / str(pid)
        d.mkdir()
        (d / "comm").write_text(comm + "\n")
        (d / "cgroup").write_text(cgroup)
        flags = 0x00208040 if kernel_thread else 0x00400100
        rest = " ".join(["0"] * 40)  # a whole line: 52 fields, as the kernel writes it
        (d / "stat").write_text(f"{pid} ({comm}) S 1 {pid} {pid} 0 -1 {flags} 120 0 0 {rest}\n")
        (d / "environ").write_bytes(b"PATH=/usr/bin\0")


def sample(name: str) -> str:
    return (CGROUP_SAMPLES / name).read_text()


def context(tmp_path: Path, proc: Optional[FakeProc] = None, **kw: Any) -> Context:
    cfg = load_config(Path(os.devnull), environ={},
                      overrides={"daemon.runtime_dir": tmp_path / "run"})
    if proc is not None:
        kw.setdefault("proc", proc.path)
    return Context(cfg, **kw)


def one(checks: list[Check]) -> Check:
    assert len(checks) == 1, checks
    return checks[0]


def doctor_json(env: dict[str, str], *args: str) -> tuple[int, dict[str, Any]]:
    result = gpuwatch(["doctor", "--json", *args], env)
    assert result.stdout, result.stderr
    doc = json.loads(result.stdout)
    assert doc["exit_code"] == result.returncode
    return result.returncode, doc


def by_name(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["checks"]}


def free_port() -> int:
    """A port that refuses: bound by nobody once this returns."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


@functools.cache
def _nobody_cannot_run_python() -> Optional[str]:
    """Why this interpreter cannot run as uid 65534 here, or None. setpriv rather than
    subprocess's user=: it keeps root's capabilities until execve, so an interpreter reached
    through a directory only root may enter (/root/.pyenv) still starts."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return "needs root and setpriv(1) to run a check as another user"
    probe = subprocess.run([*AS_NOBODY, sys.executable, "-c", "import gpuwatch.doctor"],
                           cwd=ROOT, capture_output=True, text=True, timeout=30)
    return None if probe.returncode == 0 else f"python cannot run as uid {NOBODY}: {probe.stderr}"


def run_as_nobody(code: str) -> dict[str, Any]:
    """Run Python `code` (which prints one JSON object) as uid/gid 65534 with no groups."""
    why = _nobody_cannot_run_python()
    if why is not None:
        pytest.skip(why)
    done = subprocess.run([*AS_NOBODY, sys.executable, "-c", code], cwd=ROOT,
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def unshared(argv: list[str], env: dict[str, str], shell: Optional[str] = None
             ) -> subprocess.CompletedProcess[str]:
    """`argv` in a PID namespace of its own with its own /proc (root only)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a PID namespace")
    if shell is None:
        cmd = ["unshare", "--pid", "--fork", "--mount-proc", *argv]
    else:
        cmd = ["unshare", "--pid", "--fork", "--mount", "--propagation", "private", "sh", "-c",
               shell, "sh", *argv]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    if done.returncode not in (0, EXIT_DOCTOR_WARNINGS, EXIT_DOCTOR_FAILURES):
        pytest.skip(f"cannot make a PID namespace here: {done.stderr.strip()}")
    return done


# ---- config --------------------------------------------------------------------------------------
def test_a_valid_config_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "gpuwatch.toml"
    path.write_text('[daemon]\ninterval = 5\nlisten = "127.0.0.1:9977"\n')
    loaded = load_config_for_doctor(path, environ={"GPUWATCH_NODE_NAME": "n1"})
    assert loaded.error is None and loaded.config.daemon.interval == 5
    check = one(check_config(context(tmp_path, config_source=loaded.source)))
    assert check.status == OK
    assert check.summary == f"{path} (--config): valid; GPUWATCH_NODE_NAME set"


def test_no_config_file_means_the_defaults(tmp_path: Path) -> None:
    if DEFAULT_CONFIG_PATH.exists():
        pytest.skip(f"{DEFAULT_CONFIG_PATH} exists here")
    loaded = load_config_for_doctor(None, environ={})
    assert loaded.error is None and loaded.config == Config()
    assert loaded.source.startswith("no config file") and loaded.source.endswith("the defaults")


def test_a_bad_key_fails_naming_it_and_the_others_run_on_a_fallback(tmp_path: Path) -> None:
    path = tmp_path / "gpuwatch.toml"
    path.write_text("[daemon]\nintervall = 5\n")
    loaded = load_config_for_doctor(path, environ={"GPUWATCH_RUNTIME_DIR": str(tmp_path / "rt")})
    assert loaded.error is not None
    # The file is left out, the environment kept: the socket checks look where the user said.
    assert loaded.config.daemon.runtime_dir == tmp_path / "rt"
    check = one(check_config(context(tmp_path, config_source=loaded.source,
                                     config_error=loaded.error)))
    assert check.status == FAIL
    assert "daemon.intervall: unknown key" in check.summary and str(path) in check.summary
    assert check.fix is not None and "docs/config.md" in check.fix


def test_the_cli_reports_a_bad_config_as_a_failed_check_not_exit_78(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[detectors]\nzombie_grace = "soon"\n')
    code, doc = doctor_json(cli_env, "--config", str(path), "--check", "config",
                            "--check", "daemon")
    assert code == EXIT_DOCTOR_FAILURES
    checks = by_name(doc)
    assert checks["config"]["status"] == FAIL
    assert "detectors.zombie_grace" in checks["config"]["summary"]
    # Still looked in the runtime directory GPUWATCH_RUNTIME_DIR names.
    assert cli_env["GPUWATCH_RUNTIME_DIR"] in checks["daemon"]["summary"]


# ---- NVML and the GPUs (the fake driver, in a process of its own) ------------------------------
def test_nvml_ok_gives_the_versions_and_a_line_per_gpu(fake_node: FakeNode,
                                                       cli_env: dict[str, str]) -> None:
    fake_node.hold(os.getpid(), device=0, used=3 * GIB)
    code, doc = doctor_json(cli_env, "--check", "nvml", "--check", "pid-namespace")
    checks = by_name(doc)
    assert [c["name"] for c in doc["checks"]] == ["nvml", "gpu0", "gpu1", "pid-namespace"]
    nvml = checks["nvml"]
    assert nvml["status"] == OK
    assert nvml["summary"] == "NVML 12.550.54.15, driver 550.54.15, CUDA 12.4, 2 GPUs"
    gpu0, gpu1 = checks["gpu0"], checks["gpu1"]
    assert gpu0["status"] == gpu1["status"] == OK
    assert gpu0["summary"].startswith("NVIDIA H100 80GB HBM3 00000000:18:00.0: 3.0 GiB of ")
    assert gpu0["summary"].endswith(", 1 process") and gpu1["summary"].endswith(", 0 processes")
    assert gpu0["detail"] == fake_node.devices[0].uuid
    # The cross-check: the PID NVML lists is this process, which this /proc has.
    assert "NVML lists 1 PID, all in this /proc" in checks["pid-namespace"]["summary"]
    assert code == (EXIT_OK if checks["pid-namespace"]["status"] == OK else EXIT_DOCTOR_WARNINGS)


def test_nvml_init_failing_is_a_failure_naming_the_error(fake_node: FakeNode,
                                                         cli_env: dict[str, str]) -> None:
    fake_node.fail("nvmlInitWithFlags", fakenvml.DRIVER_NOT_LOADED)
    code, doc = doctor_json(cli_env, "--check", "nvml")
    assert code == EXIT_DOCTOR_FAILURES
    (nvml,) = doc["checks"]
    assert nvml["status"] == FAIL
    assert "Driver Not Loaded" in nvml["summary"] and "NVML error 9" in nvml["summary"]
    assert "modprobe nvidia" in nvml["fix"]


def test_a_lost_gpu_and_an_unreadable_process_list_fail_their_own_lines(
        fake_node: FakeNode, cli_env: dict[str, str]) -> None:
    fake_node.fail("*", fakenvml.GPU_IS_LOST, device=1)
    fake_node.fail("nvmlDeviceGetComputeRunningProcesses_v3", fakenvml.TIMEOUT, device=0)
    code, doc = doctor_json(cli_env, "--check", "nvml")
    assert code == EXIT_DOCTOR_FAILURES
    checks = by_name(doc)
    assert checks["nvml"]["status"] == OK
    gpu0, gpu1 = checks["gpu0"], checks["gpu1"]
    assert gpu0["status"] == FAIL
    assert "nvmlDeviceGetComputeRunningProcesses: Timeout" in gpu0["summary"]
    assert "who holds its memory is unknown" in gpu0["summary"]
    assert gpu1["status"] == FAIL and "lost, needs a reset" in gpu1["summary"]
    assert "GPU is lost" in gpu1["summary"] and "nvidia-smi -r -i 1" in gpu1["fix"]


def test_no_nvml_library_warns_that_only_host_processes_are_monitored(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    if real_nvml_present():
        pytest.skip("this machine has a real libnvidia-ml.so.1")
    empty = tmp_path / "no-libs"
    empty.mkdir()
    env = {**cli_env, "LD_LIBRARY_PATH": str(empty)}
    env.pop(fakenvml.STATE_ENV)
    code, doc = doctor_json(env, "--check", "nvml")
    (nvml,) = doc["checks"]
    if nvml["status"] == FAIL and "device file" in nvml["summary"]:
        pytest.skip("this machine has /dev/nvidiaN files")
    assert code == EXIT_DOCTOR_WARNINGS
    assert nvml["status"] == WARN
    assert "NVML Shared Library Not Found" in nvml["summary"]
    assert "host processes only" in nvml["summary"]


def test_no_library_on_a_node_with_gpu_device_files_is_a_failure(tmp_path: Path) -> None:
    """In this process, where no library is on the loader path; /dev is a fixture."""
    if real_nvml_present():
        pytest.skip("this machine has a real libnvidia-ml.so.1")
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    ctx = context(tmp_path, dev_dir=dev)
    nvml = one(check_nvml(ctx))
    assert nvml.status == FAIL
    assert "2 nvidiaN device files" in nvml.summary and "ldconfig" in (nvml.fix or "")
    assert ctx.nvml is not None and not ctx.nvml.status.available


# ---- privileges ----------------------------------------------------------------------------------
def test_with_every_capability_privileges_are_ok(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    proc.process(100, "python")
    check = one(check_privileges(context(tmp_path, proc)))
    assert check.status == OK, check
    assert "every process's launch environment is readable" in check.summary


def test_without_capabilities_privileges_warn_and_say_what_is_hidden(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path, uid=STRANGER, caps=NO_CAPS)
    proc.process(100, "python")
    proc.process(101, "torchrun")
    proc.process(2, "kthreadd", kernel_thread=True)  # no environment to hide: not counted
    check = one(check_privileges(context(tmp_path, proc)))
    assert check.status == WARN
    assert check.summary.startswith(f"uid {STRANGER} without CAP_SYS_PTRACE, "
                                    "CAP_DAC_READ_SEARCH, CAP_KILL: ")
    assert "of 2 other users' processes hide their environment" in check.summary
    assert "cannot signal other users' processes" in check.summary
    assert check.fix is not None and "sudo" in check.fix and "gpuwatch status" in check.fix


def test_as_another_user_the_environments_of_roots_processes_are_counted_hidden() -> None:
    """For real: this suite's own processes are root's; uid 65534 may not open their environ."""
    result = run_as_nobody(
        "import json; from pathlib import Path; from gpuwatch.config import Config; "
        "from gpuwatch.doctor import Context, check_privileges; "
        "(c,) = check_privileges(Context(Config())); print(json.dumps(c.as_json()))")
    assert result["status"] == WARN
    match = re.fullmatch(r"(\d+) processes of other users, (\d+) with an unreadable environment",
                         result["detail"])
    assert match is not None, result
    others, unreadable = map(int, match.groups())
    assert others >= 1 and unreadable == others
    assert f"{unreadable} of {others} other users' processes hide" in result["summary"]


# ---- executables ---------------------------------------------------------------------------------
def _doctor_executables(user: Optional[LocalUser]) -> dict[str, Any]:
    """`gpuwatch doctor --check executables --json` as root, or as `user` with no capability
    (setpriv, as a user's own shell gives none)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GPUWATCH_CONFIG": "/dev/null",
           "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "gpuwatch", "doctor", "--json", "--check", "executables"]
    if user is not None:
        argv = ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups",
                *argv]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout, done.stderr
    (check,) = json.loads(done.stdout)["checks"]
    return dict(check)


def test_who_cannot_read_another_users_proc_pid_exe_is_warned_that_protection_by_program_fails(
        ) -> None:
    """alice's process is another user's to mallory (and root's processes are too): without
    CAP_SYS_PTRACE she cannot read which program they run, so none could be protected by it.
    Root can."""
    setpriv_or_skip()
    alice, mallory = local_user("alice"), local_user("mallory")
    alices = alice.popen(["sleep", "600"])
    try:
        check = _doctor_executables(mallory)
        assert check["status"] == WARN, check
        assert check["summary"].startswith(f"uid {mallory.uid} ({mallory.name}) cannot read "
                                           "/proc/PID/exe of "), check
        assert "protected_executables" in check["summary"], check
        assert "AmbientCapabilities=CAP_SYS_PTRACE" in check["fix"], check
        as_root = _doctor_executables(None)
        assert as_root["status"] == OK, as_root
        assert as_root["summary"].startswith("root reads which program other users' "
                                             "processes run"), as_root
    finally:
        alices.kill()
        alices.wait()


def test_with_no_other_users_process_to_try_the_executables_check_says_so(tmp_path: Path
                                                                          ) -> None:
    proc = FakeProc(tmp_path, uid=STRANGER, caps=NO_CAPS)
    check = one(check_executables(context(tmp_path, proc)))
    assert check.status == OK, check
    assert "no other user's process to try" in check.summary, check


# ---- /proc's mount options -------------------------------------------------------------------
@pytest.mark.parametrize(("options", "caps", "groups", "status", "words"), [
    ("rw", NO_CAPS, "", OK, "no hidepid"),
    ("rw,hidepid=invisible", NO_CAPS, "", WARN, "other users' processes are invisible"),
    ("rw,hidepid=2", NO_CAPS, "", WARN, "other users' processes are invisible"),
    ("rw,hidepid=noaccess", NO_CAPS, "", WARN, "other users' /proc/PID files are unreadable"),
    ("rw,hidepid=invisible,gid=5000", NO_CAPS, "5000 27", OK, "in group 5000, which it exempts"),
    ("rw,hidepid=invisible,gid=5000", NO_CAPS, "27", WARN, "processes are invisible"),
    ("rw,hidepid=invisible", ALL_CAPS, "", OK, "CAP_SYS_PTRACE, which it exempts"),
    ("rw,subset=pid", NO_CAPS, "", WARN, "/proc/meminfo is hidden"),
])
def test_proc_mount_options(tmp_path: Path, options: str, caps: str, groups: str, status: str,
                            words: str) -> None:
    proc = FakeProc(tmp_path, uid=STRANGER, caps=caps, groups=groups, proc_options=options)
    check = one(check_proc_mount(context(tmp_path, proc)))
    assert check.status == status, check
    assert words in check.summary
    if status == WARN and "hidepid" in options:
        assert check.fix is not None and "gid=<group>" in check.fix


def test_without_a_proc_mount_on_proc_the_mount_check_is_skipped(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path, proc_options=None)
    check = one(check_proc_mount(context(tmp_path, proc)))
    assert check.status == SKIP and "cannot tell" in check.summary


def test_a_real_hidepid_mount_warns_an_unprivileged_user(cli_env: dict[str, str]) -> None:
    why = _nobody_cannot_run_python()
    if why is not None:
        pytest.skip(why)
    # A fresh procfs in a PID and mount namespace of its own: the host's /proc is untouched.
    script = ('mount -t proc -o hidepid=2 proc /proc && exec setpriv --reuid=65534 '
              '--regid=65534 --clear-groups "$@"')
    done = unshared([sys.executable, "-m", "gpuwatch", "doctor", "--json", "--check",
                     "proc-mount"], cli_env, shell=script)
    assert done.returncode == EXIT_DOCTOR_WARNINGS, done.stderr
    (check,) = json.loads(done.stdout)["checks"]
    assert check["status"] == WARN
    assert "/proc is mounted hidepid=invisible: for uid 65534" in check["summary"]


# ---- the PID namespace -----------------------------------------------------------------------
def _nvml_listing(*pids: int) -> NvmlReading:
    usage = tuple(GpuProcessUsage(0, None, pid, GIB) for pid in pids)
    return NvmlReading(status=NvmlStatus(available=True), gpus=(GpuDevice(0, processes=usage),))


def test_the_host_pid_namespace_is_ok(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    proc.process(4321, "python")
    ctx = context(tmp_path, proc, nvml=_nvml_listing(4321))
    check = one(check_pid_namespace(ctx))
    assert check.status == OK
    assert check.summary == (f"the host's PID namespace (pid:[{INIT_PID_NS_INODE}]); NVML lists "
                             "1 PID, all in this /proc")


def test_a_pid_namespace_of_its_own_warns_with_the_host_pid_fix(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path, ns_inode=4026532178, nspid="3")
    ctx = context(tmp_path, proc, nvml=_nvml_listing(98765, 98766))
    check = one(check_pid_namespace(ctx))
    assert check.status == WARN
    assert "PID namespace of its own (pid:[4026532178]" in check.summary
    assert "NVML lists 2 PIDs, 2 of them not in this /proc" in check.summary
    assert check.detail == "NVML PIDs not in /proc: 98765, 98766"
    assert check.fix is not None and "hostPID: true" in check.fix and "--pid=host" in check.fix


def test_nested_nspid_alone_is_evidence(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path, ns_inode=None, nspid="5678\t3")
    check = one(check_pid_namespace(context(tmp_path, proc)))
    assert check.status == WARN and "NSpid 5678 3" in check.summary


def test_without_the_link_nvml_pids_missing_from_proc_are_the_evidence(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path, ns_inode=None, nspid="3")
    check = one(check_pid_namespace(context(tmp_path, proc, nvml=_nvml_listing(98765))))
    assert check.status == WARN and "none of the PIDs NVML lists" in check.summary
    nothing = FakeProc(tmp_path / "other", ns_inode=None, nspid="")
    assert one(check_pid_namespace(context(tmp_path, nothing))).status == SKIP


def test_a_kernel_without_children_files_is_said_and_the_trees_come_from_parents(
        tmp_path: Path) -> None:
    assert one(check_proc_children(context(tmp_path))).status == OK  # this machine's /proc
    copy = proc_without_children_files(tmp_path / "proc")
    ctx = context(tmp_path)
    ctx.proc = copy
    check = one(check_proc_children(ctx))
    assert check.status == WARN and "CONFIG_PROC_CHILDREN" in check.summary
    assert "parent PID" in check.summary and check.fix


def test_a_real_pid_namespace_warns_and_nvml_pids_are_missing_from_its_proc(
        fake_node: FakeNode, cli_env: dict[str, str]) -> None:
    host_pid = os.getpid()  # no such PID in a namespace just made: its PIDs start at 1
    # ghost: the fake lists only PIDs its caller can see, unless told to; a real driver lists
    # host PIDs whatever namespace asks.
    fake_node.hold(host_pid, device=0, used=GIB, ghost=True)
    done = unshared([sys.executable, "-m", "gpuwatch", "doctor", "--json", "--check", "nvml",
                     "--check", "pid-namespace"], cli_env)
    checks = by_name(json.loads(done.stdout))
    assert checks["nvml"]["status"] == OK
    ns = checks["pid-namespace"]
    assert ns["status"] == WARN
    assert "NVML lists 1 PID, 1 of them not in this /proc" in ns["summary"]
    assert ns["detail"] == f"NVML PIDs not in /proc: {host_pid}"


# ---- cgroups ---------------------------------------------------------------------------------
def _cgroupfs(root: Path, layout: str) -> Path:
    sys_cgroup = root / "sys-fs-cgroup"
    sys_cgroup.mkdir()
    if layout == "v2":
        (sys_cgroup / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    if layout in ("v1", "hybrid"):
        for controller in ("memory", "cpu", "pids", "systemd"):
            (sys_cgroup / controller).mkdir()
    if layout == "hybrid":
        (sys_cgroup / "unified").mkdir()
    return sys_cgroup


@pytest.mark.parametrize("layout", ["v2", "hybrid", "v1", "none"])
def test_the_cgroup_layout_is_told_apart(tmp_path: Path, layout: str) -> None:
    sys_cgroup = _cgroupfs(tmp_path, layout)
    assert cgroup_layout(sys_cgroup) == layout
    proc = FakeProc(tmp_path)
    proc.process(1, "systemd", sample("init_scope.txt"))
    check = one(check_cgroups(context(tmp_path, proc, sys_cgroup=sys_cgroup)))
    assert check.status == (WARN if layout == "none" else OK), check
    assert "no Slurm, pod or container cgroup among 1 process " in check.summary


def test_slurm_pods_and_containers_seen_in_cgroups_are_counted(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    proc.process(1, "systemd", sample("init_scope.txt"))
    proc.process(200, "python", sample("slurm_v2_step.txt"))
    proc.process(201, "slurmstepd", sample("slurm_v2_stepd.txt"))  # the same job
    proc.process(300, "python", sample("k8s_systemd_burstable_containerd.txt"))
    proc.process(400, "redis-server", sample("docker_systemd_v2.txt"))
    check = one(check_cgroups(context(tmp_path, proc, sys_cgroup=_cgroupfs(tmp_path, "v2"))))
    assert check.status == OK
    assert check.summary == ("cgroup v2 (unified); job cgroups among 5 processes: Slurm (1 job), "
                             "Kubernetes (1 pod), containers (1)")


def test_slurm_steps_without_slurm_cgroups_warn_to_use_proctrack_cgroup(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    proc.process(1, "systemd", sample("init_scope.txt"))
    proc.process(201, "slurmstepd", sample("systemd_daemon.txt"))
    check = one(check_cgroups(context(tmp_path, proc, sys_cgroup=_cgroupfs(tmp_path, "v1"))))
    assert check.status == WARN and "slurmstepd" in check.summary
    assert check.fix is not None and "ProctrackType=proctrack/cgroup" in check.fix


def test_a_kubelet_with_no_pod_in_sight_warns_about_namespaces(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    proc.process(900, "kubelet", sample("systemd_daemon.txt"))
    check = one(check_cgroups(context(tmp_path, proc, sys_cgroup=_cgroupfs(tmp_path, "v2"))))
    assert check.status == WARN and "kubelet runs" in check.summary
    assert check.fix is not None and "hostPID: true" in check.fix


# ---- the daemon, its sockets and /metrics ----------------------------------------------------
DAEMON_CHECKS = ("--check", "config", "--check", "daemon", "--check", "agent-socket",
                 "--check", "metrics")


def test_with_the_daemon_running_its_checks_pass_and_doctor_exits_0(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_daemon(cli_env, tmp_path) as d:
        code, doc = doctor_json(cli_env, *DAEMON_CHECKS)
        human = gpuwatch(["doctor", *DAEMON_CHECKS], cli_env)
    assert code == EXIT_OK, doc
    checks = by_name(doc)
    assert all(c["status"] == OK for c in doc["checks"]), doc
    assert checks["daemon"]["summary"].startswith(
        f"answers on {d.runtime_dir / 'state.sock'}: gpuwatch {__version__}, PID {d.proc.pid}, "
        "last poll ")
    assert checks["agent-socket"]["summary"] == (f"{d.runtime_dir / 'agent.sock'} accepts "
                                                 "reports (mode 0666)")
    families = re.fullmatch(rf"{re.escape(d.metrics_url)} serves (\d+) gpuwatch_ metric "
                            rf"families, from the daemon \(PID {d.proc.pid}\)",
                            checks["metrics"]["summary"])
    assert families is not None and int(families.group(1)) > 10, checks["metrics"]
    assert human.returncode == EXIT_OK
    lines = human.stdout.splitlines()
    assert [line.split()[:2] for line in lines[:4]] == [
        ["ok", "config"], ["ok", "daemon"], ["ok", "agent-socket"], ["ok", "metrics"]]
    assert lines[4:] == ["", "all ok (4 ok)"]


def test_without_a_daemon_its_checks_fail_saying_how_to_start_it(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "gpuwatch.toml"
    config.write_text(f'[daemon]\nlisten = "127.0.0.1:{port}"\n')
    code, doc = doctor_json(cli_env, "--config", str(config), *DAEMON_CHECKS)
    assert code == EXIT_DOCTOR_FAILURES
    checks = by_name(doc)
    run = cli_env["GPUWATCH_RUNTIME_DIR"]
    assert checks["config"]["status"] == OK
    assert checks["daemon"]["status"] == FAIL
    assert checks["daemon"]["summary"] == f"no daemon: {run}/state.sock does not exist"
    assert "systemctl start gpuwatch" in checks["daemon"]["fix"]
    assert "gpuwatch daemon" in checks["daemon"]["fix"]
    assert checks["agent-socket"]["status"] == FAIL
    assert checks["agent-socket"]["summary"] == f"no {run}/agent.sock"
    assert checks["metrics"]["status"] == FAIL
    assert checks["metrics"]["summary"] == (f"nothing listens on http://127.0.0.1:{port}/metrics "
                                            "(from daemon.listen)")


def test_without_a_daemon_another_daemons_metrics_on_the_port_fail_the_metrics_check(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    """No daemon on this runtime directory, another one on the port its configuration names:
    the metrics are that one's, and doctor says so instead of `ok metrics` beside `fail
    daemon`."""
    other_env = {**cli_env, "GPUWATCH_RUNTIME_DIR": str(tmp_path / "other-run")}
    with running_daemon(other_env, tmp_path / "other") as other:
        config = tmp_path / "gpuwatch.toml"
        config.write_text(f'[daemon]\nlisten = "{other.metrics_url.split("/")[2]}"\n')
        code, doc = doctor_json(cli_env, "--config", str(config), *DAEMON_CHECKS)
    assert code == EXIT_DOCTOR_FAILURES
    checks = by_name(doc)
    assert checks["daemon"]["status"] == FAIL
    assert checks["metrics"]["status"] == FAIL, checks["metrics"]
    assert checks["metrics"]["summary"] == (
        f"{other.metrics_url} (from daemon.listen) is another daemon's (gpuwatch PID "
        f"{other.proc.pid}): no daemon runs on {cli_env['GPUWATCH_RUNTIME_DIR']}")
    assert "--runtime-dir" in checks["metrics"]["fix"]


class _GpuwatchMetrics(http.server.BaseHTTPRequestHandler):
    body = (b'# HELP gpuwatch_build_info Version.\n# TYPE gpuwatch_build_info gauge\n'
            b'gpuwatch_build_info{version="1",python="3.11",pid="4242"} 1.0\n')

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


def test_metrics_served_by_a_daemon_other_than_daemon_json_names_fail(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _GpuwatchMetrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        (run / "daemon.json").write_text(json.dumps({"pid": 4243, "metrics_url": url}))
        check = one(check_metrics(context(tmp_path)))
        assert check.status == FAIL
        assert check.summary == (f"{url} (from daemon.json) is served by gpuwatch PID 4242, "
                                 "not by the daemon daemon.json names (PID 4243)")
        (run / "daemon.json").write_text(json.dumps({"pid": 4242, "metrics_url": url}))
        check = one(check_metrics(context(tmp_path)))
        assert check.status == OK
        assert check.summary == f"{url} serves 1 gpuwatch_ metric family, from the daemon " \
                                "(PID 4242)"
    finally:
        server.shutdown()
        server.server_close()


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_sockets_left_by_a_dead_daemon_fail_as_such(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    dead = _dead_pid()
    (run / "daemon.json").write_text(json.dumps({"pid": dead, "version": __version__}))
    for name, kind in (("state.sock", socket.SOCK_STREAM), ("agent.sock", socket.SOCK_DGRAM)):
        with socket.socket(socket.AF_UNIX, kind) as s:
            s.bind(str(run / name))  # closed without a listener: the file stays, nobody behind
    ctx = context(tmp_path)
    daemon = one(check_daemon(ctx))
    assert daemon.status == FAIL
    assert daemon.summary == (f"nothing listens on {run / 'state.sock'}: the daemon that made it "
                              f"is gone; daemon.json names PID {dead}, which is not running")
    assert daemon.fix is not None and "journalctl -u gpuwatch" in daemon.fix
    agent = one(check_agent_socket(ctx))
    assert agent.status == FAIL and "nothing receives on" in agent.summary


def test_an_agent_socket_path_that_is_no_socket_or_keeps_users_out(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "agent.sock").write_text("")
    ctx = context(tmp_path)
    assert one(check_agent_socket(ctx)).summary == f"{run / 'agent.sock'} is not a socket"
    (run / "agent.sock").unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(str(run / "agent.sock"))
        os.chmod(run / "agent.sock", 0o660)
        check = one(check_agent_socket(ctx))
    assert check.status == WARN and "mode is 0660" in check.summary
    assert "other users' training processes cannot report" in check.summary


@contextlib.contextmanager
def state_server(run: Path, doc: Optional[dict[str, Any]]) -> Iterator[None]:
    """The daemon's own state-socket server, serving `doc` (None: no poll finished yet)."""
    run.mkdir(exist_ok=True)
    body = json.dumps(doc).encode() if doc is not None else None
    server = StateServer(run / "state.sock", lambda: body, group=None)
    server.start()
    try:
        yield
    finally:
        server.stop()


def test_a_daemon_of_another_version_warns_and_doctor_exits_3(cli_env: dict[str, str]) -> None:
    run = Path(cli_env["GPUWATCH_RUNTIME_DIR"])
    with state_server(run, {"gpuwatch_version": "0.0.1", "taken_at": time.time()}):
        code, doc = doctor_json(cli_env, "--check", "daemon")
    assert code == EXIT_DOCTOR_WARNINGS
    (daemon,) = doc["checks"]
    assert daemon["status"] == WARN
    assert re.search(rf"gpuwatch 0\.0\.1, last poll \d+ s ago; this command is gpuwatch "
                     rf"{re.escape(__version__)}$", daemon["summary"]), daemon
    assert "systemctl restart gpuwatch" in daemon["fix"]


def test_a_daemon_without_a_fresh_poll_warns(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ctx = context(tmp_path)
    with state_server(run, None):
        check = one(check_daemon(ctx))
    assert check.status == WARN and "has not finished its first poll" in check.summary
    with state_server(run, {"gpuwatch_version": __version__, "taken_at": time.time() - 600}):
        check = one(check_daemon(ctx))
    assert check.status == WARN and "its poll loop is stuck" in check.summary


def test_a_daemon_that_never_answers_fails_within_the_timeout(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(run / "state.sock"))
        s.listen()  # the backlog takes the connection; nobody ever reads or answers
        started = time.monotonic()
        check = one(check_daemon(context(tmp_path, timeout=0.2)))
    assert check.status == FAIL and "did not answer" in check.summary and "0.2 s" in check.summary
    assert time.monotonic() - started < 5


def test_without_permission_on_the_state_socket_the_fix_is_the_group() -> None:
    with contextlib.ExitStack() as stack:
        run = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "run"
        stack.enter_context(state_server(run, {"gpuwatch_version": __version__,
                                               "taken_at": time.time()}))
        run.chmod(0o755)
        run.parent.chmod(0o755)
        result = run_as_nobody(
            "import json; from pathlib import Path; from gpuwatch.config import load_config; "
            "from gpuwatch.doctor import Context, check_daemon; "
            f"cfg = load_config(Path('/dev/null'), environ={{}}, overrides={{"
            f"'daemon.runtime_dir': {str(run)!r}}}); "
            "(c,) = check_daemon(Context(cfg)); print(json.dumps(c.as_json()))")
    assert result["status"] == FAIL
    assert result["summary"] == f"no permission to connect to {run / 'state.sock'}"
    assert "usermod -aG gpuwatch" in result["fix"]


class _Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path != "/metrics":
            self.send_error(404)
            return
        body = b"# TYPE node_load1 gauge\nnode_load1 0.5\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_port_held_by_another_program_fails_the_metrics_check(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    ctx = context(tmp_path)
    try:
        (run / "daemon.json").write_text(json.dumps({"metrics_url": f"{base}/metrics"}))
        check = one(check_metrics(ctx))
        assert check.status == FAIL
        assert check.summary == f"{base}/metrics (from daemon.json) answers, but with no " \
                                "gpuwatch_ metric"
        (run / "daemon.json").write_text(json.dumps({"metrics_url": f"{base}/elsewhere"}))
        check = one(check_metrics(ctx))
        assert check.status == FAIL and "answers HTTP 404" in check.summary
    finally:
        server.shutdown()
        server.server_close()


def test_a_metrics_port_that_never_answers_fails_within_the_timeout(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()  # connections wait in the backlog, unanswered
        listen = f"127.0.0.1:{s.getsockname()[1]}"
        cfg = load_config(Path(os.devnull), environ={}, overrides={
            "daemon.runtime_dir": tmp_path / "run", "daemon.listen": listen})
        check = one(check_metrics(Context(cfg, timeout=0.2)))
    assert check.status == FAIL
    assert check.summary == f"http://{listen}/metrics (from daemon.listen) did not answer " \
                            "within 0.2 s"


# ---- systemd ---------------------------------------------------------------------------------
class FakeSystemctl:
    """A `systemctl` on PATH that prints what `state` says and records how it was called."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        self.args = tmp_path / "systemctl.args"
        self.state = tmp_path / "systemctl.state"
        self.script = bin_dir / "systemctl"
        self.behave("exit 0")
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        self.run_systemd = tmp_path / "run-systemd-system"
        self.run_systemd.mkdir()

    def behave(self, tail: str) -> None:
        self.script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {self.args}\n'
                               f"cat {self.state}\n{tail}\n")
        self.script.chmod(0o755)

    def unit(self, **properties: str) -> None:
        self.state.write_text("".join(f"{k}={v}\n" for k, v in properties.items()))


@pytest.mark.parametrize(("props", "status", "summary", "fix"), [
    ({"ActiveState": "active", "SubState": "running", "UnitFileState": "enabled"}, OK,
     "gpuwatch.service active (running), enabled", None),
    ({"ActiveState": "active", "SubState": "running", "UnitFileState": "disabled"}, WARN,
     "gpuwatch.service active (running), disabled: it will not start at boot",
     "systemctl enable gpuwatch.service"),
    ({"ActiveState": "failed", "SubState": "failed", "UnitFileState": "enabled",
      "Result": "exit-code"}, FAIL, "gpuwatch.service failed (failed), enabled, result exit-code",
     "journalctl -u gpuwatch.service"),
    ({"ActiveState": "inactive", "SubState": "dead", "UnitFileState": "enabled"}, FAIL,
     "gpuwatch.service inactive (dead), enabled", "systemctl start gpuwatch.service"),
    ({"ActiveState": "inactive", "SubState": "dead", "UnitFileState": "disabled"}, FAIL,
     "gpuwatch.service inactive (dead), disabled", "systemctl enable --now gpuwatch.service"),
    ({"ActiveState": "activating", "SubState": "start", "UnitFileState": "enabled"}, WARN,
     "gpuwatch.service activating (start), enabled", "journalctl"),
    ({"LoadState": "not-found", "ActiveState": "inactive", "SubState": "dead"}, WARN,
     "gpuwatch.service is not installed", "docs/systemd.md"),
    ({"LoadState": "masked", "ActiveState": "inactive", "UnitFileState": "masked"}, FAIL,
     "gpuwatch.service is masked: it cannot be started", "systemctl unmask gpuwatch.service"),
])
def test_the_unit_state_from_systemctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       props: dict[str, str], status: str, summary: str,
                                       fix: Optional[str]) -> None:
    systemctl = FakeSystemctl(tmp_path, monkeypatch)
    systemctl.unit(**{"LoadState": "loaded", "Result": "success", **props})
    check = one(check_systemd(context(tmp_path, run_systemd=systemctl.run_systemd)))
    assert (check.status, check.summary) == (status, summary)
    if fix is not None:
        assert check.fix is not None and fix in check.fix
    args = systemctl.args.read_text().split()
    assert args[:2] == ["show", "gpuwatch.service"] and "--property=ActiveState" in args


def test_systemctl_failing_or_hanging_is_reported(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    systemctl = FakeSystemctl(tmp_path, monkeypatch)
    systemctl.unit()
    systemctl.behave('echo "Failed to connect to bus: No such file or directory" >&2; exit 1')
    ctx = context(tmp_path, run_systemd=systemctl.run_systemd, timeout=0.3)
    check = one(check_systemd(ctx))
    assert check.status == WARN
    assert check.summary == ("systemctl show gpuwatch.service failed: Failed to connect to bus: "
                             "No such file or directory")
    systemctl.behave("exec tail -f /dev/null")  # blocks until killed
    check = one(check_systemd(ctx))
    assert check.status == WARN and check.summary == "systemctl did not answer within 0.3 s"
    missing = one(check_systemd(context(tmp_path, run_systemd=systemctl.run_systemd,
                                        systemctl="gpuwatch-test-no-systemctl")))
    assert missing.status == WARN and "not on PATH" in missing.summary


def test_without_systemd_running_the_check_is_skipped(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    systemctl = FakeSystemctl(tmp_path, monkeypatch)
    check = one(check_systemd(context(tmp_path, run_systemd=tmp_path / "no-such-dir")))
    assert check.status == SKIP and check.summary.startswith("skipped: systemd is not running")
    assert not systemctl.args.exists()


# ---- running the checks ------------------------------------------------------------------------
def test_a_check_that_raises_or_hangs_becomes_a_failed_line_and_the_rest_run(
        tmp_path: Path) -> None:
    released = threading.Event()

    def boom(ctx: Context) -> list[Check]:
        raise RuntimeError("boom")

    def stuck(ctx: Context) -> list[Check]:
        released.wait(30)
        return [Check("stuck", OK, "too late")]

    def after(ctx: Context) -> list[Check]:
        return [Check("after", OK, "ran")]

    specs = (Spec("boom", boom), Spec("stuck", stuck, deadline=0.2), Spec("after", after))
    try:
        checks = run_checks(context(tmp_path), specs=specs)
    finally:
        released.set()
    assert [(c.name, c.status) for c in checks] == [("boom", FAIL), ("stuck", FAIL),
                                                    ("after", OK)]
    assert checks[0].summary == "this check failed: RuntimeError: boom"
    assert checks[1].summary == "this check did not finish within 0.2 s"
    assert [c.name for c in run_checks(context(tmp_path), only={"after"}, specs=specs)] == \
        ["after"]


def test_the_human_view_aligns_columns_and_puts_the_fix_under_each_problem() -> None:
    doc = {"checks": [Check("config", OK, "fine").as_json(),
                      Check("pid-namespace", WARN, "nested", fix="use hostPID").as_json(),
                      Check("systemd", SKIP, "skipped").as_json(),
                      Check("daemon", FAIL, "no daemon", fix="start it").as_json()]}
    assert render_doctor(doc) == (
        "ok    config         fine\n"
        "warn  pid-namespace  nested\n"
        "                     → use hostPID\n"
        "skip  systemd        skipped\n"
        "fail  daemon         no daemon\n"
        "                     → start it\n"
        "\n"
        "1 warning, 1 failure (1 ok, 1 skipped)\n")
    coloured = render_doctor(doc, colour=True)
    assert "\x1b[33mwarn\x1b[0m  pid-namespace" in coloured and "\x1b[1;31mfail" in coloured


# ---- the command as an SRE runs it ---------------------------------------------------------------
def test_every_check_runs_and_the_human_view_matches_the_json(cli_env: dict[str, str]) -> None:
    """No daemon here: at least the daemon's checks fail, whatever this machine is."""
    code, doc = doctor_json(cli_env)
    assert set(doc) == {"schema", "gpuwatch_version", "checks", "exit_code"}
    assert doc["schema"] == 1 and doc["gpuwatch_version"] == __version__
    names = [c["name"] for c in doc["checks"]]
    assert [n for n in names if not re.fullmatch(r"gpu\d+", n)] == list(CHECK_NAMES)
    for c in doc["checks"]:
        assert set(c) <= {"name", "status", "summary", "detail", "fix"}, c
        assert c["status"] in (OK, WARN, FAIL, SKIP) and c["summary"]
        assert ("fix" in c) == (c["status"] in (WARN, FAIL)), c
    assert code == EXIT_DOCTOR_FAILURES and by_name(doc)["daemon"]["status"] == FAIL

    human = gpuwatch(["doctor"], cli_env)
    assert human.returncode == code and "\x1b[" not in human.stdout  # piped: no colour
    lines = human.stdout.splitlines()
    rows = [line.split()[:2] for line in lines if line and not line.startswith(" ")]
    assert rows[:-1] == [[c["status"], c["name"]] for c in doc["checks"]]
    arrows = [line.strip() for line in lines if line.startswith(" ")]
    assert arrows == [f"→ {c['fix']}" for c in doc["checks"] if "fix" in c]
    assert lines[-1] == summary_line(doc["checks"])
    assert re.fullmatch(r"(\d+ warnings?, )?\d+ failures? \(\d+ ok(, \d+ skipped)?\)", lines[-1])


def _on_a_terminal(env: dict[str, str]) -> str:
    main, sub = os.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "gpuwatch", "doctor", "--check", "config"],
                                env={**env, "TERM": "xterm"}, stdout=sub, stderr=sub)
    finally:
        os.close(sub)
    out = b""
    with contextlib.suppress(OSError):  # EIO once the terminal's other side is closed
        while chunk := os.read(main, 4096):
            out += chunk
    os.close(main)
    proc.wait(30)
    return out.decode()


def test_the_status_words_are_coloured_on_a_terminal_unless_no_color(
        cli_env: dict[str, str]) -> None:
    assert "\x1b[32mok  \x1b[0m  config" in _on_a_terminal(cli_env)
    plain = _on_a_terminal({**cli_env, "NO_COLOR": "1"})
    assert "ok    config" in plain and "\x1b[" not in plain


def test_usage_errors_exit_2(cli_env: dict[str, str]) -> None:
    unknown = gpuwatch(["doctor", "--check", "daemons"], cli_env)
    assert unknown.returncode == EXIT_USAGE
    assert "unknown check daemons; checks: config, nvml," in unknown.stderr
    assert gpuwatch(["doctor", "--timeout", "0"], cli_env).returncode == EXIT_USAGE


def test_the_docs_describe_every_check_and_exit_code() -> None:
    from gpuwatch.cli import DOCTOR_EXIT_CODES

    documented = (ROOT / "docs" / "doctor.md").read_text()
    for name in CHECK_NAMES:
        assert f"### `{name}`" in documented, name
    for line in DOCTOR_EXIT_CODES.splitlines()[2:]:
        code, _, meaning = line.strip().partition("  ")
        assert f"| {code} | {meaning.strip()} |" in documented, line
