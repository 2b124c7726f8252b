"""The agent's chores, at most one round per step when due: a discovery slice (`_discovery`,
imported on first use), a look for a daemon request (a faster search, or a trace), and while a
trace runs (`_tracing`, imported when the daemon asks), its step count.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from gpuwatch.agent import _state
from gpuwatch.agent._reports import _report, _send
from gpuwatch.agent._sizing import count
from gpuwatch.protocol import MAX_SEARCH_SECONDS

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
_monotonic = time.monotonic


def _chore_round(now: float) -> None:
    if not _state.used or not _state.lock.acquire(False):
        return
    try:
        st = _state.st
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
        if _state.discover_on and now >= st.next_scan and n is not None:
            _discover(n, now)
        tracing = st.tracer is not None and st.tracer.active
        st.chores_due = 0.0 if tracing else min(
            st.next_request, st.next_scan if _state.discover_on else float("inf"))
    except Exception:
        _state.st.chores_due = now + SCAN_INTERVAL
    finally:
        _state.lock.release()


def _discover(n: int, now: float) -> None:
    st = _state.st
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
    st = _state.st
    kind = request.get("kind")
    if kind == "search":
        seconds = request.get("seconds")
        if (type(seconds) is int and seconds > 0 and _state.discover_on and now >= st.search_until
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


def _send_trace(body: dict[str, Any], n: Optional[int]) -> None:
    now = _monotonic()
    data = _report("trace", n, now, {"trace": body})
    if data is not None:
        _send(data, now)
