"""The in-process agent: a training program tells the gpuwatch daemon its step and buffer sizes.

    from gpuwatch import agent
    agent.watch("fetch_buffer", fetch_buffer)
    for global_step, batch in enumerate(loader):
        ...
        agent.step(global_step)
    agent.finished()

Reports are JSON datagrams on the daemon's Unix socket (docs/agent-protocol.md). The daemon takes
the sender's PID from the kernel, so nothing here names the process. This module uses the standard
library only and imports nothing else from gpuwatch: it runs inside training processes that never
install the daemon's dependencies. Importing it has no side effects: the socket, the fork and exit
hooks appear on first use (watch, step, finished), the SIGINT handler only with graceful_shutdown.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import operator
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from itertools import islice
from typing import Any, Callable, Optional, Union

__all__ = ["configure", "finished", "graceful_shutdown", "step", "unwatch", "watch"]

PROTOCOL_VERSION = 1
MAX_DATAGRAM = 16384
MAX_BUFFERS = 64
MAX_THREAD_NAMES = 64
MAX_THREAD_NAME = 64
DEFAULT_RUNTIME_DIR = "/run/gpuwatch"
SOCKET_NAME = "agent.sock"
DEFAULT_MIN_INTERVAL = 0.05
#: With no daemon, one failed send, then silence for this long, doubling up to BACKOFF_MAX.
BACKOFF_FIRST = 1.0
BACKOFF_MAX = 30.0
#: Items sampled from a watched container (spread over it), from each container inside it (a
#: batch: a tuple or dict of tensors), and from each container inside those; deeper is unknown.
#: At most 8 x 4 x 2 sizes are read per buffer and report, whatever the containers hold.
SAMPLES = (8, 4, 2)
EXIT_CODE_INTERRUPTED = 130

_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,64}")
_INT_LIMIT = 1 << 63
# Below this the receiver's queue was full or the kernel short of buffers: the daemon is there,
# so the report is dropped without backing off.
_TRANSIENT = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS, errno.EINTR})
_SCALAR = -1  # a number or None inside a container: holds no buffer memory worth counting
_CONTAINERS = (list, tuple, deque, dict, set, frozenset)
_CONTAINER_TYPES = frozenset(_CONTAINERS)
_BYTES_LIKE = frozenset({bytes, bytearray})
_SCALARS = frozenset({int, float, bool, complex, type(None)})
_monotonic = time.monotonic
# json.dumps with any option builds a new encoder per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _make_fast_encode() -> Callable[[Any], str]:
    """_ENCODER.encode without the C encoder it rebuilds on every call (40% of its cost on a
    report). Reports are acyclic trees of str, int, bool and None, so no cycle check is needed.
    Where json has no C encoder, or it does not encode as _ENCODER does, _ENCODER.encode."""
    try:
        make = json.encoder.c_make_encoder
        if make is None:
            return _ENCODER.encode
        encode = make(None, _ENCODER.default, json.encoder.encode_basestring, None, ":", ",",
                      False, False, True)
        sample = {"v": 1, "k": "\u00e9\"", "b": {"x": {"items": 3}}, "t": [True, None]}
        if "".join(encode(sample, 0)) != _ENCODER.encode(sample):
            return _ENCODER.encode
    except Exception:
        return _ENCODER.encode
    return lambda report: "".join(encode(report, 0))


_encode_json = _make_fast_encode()
try:
    _PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
except (AttributeError, OSError, ValueError):  # pragma: no cover - not Linux
    _PAGE_SIZE = 0


class _State:
    """Everything a forked child must not inherit; reset() gives the child its own."""

    __slots__ = ("attempts", "backoff", "dropped", "due", "failed", "finished", "last", "path",
                 "sent", "sent_reports", "seq", "sock", "statm")

    def __init__(self) -> None:
        self.sock: Optional[socket.socket] = None
        self.statm = -1
        self.reset()

    def reset(self) -> None:
        old, self.sock = self.sock, None
        if old is not None:
            with contextlib.suppress(OSError):
                old.close()
        # /proc/self is resolved when opened: a parent's descriptor would read the parent.
        statm, self.statm = self.statm, -1
        if statm >= 0:
            with contextlib.suppress(OSError):
                os.close(statm)
        self.path: Optional[str] = None
        self.seq = 0
        # The newest (step, time) recorded, and the one the last step report carried: they differ
        # (by identity) while a step is still waiting for its report.
        self.last: Optional[tuple[Any, float]] = None
        self.sent: Optional[tuple[Any, float]] = None
        self.due = 0.0 if _enabled else float("inf")
        self.backoff = 0.0
        self.finished = False
        self.attempts = self.sent_reports = self.failed = self.dropped = 0


_enabled = True
_socket_path: Optional[str] = None
_min_interval = DEFAULT_MIN_INTERVAL
_st = _State()
# Reentrant: a graceful_shutdown cleanup that calls finished() runs in a signal handler, perhaps
# while the interrupted main thread holds this lock in the middle of a report.
_lock = threading.RLock()
_watched: dict[str, Any] = {}
_used = False
_exit_hook_installed = False
_fork_hook_installed = False
_cleanups: tuple[Callable[[], Any], ...] = ()
_previous_sigint: Any = None
_interrupted = False


# ---- public API --------------------------------------------------------------------------------


def watch(name: str, obj: Any) -> None:
    """Report the size of `obj` under `name` with every report.

    `obj` is anything with len() (items; bytes too when it holds bytes, arrays or tensors, sampled),
    a queue with qsize(), or a callable returning an int (items) or such an object. Raises
    ValueError for a name the protocol refuses or a 65th name: call it at setup.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"gpuwatch agent: buffer name {name!r} must be 1 to 64 characters of "
                         "A-Z a-z 0-9 _ . : / -")
    with _lock:
        if name not in _watched and len(_watched) >= MAX_BUFFERS:
            raise ValueError(f"gpuwatch agent: at most {MAX_BUFFERS} watched buffers; "
                             f"unwatch one before watching {name!r}")
        _watched[name] = obj
        _first_use()


