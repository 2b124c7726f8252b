"""The runtime and state directories: checked before anything in them is touched, and one
daemon owns the runtime directory.

A directory another user can write is a place where that user chooses what a path means: a
symbolic link where the daemon writes `daemon.json.tmp`, a `daemon.lock` they hold, a
`state.sock` they serve. So every directory the daemon writes in is opened once, component by
component without following a link another user could have made (`open_private_dir`), and
refused (`UnsafeDirectory`, exit 78) unless it and every directory above it are owned by root or
the daemon's user and writable by no one else (a sticky directory such as /tmp may be above it).
What the daemon creates, opens, renames and removes in it afterwards goes through the
directory's descriptor (`TrustedDir`), with O_NOFOLLOW, and what it chmods or chowns is the file
it opened, never a path looked up again. The clients (`status`, `reap`, `top`, `doctor`) check
the same from their side (`open_daemon_dir`) before they believe `daemon.json` or `state.sock`.

`daemon.lock` is flock-ed by the daemon for its whole life, so a second daemon started on the
same directory (by hand, while the service runs) refuses instead of taking over `state.sock` and
`agent.sock` from the CLI and the agents. A lock held by a process of another user is not a
daemon's: the file is replaced. `daemon.json` tells the CLI, the demo and tests where the live
daemon serves; each daemon removes only the one it wrote.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from gpuwatch.daemon_info import DaemonInfo
from gpuwatch.protocol import user_named, users_named

#: Written to the runtime directory so that the CLI, the demo and tests find the live daemon.
DAEMON_INFO_NAME = "daemon.json"
#: flock-ed by the daemon for its whole life: one daemon per runtime directory. Holds its PID.
LOCK_NAME = "daemon.lock"
#: sysexits' EX_TEMPFAIL: another daemon holds the runtime directory. Not 78: systemd restarts on
#: it, so the service gets its directory back once a daemon started by hand there is stopped.
EXIT_ALREADY_RUNNING = 75
#: sysexits' EX_CONFIG, as for a bad configuration: a runtime or state directory another user
#: can write is fixed by whoever set it up, not by a restart (the unit does not restart on 78).
EXIT_UNSAFE_DIRECTORY = 78
#: daemon.json is a few hundred bytes; more is not the daemon's.
MAX_DAEMON_INFO = 64 << 10
#: Symbolic links followed on the way to a directory, as the kernel's own limit.
_MAX_LINKS = 40
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


#: A file as the kernel names it: (st_dev, st_ino). Whoever created a path records it, so that on
#: the way out it removes its own file and not one another process has put there since.
FileIdentity = tuple[int, int]


def file_identity(path: Path) -> FileIdentity:
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def unlink_if_same(path: Path, identity: Optional[FileIdentity]) -> None:
    """Remove `path` only if it is still the file that had `identity` (a daemon started since
    may have put its own socket there). Callers forget the identity once checked: after the
    unlink its inode number may be given to someone else's file."""
    try:
        current = file_identity(path)
    except OSError:
        return
    if identity is not None and current == identity:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class UnsafeDirectory(Exception):
    """A runtime or state directory that another user can write, or that is not what it should
    be: the message names the directory and why, for the user."""


