"""The in-process agent: a training program tells the gpuwatch daemon its step and buffer sizes.

    from gpuwatch import agent
    for global_step, batch in enumerate(loader):
        ...
        agent.step(global_step)
    agent.finished()

With nothing else, the agent reports the step, RSS and (where the program uses CUDA) the caching
allocator's figures, and looks for containers that grow by itself (`_discovery`). `watch()` names
a buffer to report on every report; the daemon can ask for allocation sites (`_tracing`).

Reports are JSON datagrams on the daemon's Unix socket (docs/agent-protocol.md). The daemon takes
the sender's PID from the kernel, so nothing here names the process. This package uses the
standard library only and imports nothing else from gpuwatch: it runs inside training processes
that never install the daemon's dependencies. Importing it has no side effects: the socket, the
fork and exit hooks appear on first use (watch, step, finished), the SIGINT handler only with
graceful_shutdown, tracemalloc only when the daemon asks for a trace.

What one `step()` call may do, cheapest first: record the step (every call); send a report when
one is due (at most every `min_interval`; buffers and CUDA figures are measured for at most one
report in SIZE_INTERVAL); then at most one round of chores when due: a discovery slice (at most
0.9% of the time, in slices of at most SCAN_BUDGET_MAX seconds; SEARCH_SHARE for a bounded time
when the daemon asks for a faster search), a look for a daemon request every REQUEST_INTERVAL,
and while a trace runs, its step count.

Loaded by the bootstrap (gpuwatch.agent._auto), a process that has not stepped reports on a
timer instead (tick_until_stepped: a `tick` report every TICK_INTERVAL from a daemon thread,
after a discovery slice), until its first step.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional, Union

from gpuwatch.agent._exit import EXIT_CODE_INTERRUPTED, exit_now, leftovers, say
from gpuwatch.agent._sizing import SAMPLES, count, measure
from gpuwatch.agent._transport import BACKOFF_FIRST, BACKOFF_MAX, Transport
from gpuwatch.protocol import (
    BUFFER_NAME_PATTERN,
    MAX_BUFFERS,
    MAX_DATAGRAM,
    MAX_SEARCH_SECONDS,
    PROTOCOL_VERSION,
)
from gpuwatch.protocol import INT_LIMIT as _INT_LIMIT

__all__ = ["configure", "finished", "graceful_shutdown", "step", "unwatch", "watch"]

DEFAULT_MIN_INTERVAL = 0.05
#: Watched buffers and CUDA figures are measured for at most one step report in this many
#: seconds: every report of a loop slower than this, ten a second of a faster one.
SIZE_INTERVAL = 0.1
#: Discovery works in slices, resuming where the last one stopped: at most one slice per step()
#: call and per SCAN_INTERVAL seconds, each SCAN_SHARE of the time since the previous one, but
#: at least SCAN_BUDGET and at most SCAN_BUDGET_MAX seconds. So 0.9% of the training thread's
#: time, and the agent with its reports within 1%: a fast loop gets a 2.25 ms slice every
#: 0.25 s, a 0.4 s step a 3.6 ms slice per step, a slow one 5 ms per step.
SCAN_INTERVAL = 0.25
SCAN_SHARE = 0.009
SCAN_BUDGET = 0.002
SCAN_BUDGET_MAX = 0.005
#: A faster search, when the daemon asks for one (a leak that nothing explains yet): for the
#: seconds asked, at most MAX_SEARCH_SECONDS, slices of SEARCH_SHARE of the time since the
#: previous one, at most SEARCH_BUDGET_MAX seconds each, at the same cadence. A request within
#: SEARCH_COOLDOWN seconds of the start of the previous search is ignored, so that at most
#: MAX_SEARCH_SECONDS in every SEARCH_COOLDOWN run at the higher share, whatever is asked.
SEARCH_SHARE = 0.06
SEARCH_BUDGET_MAX = 0.04
SEARCH_COOLDOWN = 300.0
#: How often the agent looks for a request from the daemon (one non-blocking read).
REQUEST_INTERVAL = 0.5
#: A process loaded by the bootstrap that has not stepped (a data worker, a helper, a trainer
#: still loading its data) reports a `tick` every TICK_INTERVAL seconds from a daemon thread,
#: with a discovery slice before each (SCAN_SHARE of the interval, at most SCAN_BUDGET_MAX), so
#: that its growth is tested too. Its first step ends the ticks.
TICK_INTERVAL = 1.0
_OFF = frozenset({"0", "false", "no", "off"})

__all__ += ["BACKOFF_FIRST", "BACKOFF_MAX", "EXIT_CODE_INTERRUPTED", "MAX_SEARCH_SECONDS",
            "SAMPLES"]

_NAME = re.compile(BUFFER_NAME_PATTERN)
_monotonic = time.monotonic
# json.dumps with any option builds a new encoder per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _make_fast_encode() -> Callable[[Any], str]:
    """_ENCODER.encode without the C encoder it rebuilds on every call (40% of its cost on a
    report). Reports are acyclic trees of str, int, bool and None, so no cycle check is needed.
    Where json has no C encoder, or it does not encode as _ENCODER does, _ENCODER.encode."""
    try:
        make = getattr(json.encoder, "c_make_encoder", None)
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

    __slots__ = ("chores_due", "discovered", "due", "finished", "last", "next_request",
                 "next_scan", "scanned_at", "scanner", "search_began", "search_until", "sent",
                 "seq", "sized_at", "statm", "tracer", "transport")

    def __init__(self) -> None:
        self.transport = Transport()
        self.statm = -1
        self.tracer: Any = None
        self.reset()

    def reset(self) -> None:
        self.transport.close()
        self.transport = Transport()
        # /proc/self is resolved when opened: a parent's descriptor would read the parent.
        statm, self.statm = self.statm, -1
        if statm >= 0:
            with contextlib.suppress(OSError):
                os.close(statm)
        tracer, self.tracer = self.tracer, None
        if tracer is not None:
            with contextlib.suppress(Exception):
                tracer.cancel()
        self.seq = 0
        # The newest (step, time) recorded, and the one the last step report carried: they differ
        # (by identity) while a step is still waiting for its report.
        self.last: Optional[tuple[Any, float]] = None
        self.sent: Optional[tuple[Any, float]] = None
        self.due = 0.0 if _enabled else float("inf")
        self.chores_due = self.due
        self.sized_at = float("-inf")
        self.next_scan = self.next_request = 0.0
        self.scanned_at = float("-inf")
        #: A faster search asked for by the daemon runs until search_until (monotonic).
        self.search_began = float("-inf")
        self.search_until = 0.0
        self.scanner: Any = None
        #: The growers of the newest completed discovery pass, for the next step report only.
        self.discovered: Optional[dict[str, dict[str, int]]] = None
        self.finished = False


_enabled = True
# None: GPUWATCH_AGENT_DISCOVERY decides, at first use. Not `_discovery`: that is the name
# of the submodule, which importing it sets on this package.
_discover_on: Optional[bool] = None
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
#: tick_until_stepped() was called: forked children tick too, each from a thread of its own.
_ticking = False
_ticker: Optional[threading.Thread] = None


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
    newest step; otherwise this stores the step and returns. At most every 0.25 s a call also
    does a slice of discovery (at most 5 ms, 0.9% of the time since the last) or looks for a request
    from the daemon (one non-blocking read).
    """
    try:
        now = _monotonic()
        st = _st
        st.last = (n, now)
        if now >= st.due:
            _send_step(now)
        if now >= st.chores_due:
            _chores(now)
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
            now = _monotonic()
            data = _report("finished", last[0] if last is not None else None, now)
            st.sent = last
            if data is not None:
                _send(data, now)
        finally:
            _lock.release()
    except Exception:
        pass