def unwatch(name: str) -> None:
    """Stop reporting `name`; unknown names are ignored."""
    with _lock:
        _watched.pop(name, None)


def step(n: int) -> None:
    """Record training step `n` (an int). Never blocks, never raises.

    A report goes out only when `min_interval` has passed since the last one, and carries the
    newest step; otherwise this stores the step and returns.
    """
    try:
        now = _monotonic()
        _st.last = (n, now)
        if now >= _st.due:
            _send_step(now)
    except Exception:
        pass


def finished() -> None:
    """Training is done: tell the daemon now, so whatever of the job stays alive is a leftover."""
    try:
        if not _enabled or not _acquire():
            return
        try:
            _first_use()
            st = _st
            if st.finished:
                return
            st.finished = True
            last = st.last
            data = _report("finished", last[0] if last is not None else None)
            st.sent = last
            if data is not None:
                _send(data, _monotonic())
        finally:
            _lock.release()
    except Exception:
        pass


def configure(socket_path: Union[str, os.PathLike[str], None] = None,
              min_interval: float = DEFAULT_MIN_INTERVAL, enabled: bool = True) -> None:
    """Set where reports go (default `$GPUWATCH_RUNTIME_DIR/agent.sock`, read when first needed),
    the least time between step reports, and whether the agent reports at all."""
    global _enabled, _socket_path, _min_interval
    interval = float(min_interval)
    if not interval >= 0:
        raise ValueError(f"gpuwatch agent: min_interval must be >= 0, got {min_interval!r}")
    with _lock:
        _socket_path = os.fspath(socket_path) if socket_path is not None else None
        _min_interval = interval
        _enabled = bool(enabled)
        st = _st
        st.path = None
        st.backoff = 0.0
        st.due = 0.0 if _enabled else float("inf")


