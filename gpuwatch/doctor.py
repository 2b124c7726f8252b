"""`gpuwatch doctor`: everything gpuwatch depends on, checked, each with what to do about it.

A source like the others: it reads the node (NVML, /proc, /sys/fs/cgroup, the runtime directory,
the daemon's sockets and /metrics, systemd) and produces `Check` results, which
gpuwatch/sinks/doctor_view.py renders and the CLI turns into an exit code. Every path a check
reads is a field of `Context`, so that tests point the checks at fixture trees.

Each check runs in a thread of its own with a deadline: NVML can block for ever on a GPU that fell
off the bus, and a check that hangs or raises must cost only its own line, never the others'.
docs/doctor.md says what each check looks at and why.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import pwd
import re
import shutil
import socket
import ssl
import stat
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from gpuwatch import __version__
from gpuwatch.config import (
    DEFAULT_CONFIG_PATH,
    Config,
    ConfigError,
    describe,
    load_config,
    split_listen,
)
from gpuwatch.model import GpuDevice, NvmlReading
from gpuwatch.protocol import SOCKET_NAME as AGENT_SOCKET_NAME
from gpuwatch.runtime_dir import DAEMON_INFO_NAME, UnsafeDirectory, open_daemon_dir
from gpuwatch.runtime_dir import read_daemon_info as runtime_daemon_info
from gpuwatch.serve.state_socket import STATE_SOCKET_NAME, StateUnavailable, fetch_status
from gpuwatch.sources.jobs import parse_cgroup
from gpuwatch.sources.nvml import NvmlSource
from gpuwatch.sources.proc_stat import is_kernel_thread, parse_stat
from gpuwatch.sources.processes import has_children_files
from gpuwatch.units import human_bytes, plural

OK = "ok"
WARN = "warn"
FAIL = "fail"
#: The check does not apply here (systemd not running) or cannot tell; never a problem.
SKIP = "skip"
STATUSES = (OK, WARN, FAIL, SKIP)

#: PROC_PID_INIT_INO in the kernel's include/linux/proc_ns.h: the inode number of the initial
#: (host's) PID namespace, the same on every Linux system.
INIT_PID_NS_INODE = 4026531836
#: NVML's first initialisation without persistence mode takes seconds per GPU; beyond this the
#: driver is stuck, not slow.
NVML_DEADLINE = 30.0
#: A daemon whose newest poll is older than this has a stuck poll loop (the default interval is
#: 2 s; the systemd unit's watchdog kills a loop stuck for 30 s).
STALE_POLL_SECONDS = 60.0

# Capability bits (linux/capability.h) that decide what gpuwatch can see and do.
_CAP_DAC_OVERRIDE = 1
_CAP_DAC_READ_SEARCH = 2
_CAP_KILL = 5
_CAP_SYS_PTRACE = 19
# Bounds a /proc walk on a node with an absurd number of processes: the checks stay quick.
_MAX_PROCESSES = 50_000
_MAX_METRICS_BYTES = 32 << 20


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    status: str
    #: What was found, one line.
    summary: str
    #: What to do; given for warn and fail.
    fix: Optional[str] = None
    #: More of what was found, for --json readers (paths, PIDs, numbers).
    detail: Optional[str] = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "status": self.status, "summary": self.summary}
        if self.detail:
            out["detail"] = self.detail
        if self.fix:
            out["fix"] = self.fix
        return out


@dataclass
class Context:
    """What the checks read, and where: every path here can point at a fixture tree."""

    config: Config
    #: What was loaded, as the config check's ok line says it ("/etc/gpuwatch/gpuwatch.toml:
    #: valid", "no config file (...): the defaults").
    config_source: str = "the defaults"
    #: The ConfigError message when the configuration is invalid (`config` then holds the
    #: defaults, so the other checks still run).
    config_error: Optional[str] = None
    #: Seconds for each socket, HTTP and systemctl exchange.
    timeout: float = 2.0
    proc: Path = Path("/proc")
    sys_cgroup: Path = Path("/sys/fs/cgroup")
    #: Exists when systemd is the init system (sd_booted(3) tests the same path).
    run_systemd: Path = Path("/run/systemd/system")
    dev_dir: Path = Path("/dev")
    #: Looked up on PATH when the systemd check runs.
    systemctl: str = "systemctl"
    unit: str = "gpuwatch.service"
    version: str = __version__
    #: The NVML check's reading, for the PID-namespace check's cross-check; None until it ran.
    nvml: Optional[NvmlReading] = field(default=None, repr=False)

    @property
    def runtime_dir(self) -> Path:
        return self.config.daemon.runtime_dir


# -- the configuration -------------------------------------------------------------------------
@dataclass(frozen=True)
class ConfigLoad:
    config: Config
    #: What was loaded, for the ok line.
    source: str
    #: ConfigError's message (it names the key and where the value came from).
    error: Optional[str] = None


def load_config_for_doctor(path: Optional[Path], runtime_dir: Optional[Path] = None,
                           environ: Optional[Mapping[str, str]] = None) -> ConfigLoad:
    """The configuration as every other command loads it; when it is invalid, the error and a
    fallback (the environment and flags without the file, else the defaults) for the rest."""
    env = os.environ if environ is None else environ
    overrides = {"daemon.runtime_dir": runtime_dir}
    if path is not None:
        source = f"{path} (--config): valid"
    elif "GPUWATCH_CONFIG" in env:
        source = f"{env['GPUWATCH_CONFIG']} (GPUWATCH_CONFIG): valid"
    elif DEFAULT_CONFIG_PATH.exists():
        source = f"{DEFAULT_CONFIG_PATH}: valid"
    else:
        source = f"no config file ({DEFAULT_CONFIG_PATH} does not exist): the defaults"
    variables = sorted(v for _, _, _, v in describe() if v and v in env)
    if variables:
        source += "; " + ", ".join(variables) + " set"
    try:
        return ConfigLoad(load_config(path, environ=env, overrides=overrides), source)
    except ConfigError as exc:
        error = str(exc)
    for fallback_env in (env, {}):
        with contextlib.suppress(ConfigError):
            return ConfigLoad(load_config(Path(os.devnull), environ=fallback_env,
                                          overrides=overrides), source, error)
    return ConfigLoad(Config(), source, error)


def check_config(ctx: Context) -> list[Check]:
    if ctx.config_error is not None:
        return [Check("config", FAIL, f"invalid: {ctx.config_error}",
                      fix="correct the key the message names (docs/config.md lists every key); "
                          "the daemon will not start with this configuration (exit 78), and a "
                          "running one refuses it on reload; the other checks ran with the "
                          "defaults instead")]
    return [Check("config", OK, ctx.config_source,
                  detail=f"runtime directory {ctx.runtime_dir}, "
                         f"metrics on {ctx.config.daemon.listen}")]


# -- NVML and each GPU --------------------------------------------------------------------------
# nvmlReturn_t values (pynvml's NVML_ERROR_* numbering).
_NVML_NO_PERMISSION = 4
_NVML_DRIVER_NOT_LOADED = 9
_NVML_LIBRARY_NOT_FOUND = 12
_NVML_LIB_RM_VERSION_MISMATCH = 18
_NVML_FIXES = {
    _NVML_NO_PERMISSION:
        "no access to /dev/nvidiactl or /dev/nvidiaN: run as a user who may open them; in a "
        "container use the NVIDIA container runtime; under systemd see DeviceAllow= in "
        "docs/systemd.md",
    _NVML_DRIVER_NOT_LOADED:
        "the kernel module is not loaded: `modprobe nvidia` or reinstall the driver "
        "(`nvidia-smi` fails the same way; `dmesg | grep -i nvrm` says why)",
    _NVML_LIB_RM_VERSION_MISMATCH:
        "libnvidia-ml and the loaded kernel module are different versions (a driver upgrade "
        "without a reboot): reboot, or unload and reload the nvidia modules",
}
_NVML_DEFAULT_FIX = ("`nvidia-smi` shows whether the driver answers at all; "
                     "`dmesg | grep -i -e nvrm -e xid` says why not")


def check_nvml(ctx: Context) -> list[Check]:
    """The library, its version and the driver's; then one line per GPU."""
    source = NvmlSource(dev_dir=str(ctx.dev_dir))
    try:
        reading = source.read()
    finally:
        source.close()
    ctx.nvml = reading
    status = reading.status
    if not status.available:
        return [_nvml_unavailable(status.error or "unknown reason", status.error_code,
                                  status.device_files or 0, ctx.dev_dir)]
    versions = status.message + (f", CUDA {status.cuda_driver_version}"
                                 if status.cuda_driver_version else "")
    if not reading.gpus:
        return [Check("nvml", WARN, f"{versions}, but NVML lists no GPU",
                      fix="`nvidia-smi -L` lists the GPUs the driver sees; in a container, "
                          "NVIDIA_VISIBLE_DEVICES or the device plugin gave it none")]
    count = len(reading.gpus)
    return [Check("nvml", OK, f"{versions}, {plural(count, 'GPU')}"),
            *(_gpu_check(g) for g in reading.gpus)]