def configure(socket_path: Union[str, os.PathLike[str], None] = None,
              min_interval: float = DEFAULT_MIN_INTERVAL, enabled: bool = True,
              discovery: Optional[bool] = None) -> None:
    """Set where reports go (default `$GPUWATCH_RUNTIME_DIR/agent.sock`, read when first needed),
    the least time between step reports, whether the agent reports at all, and whether it looks
    for growing containers (None: unless GPUWATCH_AGENT_DISCOVERY is 0, false, no or off)."""
    global _enabled, _socket_path, _min_interval, _discover_on
    interval = float(min_interval)
    if not interval >= 0:
        raise ValueError(f"gpuwatch agent: min_interval must be >= 0, got {min_interval!r}")
    with _lock:
        _socket_path = os.fspath(socket_path) if socket_path is not None else None
        _min_interval = interval
        _enabled = bool(enabled)
        _discover_on = (_env_on("GPUWATCH_AGENT_DISCOVERY") if discovery is None
                        else bool(discovery))
        st = _st
        st.transport.path = st.transport.target = st.transport.private = None
        st.transport.backoff = 0.0
        st.due = st.chores_due = 0.0 if _enabled else float("inf")


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
        data = _report("step", last[0], now)
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
    if now < st.due and st.transport.backoff:
        return  # no daemon a moment ago: the backoff promise holds at exit too
    data = _report("step", last[0], now)
    st.sent = last
    if data is not None:
        _send(data, now)


