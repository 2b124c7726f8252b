"""What every check of `gpuwatch doctor` shares: a check's result (`Check`), what the checks read
and where (`Context`: every path of it can point at a fixture tree), the statuses, and what more
than one check group reads: who this process is (its ids and capabilities), the PIDs of /proc,
daemon.json, and the words that say how to start the daemon."""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from gpuwatch import __version__
from gpuwatch.config import Config
from gpuwatch.daemon_info import DaemonInfo
from gpuwatch.model import NvmlReading
from gpuwatch.runtime_dir import daemon_info
from gpuwatch.vocabulary import CheckStatus

OK, WARN, FAIL, SKIP = CheckStatus.OK, CheckStatus.WARN, CheckStatus.FAIL, CheckStatus.SKIP
STATUSES: tuple[CheckStatus, ...] = tuple(CheckStatus)


# Capability bits (linux/capability.h) that decide what gpuwatch can see and do.
CAP_DAC_OVERRIDE = 1
CAP_DAC_READ_SEARCH = 2
CAP_KILL = 5
CAP_SYS_PTRACE = 19
# Bounds a /proc walk on a node with an absurd number of processes: the checks stay quick.
MAX_PROCESSES = 50_000


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    status: CheckStatus
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
        return self.has(CAP_SYS_PTRACE) and (self.has(CAP_DAC_READ_SEARCH)
                                              or self.has(CAP_DAC_OVERRIDE))

    @property
    def signals_anyone(self) -> bool:
        return self.has(CAP_KILL)

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


def pid_dirs(proc: Path) -> list[os.DirEntry[str]]:
    with os.scandir(proc) as entries:
        return [e for e in entries if e.name.isdigit()][:MAX_PROCESSES]


def read_daemon_info(runtime_dir: Path) -> Optional[DaemonInfo]:
    """daemon.json, where it is the daemon's (gpuwatch.runtime_dir.daemon_info)."""
    return daemon_info(runtime_dir)


START_DAEMON = ("start it: `systemctl start gpuwatch` (installing: docs/systemd.md), or "
                 "`gpuwatch daemon`; if it runs with another runtime directory, pass "
                 "--runtime-dir")
START_SHORT = "start the daemon (`systemctl start gpuwatch` or `gpuwatch daemon`)"
RESTART_DAEMON = ("`systemctl status gpuwatch` and `journalctl -u gpuwatch -n 50` say why; "
                   "then `systemctl restart gpuwatch`")
