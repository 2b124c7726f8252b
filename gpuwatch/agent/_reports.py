"""The agent's reports: built (step, RSS, CUDA figures, watched buffers, discovered growers),
encoded as one JSON datagram within the protocol's size, and sent, one non-blocking sendto.
The caller holds the lock.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Optional

from gpuwatch.agent import _state
from gpuwatch.agent._sizing import count, measure
from gpuwatch.protocol import INT_LIMIT as _INT_LIMIT
from gpuwatch.protocol import MAX_DATAGRAM, PROTOCOL_VERSION

#: Watched buffers and CUDA figures are measured for at most one step report in this many
#: seconds: every report of a loop slower than this, ten a second of a faster one.
SIZE_INTERVAL = 0.1

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


def _flush_step() -> None:
    """Send the newest step if its report was coalesced away (caller holds the lock)."""
    st = _state.st
    last = st.last
    if last is None or last is st.sent or not _state.enabled:
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
    st = _state.st
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
    st = _state.st
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
    wait = _state.st.transport.send(data, _state.socket_path)
    _state.st.due = now + max(wait, _state.min_interval)


#: A report sent once (finished) is tried again while the daemon's queue is full, this many
#: times, FULL_QUEUE_WAIT apart: a daemon busy for a moment drains it, and a dropped finished
#: would leave the job's helpers unjudged while the trainer lingers.
FULL_QUEUE_TRIES = 50
FULL_QUEUE_WAIT = 0.01


def _send_once_only(data: bytes, now: float) -> None:
    """_send for a report that is never sent again: a full queue is waited out, at most
    FULL_QUEUE_TRIES x FULL_QUEUE_WAIT (0.5 s); no daemon is not."""
    transport = _state.st.transport
    for _ in range(FULL_QUEUE_TRIES):
        dropped = transport.dropped
        _send(data, now)
        if transport.dropped == dropped:
            return
        time.sleep(FULL_QUEUE_WAIT)


def _rss() -> Optional[int]:
    # One descriptor kept open and re-read from offset 0 (the kernel regenerates the text): a
    # quarter of the cost of open/read/close. Caller holds the lock.
    st = _state.st
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
    for name, obj in list(_state.watched.items()):
        entry = measure(obj)
        if entry:
            out[name] = entry
    return out
