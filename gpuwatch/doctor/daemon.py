"""The daemon checks: its directories as gpuwatch.runtime_dir checks them, its state socket
(whether it answers, its version, its last poll) and the agent socket."""

from __future__ import annotations

import os
import pwd
import socket
import stat
import time
from pathlib import Path
from typing import Any, Optional

from gpuwatch.daemon_info import DaemonInfo
from gpuwatch.doctor.base import (
    FAIL,
    OK,
    RESTART_DAEMON,
    START_DAEMON,
    START_SHORT,
    WARN,
    Check,
    Context,
    read_daemon_info,
)
from gpuwatch.protocol import SOCKET_NAME as AGENT_SOCKET_NAME
from gpuwatch.runtime_dir import DAEMON_INFO_NAME, UnsafeDirectory, open_daemon_dir
from gpuwatch.serve.state_socket import STATE_SOCKET_NAME, StateUnavailable, fetch_status

#: A daemon whose newest poll is older than this has a stuck poll loop (the default interval is
#: 2 s; the systemd unit's watchdog kills a loop stuck for 30 s).
STALE_POLL_SECONDS = 60.0


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


def _pid_runs(proc: Path, pid: Any) -> bool:
    return isinstance(pid, int) and pid > 0 and (proc / str(pid)).exists()



def check_daemon(ctx: Context) -> list[Check]:
    path = ctx.runtime_dir / STATE_SOCKET_NAME
    info = read_daemon_info(ctx.runtime_dir)
    try:
        doc = fetch_status(path, timeout=ctx.timeout)
    except StateUnavailable as exc:
        return [_daemon_unreachable(ctx, path, info, exc)]
    version = doc.get("gpuwatch_version")
    pid = info.pid if info is not None else None
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
                          + RESTART_DAEMON)]
    return [Check("daemon", OK, found)]


def _daemon_unreachable(ctx: Context, path: Path, info: Optional[DaemonInfo],
                        exc: StateUnavailable) -> Check:
    # fetch_status folds every cause into one message; the cause it was raised from says which.
    cause = exc.__context__
    stale = ""
    if info is not None and not _pid_runs(ctx.proc, info.pid):
        stale = f"; {DAEMON_INFO_NAME} names PID {info.pid}, which is not running"
    if isinstance(cause, FileNotFoundError) or not os.path.lexists(path):
        return Check("daemon", FAIL, f"no daemon: {path} does not exist{stale}",
                     fix=START_DAEMON)
    if isinstance(cause, PermissionError):
        return Check("daemon", FAIL, f"no permission to connect to {path}",
                     fix="join the gpuwatch group (`sudo usermod -aG gpuwatch $USER`, then log "
                         "in again), or run with sudo")
    if isinstance(cause, ConnectionRefusedError):
        return Check("daemon", FAIL,
                     f"nothing listens on {path}: the daemon that made it is gone{stale}",
                     fix=RESTART_DAEMON)
    if isinstance(cause, (socket.timeout, TimeoutError)):
        return Check("daemon", FAIL, f"the daemon did not answer on {path} within "
                                     f"{ctx.timeout:g} s",
                     fix="it may be overloaded or stuck: " + RESTART_DAEMON
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
    return Check("daemon", FAIL, f"the daemon did not answer: {exc}", fix=RESTART_DAEMON)


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
                      fix=f"the daemon creates it when it starts: {START_SHORT}; {lost}")]
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
                          fix=f"{RESTART_DAEMON}; {lost}")]
    if mode & 0o002 == 0:
        return [Check("agent-socket", WARN,
                      f"{path} accepts reports from here, but its mode is {mode:04o}: other "
                      "users' training processes cannot report",
                      fix="the daemon makes it 0666: restart it; find what changed the mode")]
    return [Check("agent-socket", OK, f"{path} accepts reports (mode {mode:04o})")]