def _nvml_unavailable(error: str, code: Optional[int], device_files: int,
                      dev_dir: Path) -> Check:
    if code == _NVML_LIBRARY_NOT_FOUND:
        if device_files:
            return Check(
                "nvml", FAIL,
                f"no NVML library (libnvidia-ml.so.1: {error}), yet {dev_dir} has "
                f"{plural(device_files, 'nvidiaN device file')}: a GPU "
                "node without its driver's user-space libraries",
                fix="install the driver's user-space part (the package with libnvidia-ml.so.1) "
                    "or put its directory on the loader path (ldconfig); in a container, run it "
                    "with the NVIDIA container runtime")
        return Check(
            "nvml", WARN,
            f"no NVML library (libnvidia-ml.so.1: {error}) and no GPU device files: gpuwatch "
            "monitors host processes only, without GPU memory figures",
            fix="nothing to do on a node without GPUs; on a GPU node, install the NVIDIA driver")
    if code is None:  # no NVML error code: gpuwatch's own install is broken
        return Check("nvml", FAIL, f"NVML cannot be used: {error}",
                     fix="reinstall gpuwatch with its dependencies (nvidia-ml-py)")
    return Check("nvml", FAIL,
                 f"libnvidia-ml.so.1 found, but NVML initialisation failed: {error} (NVML error "
                 f"{code})", fix=_NVML_FIXES.get(code, _NVML_DEFAULT_FIX))


def _gpu_check(g: GpuDevice) -> Check:
    name = f"gpu{g.index}"
    what = " ".join(p for p in (g.name, g.pci_bus_id) if p) or f"GPU {g.index}"
    if g.errors:
        failed = "; ".join(str(e) for e in g.errors)
        if g.lost:
            return Check(name, FAIL, f"{what}: lost, needs a reset ({failed})", detail=g.uuid,
                         fix="stop the processes using it, then `nvidia-smi -r -i "
                             f"{g.index}`, or reboot the node; `dmesg | grep -i xid` says "
                             "what happened")
        unknown = " (who holds its memory is unknown)" if g.holders_unknown else ""
        return Check(name, FAIL, f"{what}: {failed}{unknown}", detail=g.uuid,
                     fix=f"`nvidia-smi -q -i {g.index}` shows what the driver says about it; "
                         "`dmesg | grep -i xid` whether it faulted")
    memory = (f"{human_bytes(g.memory_used_bytes)} of {human_bytes(g.memory_total_bytes)} used"
              if g.memory_total_bytes is not None else "memory unknown")
    count = len(g.processes)
    mig = ", MIG on" if g.mig_enabled else ""
    return Check(name, OK, f"{what}: {memory}, {plural(count, 'process')}{mig}",
                 detail=g.uuid)


