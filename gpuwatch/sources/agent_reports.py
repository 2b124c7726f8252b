"""Agent reports read and checked: one datagram in, a `Report` out, or `Rejected` with the
reason the receiver counts (docs/agent-protocol.md; the bounds are gpuwatch.protocol's).

Written for speed (the goal is over 20,000 reports/s on one core): one strict UTF-8 decode, one
`json.loads`, type checks with `type(x) is int` (a bool is not an int), and the buffer-name regex
only for names not already accepted from the same process (`known_names`). The optional parts
(`discovered`, the CUDA allocator's counts, `trace` reports) cost a report without them a
dictionary lookup each.

Where the protocol leaves a choice open, this decides: a report without `v` is rejected as
`version`; one without `kind`, or a `step` report without `step`, is `malformed`; an unknown
`kind` is `bad_value`; a JSON `null` for an optional figure means the same as leaving it out
(unknown); `exit` is read on `exit` reports only, `trace` on `trace` reports only (one without it
is `malformed`); every field of a trace site or traceback frame is required (`bad_type` when
missing); text in a trace report (file names, `why`) may not hold control characters
(`bad_value`), since it ends up in log lines.

A figure within a 64-bit integer's range that no node could hold (bytes, item and allocation
counts above the receiver's `max_bytes`: the node's MemTotal plus its GPUs' memory, at most
MAX_FIGURE; a step above MAX_FIGURE) is `implausible`: the kernel outranks the agent, and a
figure the daemon could not believe of any process must not become a growth rate, a metric or a
line of the log.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple, Optional

from gpuwatch.model import BufferSize, DiscoveredSize, TraceSite
from gpuwatch.protocol import (
    BUFFER_NAME_PATTERN,
    DISCOVERED_NAME_PATTERN,
    INT_LIMIT,
    MAX_BUFFERS,
    MAX_DATAGRAM,
    MAX_DISCOVERED_PER_REPORT,
    MAX_EXIT_THREADS,
    MAX_FIGURE,
    MAX_POOL_THREAD_NAMES,
    MAX_THREAD_NAME,
    MAX_TRACE_FILE,
    MAX_TRACE_SITES,
    MAX_TRACE_WHY,
    MAX_TRACEBACK,
    PROTOCOL_VERSION,
    REPORT_KINDS,
    TRACE_STATUSES,
)

_INT_LIMIT = INT_LIMIT
_NAME = re.compile(BUFFER_NAME_PATTERN)
_DISCOVERED_NAME = re.compile(DISCOVERED_NAME_PATTERN)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_KINDS = REPORT_KINDS
_EMPTY_EXIT: Mapping[str, Any] = MappingProxyType({})
_NO_NAMES: Mapping[str, str] = MappingProxyType({})

#: A trace report's fields: status, why, steps, sites, traceback.
TraceFields = tuple[str, str, Optional[int], tuple[TraceSite, ...], tuple[tuple[str, int], ...]]


class Rejected(Exception):
    """A report refused, with the reason counted (`gpuwatch_agent_reports_rejected_total`)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason



class Report(NamedTuple):
    """One report as checked: the fields the receiver keeps, None where not sent."""

    kind: str
    step: Optional[int]
    rss: Optional[int]
    allocated: Optional[int]
    reserved: Optional[int]
    active: Optional[int]
    allocations: Optional[int]
    buffers: Optional[dict[str, BufferSize]]
    discovered: Optional[dict[str, BufferSize]]
    exit_report: Optional[Mapping[str, Any]]
    trace: Optional[TraceFields]


