"""The reap audit log (reap.jsonl in the state directory): append-only, one line per write().

Every action a reaper carries out goes to it: its plan before the first signal, its result the
moment it is known, and, for a process still there at the first look after a signal, a
"signalled" line then; so a reaper killed in the middle leaves every result and signal it had,
and `AuditFollower` (the daemon) finds the actions such a reaper left without a result and
records what became of their processes.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import functools
import io
import json
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from gpuwatch.actions.reap_plan import (
    FREED,
    NOT_SIGNALLED,
    TERMINATE,
    VIA_PARENT,
    Action,
    Result,
)
from gpuwatch.actions.signals import GONE, OTHER, SAME, ZOMBIE, ProcessRef, Signaller
from gpuwatch.runtime_dir import TrustedDir, UnsafeDirectory, open_daemon_dir, open_private_dir
from gpuwatch.sources.processes import ProcessSource
from gpuwatch.units import plural
from gpuwatch.vocabulary import ReapOutcome

AUDIT_NAME = "reap.jsonl"
#: Phases of an audit line: a plan (a dry run's, or one about to be carried out), a signal sent
#: to a process still there at the first look after it (no result yet), the result of carrying
#: it out, and the result found later for an action whose reaper stopped first.
PLANNED, SIGNALLED, EXECUTED, RECOVERED = "planned", "signalled", "executed", "recovered"
#: How much of the audit log's end the daemon reads when it starts: actions left without a result
#: are the last ones written.
AUDIT_TAIL_BYTES = 4 << 20


@functools.lru_cache(maxsize=4)
def _start_time_of(pid: int) -> Optional[float]:
    """This process's start time (`pid`: os.getpid(), so that a forked child reads its own)."""
    stat = ProcessSource().stat("self")
    return stat.start_time if stat is not None else None


class AuditRefused(Exception):
    """The audit log cannot be written: the message says which file, why, and who can."""


def audit_refusal(path: Path, exc: OSError) -> str:
    reason = exc.strerror or str(exc)
    who = (" (the audit log is written by root and by the daemon's user; members of the "
           "gpuwatch group may read it and run --dry-run)"
           if isinstance(exc, PermissionError) else "")
    return f"cannot write the audit log {path}: {reason}{who}"