# -- who this process is ------------------------------------------------------------------------
@dataclass(frozen=True)
class Identity:
    """The effective ids and capabilities in /proc/self/status: what the kernel checks."""

    euid: int
    egid: int
    groups: frozenset[int]
    capabilities: int
    #: NSpid: this process's PID in each PID namespace from /proc's own down to its own.
    nspid: tuple[int, ...] = ()

    def has(self, capability: int) -> bool:
        return bool(self.capabilities >> capability & 1)

    @property
    def reads_environ(self) -> bool:
        """May open other users' /proc/PID/environ: a ptrace read check and a file-mode check."""
        return self.has(_CAP_SYS_PTRACE) and (self.has(_CAP_DAC_READ_SEARCH)
                                              or self.has(_CAP_DAC_OVERRIDE))

    @property
    def signals_anyone(self) -> bool:
        return self.has(_CAP_KILL)

    @property
    def who(self) -> str:
        if self.euid == 0:
            return "root"
        try:
            return f"uid {self.euid} ({pwd.getpwuid(self.euid).pw_name})"
        except KeyError:
            return f"uid {self.euid}"


def read_identity(proc: Path) -> Identity:
    fields: dict[str, str] = {}
    for line in (proc / "self" / "status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return Identity(
        euid=int(fields["Uid"].split()[1]),
        egid=int(fields["Gid"].split()[1]),
        groups=frozenset(int(g) for g in fields.get("Groups", "").split()),
        capabilities=int(fields.get("CapEff", "0"), 16),
        nspid=tuple(int(p) for p in fields.get("NSpid", "").split()),
    )


def _pid_dirs(proc: Path) -> list[os.DirEntry[str]]:
    with os.scandir(proc) as entries:
        return [e for e in entries if e.name.isdigit()][:_MAX_PROCESSES]


def _is_kernel_thread(proc: Path, pid: str) -> Optional[bool]:
    """None when the process is gone. Kernel threads have no environment to read."""
    try:
        text = (proc / pid / "stat").read_bytes()
    except OSError:
        return None
    try:
        return is_kernel_thread(parse_stat(text)[1])
    except ValueError:
        return False


def _other_users_processes(proc: Path, euid: int) -> Iterator[os.DirEntry[str]]:
    """The /proc entries of processes (not kernel threads) of users other than `euid`; one
    gone meanwhile is left out."""
    for entry in _pid_dirs(proc):
        try:
            if entry.stat().st_uid == euid:
                continue
        except OSError:
            continue
        if _is_kernel_thread(proc, entry.name) is False:
            yield entry


def count_unreadable_environ(proc: Path, euid: int) -> tuple[int, int]:
    """(other users' processes, those whose /proc/PID/environ this process may not open).

    Opening is enough: the kernel checks permission at open, and reading an environment would
    take the process's memory lock, which a process stuck in D state holds.
    """
    others = unreadable = 0
    for entry in _other_users_processes(proc, euid):
        try:
            os.close(os.open(proc / entry.name / "environ", os.O_RDONLY | os.O_CLOEXEC))
        except PermissionError:
            unreadable += 1
        except OSError:
            continue  # exited meanwhile: neither counted nor hidden
        others += 1
    return others, unreadable


def check_privileges(ctx: Context) -> list[Check]:
    me = read_identity(ctx.proc)
    others, unreadable = count_unreadable_environ(ctx.proc, me.euid)
    missing = [name for name, held in (("CAP_SYS_PTRACE", me.has(_CAP_SYS_PTRACE)),
                                       ("CAP_DAC_READ_SEARCH", me.has(_CAP_DAC_READ_SEARCH)
                                        or me.has(_CAP_DAC_OVERRIDE)),
                                       ("CAP_KILL", me.signals_anyone)) if not held]
    detail = f"{others} processes of other users, {unreadable} with an unreadable environment"
    if me.reads_environ and me.signals_anyone:
        if unreadable:
            return [Check("privileges", WARN,
                          f"{me.who} with CAP_SYS_PTRACE and CAP_KILL, yet {unreadable} of "
                          f"{others} other users' processes hide their environment",
                          fix="a security module (AppArmor, SELinux) or a user namespace denies "
                              "it: check the audit log for denials of ptrace read",
                          detail=detail)]
        return [Check("privileges", OK,
                      f"{me.who}: every process's launch environment is readable and every "
                      "process may be signalled", detail=detail)]
    hidden = []
    if not me.reads_environ:
        # hidepid may hide every other user's process: then none is counted, yet all would be.
        hidden.append((f"{unreadable} of {others} other users' processes hide their environment"
                       if others else "other users' processes would hide their environment "
                                      "(none is visible now)")
                      + " (no job from SLURM_JOB_ID or rank variables, no worker marks)")
    if not me.signals_anyone:
        hidden.append("`gpuwatch reap` cannot signal other users' processes")
    return [Check("privileges", WARN, f"{me.who} without {', '.join(missing)}: "
                  + "; ".join(hidden),
                  fix="run as root (`sudo gpuwatch ...`), or use the daemon's view: `gpuwatch "
                      "status` asks it, and the systemd unit gives it CAP_SYS_PTRACE, "
                      "CAP_DAC_READ_SEARCH and CAP_KILL",
                  detail=detail)]


def count_unreadable_executables(proc: Path, euid: int) -> tuple[int, list[int]]:
    """(other users' processes, the PIDs of those whose /proc/PID/exe this process may not
    read): the link is what protection by program is proven from (gpuwatch.sources.authority),
    and reading another user's needs CAP_SYS_PTRACE. Kernel threads and processes gone have no
    link and are not counted."""
    others = 0
    unreadable: list[int] = []
    for entry in _other_users_processes(proc, euid):
        try:
            os.readlink(proc / entry.name / "exe")
        except PermissionError:
            unreadable.append(int(entry.name))
        except OSError:
            continue  # exited meanwhile, or a zombie: neither counted nor hidden
        others += 1
    return others, unreadable


