"""Programs for the protection tests (docs/security.md, rule 2): a program only root could have
put where it is, and a plain user's orphaned GPU worker that calls itself what it likes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Optional

import pytest

from gpuwatch.simulate.demo import wait_for
from tests.localusers import LocalUser
from tests.scenarios import START_TIMEOUT, running, wait_not_running

#: Parents tried for a directory only root may write: root's alone all the way up (/tmp, writable
#: by all, is not).
_ROOT_ONLY_PARENTS = ("/run", "/var/lib", "/opt", "/usr/local/lib")
#: The system's own Python: a plain user cannot run the suite's (under /root).
SYSTEM_PYTHON = "/usr/bin/python3"

#: A worker that names itself argv[1] (prctl(PR_SET_NAME), as setproctitle does) when given one,
#: then waits; SIGTERM ends it.
WORKER = """\
import ctypes, sys, time
if len(sys.argv) > 1:
    ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)  # PR_SET_NAME
while True:
    time.sleep(3600)
"""

# Fork, setsid, exec, from a parent that exits at once: the PID printed is already an orphan.
_DOUBLE_FORK = """\
import json, os, sys
argv, env = json.loads(sys.argv[1])
pid = os.fork()
if pid == 0:
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the pipes read to their end must not stay open in it
        os.dup2(null, fd)
    os.execve(argv[0], argv, env)
print(pid, flush=True)
"""


#: Loaded into a program (LD_PRELOAD), points its executable link (/proc/self/exe) at the file
#: GWTEST_EXE names, as any user may: in a user namespace of its own it has
#: CAP_CHECKPOINT_RESTORE, which is all prctl(PR_SET_MM_MAP) asks to change the link, once the
#: program's own file is no longer mapped (its pages are copied to anonymous memory first). Then
#: it waits for a signal, its program's main never run.
_EXE_SETTER = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/prctl.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

static void put(const char *path, const char *text) {
    int fd = open(path, O_WRONLY);
    if (fd >= 0) { (void)!write(fd, text, strlen(text)); close(fd); }
}

__attribute__((constructor)) static void set_exe(void) {
    const char *target = getenv("GWTEST_EXE");
    if (!target) return;
    char exe[4096] = {0}, line[8192], map[64];
    (void)!readlink("/proc/self/exe", exe, sizeof exe - 1);
    unsigned long long f[52] = {0};  /* /proc/self/stat, by field number */
    FILE *in = fopen("/proc/self/stat", "r");
    char *p = fgets(line, sizeof line, in) ? strrchr(line, ')') + 2 : line;
    fclose(in);
    for (int i = 3; i < 52 && (p = strtok(i == 3 ? p : NULL, " ")); i++) f[i] = strtoull(p, 0, 10);
    uid_t uid = getuid(); gid_t gid = getgid();
    if (unshare(CLONE_NEWUSER)) _exit(1);
    put("/proc/self/setgroups", "deny");
    snprintf(map, sizeof map, "0 %d 1", uid); put("/proc/self/uid_map", map);
    snprintf(map, sizeof map, "0 %d 1", gid); put("/proc/self/gid_map", map);
    in = fopen("/proc/self/maps", "r");
    while (fgets(line, sizeof line, in)) {
        unsigned long a, b; char perms[8] = {0}, path[4096] = {0};
        if (sscanf(line, "%lx-%lx %7s %*s %*s %*s %4095s", &a, &b, perms, path) < 4
            || strcmp(path, exe)) continue;
        size_t n = b - a;
        void *copy = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        memcpy(copy, (void *)a, n);
        mmap((void *)a, n, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        memcpy((void *)a, copy, n);
        mprotect((void *)a, n, (perms[0] == 'r' ? PROT_READ : 0)
                               | (perms[1] == 'w' ? PROT_WRITE : 0)
                               | (perms[2] == 'x' ? PROT_EXEC : 0));
        munmap(copy, n);
    }
    fclose(in);
    struct prctl_mm_map mm = {
        .start_code = f[26], .end_code = f[27], .start_stack = f[28], .start_data = f[45],
        .end_data = f[46], .start_brk = f[47], .brk = (uint64_t)(uintptr_t)sbrk(0),
        .arg_start = f[48], .arg_end = f[49], .env_start = f[50], .env_end = f[51],
        .exe_fd = (uint32_t)open(target, O_RDONLY)};
    if (prctl(PR_SET_MM, PR_SET_MM_MAP, (unsigned long)&mm, sizeof mm, 0)) _exit(2);
    for (;;) pause();
}
"""


def exe_setter(directory: Path) -> Path:
    """The library (`_EXE_SETTER`) built in `directory`; skips where there is no C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the library that sets a process's executable link")
    source, library = directory / "set_exe.c", directory / "set_exe.so"
    source.write_text(_EXE_SETTER)
    built = subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(source)],
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    library.chmod(0o755)
    return library


def _roots_alone(path: str) -> bool:
    while True:
        st = os.lstat(path)
        if (not stat.S_ISDIR(st.st_mode) or st.st_uid != 0
                or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


@contextlib.contextmanager
def roots_own_program(name: str, source: str = "/bin/sleep") -> Iterator[Path]:
    """A copy of `source` named `name` in a new directory only root may write (it and every
    directory above it root's, writable by no one else): what a package installs. Skips where
    the suite is not root or no such directory can be made."""
    if os.geteuid() != 0:
        pytest.skip("needs root to install a program where only root may write")
    parent = next((p for p in _ROOT_ONLY_PARENTS if os.path.isdir(p) and _roots_alone(p)), None)
    if parent is None:
        pytest.skip(f"none of {', '.join(_ROOT_ONLY_PARENTS)} is writable by root alone")
    directory = Path(tempfile.mkdtemp(prefix="gwtest-protected-", dir=parent))
    try:
        directory.chmod(0o755)
        program = directory / name
        shutil.copyfile(os.path.realpath(source), program)
        program.chmod(0o755)
        yield program
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def users_directory(user: LocalUser) -> Iterator[Path]:
    """A new directory in /tmp that `user` owns (where they make their links and copies)."""
    directory = Path(tempfile.mkdtemp(prefix="gwtest-users-"))
    try:
        directory.chmod(0o755)
        os.chown(directory, user.uid, user.gid)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def users_orphan(user: LocalUser, argv: Sequence[str], env: Mapping[str, str],
                 what: str, runs: Optional[str] = None) -> Iterator[int]:
    """`argv` run by `user` as an orphan (its parent exited at once), with `env`; yields its PID
    once its executable link names `runs` (by default `argv[0]`), and kills it (as root) after."""
    parent_env = {k: v for k, v in env.items() if k != "LD_PRELOAD"}  # for the program alone
    started = user.run([SYSTEM_PYTHON, "-c", _DOUBLE_FORK, json.dumps([list(argv), dict(env)])],
                       env=parent_env, timeout=START_TIMEOUT, cwd="/")
    assert started.returncode == 0, started.stderr
    pid = int(started.stdout)
    program = runs if runs is not None else argv[0]
    try:
        wait_for(what, lambda: True if running(pid) and _exec_done(pid, program) else None,
                 START_TIMEOUT)
        yield pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
        wait_not_running([pid], what=f"{what}: PID {pid} to end")


def _exec_done(pid: int, program: str) -> bool:
    """Whether `pid` runs `program` (its exec is done) and has named itself, if it does."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return exe == os.path.realpath(program) and os.path.exists(f"/proc/{pid}/comm")