def _report(kind: str, step_value: Any, now: float, extra: Optional[dict[str, Any]] = None
            ) -> Optional[bytes]:
    st = _st
    if (extra is None and kind == "step" and now - st.sized_at < SIZE_INTERVAL
            and not st.discovered):
        return _plain_step_report(step_value)
    report: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": kind, "seq": st.seq}
    if step_value is not None:
        s = count(step_value)
        if s is not None:
            report["step"] = s
        elif kind == "step":
            return None
    rss = _rss()
    if rss is not None:
        report["rss"] = rss
    discovered = None
    if extra is None:
        # Sizing is most of a report's cost: a fast loop pays for it a few times a second.
        if kind != "step" or now - st.sized_at >= SIZE_INTERVAL:
            st.sized_at = now
            cuda = _cuda()
            if cuda is not None:
                report["cuda"] = cuda
            buffers = _buffers()
            if buffers:
                report["buffers"] = buffers
        discovered = st.discovered
        if discovered and (kind == "step" or kind == "tick"):
            report["discovered"] = discovered
    else:
        report.update(extra)
    data = _encode(report)
    if data is None:
        return None
    if discovered:
        st.discovered = None  # measured once, reported once
    st.seq += 1
    return data


def _plain_step_report(step_value: Any) -> Optional[bytes]:
    """The report of most steps of a fast loop (step and RSS, nothing sized): formatted as text,
    a fifth of the cost of encoding the same dict, with the same bytes."""
    st = _st
    s = step_value if type(step_value) is int and 0 <= step_value < _INT_LIMIT else count(
        step_value)
    if s is None:
        return None
    rss = _rss()
    tail = "}" if rss is None else f',"rss":{rss}}}'
    data = f'{{"v":{PROTOCOL_VERSION},"kind":"step","seq":{st.seq},"step":{s}{tail}'.encode()
    st.seq += 1
    return data