class TrustedDir:
    """A directory checked by `open_private_dir` or `open_daemon_dir`, held open: every name in
    it is looked up relative to its descriptor, never through its path again, and no symbolic
    link in it is followed. `daemon_uids`: the users whose files in it are believed (root, this
    process's user, and the directory's owner where it was accepted as the daemon's)."""

    def __init__(self, path: Path, fd: int, owner: int, daemon_uids: frozenset[int]) -> None:
        self.path = path
        self.fd = fd
        self.owner = owner
        self.daemon_uids = daemon_uids

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> TrustedDir:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TrustedDir({str(self.path)!r})"

    # -- files in it -----------------------------------------------------------------------
    def open(self, name: str, flags: int, mode: int = 0o644) -> int:
        """os.open of `name` in this directory, never through a symbolic link."""
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd)

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def identity(self, name: str) -> FileIdentity:
        st = self.lstat(name)
        return (st.st_dev, st.st_ino)

    def unlink(self, name: str) -> None:
        """Remove `name` if it is there (a stale file, or a link: never what it points to)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def unlink_if_same(self, name: str, identity: Optional[FileIdentity]) -> None:
        """Remove `name` only if it is still the file that had `identity`."""
        try:
            current = self.identity(name)
        except OSError:
            return
        if identity is not None and current == identity:
            self.unlink(name)

    def write_file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        """Write `name` whole, atomically: `<name>.tmp` created anew (O_EXCL: never a file or
        link already there), then renamed over `name` within the directory."""
        tmp = name + ".tmp"
        self.unlink(tmp)  # a stale one from a daemon killed while writing
        fd = self.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            self.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def read_file(self, name: str, limit: int = MAX_DAEMON_INFO) -> bytes:
        """The first `limit` bytes of `name`, a regular file owned by one of `daemon_uids`
        (PermissionError names the owner otherwise; O_NONBLOCK: a FIFO planted there never
        blocks the open)."""
        fd = self.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{self.path / name} is not a regular file")
            if st.st_uid not in self.daemon_uids:
                raise PermissionError(f"{self.path / name} is owned by {user_named(st.st_uid)}, "
                                      f"not by {users_named(self.daemon_uids)}: not believed")
            return os.pread(fd, limit, 0)
        finally:
            os.close(fd)

    def read_json(self, name: str) -> Optional[dict[str, Any]]:
        """`name` as a JSON object, or None (missing, not believed, not JSON, not an object)."""
        try:
            doc = json.loads(self.read_file(name))
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    @contextlib.contextmanager
    def node(self, name: str, kind: int) -> Iterator[str]:
        """A path that names the file `name` is now (`kind`: stat.S_IFSOCK, ...; owned by this
        process's user), whatever is put at `name` afterwards: /proc/self/fd/N of an O_PATH
        descriptor. For what takes only a path: chmod and chown of a socket, its ACL."""
        fd = self.open(name, os.O_PATH)
        try:
            st = os.fstat(fd)
            if stat.S_IFMT(st.st_mode) != kind or st.st_uid != os.geteuid():
                raise PermissionError(f"{self.path / name} is not the file this process made")
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)

    def subdir(self, name: str, mode: Optional[int] = None) -> TrustedDir:
        """The directory `name` in this one, this process's user's (another user's there is
        refused, never changed). With `mode`: made with it if missing, and given it."""
        if mode is not None:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, mode, dir_fd=self.fd)
        fd = self.open(name, os.O_RDONLY | os.O_DIRECTORY)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise UnsafeDirectory(f"{self.path / name} is owned by {user_named(st.st_uid)}, "
                                      "not by this process's user")
            if mode is not None:
                os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            raise
        return TrustedDir(self.path / name, fd, st.st_uid, self.daemon_uids)


def open_private_dir(path: Path, *, create_mode: Optional[int] = None,
                     setting: str = "") -> TrustedDir:
    """The daemon's directory `path`, checked and held open; made (with `create_mode`, and any
    missing directory above it with 0755) when missing and `create_mode` is given.

    Refused (UnsafeDirectory) unless it is a directory, not a symbolic link, owned by root or
    this process's user, writable by neither group nor others; and every directory above it is
    owned by root or this user and writable by no one else, or sticky (/tmp: another user there
    cannot rename or remove what is not theirs). Symbolic links above it are followed only
    where they lie in a directory that passed. `setting` (daemon.runtime_dir) leads the message.
    """
    trusted = frozenset({0, os.geteuid()})
    fd, st, _ = _walk(path, trusted, create_mode, setting)
    if st.st_uid not in trusted:
        os.close(fd)
        raise UnsafeDirectory(_lead(setting, path) + f"owned by {user_named(st.st_uid)}, not by "
                              f"{users_named(trusted)}: another user's directory; "
                              + _FIX)
    return TrustedDir(Path(os.path.abspath(path)), fd, st.st_uid, trusted)


def open_daemon_dir(path: Path, setting: str = "") -> TrustedDir:
    """A daemon's directory as a client sees it (`status`, `reap`, `top`, `doctor`): checked as
    `open_private_dir` does, except that its owner may be any user when the directory above it
    is writable only by root or this user (who put it there: /run/gpuwatch, the unit's
    `gpuwatch` account's, in /run). That owner, root and this user are `daemon_uids`: the users
    whose `daemon.json` and `state.sock` are believed."""
    me = frozenset({0, os.geteuid()})
    fd, st, placed = _walk(path, me, None, setting)
    if st.st_uid not in me and not placed:
        os.close(fd)
        raise UnsafeDirectory(_lead(setting, path) + f"owned by {user_named(st.st_uid)} in a "
                              "directory any user may create in: not the daemon's")
    return TrustedDir(Path(os.path.abspath(path)), fd, st.st_uid, me | {st.st_uid})


_FIX = ("make it root's or the daemon's user's, mode 0755 (or 0750, 0700), or choose another "
        "(docs/security.md)")


def _lead(setting: str, path: Path) -> str:
    return f"{setting} {path}: " if setting else f"{path}: "


def _safe_mode(st: os.stat_result) -> bool:
    return not st.st_mode & _WRITABLE_BY_OTHERS


def _walk(path: Path, trusted: frozenset[int], create_mode: Optional[int],
          setting: str) -> tuple[int, os.stat_result, bool]:
    """Open `path` one component at a time, O_PATH|O_NOFOLLOW relative to the one above, each
    checked before the next is looked up in it. Returns the descriptor, the final directory's
    stat, and whether the directory it lies in is writable only by `trusted` users (not sticky:
    then only they could have put it there)."""
    where = os.path.abspath(path)
    parts = [p for p in where.split("/") if p]
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open("/", flags | os.O_DIRECTORY)
    current = "/"
    links = 0
    try:
        st = os.fstat(fd)
        _check_above(st, current, trusted, path, setting)
        placed = _safe_mode(st)
        while parts:
            name = parts.pop(0)
            if name == ".":
                continue
            last = not parts
            try:
                new = os.open(name, flags, dir_fd=fd)
            except FileNotFoundError:
                if create_mode is None:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, create_mode if last else 0o755, dir_fd=fd)
                new = os.open(name, flags, dir_fd=fd)
            except OSError as exc:
                raise OSError(exc.errno, _lead(setting, path) + "cannot use it as a directory: "
                              f"{os.path.join(current, name)}: {exc.strerror}") from None
            st = os.fstat(new)
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(name, dir_fd=fd)
                os.close(new)
                if last:
                    raise UnsafeDirectory(_lead(setting, path) + f"a symbolic link (to "
                                          f"{target}): give the directory itself")
                links += 1
                if links > _MAX_LINKS:
                    raise UnsafeDirectory(_lead(setting, path) + "too many symbolic links")
                parts[:0] = [p for p in target.split("/") if p]
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", flags | os.O_DIRECTORY)
                    current = "/"
                continue
            os.close(fd)
            fd = new
            current = os.path.normpath(os.path.join(current, name))
            if not stat.S_ISDIR(st.st_mode):
                raise UnsafeDirectory(_lead(setting, path) + f"{current} is not a directory")
            if last:
                break
            _check_above(st, current, trusted, path, setting)
            placed = _safe_mode(st)
        if not _safe_mode(st):
            raise UnsafeDirectory(_lead(setting, path) + f"writable by "
                                  f"{_whom(st)} (mode {stat.S_IMODE(st.st_mode):04o}): another "
                                  "user could put files and links in it; " + _FIX)
        return fd, st, placed
    except BaseException:
        os.close(fd)
        raise


def _whom(st: os.stat_result) -> str:
    return "others" if st.st_mode & stat.S_IWOTH else "its group"


def _check_above(st: os.stat_result, current: str, trusted: frozenset[int], path: Path,
                 setting: str) -> None:
    """A directory above the one checked: another user who owns it, or may write it without
    the sticky bit, could replace what lies below."""
    if st.st_uid not in trusted:
        raise UnsafeDirectory(_lead(setting, path) + f"{current} above it is owned by "
                              f"{user_named(st.st_uid)}, who could replace what lies below; "
                              + _FIX)
    if not _safe_mode(st) and not st.st_mode & stat.S_ISVTX:
        raise UnsafeDirectory(_lead(setting, path) + f"{current} above it is writable by "
                              f"{_whom(st)} (mode {stat.S_IMODE(st.st_mode):04o}, not sticky): "
                              "another user could replace what lies below; " + _FIX)


class AlreadyRunning(Exception):
    """Another daemon holds the runtime directory; the message names it, for the user."""


def lock_runtime_dir(directory: TrustedDir) -> int:
    """Take the runtime directory for this process: the descriptor holding its lock.

    flock rather than a PID file alone: the kernel releases the lock however its holder dies
    (SIGKILL, the OOM killer, a crash), so a dead daemon never blocks the next one. The PID
    written into the file is only read to name the holder in the refusal. The file is opened in
    the checked directory, O_NOFOLLOW; one that is not a plain file of this user's, or whose
    lock is held by a process of a user who runs no daemon here (the file is readable by all, and
    flock needs no more), is replaced, never waited on.
    """
    runtime_dir, path = directory.path, directory.path / LOCK_NAME
    try:
        fd = _open_lock(directory)
    except OSError as exc:
        if isinstance(exc, PermissionError):
            refuse_if_held(path, runtime_dir)
        raise OSError(f"daemon.runtime_dir {runtime_dir}: cannot create the lock file {path}: "
                      f"{exc.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holders = _lock_holders(os.fstat(fd))
            honoured = {0, os.geteuid(), directory.owner}
            if not holders or any(uid is None or uid in honoured for _, uid in holders):
                raise AlreadyRunning(_held_by(directory)) from None
            # Held by someone who runs no daemon here: their lock, not this directory's.
            import logging  # here: `status` and the other clients of the directory never log

            logging.getLogger("gpuwatch.daemon").warning(
                "%s was locked by %s, which is not a daemon of this directory: replaced",
                path, ", ".join(f"PID {pid} ({user_named(uid or 0)})" for pid, uid in holders))
            os.close(fd)
            directory.unlink(LOCK_NAME)
            fd = _open_lock(directory, fresh=True)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # The file mode, whatever the umask (the unit's is 0077): any user who runs a second
        # daemon by mistake is told which PID holds the directory.
        with contextlib.suppress(PermissionError):
            os.fchmod(fd, 0o644)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except AlreadyRunning:
        os.close(fd)
        raise
    except OSError as exc:
        os.close(fd)
        raise OSError(f"daemon.runtime_dir {runtime_dir}: cannot lock {path}: "
                      f"{exc.strerror or exc}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_lock(directory: TrustedDir, fresh: bool = False) -> int:
    """The lock file, this user's plain file with one name (a hard link to another file, or a
    file another user left, is replaced by a new one)."""
    flags = os.O_RDWR | os.O_CREAT | (os.O_EXCL if fresh else 0)
    fd = directory.open(LOCK_NAME, flags, 0o644)
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1:
        return fd
    os.close(fd)
    if fresh:
        raise OSError(f"{directory.path / LOCK_NAME} is not a file of this user's")
    directory.unlink(LOCK_NAME)
    return _open_lock(directory, fresh=True)


def _lock_holders(st: os.stat_result) -> list[tuple[int, Optional[int]]]:
    """(PID, effective uid or None when unknown) of each process /proc/locks says holds a lock
    on the file of `st`: the kernel's word, not the file's."""
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    holders: list[tuple[int, Optional[int]]] = []
    try:
        with open("/proc/locks") as f:
            lines = f.read(1 << 20).splitlines()
    except OSError:
        return holders
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->" or fields[5] != key:
            continue
        try:
            pid = int(fields[4])
        except ValueError:
            continue
        uid: Optional[int] = None
        if pid > 0:
            with contextlib.suppress(OSError):
                uid = os.stat(f"/proc/{pid}").st_uid
        holders.append((pid, uid))
    return holders


def refuse_if_held(path: Path, runtime_dir: Path) -> None:
    """Raise AlreadyRunning if a daemon holds `path`, which this user may not write: the
    service's directory seen by someone else deserves "already running", not "permission denied".
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        # A shared lock is enough to learn whether an exclusive one is held.
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise AlreadyRunning(_held_by_at(path, runtime_dir)) from None
    except OSError:
        return
    finally:
        os.close(fd)