def check_executables(ctx: Context) -> list[Check]:
    me = read_identity(ctx.proc)
    others, unreadable = count_unreadable_executables(ctx.proc, me.euid)
    detail = (f"{others} processes of other users, {len(unreadable)} whose /proc/PID/exe is "
              "unreadable")
    if not others:
        return [Check("executables", OK,
                      f"{me.who}: no other user's process to try reading /proc/PID/exe of "
                      f"({'with' if me.has(_CAP_SYS_PTRACE) else 'without'} CAP_SYS_PTRACE)",
                      detail=detail)]
    if not unreadable:
        return [Check("executables", OK,
                      f"{me.who} reads which program other users' processes run "
                      f"(/proc/PID/exe of {plural(others, 'process')}): protected_executables "
                      "and protected_names can protect root's programs", detail=detail)]
    pids = ", ".join(str(pid) for pid in unreadable[:5]) + (", ..." if len(unreadable) > 5 else "")
    if me.has(_CAP_SYS_PTRACE):
        fix = ("a security module (AppArmor, SELinux) or a user namespace denies it: check the "
               "audit log for denials of ptrace read")
    else:
        fix = ("give the daemon CAP_SYS_PTRACE: `AmbientCapabilities=CAP_SYS_PTRACE` in its "
               "unit (and in `CapabilityBoundingSet=`), as systemd/gpuwatch.service has it, or "
               "run it as root; for your own account, `sudo gpuwatch ...`")
    return [Check("executables", WARN,
                  f"{me.who} cannot read /proc/PID/exe of {len(unreadable)} of {others} other "
                  f"users' processes (PID {pids}): none of them is protected by its program "
                  "(detectors.protected_executables, protected_names); they are reported and "
                  "reaped like any other", fix=fix, detail=detail)]


# -- /proc's mount options -----------------------------------------------------------------------
_HIDEPID = {"0": "off", "off": "off", "1": "noaccess", "noaccess": "noaccess",
            "2": "invisible", "invisible": "invisible", "4": "ptraceable",
            "ptraceable": "ptraceable"}
_HIDES = {
    "noaccess": "other users' /proc/PID files are unreadable (no command line, user, cgroup or "
                "job for their processes)",
    "invisible": "other users' processes are invisible (their GPU memory shows under PIDs "
                 "\"not in /proc\", with no process or job)",
    "ptraceable": "processes this one may not ptrace are invisible (their GPU memory shows "
                  "under PIDs \"not in /proc\")",
}


def proc_mount_options(proc: Path) -> Optional[dict[str, str]]:
    """The options of the procfs mounted on /proc, from /proc/self/mountinfo; None if absent."""
    found: Optional[dict[str, str]] = None
    for line in (proc / "self" / "mountinfo").read_text().splitlines():
        left, sep, right = line.partition(" - ")
        mount, fs = left.split(), right.split()
        if not sep or len(mount) < 6 or len(fs) < 3 or fs[0] != "proc" or mount[4] != "/proc":
            continue
        options: dict[str, str] = {}
        for option in (*mount[5].split(","), *fs[2].split(",")):
            key, _, value = option.partition("=")
            options[key] = value
        found = options  # the last mount on /proc is the one on top
    return found


def check_proc_mount(ctx: Context) -> list[Check]:
    options = proc_mount_options(ctx.proc)
    if options is None:
        return [Check("proc-mount", SKIP,
                      f"no proc mount on /proc in {ctx.proc}/self/mountinfo: cannot tell")]
    hidepid = _HIDEPID.get(options.get("hidepid", "off"), options.get("hidepid", "off"))
    gid_text = options.get("gid", "")
    gid = int(gid_text) if gid_text.isdigit() else None
    subset = options.get("subset")
    if hidepid == "off":
        if subset == "pid":
            return [Check("proc-mount", WARN,
                          "/proc is mounted subset=pid: /proc/meminfo is hidden, so leaks are "
                          "projected without the node's MemAvailable",
                          fix="mount /proc without subset=pid where gpuwatch runs")]
        return [Check("proc-mount", OK, "/proc shows every process (no hidepid)")]
    me = read_identity(ctx.proc)
    mounted = f"/proc is mounted hidepid={options['hidepid']}" + (f",gid={gid}" if gid else "")
    if me.has(_CAP_SYS_PTRACE):
        return [Check("proc-mount", OK, f"{mounted}; {me.who} has CAP_SYS_PTRACE, which it "
                                        "exempts")]
    if gid is not None and (gid == me.egid or gid in me.groups):
        return [Check("proc-mount", OK, f"{mounted}; {me.who} is in group {gid}, which it "
                                        "exempts")]
    return [Check("proc-mount", WARN, f"{mounted}: for {me.who}, {_HIDES.get(hidepid, hidepid)}",
                  fix=f"add gid=<group> to /proc's options (`mount -o remount,hidepid="
                      f"{options['hidepid']},gid=<group> /proc`, and in /etc/fstab) and put "
                      "your account and gpuwatch's in that group, or run as root; the daemon "
                      "under the systemd unit is exempt (CAP_SYS_PTRACE)")]


# -- the PID namespace -----------------------------------------------------------------------
_NS_LINK = re.compile(r"pid:\[([0-9]+)\]")


def check_pid_namespace(ctx: Context) -> list[Check]:
    why = ""
    try:
        match = _NS_LINK.fullmatch(os.readlink(ctx.proc / "self" / "ns" / "pid"))
        inode = int(match.group(1)) if match else None
    except OSError as exc:
        inode, why = None, f"{exc.strerror}"
    try:
        nspid = read_identity(ctx.proc).nspid
    except (OSError, KeyError, ValueError):
        nspid = ()
    if inode is None and not nspid:
        return [Check("pid-namespace", SKIP,
                      f"cannot tell: {ctx.proc}/self/ns/pid unreadable ({why or 'unexpected'}) "
                      "and no NSpid in /proc/self/status")]
    listed, absent = _nvml_pids_absent(ctx)
    cross = ""
    if listed:
        cross = (f"; NVML lists {plural(len(listed), 'PID')}, "
                 + (f"{len(absent)} of them not in this /proc" if absent
                    else "all in this /proc"))
    nested = (inode is not None and inode != INIT_PID_NS_INODE) or len(nspid) > 1
    where = f"pid:[{inode}]" if inode is not None else f"NSpid {' '.join(map(str, nspid))}"
    detail = f"NVML PIDs not in /proc: {', '.join(map(str, absent))}" if absent else None
    if nested:
        return [Check("pid-namespace", WARN,
                      f"this process runs in a PID namespace of its own ({where}; the host's is "
                      f"pid:[{INIT_PID_NS_INODE}]): NVML's PIDs are the host's and do not match "
                      f"this /proc{cross}",
                      fix="run gpuwatch in the host's PID namespace: `hostPID: true` "
                          "(Kubernetes), `--pid=host` (Docker), or outside the container",
                      detail=detail)]
    if inode is None and listed and len(absent) == len(listed):
        return [Check("pid-namespace", WARN,
                      f"cannot read the namespace link ({why}), and none of the PIDs NVML lists "
                      "is in this /proc: this process is likely in a PID namespace of its own",
                      fix="run gpuwatch in the host's PID namespace: `hostPID: true` "
                          "(Kubernetes), `--pid=host` (Docker)", detail=detail)]
    note = (f" ({len(absent)} exited since NVML listed them, or hold memory from elsewhere)"
            if absent else "")
    return [Check("pid-namespace", OK, f"the host's PID namespace ({where}){cross}{note}",
                  detail=detail)]


