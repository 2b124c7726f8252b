"""What the daemon asks of agents: a trace of allocations, or a faster search for growing
containers (docs/agent-protocol.md, "Requests").

A request is one small datagram to the abstract address the process's newest report came from,
sent with MSG_DONTWAIT from the socket that report came in on: the kernel attaches the daemon's
credentials, and the source address is the daemon's bound path, which no other process can send
from and which the agent checks. Only abstract addresses are kept (a path would let a sender
point the daemon at any socket file it can name).
"""

from __future__ import annotations

import json
import logging
import socket
from typing import Any

from gpuwatch.protocol import MAX_SEARCH_SECONDS, MAX_TRACE_STEPS, PROTOCOL_VERSION
from gpuwatch.sources.agent_admission import AgentStore
from gpuwatch.sources.agent_transport import AgentTransport

log = logging.getLogger("gpuwatch.sources.agent_socket")


class AgentRequests:
    """Sends requests to the agents the store knows a reply address for; never raises."""

    def __init__(self, store: AgentStore, transport: AgentTransport) -> None:
        self._store = store
        self._transport = transport

    def request_trace(self, pid: int, steps: int) -> bool:
        """Ask `pid`'s agent to trace its allocations over the next `steps` steps (1 to 100).

        One datagram, `{"v": 1, "kind": "trace", "steps": K}`, to the abstract address its newest
        report came from, sent from agent.sock with MSG_DONTWAIT: the poll thread never waits
        on a training process. False when there is nowhere to send (no such process, no
        abstract address, the receiver stopped) or the send failed (the agent's queue full, its
        socket closed); never raises.
        """
        if type(steps) is not int or not 1 <= steps <= MAX_TRACE_STEPS:
            return False
        return self._request(pid, {"v": PROTOCOL_VERSION, "kind": "trace", "steps": steps})

    def request_search(self, pid: int, seconds: int) -> bool:
        """Ask `pid`'s agent to search for growing containers faster, for `seconds` (1 to
        MAX_SEARCH_SECONDS): `{"v": 1, "kind": "search", "seconds": S}`, sent as a trace
        request is."""
        if type(seconds) is not int or not 1 <= seconds <= MAX_SEARCH_SECONDS:
            return False
        return self._request(pid, {"v": PROTOCOL_VERSION, "kind": "search", "seconds": seconds})

    def _request(self, pid: int, request: dict[str, Any]) -> bool:
        address, via = self._store.reply_route(pid)
        sock = self._transport.sock if via is None or via.fileno() < 0 else via
        if address is None or sock is None:
            return False
        payload = json.dumps(request, separators=(",", ":")).encode()
        try:
            sock.sendto(payload, socket.MSG_DONTWAIT, address)
        except (OSError, ValueError, TypeError) as exc:
            log.debug("agent socket: %s request to PID %d failed: %s", request["kind"], pid, exc)
            return False
        return True