def _held_by(directory: TrustedDir) -> str:
    """The refusal for a second daemon, naming the one that holds the lock of `directory`."""
    return _refusal(directory.path, lambda: _pid_in(directory.read_file(LOCK_NAME, 64)),
                    lambda: directory.read_json(DAEMON_INFO_NAME))


def _held_by_at(path: Path, runtime_dir: Path) -> str:
    def info() -> Optional[dict[str, Any]]:
        try:
            with open_daemon_dir(runtime_dir) as directory:
                return directory.read_json(DAEMON_INFO_NAME)
        except (OSError, UnsafeDirectory):
            return None

    def pid() -> Optional[int]:
        try:
            return _pid_in(path.read_bytes()[:64])
        except OSError:
            return None

    return _refusal(runtime_dir, pid, info)


def _refusal(runtime_dir: Path, read_pid: Any, read_info: Any) -> str:
    # The holder writes its PID just after taking the lock: give it that moment.
    deadline = time.monotonic() + 1.0
    pid = _read_or_none(read_pid)
    while pid is None and time.monotonic() < deadline:
        time.sleep(0.01)
        pid = _read_or_none(read_pid)
    serving = ""
    doc = read_info()
    info = DaemonInfo.from_json(doc) if isinstance(doc, dict) else None
    # daemon.json may be a dead daemon's, or not written yet: only the holder's own is quoted.
    if info is not None and pid is not None and info.pid == pid and info.metrics_url:
        serving = f", serving {info.metrics_url}"
    holder = f"PID {pid}" if pid is not None else "PID unknown"
    return (f"another gpuwatch daemon ({holder}{serving}) already runs on the runtime directory "
            f"{runtime_dir}: stop it, or pass another --runtime-dir")


