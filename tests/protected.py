"""Programs for the protection tests (docs/security.md, rule 2): a program only root could have
put where it is, and a plain user's orphaned GPU worker that calls itself what it likes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

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
                 what: str) -> Iterator[int]:
    """`argv` run by `user` as an orphan (its parent exited at once), with `env`; yields its PID
    once it runs `argv[0]`, and kills it (as root) after."""
    started = user.run([SYSTEM_PYTHON, "-c", _DOUBLE_FORK, json.dumps([list(argv), dict(env)])],
                       env=env, timeout=START_TIMEOUT, cwd="/")
    assert started.returncode == 0, started.stderr
    pid = int(started.stdout)
    try:
        wait_for(what, lambda: True if running(pid) and _exec_done(pid, argv[0]) else None,
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