# -- the process tree ---------------------------------------------------------------------
def check_proc_children(ctx: Context) -> list[Check]:
    if has_children_files(str(ctx.proc)):
        return [Check("proc-children", OK, "the kernel lists each process's children "
                                           "(/proc/PID/task/TID/children)")]
    return [Check("proc-children", WARN,
                  "the kernel has no /proc/PID/task/TID/children (built without "
                  "CONFIG_PROC_CHILDREN): job trees are worked out from every process's parent "
                  "PID, one scan of /proc per poll; nothing is missed, a poll costs more on a "
                  "host with many processes",
                  fix="a kernel built with CONFIG_PROC_CHILDREN=y (most distributions' are)")]


def _nvml_pids_absent(ctx: Context) -> tuple[list[int], list[int]]:
    reading = ctx.nvml
    if reading is None or not reading.status.available:
        return [], []
    listed = sorted({u.pid for g in reading.gpus for u in g.processes})
    return listed, [pid for pid in listed if not (ctx.proc / str(pid)).exists()]


# -- cgroups and job attribution -----------------------------------------------------------------
_V1_CONTROLLERS = ("memory", "cpu", "cpuacct", "pids", "devices", "freezer", "blkio", "cpuset")
_KUBELETS = frozenset({"kubelet", "k3s-server", "k3s-agent", "rke2-agent", "rke2-server"})


def cgroup_layout(sys_cgroup: Path) -> str:
    """"v2", "hybrid" (v1 controllers plus systemd's unified tree), "v1" or "none"."""
    if (sys_cgroup / "cgroup.controllers").exists():
        return "v2"
    v1 = any((sys_cgroup / c).is_dir() for c in _V1_CONTROLLERS)
    if v1 and (sys_cgroup / "unified").is_dir():
        return "hybrid"
    return "v1" if v1 else "none"


@dataclass
class _Attribution:
    processes: int = 0
    slurm_jobs: set[str] = field(default_factory=set)
    pods: set[str] = field(default_factory=set)
    containers: set[str] = field(default_factory=set)
    names: set[str] = field(default_factory=set)


def _scan_attribution(proc: Path) -> _Attribution:
    seen = _Attribution()
    for entry in _pid_dirs(proc):
        try:
            text = (proc / entry.name / "cgroup").read_text(errors="replace")
            comm = (proc / entry.name / "comm").read_text(errors="replace").strip()
        except OSError:
            continue  # exited, or hidden by hidepid (the proc-mount check says so)
        seen.processes += 1
        seen.names.add(comm)
        info = parse_cgroup(text)
        if info.slurm_job_id:
            seen.slurm_jobs.add(info.slurm_job_id)
        if info.pod_uid:
            seen.pods.add(info.pod_uid)
        elif info.container_id:
            seen.containers.add(info.container_id)
    return seen



def check_cgroups(ctx: Context) -> list[Check]:
    layout = cgroup_layout(ctx.sys_cgroup)
    seen = _scan_attribution(ctx.proc)
    kind = {"v2": "cgroup v2 (unified)",
            "hybrid": "cgroup hybrid (v1 controllers, jobs read from the v1 paths)",
            "v1": "cgroup v1", "none": f"no cgroup hierarchy under {ctx.sys_cgroup}"}[layout]
    sources = []
    if seen.slurm_jobs:
        sources.append(f"Slurm ({plural(len(seen.slurm_jobs), 'job')})")
    if seen.pods:
        sources.append(f"Kubernetes ({plural(len(seen.pods), 'pod')})")
    if seen.containers:
        sources.append(f"containers ({len(seen.containers)})")
    among = plural(seen.processes, "process")
    found = (f"job cgroups among {among}: {', '.join(sources)}" if sources
             else f"no Slurm, pod or container cgroup among {among} (jobs then come from launch "
                  "environments and systemd units)")
    if layout == "none":
        return [Check("cgroups", WARN, f"{kind}; {found}",
                      fix="mount the cgroup filesystem; in a container, mount the host's "
                          "/sys/fs/cgroup read-only")]
    if "slurmstepd" in seen.names and not seen.slurm_jobs:
        return [Check("cgroups", WARN,
                      f"{kind}; Slurm steps run (slurmstepd), but no process is in a Slurm job "
                      "cgroup: jobs are named only from SLURM_JOB_ID in environments, which "
                      "needs root to read",
                      fix="set ProctrackType=proctrack/cgroup and TaskPlugin=task/cgroup in "
                          "slurm.conf (and cgroup.conf), then restart slurmd")]
    if seen.names & _KUBELETS and not seen.pods:
        return [Check("cgroups", WARN,
                      f"{kind}; the kubelet runs, but no process is in a pod cgroup: this "
                      "process sees a cgroup namespace or /proc of its own",
                      fix="run gpuwatch with `hostPID: true` and the host's /sys/fs/cgroup "
                          "mounted, in the host's cgroup namespace")]
    return [Check("cgroups", OK, f"{kind}; {found}")]


