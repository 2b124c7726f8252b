"""The privileges and executables checks: what this process may read of other users'
processes (their launch environments, which program each runs) and whether it may signal them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from gpuwatch.doctor.base import (
    CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH,
    CAP_SYS_PTRACE,
    OK,
    WARN,
    Check,
    Context,
    pid_dirs,
    read_identity,
)
from gpuwatch.sources.proc_stat import is_kernel_thread, parse_stat
from gpuwatch.units import plural


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
    for entry in pid_dirs(proc):
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
    missing = [name for name, held in (("CAP_SYS_PTRACE", me.has(CAP_SYS_PTRACE)),
                                       ("CAP_DAC_READ_SEARCH", me.has(CAP_DAC_READ_SEARCH)
                                        or me.has(CAP_DAC_OVERRIDE)),
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
                      f"({'with' if me.has(CAP_SYS_PTRACE) else 'without'} CAP_SYS_PTRACE)",
                      detail=detail)]
    if not unreadable:
        return [Check("executables", OK,
                      f"{me.who} reads which program other users' processes run "
                      f"(/proc/PID/exe of {plural(others, 'process')}): protected_executables "
                      "and protected_names can protect root's programs", detail=detail)]
    pids = ", ".join(str(pid) for pid in unreadable[:5]) + (", ..." if len(unreadable) > 5 else "")
    if me.has(CAP_SYS_PTRACE):
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