def graceful_shutdown(*cleanups: Callable[[], Any]) -> None:
    """On the first SIGINT (Ctrl+C), run `cleanups` in order, then exit with status 130; a second
    SIGINT while they run exits at once. Call it from the main thread (Python delivers signals
    there only); a later call replaces the cleanups. It takes SIGINT even where the process
    started with it ignored (a `cmd &` in a script); forked children get back what was there."""
    global _cleanups, _previous_sigint
    for cleanup in cleanups:
        if not callable(cleanup):
            raise TypeError(f"gpuwatch agent: cleanup {cleanup!r} is not callable")
    previous = signal.signal(signal.SIGINT, _on_sigint)
    if previous is not _on_sigint:
        _previous_sigint = previous
    _cleanups = tuple(cleanups)
    _install_fork_hook()


# ---- reports -----------------------------------------------------------------------------------


def _acquire() -> bool:
    # Bounded, so a report from a signal handler or the exit hook can never hang the program.
    return _lock.acquire(timeout=1.0)


def _send_step(now: float) -> None:
    if not _lock.acquire(False):
        return  # another thread is reporting; this step stays in _st.last for the next report
    try:
        st = _st
        if now < st.due:
            return
        if not _used:
            _first_use()
        last = st.last
        if last is None:
            return
        # Moved on before building, so that nothing going wrong below can make every following
        # step build a report again.
        st.due = now + _min_interval
        data = _report("step", last[0])
        st.sent = last
        if data is not None:
            _send(data, now)
    finally:
        _lock.release()


def _flush_step() -> None:
    """Send the newest step if its report was coalesced away (caller holds the lock)."""
    st = _st
    last = st.last
    if last is None or last is st.sent or not _enabled:
        return
    now = _monotonic()
    if now < st.due and st.backoff:
        return  # no daemon a moment ago: the backoff promise holds at exit too
    data = _report("step", last[0])
    st.sent = last
    if data is not None:
        _send(data, now)


def _report(kind: str, step_value: Any, extra: Optional[dict[str, Any]] = None
            ) -> Optional[bytes]:
    report: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": kind, "seq": _st.seq}
    if step_value is not None:
        s = _count(step_value)
        if s is not None:
            report["step"] = s
        elif kind == "step":
            return None
    rss = _rss()
    if rss is not None:
        report["rss"] = rss
    cuda = _cuda()
    if cuda is not None:
        report["cuda"] = cuda
    if extra is None:
        buffers = _buffers()
        if buffers:
            report["buffers"] = buffers
    else:
        report.update(extra)
    data = _encode(report)
    if data is None:
        return None
    _st.seq += 1
    return data