# -- the runtime and state directories -------------------------------------------------------------
def check_directories(ctx: Context) -> list[Check]:
    """The daemon's directories as gpuwatch.runtime_dir checks them: no other user may write
    them or anything above them (docs/security.md, rule 3). The daemon refuses to start on one
    that fails (exit 78); the CLI does not believe the daemon.json and state.sock in it."""
    found: list[str] = []
    for key, directory in (("runtime_dir", ctx.runtime_dir),
                           ("state_dir", ctx.config.daemon.state_dir)):
        try:
            with open_daemon_dir(directory, setting=f"daemon.{key}") as checked:
                st = os.fstat(checked.fd)
        except FileNotFoundError:
            found.append(f"{directory} does not exist yet (the daemon makes it)")
            continue
        except UnsafeDirectory as exc:
            return [Check("directories", FAIL, str(exc),
                          fix="the daemon refuses to start on it (exit 78), and `status`, "
                              "`reap` and `top` do not believe a daemon there: give it to root "
                              "or the daemon's user, mode 0755 (the state directory 0750), in "
                              "directories only they may write, or choose another "
                              "(docs/security.md)")]
        except OSError as exc:
            return [Check("directories", WARN, f"cannot check {directory}: "
                                               f"{exc.strerror or exc}",
                          fix="run as root, or as the daemon's user")]
        owner = _user_name(st.st_uid)
        found.append(f"{directory} ({owner}'s, mode {stat.S_IMODE(st.st_mode):04o})")
    return [Check("directories", OK, "; ".join(found) + ": writable by root and the daemon's "
                                                       "user alone")]


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


# -- the daemon, its sockets and /metrics ----------------------------------------------------------
def read_daemon_info(runtime_dir: Path) -> Optional[dict[str, Any]]:
    """daemon.json, where it is the daemon's (gpuwatch.runtime_dir.read_daemon_info)."""
    return runtime_daemon_info(runtime_dir)[0]


def _pid_runs(proc: Path, pid: Any) -> bool:
    return isinstance(pid, int) and pid > 0 and (proc / str(pid)).exists()


_START_DAEMON = ("start it: `systemctl start gpuwatch` (installing: docs/systemd.md), or "
                 "`gpuwatch daemon`; if it runs with another runtime directory, pass "
                 "--runtime-dir")
_START_SHORT = "start the daemon (`systemctl start gpuwatch` or `gpuwatch daemon`)"
_RESTART_DAEMON = ("`systemctl status gpuwatch` and `journalctl -u gpuwatch -n 50` say why; "
                   "then `systemctl restart gpuwatch`")


def check_daemon(ctx: Context) -> list[Check]:
    path = ctx.runtime_dir / STATE_SOCKET_NAME
    info = read_daemon_info(ctx.runtime_dir)
    try:
        doc = fetch_status(path, timeout=ctx.timeout)
    except StateUnavailable as exc:
        return [_daemon_unreachable(ctx, path, info, exc)]
    version = doc.get("gpuwatch_version")
    pid = info.get("pid") if info is not None else None
    taken_at = doc.get("taken_at")
    age = time.time() - taken_at if isinstance(taken_at, (int, float)) else None
    found = (f"answers on {path}: gpuwatch {version}"
             + (f", PID {pid}" if isinstance(pid, int) else "")
             + (f", last poll {age:.0f} s ago" if age is not None else ""))
    if version != ctx.version:
        return [Check("daemon", WARN, f"{found}; this command is gpuwatch {ctx.version}",
                      fix="restart the daemon so that it runs the installed version: "
                          "`systemctl restart gpuwatch`")]
    if age is not None and age > STALE_POLL_SECONDS:
        return [Check("daemon", WARN, f"{found}: its poll loop is stuck",
                      fix="NVML may hang on a GPU (`dmesg | grep -i xid`); "
                          + _RESTART_DAEMON)]
    return [Check("daemon", OK, found)]


def _daemon_unreachable(ctx: Context, path: Path, info: Optional[dict[str, Any]],
                        exc: StateUnavailable) -> Check:
    # fetch_status folds every cause into one message; the cause it was raised from says which.
    cause = exc.__context__
    stale = ""
    if info is not None and not _pid_runs(ctx.proc, info.get("pid")):
        stale = f"; {DAEMON_INFO_NAME} names PID {info.get('pid')}, which is not running"
    if isinstance(cause, FileNotFoundError) or not os.path.lexists(path):
        return Check("daemon", FAIL, f"no daemon: {path} does not exist{stale}",
                     fix=_START_DAEMON)
    if isinstance(cause, PermissionError):
        return Check("daemon", FAIL, f"no permission to connect to {path}",
                     fix="join the gpuwatch group (`sudo usermod -aG gpuwatch $USER`, then log "
                         "in again), or run with sudo")
    if isinstance(cause, ConnectionRefusedError):
        return Check("daemon", FAIL,
                     f"nothing listens on {path}: the daemon that made it is gone{stale}",
                     fix=_RESTART_DAEMON)
    if isinstance(cause, (socket.timeout, TimeoutError)):
        return Check("daemon", FAIL, f"the daemon did not answer on {path} within "
                                     f"{ctx.timeout:g} s",
                     fix="it may be overloaded or stuck: " + _RESTART_DAEMON
                         + "; --timeout waits longer")
    if "not believed" in str(exc):
        return Check("daemon", FAIL, f"{exc}",
                     fix="the process serving it is not the daemon, or its directory is one "
                         "another user can write: see the directories check; "
                         "docs/security.md")
    if "first poll" in str(exc):
        return Check("daemon", WARN, "the daemon answers but has not finished its first poll",
                     fix="wait a poll interval; if this stays, NVML may hang on a GPU: "
                         "`journalctl -u gpuwatch`, `dmesg | grep -i xid`")
    return Check("daemon", FAIL, f"the daemon did not answer: {exc}", fix=_RESTART_DAEMON)