class AuditWriter:
    """Appends to the audit log: O_APPEND, one line per write(), under an exclusive flock so
    that the check for a torn last line (a writer killed mid-write) and the append are one step:
    an entry after a torn line starts on a line of its own. Each line names the process that
    wrote it (`reaper`: PID and start time), which is how the daemon tells a reaper still at
    work from one that stopped."""

    def __init__(self, path: Path, actor: str, uid: int,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.actor = actor
        self.uid = uid
        self._clock = clock
        self.reaper = {"pid": os.getpid(), "start_time": _start_time_of(os.getpid())}

    def entry(self, r: Result, phase: str, dry_run: bool = False,
              action_id: Optional[str] = None) -> dict[str, Any]:
        return {"ts": round(self._clock(), 3), "actor": self.actor, "uid": self.uid,
                "reaper": self.reaper, "id": action_id, "phase": phase, "dry_run": dry_run,
                **r.as_json(), "sent": [{"signal": name, "at": round(at, 3)}
                                        for name, at in r.sent]}

    def write(self, entries: list[dict[str, Any]]) -> None:
        if not entries:
            return
        with self._open() as fd:
            lead = b"" if _ends_a_line(fd) else b"\n"
            for e in entries:
                _write_all(fd, lead + json.dumps(e).encode() + b"\n")
                lead = b""

    def touch(self) -> None:
        """Open the log for appending, creating it as a write would, and write nothing."""
        with self._open():
            pass

    def end_torn_line(self) -> bool:
        """End a torn last line, if there is one (so that it reads as one unreadable line, and
        the next entry starts on a line of its own). Whether there was one."""
        if not self.path.exists():
            return False
        with self._open() as fd:
            if _ends_a_line(fd):
                return False
            os.write(fd, b"\n")
            return True

    @contextlib.contextmanager
    def _open(self) -> Iterator[int]:
        flags = os.O_RDWR | os.O_APPEND  # read: the last byte, for a torn line
        with _audit_dir(self.path, create=True) as directory:
            name = self.path.name
            try:
                fd = _open_in(directory, self.path, flags | os.O_CREAT | os.O_EXCL, 0o640)
                created = True
            except FileExistsError:
                fd = _open_in(directory, self.path, flags)
                created = False
            try:
                if created and os.geteuid() == 0:
                    # Root (`gpuwatch reap` in an epilog) creating the log in the daemon's state
                    # directory: the file is the directory owner's, so that the daemon (the
                    # unit's gpuwatch account) can append to it too.
                    st = os.fstat(directory.fd)
                    with contextlib.suppress(OSError):
                        os.fchown(fd, st.st_uid, st.st_gid)
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise PermissionError(errno.EACCES, f"{name} is not a regular file")
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield fd
            finally:
                os.close(fd)


@contextlib.contextmanager
def _audit_dir(path: Path, create: bool = False) -> Iterator[TrustedDir]:
    """The audit log's state directory, checked and held open (gpuwatch.runtime_dir: no other
    user may write it, nor anything above it); made 0750 where missing when `create`. One that
    is not trusted is a PermissionError saying why: the log is not written there."""
    try:
        try:
            directory = open_daemon_dir(path.parent, setting="daemon.state_dir")
        except FileNotFoundError:
            if not create:
                raise
            directory = open_private_dir(path.parent, create_mode=0o750,
                                         setting="daemon.state_dir")
    except UnsafeDirectory as exc:
        raise PermissionError(errno.EACCES, f"refused: {exc}") from None
    with directory:
        yield directory


def _open_in(directory: TrustedDir, path: Path, flags: int, mode: int = 0o640) -> int:
    """`path` opened in its checked directory, never through a symbolic link."""
    try:
        return directory.open(path.name, flags | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermissionError(errno.EACCES, "a symbolic link: not followed") from None
        raise


def _read_audit(path: Path) -> io.FileIO:
    """The audit log, open for reading (FileNotFoundError when there is none yet)."""
    with _audit_dir(path) as directory:
        return io.FileIO(_open_in(directory, path, os.O_RDONLY), "rb")


def _write_all(fd: int, data: bytes) -> None:
    """One write() for the line; the rest of it only after a short write (a full disk)."""
    while data:
        data = data[os.write(fd, data):]


def _ends_a_line(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size == 0 or os.pread(fd, 1, size - 1) == b"\n"


@dataclass
class AuditNews:
    """What the daemon learnt from the audit log since it last looked."""

    #: Results recorded (executed or recovered), by (finding kind, result).
    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    #: Lines that do not parse: torn by a writer killed in the middle of one.
    torn: int = 0
    #: Whether the log ended in such a line when the daemon started (now ended by a newline).
    ended_torn: bool = False
    #: The "recovered" entries written for actions a stopped reaper left without a result.
    recovered: list[dict[str, Any]] = field(default_factory=list)
    #: A new problem reading the log, or writing the recovered entries.
    error: Optional[str] = None


def _who(entry: dict[str, Any]) -> str:
    """The reaper that wrote `entry`, in words: "daemon PID 5120, started 10:27:19Z"."""
    ident = _identity(entry)
    if ident is None:
        return str(entry.get("actor"))
    pid, start_time = ident
    started = ""
    if isinstance(start_time, (int, float)):
        when = datetime.datetime.fromtimestamp(start_time, tz=datetime.timezone.utc)
        started = f", started {when:%H:%M:%S}Z"
    return f"{entry.get('actor')} PID {pid}{started}"


def _identity(entry: dict[str, Any]) -> Optional[tuple[int, Optional[float]]]:
    reaper = entry.get("reaper")
    if not isinstance(reaper, dict) or not isinstance(reaper.get("pid"), int):
        return None
    return reaper["pid"], reaper.get("start_time")


#: The most entries each of AuditFollower's memories keeps, whatever a log holds.
_KEPT = 10_000


def _keep(memory: dict[Any, Any], key: Any, value: Any) -> None:
    """`memory[key] = value`, the oldest entries dropped beyond _KEPT."""
    memory[key] = value
    while len(memory) > _KEPT:
        memory.pop(next(iter(memory)))


class AuditFollower:
    """The daemon's reading of the audit log, whoever writes it (`gpuwatch reap`, `top`, its own
    auto-reap), a poll at a time: it counts the results, skips and counts torn lines, remembers
    the refused auto-reap plans already recorded, and finds the actions a reaper planned and
    then stopped without a result for (killed in its grace period, say), checks what became of
    their processes and records that as a "recovered" line.

    An action is left without a result only once the process that planned it (the `reaper` of
    its line: PID and start time) is gone: a reaper still inside its grace period is not one.
    """

    def __init__(self, path: Path, writer: AuditWriter,
                 signaller: Optional[Signaller] = None) -> None:
        self.path = path
        self.writer = writer
        self._signals = signaller or Signaller()
        self.offset = 0
        #: Planned actions carried out with no result yet, by id.
        self._pending: dict[str, dict[str, Any]] = {}
        #: (pid, start_time, action, refused) of the refused auto-reap plans recorded, oldest
        #: first.
        self._refusals: dict[tuple[Any, ...], None] = {}
        #: (pid, start_time) of the processes the log records as ended, newest last.
        self._ended: dict[tuple[Any, Any], None] = {}
        self._started = False
        self._failing: Optional[str] = None
        #: The log as last opened (through its checked directory), with the file's identity:
        #: read again while the path names that file, so a poll with nothing new costs an
        #: lstat and an fstat, not the directory's checks and an open.
        self._log: Optional[tuple[io.FileIO, tuple[int, int]]] = None

    def poll(self) -> AuditNews:
        """What was appended since the last look, and what stopped reapers left. The first look
        (the daemon's start) reads the end of the log as it stands: earlier runs' results are
        not counted again, a torn last line is ended, and their actions without a result are
        recovered. A log that cannot be read is said once (`error`), not at every poll."""
        news = AuditNews()
        try:
            if not self._started:
                self._start(news)
                self._started = True
            self._settle(news)
        except OSError as exc:
            error = f"cannot read {self.path}: {exc.strerror or exc}"
            news.error = error if error != self._failing else None
            self._failing = error
            return news
        self._failing = None
        return news

    def _start(self, news: AuditNews) -> None:
        news.ended_torn = self.writer.end_torn_line()
        try:
            f = _read_audit(self.path)
        except FileNotFoundError:
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            begin = max(0, size - AUDIT_TAIL_BYTES)
            f.seek(begin)
            data = f.read(size - begin)
        if begin > 0:  # the first line read is only the end of one
            data = data[data.find(b"\n") + 1:]
        complete = data.rfind(b"\n") + 1
        self.offset = size - (len(data) - complete)
        # Earlier runs' results are not counted again; their torn lines are reported.
        news.torn = self._take(data[:complete], AuditNews()).torn

    def refusals_to_audit(self, refused: list[Action]) -> list[Action]:
        """Of the refused auto-reap plans of this poll, those not recorded yet: each refusal is
        recorded once per process and reason, not per poll. A poll that plans none (the finding
        not old enough yet in a daemon just started, a poll that missed it) forgets none: the
        process's identity (PID and start time) is in the key, so a new process on the PID is
        recorded afresh."""
        new = []
        for a in refused:
            key = self._refusal_key(a)
            if key not in self._refusals:
                _keep(self._refusals, key, None)
                new.append(a)
        return new

    def not_ended_yet(self, actions: list[Action]) -> list[Action]:
        """`actions` less those about a process the log already records as ended: an exited
        process stays a finding until its new parent collects it, and a daemon started again
        after a reap recovered it; neither is ended a second time (nor counted twice)."""
        return [a for a in actions if (a.pid, a.start_time) not in self._ended]

    def _note_ended(self, entry: dict[str, Any]) -> None:
        if entry.get("result") in FREED:
            _keep(self._ended, (entry.get("pid"), entry.get("start_time")), None)

    @staticmethod
    def _refusal_key(a: Any) -> tuple[Any, ...]:
        if isinstance(a, dict):
            return a.get("pid"), a.get("start_time"), a.get("action"), a.get("refused")
        return a.pid, a.start_time, a.action, a.refused

    def _settle(self, news: AuditNews) -> None:
        # The reapers found gone first, then their last lines: a reaper that wrote its result
        # and exited between a read and the check is never taken for one that stopped short.
        stopped = {ident for ident in {_identity(e) for e in self._pending.values()}
                   if ident is not None and not self._running(ident)}
        self._read(news)
        left = [e for e in self._pending.values() if _identity(e) in stopped]
        if left:
            self._recover(left, news)

    def _running(self, ident: tuple[int, Optional[float]]) -> bool:
        return self._signals.state(ProcessRef(*ident)) == SAME

    def _read(self, news: AuditNews) -> None:
        log = self._open_log()
        if log is None:
            self.offset = 0
            return
        size = os.fstat(log.fileno()).st_size
        if size < self.offset:  # truncated: read the file from its start
            self.offset = 0
        if size == self.offset:
            return
        data = os.pread(log.fileno(), size - self.offset, self.offset)
        # Only whole lines: a line being written is read once its newline is there.
        complete = data.rfind(b"\n") + 1
        self.offset += complete
        self._take(data[:complete], news)

    def _open_log(self) -> Optional[io.FileIO]:
        """The log open for reading, None while there is none. The file opened at the last
        poll while the path still names it (one lstat: the path is only asked which file it
        names, if any, never read through); else it is opened again through its checked
        directory. A log rotated (renamed, a new one made) is read from the new file's start;
        one put in its place by another user is the new file, and meets the directory's
        checks."""
        named: Optional[tuple[int, int]]
        try:
            st = os.stat(self.path, follow_symlinks=False)
            named = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            named = None  # no log yet (or rotated away, none made since): nothing to read
        except OSError:
            named = (-1, -1)  # the checks below say why
        kept = self._log
        if kept is not None:
            if named == kept[1]:
                return kept[0]
            self._log = None
            kept[0].close()
            self.offset = 0
        if named is None:
            return None
        try:
            log = _read_audit(self.path)
        except FileNotFoundError:
            return None
        st = os.fstat(log.fileno())
        self._log = (log, (st.st_dev, st.st_ino))
        return log

    def _take(self, data: bytes, news: AuditNews) -> AuditNews:
        for line in data.splitlines():
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                news.torn += 1
                continue
            if not isinstance(entry, dict):
                news.torn += 1
                continue
            phase, action_id = entry.get("phase"), entry.get("id")
            if phase == SIGNALLED and action_id in self._pending:
                self._pending[action_id]["sent"] = entry.get("sent") or []
            elif phase in (EXECUTED, RECOVERED):
                key = (str(entry.get("kind")), str(entry.get("result")))
                news.counts[key] = news.counts.get(key, 0) + 1
                self._note_ended(entry)
                if action_id is not None:
                    self._pending.pop(action_id, None)
            elif phase == PLANNED and not entry.get("dry_run"):
                if action_id is not None and entry.get("action") in (TERMINATE, VIA_PARENT):
                    _keep(self._pending, action_id, entry)
                elif entry.get("actor") == "daemon" and entry.get("action") in NOT_SIGNALLED:
                    _keep(self._refusals, self._refusal_key(entry), None)
        return news

    def _recover(self, entries: list[dict[str, Any]], news: AuditNews) -> None:
        recovered = []
        for e in entries:
            self._pending.pop(e["id"], None)
            result, detail = self._became(e)
            who = _who(e)
            signals = [s.get("signal") for s in e.get("sent") or [] if isinstance(s, dict)]
            after = f" after sending {' and '.join(map(str, signals))}" if signals else ""
            r = Result(Action.from_json(e), result,
                       f"its reaper ({who}) stopped{after} before recording a result; {detail}")
            recovered.append(self.writer.entry(r, RECOVERED, action_id=e["id"]))
        try:
            self.writer.write(recovered)
        except OSError as exc:
            news.error = (f"cannot record what became of "
                          f"{plural(len(recovered), 'unfinished action')} in {self.path}: "
                          f"{exc.strerror or exc}")
            return
        news.recovered.extend(recovered)
        for entry in recovered:
            self._note_ended(entry)

    def _became(self, e: dict[str, Any]) -> tuple[str, str]:
        """What became of the process an action was about, looked at now."""
        pid, start_time = e.get("pid"), e.get("start_time")
        if not isinstance(pid, int):
            return ReapOutcome.FAILED, "no process to look at"
        now = self._signals.state(ProcessRef(pid, start_time))
        if now == GONE:
            return ReapOutcome.GONE, "the process is gone"
        if now == OTHER:
            return ReapOutcome.GONE, "the process is gone; its PID now belongs to another process"
        if e.get("action") == VIA_PARENT:
            return ReapOutcome.FAILED, "still a zombie (same PID and start time)"
        if now == ZOMBIE:
            return ReapOutcome.GONE, "the process has exited (its parent has yet to collect it)"
        return ReapOutcome.STILL_RUNNING, ("still running (same PID and start time): not signalled "
                                 "again here; reap it again")