def parse_report(payload: bytes, truncated: bool = False,
                 known_names: Mapping[str, str] = _NO_NAMES,
                 known_discovered: Mapping[str, str] = _NO_NAMES,
                 max_bytes: int = MAX_FIGURE) -> Report:
    """Check one datagram; raises Rejected. `known_names` and `known_discovered` are the names
    already accepted from the same process (they skip the regex). `max_bytes` is the most any
    byte figure or count may be: what the node could hold (the receiver's `max_bytes`), at most
    MAX_FIGURE; steps may reach MAX_FIGURE."""
    if truncated or len(payload) > MAX_DATAGRAM:
        raise Rejected("oversized")
    try:
        doc = json.loads(payload.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise Rejected("malformed") from None
    if type(doc) is not dict:
        raise Rejected("malformed")
    version = doc.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise Rejected("version")
    kind = _choice(doc.get("kind"), _KINDS)
    _optional_int(doc.get("seq"), _INT_LIMIT)
    step = _optional_int(doc.get("step"))
    if step is None and kind == "step":
        raise Rejected("malformed")
    rss = _optional_int(doc.get("rss"), max_bytes)
    allocated = reserved = active = allocations = None
    cuda = doc.get("cuda")
    if cuda is not None:
        if type(cuda) is not dict:
            raise Rejected("bad_type")
        allocated = _optional_int(cuda.get("allocated"), max_bytes)
        reserved = _optional_int(cuda.get("reserved"), max_bytes)
        active = _optional_int(cuda.get("active"), max_bytes)
        allocations = _optional_int(cuda.get("allocations"), max_bytes)
    raw_buffers = doc.get("buffers")
    buffers: Optional[dict[str, BufferSize]] = None
    if raw_buffers is not None:
        buffers = _sizes(raw_buffers, MAX_BUFFERS, known_names, _NAME, max_bytes)
    raw_discovered = doc.get("discovered")
    discovered = None
    if raw_discovered is not None:
        discovered = _sizes(raw_discovered, MAX_DISCOVERED_PER_REPORT, known_discovered,
                            _DISCOVERED_NAME, max_bytes, counted_at=True)
    exit_report = trace = None
    if kind != "step":
        if kind == "exit":
            exit_report = _exit_report(doc.get("exit"))
        elif kind == "trace":
            trace = _trace(doc.get("trace"), max_bytes)
    return Report(kind, step, rss, allocated, reserved, active, allocations, buffers, discovered,
                  exit_report, trace)


def _optional_int(value: Any, limit: int = MAX_FIGURE) -> Optional[int]:
    """An integer from 0 to `limit`: outside a signed 64-bit integer's range it is `bad_value`,
    within it and above `limit` (what the node could hold) `implausible`."""
    if value is None:
        return None
    if type(value) is not int:
        raise Rejected("bad_type")
    if value < 0 or value >= _INT_LIMIT:
        raise Rejected("bad_value")
    if value > limit:
        raise Rejected("implausible")
    return value




def _sizes(value: Any, limit: int, known: Mapping[str, str], pattern: re.Pattern[str],
           max_bytes: int, counted_at: bool = False) -> dict[str, BufferSize]:
    """At most `limit` name -> {"items", "bytes"}, each name either `known` (accepted before)
    or matching `pattern`, each figure at most `max_bytes`; with `counted_at`, each also with
    the optional "step" it was counted at (DiscoveredSize)."""
    if type(value) is not dict:
        raise Rejected("bad_type")
    if len(value) > limit:
        raise Rejected("too_many_buffers")
    sizes = {}
    for name, size in value.items():
        if name not in known and pattern.fullmatch(name) is None:
            raise Rejected("bad_name")
        if type(size) is not dict:
            raise Rejected("bad_type")
        items = _optional_int(size.get("items"), max_bytes)
        figure = _optional_int(size.get("bytes"), max_bytes)
        sizes[name] = (DiscoveredSize(items, figure, _optional_int(size.get("step")))
                       if counted_at else BufferSize(items, figure))
    return sizes


def _required_int(value: Any, limit: int) -> int:
    if value is None:
        raise Rejected("bad_type")
    return _optional_int(value, limit)  # type: ignore[return-value]


def _text(value: Any, limit: int) -> str:
    if type(value) is not str:
        raise Rejected("bad_type")
    if len(value) > limit or _CONTROL.search(value) is not None:
        raise Rejected("bad_value")
    return value


def _choice(value: Any, choices: tuple[str, ...]) -> str:
    """One of `choices`: missing is malformed, another type bad_type, another string bad_value."""
    if value is None:
        raise Rejected("malformed")
    if type(value) is not str:
        raise Rejected("bad_type")
    if value not in choices:
        raise Rejected("bad_value")
    return value


def _trace(value: Any, max_bytes: int) -> TraceFields:
    if value is None:
        raise Rejected("malformed")
    if type(value) is not dict:
        raise Rejected("bad_type")
    status = _choice(value.get("status"), TRACE_STATUSES)
    why = value.get("why")
    why = "" if why is None else _text(why, MAX_TRACE_WHY)
    steps = _optional_int(value.get("steps"))
    sites = tuple(TraceSite(_file(site.get("file")), _required_int(site.get("line"), _INT_LIMIT),
                            _required_int(site.get("bytes"), max_bytes),
                            _required_int(site.get("count"), max_bytes))
                  for site in _items(value.get("sites"), MAX_TRACE_SITES, dict))
    frames = tuple((_file(frame.get("file")), _required_int(frame.get("line"), _INT_LIMIT))
                   for frame in _items(value.get("traceback"), MAX_TRACEBACK, dict))
    return status, why, steps, sites, frames


def _items(value: Any, limit: int, item_type: type) -> list[Any]:
    """A list of at most `limit` items of `item_type` (absent: none)."""
    if value is None:
        return []
    if type(value) is not list:
        raise Rejected("bad_type")
    if len(value) > limit:
        raise Rejected("bad_value")
    for item in value:
        if type(item) is not item_type:
            raise Rejected("bad_type")
    return value


def _file(value: Any) -> str:
    name = _text(value, MAX_TRACE_FILE)
    if not name:
        raise Rejected("bad_value")
    return name


def _exit_report(value: Any) -> Mapping[str, Any]:
    if value is None:
        return _EMPTY_EXIT
    if type(value) is not dict:
        raise Rejected("bad_type")
    report: dict[str, Any] = {}
    threads = value.get("threads")
    if threads is not None:
        for name in _items(threads, MAX_EXIT_THREADS, str):
            if len(name) > MAX_THREAD_NAME:
                raise Rejected("bad_value")
        report["threads"] = tuple(threads)
    executors = _optional_int(value.get("executors"), _INT_LIMIT)
    if executors is not None:
        report["executors"] = executors
    pools = value.get("thread_pools")
    if pools is not None:
        report["thread_pools"] = tuple(_thread_pool(pool)
                                       for pool in _items(pools, MAX_EXIT_THREADS, dict))
    process_group = value.get("process_group")
    if process_group is not None:
        if type(process_group) is not bool:
            raise Rejected("bad_type")
        report["process_group"] = process_group
    return MappingProxyType(report)


def _thread_pool(value: dict[str, Any]) -> Mapping[str, Any]:
    """One of an exit report's `thread_pools`: its live workers, and a few of their names."""
    workers = _required_int(value.get("workers"), MAX_FIGURE)
    names = value.get("threads")
    threads = tuple(_items(names, MAX_POOL_THREAD_NAMES, str)) if names is not None else ()
    if workers < 1 or any(len(name) > MAX_THREAD_NAME for name in threads):
        raise Rejected("bad_value")
    return MappingProxyType({"workers": workers, "threads": threads})