def check_agent_socket(ctx: Context) -> list[Check]:
    """Training processes' agents send datagrams here; connect() tests the same permission and
    the presence of a receiver, without sending anything."""
    path = ctx.runtime_dir / AGENT_SOCKET_NAME
    lost = ("until then, training processes using gpuwatch.agent drop their reports (no "
            "step-aware leak detection, no culprits)")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return [Check("agent-socket", FAIL, f"no {path}",
                      fix=f"the daemon creates it when it starts: {_START_SHORT}; {lost}")]
    if not stat.S_ISSOCK(st.st_mode):
        return [Check("agent-socket", FAIL, f"{path} is not a socket",
                      fix="remove it and restart the daemon (`systemctl restart gpuwatch`)")]
    mode = stat.S_IMODE(st.st_mode)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.settimeout(ctx.timeout)
        try:
            s.connect(str(path))
        except PermissionError:
            return [Check("agent-socket", FAIL, f"{path} is not writable here (mode {mode:04o})",
                          fix="the daemon makes it 0666 so that every user's training processes "
                              "may report: restart it; find what changed the mode")]
        except ConnectionRefusedError:
            return [Check("agent-socket", FAIL,
                          f"nothing receives on {path}: the daemon that made it is gone",
                          fix=f"{_RESTART_DAEMON}; {lost}")]
    if mode & 0o002 == 0:
        return [Check("agent-socket", WARN,
                      f"{path} accepts reports from here, but its mode is {mode:04o}: other "
                      "users' training processes cannot report",
                      fix="the daemon makes it 0666: restart it; find what changed the mode")]
    return [Check("agent-socket", OK, f"{path} accepts reports (mode {mode:04o})")]


def _local_url(listen: str) -> str:
    host, port = split_listen(listen)
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"  # listening on every interface: ask the loopback one
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def check_metrics(ctx: Context) -> list[Check]:
    info = read_daemon_info(ctx.runtime_dir)
    if info is not None and isinstance(info.get("metrics_url"), str):
        url, where = info["metrics_url"], f"from {DAEMON_INFO_NAME}"
    else:
        url, where = _local_url(ctx.config.daemon.listen), "from daemon.listen"
    # A proxy from the environment must not stand between us and a local port.
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if url.startswith("https:"):
        # Whether it answers is the question here, not whether its certificate is one this
        # host trusts (Prometheus checks that with its own CA file): no verification.
        unverified = ssl.create_default_context()
        unverified.check_hostname = False
        unverified.verify_mode = ssl.CERT_NONE
        handlers.append(urllib.request.HTTPSHandler(context=unverified))
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(url, timeout=ctx.timeout) as response:
            body = response.read(_MAX_METRICS_BYTES).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        if exc.code == 401 and exc.headers.get("WWW-Authenticate", "").startswith("Basic"):
            return [Check("metrics", OK, f"{url} answers, behind basic auth (the web config's "
                                         "users; doctor has no password to read the metrics)",
                          detail=where)]
        return [Check("metrics", FAIL, f"{url} ({where}) answers HTTP {exc.code} {exc.reason}",
                      fix="another program holds the port: `ss -ltnp` names it; give the daemon "
                          "a free one (daemon.listen)")]
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, ConnectionRefusedError):
            return [Check("metrics", FAIL, f"nothing listens on {url} ({where})",
                          fix=f"{_START_SHORT}; if it runs, it listens elsewhere "
                              "(daemon.listen, --listen, or a --runtime-dir whose daemon.json "
                              "says where)")]
        if isinstance(reason, (socket.timeout, TimeoutError)):
            return [Check("metrics", FAIL, f"{url} ({where}) did not answer within "
                                           f"{ctx.timeout:g} s",
                          fix="the daemon may be overloaded or stuck: " + _RESTART_DAEMON)]
        return [Check("metrics", FAIL, f"{url} ({where}): {reason}",
                      fix="`curl -v " + url + "` shows what answers; " + _RESTART_DAEMON)]
    families = re.findall(r"^# TYPE (gpuwatch_\w+) ", body, re.M)
    if not families:
        return [Check("metrics", FAIL, f"{url} ({where}) answers, but with no gpuwatch_ metric",
                      fix="another program holds the port: `ss -ltnp` names it; give the daemon "
                          "a free one (daemon.listen)")]
    found = (f"{url} serves "
             + plural(len(families), "gpuwatch_ metric family", "gpuwatch_ metric families"))
    served = served_by(body)
    if served is None:  # a daemon from before the `pid` label: whose it is cannot be told
        return [Check("metrics", OK, found, detail=where)]
    expected = info.get("pid") if info is not None else None
    if isinstance(expected, int) and expected != served:
        return [Check("metrics", FAIL, f"{url} ({where}) is served by gpuwatch PID {served}, "
                                       f"not by the daemon {DAEMON_INFO_NAME} names (PID "
                                       f"{expected})",
                      fix="another daemon holds the port: `ss -ltnp` names it; stop one of "
                          "them, or give it another port (daemon.listen)")]
    if expected is None and not os.path.lexists(ctx.runtime_dir / DAEMON_INFO_NAME):
        return [Check("metrics", FAIL, f"{url} ({where}) is another daemon's (gpuwatch PID "
                                       f"{served}): no daemon runs on {ctx.runtime_dir}",
                      fix=f"that daemon has a runtime directory of its own: `gpuwatch doctor "
                          f"--runtime-dir DIR` checks it (`cat /proc/{served}/cmdline` shows "
                          f"its options); or {_START_SHORT} on another port")]
    if expected is None:
        return [Check("metrics", OK, f"{found}, from gpuwatch PID {served} ({DAEMON_INFO_NAME} "
                                     "is unreadable here: whose it is is not confirmed)",
                      detail=where)]
    return [Check("metrics", OK, f"{found}, from the daemon (PID {served})", detail=where)]


_BUILD_INFO_PID = re.compile(r'^gpuwatch_build_info\{[^}\n]*\bpid="(\d+)"', re.M)


def served_by(body: str) -> Optional[int]:
    """The PID of the daemon whose metrics `body` is (its `gpuwatch_build_info` says), or None
    for a daemon that does not say."""
    match = _BUILD_INFO_PID.search(body)
    return int(match.group(1)) if match else None


