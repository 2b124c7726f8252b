"""The /proc checks: its mount options (hidepid), the PID namespace it shows, and whether the
kernel lists each process's children."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from gpuwatch.doctor.base import CAP_SYS_PTRACE, OK, SKIP, WARN, Check, Context, read_identity
from gpuwatch.sources.processes import has_children_files
from gpuwatch.units import plural

#: PROC_PID_INIT_INO in the kernel's include/linux/proc_ns.h: the inode number of the initial
#: (host's) PID namespace, the same on every Linux system.
INIT_PID_NS_INODE = 4026531836

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
    if me.has(CAP_SYS_PTRACE):
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