def _encode(report: dict[str, Any]) -> Optional[bytes]:
    data = _encode_json(report).encode("utf-8")
    threads = report.get("exit", {}).get("threads")
    while len(data) > MAX_DATAGRAM and threads:
        del threads[len(threads) // 2:]  # only very long non-ASCII thread names get here
        data = _encode_json(report).encode("utf-8")
    return data if len(data) <= MAX_DATAGRAM else None


def _send(data: bytes, now: float) -> None:
    """One non-blocking sendto; a failure only moves the next step report later. The caller holds
    the lock and has decided that this report goes now: a step report when it was due, finished
    and exit reports always (there is one of each, and they matter most)."""
    st = _st
    st.attempts += 1
    try:
        sock = st.sock
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
            st.sock = sock
        if st.path is None:
            st.path = _socket_path or os.path.join(
                os.environ.get("GPUWATCH_RUNTIME_DIR") or DEFAULT_RUNTIME_DIR, SOCKET_NAME)
        sock.sendto(data, st.path)
    except Exception as e:  # OSError; anything else is treated as no daemon, never raised
        if getattr(e, "errno", None) in _TRANSIENT:
            st.dropped += 1
            st.due = now + _min_interval
        else:  # no daemon (ENOENT, ECONNREFUSED), no permission, a path too long...
            st.failed += 1
            st.backoff = min(st.backoff * 2, BACKOFF_MAX) if st.backoff else BACKOFF_FIRST
            st.due = now + max(st.backoff, _min_interval)
        return
    st.sent_reports += 1
    st.backoff = 0.0
    st.due = now + _min_interval


def _count(value: Any) -> Optional[int]:
    """`value` as a protocol integer (0 <= n < 2**63), or None."""
    try:
        n = value if type(value) is int else operator.index(value)
    except Exception:
        return None
    return int(n) if 0 <= n < _INT_LIMIT else None


def _rss() -> Optional[int]:
    # One descriptor kept open and re-read from offset 0 (the kernel regenerates the text): a
    # quarter of the cost of open/read/close. Caller holds the lock.
    st = _st
    try:
        if st.statm < 0:
            st.statm = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        return _count(int(os.pread(st.statm, 256, 0).split()[1]) * _PAGE_SIZE)
    except Exception:
        return None


def _cuda() -> Optional[dict[str, int]]:
    # Never imports torch and never initialises CUDA: only a program that did both is asked.
    # is_initialized() is a flag read, false in a forked child of a CUDA parent, and implies
    # is_available(), which can cost a driver call.
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    if cuda is None:
        return None
    try:
        if not cuda.is_initialized():
            return None
        allocated, reserved = _count(cuda.memory_allocated()), _count(cuda.memory_reserved())
    except Exception:
        return None
    if allocated is None or reserved is None:
        return None
    return {"allocated": allocated, "reserved": reserved}


# ---- buffer sizes ------------------------------------------------------------------------------


def _buffers() -> dict[str, dict[str, int]]:
    out = {}
    for name, obj in list(_watched.items()):
        entry = _measure(obj)
        if entry:
            out[name] = entry
    return out


def _measure(obj: Any) -> dict[str, int]:
    """{"items": n, "bytes": b} with whatever is known; {} when the callable or len() failed."""
    entry: dict[str, int] = {}
    try:
        if callable(obj) and not hasattr(obj, "__len__"):
            obj = obj()
            if not hasattr(obj, "__len__") and not isinstance(obj, (bool, float)):
                items = _count(obj)
                if items is not None:
                    entry["items"] = items
                    return entry
        if hasattr(obj, "__len__"):
            items = _count(len(obj))
            inner = obj
        else:
            qsize = obj.qsize  # queue.Queue and friends: no len(), a qsize() and a .queue inside
            items = _count(qsize())
            inner = getattr(obj, "queue", None)
        if items is not None:
            entry["items"] = items
    except Exception:
        return entry
    try:
        size = _nbytes(inner, 0)
        if size is not None and size != _SCALAR:
            b = _count(size)
            if b is not None:
                entry["bytes"] = b
    except Exception:
        pass  # a container changed under us: items stand, bytes wait for the next report
    return entry


def _nbytes(obj: Any, depth: int) -> Optional[int]:
    """Bytes held by `obj`, sampled for containers; None when unknown, _SCALAR for numbers."""
    t = type(obj)
    if t in _BYTES_LIKE:
        return len(obj)
    if t in _SCALARS:
        return _SCALAR
    if t in _CONTAINER_TYPES or isinstance(obj, _CONTAINERS):
        return _sampled(obj, depth) if depth < len(SAMPLES) else None
    if t is memoryview:
        return int(obj.nbytes)
    if t is str:
        return sys.getsizeof(obj)
    # numpy arrays, torch tensors (nbytes is the view's own size, not its storage's).
    nbytes = getattr(obj, "nbytes", None)
    if nbytes is not None:
        if callable(nbytes):
            nbytes = nbytes()
        return _count(nbytes)
    element_size, nelement = getattr(obj, "element_size", None), getattr(obj, "nelement", None)
    if callable(element_size) and callable(nelement):
        return _count(element_size() * nelement())
    return None


def _sampled(container: Any, depth: int) -> Optional[int]:
    """Mean size of a bounded sample of the items × their number: never a walk of the whole."""
    n = len(container)
    if n == 0:
        return 0 if depth == 0 else _SCALAR
    k = SAMPLES[depth]
    values = container.values() if isinstance(container, dict) else container
    if n <= k:
        sample = list(values)
    elif isinstance(container, (list, tuple)):
        stride = n // k
        sample = container[0:stride * k:stride]
    elif isinstance(container, (dict, deque)):
        # No cheap indexing: both ends, so the oldest and the newest items are both seen.
        sample = list(islice(values, k // 2)) + list(islice(reversed(values), k - k // 2))
    else:
        sample = list(islice(values, k))
    if len(sample) > 2 and set(map(type, sample)) <= _BYTES_LIKE:
        return sum(map(len, sample)) * n // len(sample)  # a cache of raw samples, at C speed
    total, sized = 0, False
    # A short tuple or list one level down (a batch: inputs, labels) is summed here as a call to
    # _sampled would sum it: a call per item was half the cost of a report.
    inline = SAMPLES[depth + 1] if depth + 1 < len(SAMPLES) else -1
    for item in sample:
        t = type(item)  # the usual leaves inline: this loop runs up to 16 x 8 times a report
        if t in _BYTES_LIKE:
            total += len(item)
            sized = True
        elif (t is tuple or t is list) and len(item) <= inline:
            for leaf in item:
                lt = type(leaf)
                if lt in _BYTES_LIKE:
                    total += len(leaf)
                    sized = True
                elif lt not in _SCALARS:
                    size = _nbytes(leaf, depth + 2)
                    if size is None:
                        return None
                    if size != _SCALAR:
                        total += size
                        sized = True
        elif t not in _SCALARS:
            size = _nbytes(item, depth + 1)
            if size is None:
                return None
            if size != _SCALAR:
                total += size
                sized = True
    if not sized:
        return _SCALAR
    return total * n // len(sample)


# ---- hooks: fork, exit, SIGINT -----------------------------------------------------------------


def _first_use() -> None:
    """Install the fork and exit hooks, once: the agent is in use from here on."""
    global _used, _exit_hook_installed
    if _used:
        return
    _used = True
    _install_fork_hook()
    if _exit_hook_installed:
        return
    _exit_hook_installed = True
    # threading atexit callbacks run last-registered first. The executors register theirs (which
    # join their workers) on import: importing them now puts our check before theirs, while the
    # workers are still alive. The process pool module is imported only where multiprocessing
    # already is, so a program that never uses it does not pay for it.
    try:
        import concurrent.futures.thread
        if "multiprocessing" in sys.modules:
            import concurrent.futures.process  # noqa: F401
    except Exception:
        pass
    # threading's exit callbacks run before the interpreter joins non-daemon threads, while what
    # would hold the exit is still alive; atexit callbacks run after that join.
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading._register_atexit")
        register(_at_exit)
    except Exception:
        atexit.register(_at_exit)


def _install_fork_hook() -> None:
    global _fork_hook_installed
    if not _fork_hook_installed and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hook_installed = True


def _after_fork_in_child() -> None:
    """A forked child reports as itself: its own socket, seq from 0, no step until it takes one."""
    global _lock, _used, _interrupted
    _lock = threading.RLock()  # the parent's may have been held by a thread that is not here
    _st.reset()
    _used = False  # the exit check is for children that use the agent themselves
    _interrupted = False
    # DataLoader workers and other forked children must not run the parent's cleanups on the
    # Ctrl+C the whole foreground process group receives.
    try:
        if signal.getsignal(signal.SIGINT) is _on_sigint:
            signal.signal(signal.SIGINT, _previous_sigint if _previous_sigint is not None
                          else signal.default_int_handler)
    except Exception:
        pass


def _at_exit() -> None:
    try:
        if not _used or not _enabled or not _acquire():
            return
        try:
            _flush_step()
            leftovers = _leftovers()
            if leftovers is None:
                return
            body, lines = leftovers
            last = _st.last
            data = _report("exit", last[0] if last is not None else None, {"exit": body})
            if data is not None:
                _send(data, _monotonic())
        finally:
            _lock.release()
        _say(lines)
    except Exception:
        pass


def _leftovers() -> Optional[tuple[dict[str, Any], list[str]]]:
    """What is still alive that holds the exit: the `exit` body and one stderr line per item."""
    executor_lines, executor_threads = _executors()
    lines = list(executor_lines)
    main, current = threading.main_thread(), threading.current_thread()
    threads = []
    for t in threading.enumerate():
        if t is main or t is current or t.daemon or not t.is_alive() or t in executor_threads:
            continue
        threads.append(t.name[:MAX_THREAD_NAME])
        lines.append(f"gpuwatch: at exit, non-daemon thread {t.name!r} is still running: "
                     "the process will not exit until it stops")
    process_group = False
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        with contextlib.suppress(Exception):
            process_group = bool(dist.is_available() and dist.is_initialized())
    if process_group:
        lines.append("gpuwatch: at exit, the torch.distributed process group was never destroyed: "
                     "call torch.distributed.destroy_process_group() when training ends, or the "
                     "exit can hang and the other ranks wait on this one")
    if not lines:
        return None
    body = {"threads": threads[:MAX_THREAD_NAMES], "executors": len(executor_lines),
            "process_group": process_group}
    return body, lines


def _executors() -> tuple[list[str], set[threading.Thread]]:
    """Executors never shut down, found through the registries the executors' own exit hooks
    use; their threads are returned so they are not listed again one by one.

    Thread pool workers that share a work queue belong to one executor; a process pool has one
    manager thread. Where these private registries are missing, the same threads still show up
    as non-daemon threads.
    """
    lines: list[str] = []
    seen: set[threading.Thread] = set()
    thread_mod = sys.modules.get("concurrent.futures.thread")
    pools: dict[int, list[threading.Thread]] = {}
    for t, q in list(getattr(thread_mod, "_threads_queues", {}).items()):
        if t.is_alive():
            pools.setdefault(id(q), []).append(t)
    for workers in pools.values():
        seen.update(workers)
        names = ", ".join(repr(t.name) for t in workers[:4]) + (", ..." if len(workers) > 4
                                                                else "")
        lines.append(f"gpuwatch: at exit, a ThreadPoolExecutor with {len(workers)} live worker "
                     f"thread{'s' if len(workers) != 1 else ''} ({names}) was never shut down: "
                     "the process will not exit until its running and queued tasks finish")
    process_mod = sys.modules.get("concurrent.futures.process")
    for t in list(getattr(process_mod, "_threads_wakeups", {})):
        if t.is_alive():
            seen.add(t)
            lines.append("gpuwatch: at exit, a ProcessPoolExecutor was never shut down: the "
                         "process will not exit until its running and queued tasks finish")
    return lines, seen


def _say(lines: list[str]) -> None:
    err = sys.stderr
    if err is None:
        return
    try:
        for line in lines:
            print(line, file=err)
        err.flush()
    except Exception:
        pass


def _on_sigint(signum: int, frame: Any) -> None:
    global _interrupted
    if _interrupted:
        os._exit(EXIT_CODE_INTERRUPTED)  # at once: not even a flush, which could block
    _interrupted = True
    cleanups = _cleanups
    _say([f"gpuwatch: interrupted: running {len(cleanups)} cleanup"
          f"{'s' if len(cleanups) != 1 else ''} before exiting with status 130 "
          "(Ctrl+C again to exit at once)"])
    for cleanup in cleanups:
        try:
            cleanup()
        except BaseException:
            _say([f"gpuwatch: cleanup {getattr(cleanup, '__qualname__', cleanup)!r} failed:",
                  traceback.format_exc().rstrip()])
    try:
        if _used and _lock.acquire(False):
            try:
                _flush_step()
            finally:
                _lock.release()
    except Exception:
        pass
    _exit_now()


def _exit_now() -> None:
    # os._exit, not SystemExit: an exception raised in the interrupted code can be caught and
    # swallowed by it, and a clean interpreter exit waits for every non-daemon thread (a NCCL
    # heartbeat, a prefetcher) - "Ctrl+C exits" would not hold. Output is flushed by hand since
    # nothing else runs after this.
    if "logging" in sys.modules:
        with contextlib.suppress(Exception):
            sys.modules["logging"].shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass
    os._exit(EXIT_CODE_INTERRUPTED)


def _stats() -> dict[str, int]:
    """Counters for tests: reports sent, send attempts, failed (no daemon) and dropped (full)."""
    st = _st
    return {"attempts": st.attempts, "sent": st.sent_reports, "failed": st.failed,
            "dropped": st.dropped, "seq": st.seq}