def _encode(report: dict[str, Any]) -> Optional[bytes]:
    data = _encode_json(report).encode("utf-8")
    exit_body = report.get("exit", {})
    threads, pools = exit_body.get("threads"), exit_body.get("thread_pools")
    # Only very long non-ASCII thread names get here: the pools' names go first, then the
    # threads' (`executors` still counts every pool).
    while len(data) > MAX_DATAGRAM and (threads or pools):
        names = pools or threads
        del names[len(names) // 2:]
        if pools is not None and not pools:
            del exit_body["thread_pools"]
            pools = None
        data = _encode_json(report).encode("utf-8")
    return data if len(data) <= MAX_DATAGRAM else None


def _send(data: bytes, now: float) -> None:
    """One non-blocking sendto; a failure only moves the next step report later. The caller holds
    the lock and has decided that this report goes now: a step report when it was due, finished,
    trace and exit reports always (there are few of them, and they matter most)."""
    wait = _st.transport.send(data, _socket_path)
    _st.due = now + max(wait, _min_interval)


def _rss() -> Optional[int]:
    # One descriptor kept open and re-read from offset 0 (the kernel regenerates the text): a
    # quarter of the cost of open/read/close. Caller holds the lock.
    st = _st
    try:
        if st.statm < 0:
            st.statm = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        return count(int(os.pread(st.statm, 256, 0).split()[1]) * _PAGE_SIZE)
    except Exception:
        return None


#: torch.cuda.memory_stats() keys -> report keys. Reserved growing while allocated stays flat is
#: the caching allocator keeping freed blocks, not a leak.
_CUDA_STATS = (("allocated", "allocated_bytes.all.current"),
               ("reserved", "reserved_bytes.all.current"),
               ("active", "active_bytes.all.current"),
               ("allocations", "allocation.all.current"))


def _cuda() -> Optional[dict[str, int]]:
    # Never imports torch and never initialises CUDA: only a program that did both is asked.
    # is_initialized() is a flag read, false in a forked child of a CUDA parent, and implies
    # is_available(), which can cost a driver call. One memory_stats() call: memory_allocated()
    # and memory_reserved() would each build the whole dictionary.
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    if cuda is None:
        return None
    try:
        if not cuda.is_initialized():
            return None
        stats = cuda.memory_stats()
    except Exception:
        return None
    figures = {}
    for key, stat in _CUDA_STATS:
        value = count(stats.get(stat, 0))
        if value is not None:
            figures[key] = value
    return figures if "allocated" in figures and "reserved" in figures else None


def _buffers() -> dict[str, dict[str, int]]:
    out = {}
    for name, obj in list(_watched.items()):
        entry = measure(obj)
        if entry:
            out[name] = entry
    return out


# ---- chores: discovery, the daemon's requests, tracing -----------------------------------------


def _chores(now: float) -> None:
    if not _used or not _lock.acquire(False):
        return
    try:
        st = _st
        last = st.last
        n = count(last[0]) if last is not None else None
        tracer = st.tracer
        if tracer is not None and tracer.active and n is not None:
            body = tracer.on_step(n)
            if body is not None:
                _send_trace(body, n)
        if now >= st.next_request:
            st.next_request = now + REQUEST_INTERVAL
            if st.transport.daemon_returned():
                st.due = now  # the next step reports, not the end of the backoff
            for request in st.transport.requests():
                _answer(request, n, now)
        if _discover_on and now >= st.next_scan and n is not None:
            _discover(n, now)
        tracing = st.tracer is not None and st.tracer.active
        st.chores_due = 0.0 if tracing else min(
            st.next_request, st.next_scan if _discover_on else float("inf"))
    except Exception:
        _st.chores_due = now + SCAN_INTERVAL
    finally:
        _lock.release()


def _discover(n: int, now: float) -> None:
    st = _st
    if now < st.search_until:
        share, most = SEARCH_SHARE, SEARCH_BUDGET_MAX
    else:
        share, most = SCAN_SHARE, SCAN_BUDGET_MAX
    budget = min(most, max(SCAN_BUDGET, share * (now - st.scanned_at)))
    try:
        scanner = st.scanner
        if scanner is None:
            from gpuwatch.agent._discovery import Scanner
            scanner = st.scanner = Scanner(budget=SCAN_BUDGET)
        if scanner.slice(n, budget):
            st.discovered = scanner.growers() or None
    except Exception:
        st.next_scan = float("inf")  # a scanner that fails once would fail every time
        return
    # From the slice's end: a slow slice does not make the next one come sooner.
    st.scanned_at = _monotonic()
    st.next_scan = st.scanned_at + SCAN_INTERVAL


def _answer(request: dict[str, Any], n: Optional[int], now: float) -> None:
    """A request from the daemon: a faster search for a while, or a trace (start tracing, or
    say why not)."""
    st = _st
    kind = request.get("kind")
    if kind == "search":
        seconds = request.get("seconds")
        if (type(seconds) is int and seconds > 0 and _discover_on and now >= st.search_until
                and now - st.search_began >= SEARCH_COOLDOWN):
            st.search_began = now
            st.search_until = now + min(seconds, MAX_SEARCH_SECONDS)
            st.next_scan = now  # the first faster slice at this very step
        return
    if kind != "trace" or type(request.get("steps")) is not int:
        return
    if st.tracer is None:
        from gpuwatch.agent._tracing import Tracer
        st.tracer = Tracer()
    refusal = st.tracer.start(request["steps"], n if n is not None else 0)
    if refusal is not None:
        _send_trace(refusal, n)


def tick_until_stepped() -> None:
    """Report on a timer until the first step (and in every forked child until its own): the
    bootstrap's call, for processes that may never step. Never raises."""
    global _ticking
    try:
        _ticking = True
        _install_fork_hook()
        _start_ticker()
    except Exception:
        pass


def _start_ticker() -> None:
    global _ticker
    if not _enabled or _st.last is not None:
        return
    # A daemon thread: it never keeps the program alive, and it ends at the first step.
    _ticker = threading.Thread(target=_tick_loop, args=(_st,), name="gpuwatch-agent-tick",
                               daemon=True)
    _ticker.start()


def _tick_loop(st: _State) -> None:
    count = 0
    try:
        while True:
            time.sleep(TICK_INTERVAL)
            # Stepped, or a forked child's state is not this one's: this thread is done.
            if st is not _st or st.last is not None or st.finished or not _enabled:
                return
            count += 1
            _tick(st, count)
    except Exception:
        return


def _tick(st: _State, count: int) -> None:
    if not _lock.acquire(timeout=TICK_INTERVAL):
        return
    try:
        if st.last is not None:
            return
        if not _used:
            _first_use()
        now = _monotonic()
        if _discover_on and now >= st.next_scan:
            _discover(count, now)
        if now < st.due:
            return  # no daemon a moment ago: the backoff holds for ticks too
        data = _report("tick", None, now)
        if data is not None:
            _send(data, now)
    finally:
        _lock.release()


def _send_trace(body: dict[str, Any], n: Optional[int]) -> None:
    now = _monotonic()
    data = _report("trace", n, now, {"trace": body})
    if data is not None:
        _send(data, now)


# ---- hooks: fork, exit, SIGINT -----------------------------------------------------------------


def _first_use() -> None:
    """Install the fork and exit hooks, once: the agent is in use from here on."""
    global _used, _exit_hook_installed, _discover_on
    if _used:
        return
    _used = True
    if _discover_on is None:
        _discover_on = _env_on("GPUWATCH_AGENT_DISCOVERY")
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
    if _ticking:
        with contextlib.suppress(Exception):
            _start_ticker()  # the parent's thread is not here
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
            found = leftovers()
            if found is None:
                return
            body, lines = found
            last = _st.last
            now = _monotonic()
            data = _report("exit", last[0] if last is not None else None, now, {"exit": body})
            if data is not None:
                _send(data, now)
        finally:
            _lock.release()
        say(lines)
    except Exception:
        pass


def _on_sigint(signum: int, frame: Any) -> None:
    global _interrupted
    if _interrupted:
        os._exit(EXIT_CODE_INTERRUPTED)  # at once: not even a flush, which could block
    _interrupted = True
    cleanups = _cleanups
    say([f"gpuwatch: interrupted: running {len(cleanups)} cleanup"
          f"{'s' if len(cleanups) != 1 else ''} before exiting with status 130 "
          "(Ctrl+C again to exit at once)"])
    for cleanup in cleanups:
        try:
            cleanup()
        except BaseException:
            say([f"gpuwatch: cleanup {getattr(cleanup, '__qualname__', cleanup)!r} failed:",
                  traceback.format_exc().rstrip()])
    try:
        if _used and _lock.acquire(False):
            try:
                _flush_step()
            finally:
                _lock.release()
    except Exception:
        pass
    exit_now()


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in _OFF


def _stats() -> dict[str, int]:
    """Counters for tests: reports sent, send attempts, failed (no daemon, or a socket refused),
    dropped (full) and sockets refused (docs/security.md, rule 3)."""
    t = _st.transport
    return {"attempts": t.attempts, "sent": t.sent, "failed": t.failed, "dropped": t.dropped,
            "refused": t.refused, "seq": _st.seq}