def _read_or_none(read: Any) -> Optional[int]:
    try:
        value = read()
    except OSError:
        return None
    return value if isinstance(value, int) else None


def _pid_in(data: bytes) -> Optional[int]:
    text = data.decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None


def remove_own_daemon_info(directory: TrustedDir) -> None:
    """Remove daemon.json only if this process wrote it (the PID inside says so)."""
    doc = directory.read_json(DAEMON_INFO_NAME)
    if doc is not None and DaemonInfo.from_json(doc).pid == os.getpid():
        directory.unlink(DAEMON_INFO_NAME)


def read_daemon_info(runtime_dir: Path) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """A client's reading of the daemon.json of `runtime_dir`: (the document, None) when the
    directory and the file are the daemon's, else (None, why not: missing, or not believed)."""
    try:
        with open_daemon_dir(runtime_dir) as directory:
            data = directory.read_file(DAEMON_INFO_NAME)
    except UnsafeDirectory as exc:
        return None, f"not believed: {exc}"
    except FileNotFoundError:
        return None, f"{runtime_dir / DAEMON_INFO_NAME} does not exist"
    except OSError as exc:
        return None, str(exc.strerror or exc) if not isinstance(exc, PermissionError) \
            else f"not believed: {exc}"
    try:
        doc = json.loads(data)
    except ValueError:
        return None, f"{runtime_dir / DAEMON_INFO_NAME} is not JSON"
    if not isinstance(doc, dict):
        return None, f"{runtime_dir / DAEMON_INFO_NAME} is not a JSON object"
    return doc, None


def daemon_info(runtime_dir: Path) -> Optional[DaemonInfo]:
    """The daemon.json of `runtime_dir`, read, where the directory and the file are the
    daemon's (read_daemon_info); else None."""
    doc, _ = read_daemon_info(runtime_dir)
    return DaemonInfo.from_json(doc) if doc is not None else None


def daemon_peer_refusal(runtime_dir: Path, peer_uid: int) -> Optional[str]:
    """Why a client must not believe the process serving a socket of `runtime_dir` whose
    SO_PEERCRED uid is `peer_uid` (None: it may): its directory is not the daemon's, or the
    process is neither root, this user, nor the directory's owner."""
    try:
        with open_daemon_dir(runtime_dir) as directory:
            uids = directory.daemon_uids
    except UnsafeDirectory as exc:
        return f"not believed: {exc}"
    except OSError as exc:
        return f"{runtime_dir}: {exc.strerror or exc}"
    if peer_uid in uids:
        return None
    return (f"not believed: the process serving it runs as {user_named(peer_uid)}, not as "
            f"{users_named(uids)}")
