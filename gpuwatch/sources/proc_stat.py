"""The one parser of /proc/PID/stat lines (proc(5)): every reader in gpuwatch splits them here.

The line is "PID (COMM) STATE PPID ...", and COMM is whatever the process named itself (15 bytes
at most, through prctl(PR_SET_NAME) or its executable's name): it may hold spaces and
parentheses, ")" and ") S 1" included. The only safe split is after the *last* ")": nothing after
the name can hold one. Splitting on spaces, or at the first ")", misreads such a process's state,
parent and everything after, which is how a user could hide a process or blame another.

The fields are indexed as the kernel numbers them less 3 (the PID, the name and the state's own
index): `fields[STATE]` is field 3, `fields[RSS]` field 24, and so on.
"""

from __future__ import annotations

# Indexes into parse_stat's fields (proc(5)'s field number less 3).
STATE = 0  # (3) state
PPID = 1  # (4) ppid
PGID = 2  # (5) pgrp
SID = 3  # (6) session
FLAGS = 6  # (9) flags: the kernel's PF_* bits
UTIME = 11  # (14) utime, in clock ticks
STIME = 12  # (15) stime, in clock ticks
NUM_THREADS = 17  # (20) num_threads
START_TIME = 19  # (22) starttime, in clock ticks since boot
RSS = 21  # (24) rss, in pages
ARG_START = 45  # (48) arg_start: where the arguments are, 0 before an exec put them in place

#: The process is a kernel thread (include/linux/sched.h).
PF_KTHREAD = 0x00200000


def parse_stat(line: bytes) -> tuple[bytes, list[bytes]]:
    """(the command name, the fields after it) of a /proc/PID/stat line, split after the last
    ")"; the fields stay bytes, unconverted, so that a reader that only compares or keeps them
    (the poll, for most processes) pays for no conversion. ValueError when the line is not one:
    no parenthesised name, or too few fields for the parent, the threads and the RSS."""
    start = line.find(b"(")
    end = line.rfind(b")")
    if start < 0 or end < start:
        raise ValueError(f"not a /proc/PID/stat line: {line[:80]!r}")
    fields = line[end + 2:].split()
    if len(fields) <= RSS:
        raise ValueError(f"/proc/PID/stat line cut short ({len(fields)} fields after the name)")
    return line[start + 1:end], fields


def is_kernel_thread(fields: list[bytes]) -> bool:
    """Whether the parsed line's flags mark a kernel thread."""
    return bool(int(fields[FLAGS]) & PF_KTHREAD)
