"""Real local accounts for the threat-model tests: the daemon's own user, a victim and an attacker.

The accounts are made with useradd(8) the first time a test asks for them (CI runs as root) and
kept: creating and deleting accounts for every run would race a second suite on the same host.
Where the suite is not root, or there is no useradd, the tests that need them skip, saying why.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import pytest

#: The accounts, by role. `daemon` plays the unit's `gpuwatch` user; `alice` is a plain user whose
#: job is attacked; `mallory` is a plain user who attacks.
ROLES = {"daemon": "gwtest-daemon", "alice": "gwtest-alice", "mallory": "gwtest-mallory"}


@dataclass(frozen=True)
class LocalUser:
    """One real account: run a program as it, with no supplementary groups."""

    name: str
    uid: int
    gid: int

    def popen_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for subprocess.Popen/run that start the child as this user."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def run(self, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
            timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), env=dict(env) if env is not None else None,
                              capture_output=True, text=True, timeout=timeout,
                              **self.popen_kwargs(), **kwargs)

    def popen(self, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
              **kwargs: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(list(argv), env=dict(env) if env is not None else None,
                                **self.popen_kwargs(), **kwargs)


#: Held while an account is looked up and made: the workers of a parallel run, and two suites on
#: one host, ask for the same accounts at once (useradd refuses a name another one just took).
LOCK_PATH = "/run/lock/gpuwatch-test-accounts.lock"


def _ensure(name: str) -> LocalUser:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        lock_dir = os.path.dirname(LOCK_PATH) if os.path.isdir(os.path.dirname(LOCK_PATH)) \
            else tempfile.gettempdir()
        with open(os.path.join(lock_dir, os.path.basename(LOCK_PATH)), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                entry = pwd.getpwnam(name)
            except KeyError:
                subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir",
                                "/nonexistent", "--shell", "/usr/sbin/nologin", "--user-group",
                                name], check=True, capture_output=True, text=True)
                entry = pwd.getpwnam(name)
    return LocalUser(entry.pw_name, entry.pw_uid, entry.pw_gid)


def local_user(role: str) -> LocalUser:
    """The account for `role` (a key of ROLES), made if missing; skips the test where it cannot
    be made."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create local accounts and run processes as them")
    if shutil.which("useradd") is None:
        pytest.skip("no useradd(8) to create the local accounts")
    try:
        return _ensure(ROLES[role])
    except subprocess.CalledProcessError as exc:  # pragma: no cover - depends on the host
        pytest.skip(f"useradd failed: {exc.stderr.strip()}")