# -- systemd --------------------------------------------------------------------------------------
_UNIT_PROPERTIES = ("LoadState", "ActiveState", "SubState", "UnitFileState", "Result")


def check_systemd(ctx: Context) -> list[Check]:
    if not ctx.run_systemd.is_dir():
        return [Check("systemd", SKIP, f"skipped: systemd is not running here (no "
                                       f"{ctx.run_systemd})")]
    exe = shutil.which(ctx.systemctl)
    if exe is None:
        return [Check("systemd", WARN, f"systemd runs, but {ctx.systemctl} is not on PATH",
                      fix=f"run `systemctl status {ctx.unit}` where it is")]
    # `show` rather than is-active/is-enabled: one call, output meant for programs, and an
    # unknown unit is LoadState=not-found instead of an error whose wording varies by version.
    argv = [exe, "show", ctx.unit, "--no-pager",
            *(f"--property={p}" for p in _UNIT_PROPERTIES)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=ctx.timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        return [Check("systemd", WARN, f"systemctl did not answer within {ctx.timeout:g} s",
                      fix="systemd itself is busy or stuck: `systemctl status` may hang too")]
    if done.returncode != 0:
        why = (done.stderr.strip() or f"exit {done.returncode}").splitlines()[0]
        return [Check("systemd", WARN, f"systemctl show {ctx.unit} failed: {why}",
                      fix=f"run `systemctl status {ctx.unit}` as root")]
    unit: dict[str, str] = {}
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        unit[key] = value.strip()
    load, active = unit.get("LoadState", ""), unit.get("ActiveState", "")
    sub, enabled = unit.get("SubState", ""), unit.get("UnitFileState", "") or "?"
    state = f"{ctx.unit} {active}" + (f" ({sub})" if sub else "") + f", {enabled}"
    if load == "not-found":
        return [Check("systemd", WARN, f"{ctx.unit} is not installed",
                      fix="install it (docs/systemd.md), unless the daemon runs another way "
                          "(a container, a Kubernetes DaemonSet)")]
    if load == "masked":
        return [Check("systemd", FAIL, f"{ctx.unit} is masked: it cannot be started",
                      fix=f"`systemctl unmask {ctx.unit}`, then `systemctl enable --now "
                          f"{ctx.unit}`")]
    if active == "failed":
        return [Check("systemd", FAIL, f"{state}, result {unit.get('Result') or '?'}",
                      fix=f"`journalctl -u {ctx.unit} -n 50` says why (a bad configuration "
                          "exits 78 and is not restarted: fix it first); then `systemctl "
                          f"restart {ctx.unit}`")]
    if active == "inactive":
        start = "start" if enabled.startswith("enabled") else "enable --now"
        return [Check("systemd", FAIL, state, fix=f"`systemctl {start} {ctx.unit}`")]
    if active != "active":
        return [Check("systemd", WARN, state,
                      fix=f"check again in a moment; `journalctl -u {ctx.unit}` shows progress")]
    if enabled not in ("enabled", "enabled-runtime", "static", "indirect", "generated",
                       "linked", "linked-runtime"):
        return [Check("systemd", WARN, f"{state}: it will not start at boot",
                      fix=f"`systemctl enable {ctx.unit}`")]
    return [Check("systemd", OK, state)]


# -- running them ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    name: str
    run: Callable[[Context], list[Check]]
    #: Seconds before the check is abandoned; None: 10 s plus three times the context's timeout.
    deadline: Optional[float] = None
    #: What to do when it is abandoned.
    on_hang: str = "something it reads is blocked; run it alone with `--check NAME` to see"


CHECKS: tuple[Spec, ...] = (
    Spec("config", check_config),
    Spec("nvml", check_nvml, NVML_DEADLINE,
         on_hang="NVML is blocked in the driver: a GPU may have fallen off the bus (`dmesg | "
                 "grep -i xid`); `nvidia-smi` probably hangs too"),
    Spec("privileges", check_privileges),
    Spec("executables", check_executables),
    Spec("proc-mount", check_proc_mount),
    Spec("pid-namespace", check_pid_namespace),
    Spec("proc-children", check_proc_children),
    Spec("cgroups", check_cgroups),
    Spec("directories", check_directories),
    Spec("daemon", check_daemon),
    Spec("agent-socket", check_agent_socket),
    Spec("metrics", check_metrics),
    Spec("systemd", check_systemd),
)
CHECK_NAMES: tuple[str, ...] = tuple(s.name for s in CHECKS)


def run_checks(ctx: Context, only: Collection[str] = (),
               specs: Sequence[Spec] = CHECKS) -> list[Check]:
    """Every check in order (or those named in `only`); never raises for a check's sake."""
    results: list[Check] = []
    for spec in specs:
        if not only or spec.name in only:
            results += run_one(ctx, spec)
    return results


def run_one(ctx: Context, spec: Spec) -> list[Check]:
    deadline = spec.deadline if spec.deadline is not None else 10.0 + 3 * ctx.timeout
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append(spec.run(ctx))
        except Exception as exc:
            outcome.append(exc)

    # A daemon thread: one stuck in the driver must not keep the command from exiting.
    thread = threading.Thread(target=target, name=f"doctor-{spec.name}", daemon=True)
    thread.start()
    thread.join(deadline)
    if not outcome:
        return [Check(spec.name, FAIL, f"this check did not finish within {deadline:g} s",
                      fix=spec.on_hang.replace("NAME", spec.name))]
    result = outcome[0]
    if isinstance(result, Exception):
        return [Check(spec.name, FAIL,
                      f"this check failed: {type(result).__name__}: {result}",
                      fix="an unexpected state of the node, or a bug in gpuwatch doctor: report "
                          "this line with the node's details")]
    return list(result)


def exit_status(checks: Sequence[Check]) -> str:
    """The worst status: fail, else warn, else ok (skips count as ok)."""
    statuses = {c.status for c in checks}
    return FAIL if FAIL in statuses else WARN if WARN in statuses else OK

