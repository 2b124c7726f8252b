"""The agent protocol's vocabulary: the one place its names and limits are written
(docs/agent-protocol.md).

Both sides read these: the agent (`gpuwatch.agent`, inside training programs) to stay within
them, the daemon's receiver (`gpuwatch.sources.agent_socket`) to enforce them, and the history
to follow as many buffers as a process may name. This module uses the standard library only and
imports nothing of gpuwatch, so that the agent can import it without pulling in the daemon
(.importlinter's agent contract, tests/test_layers.py).
"""

from __future__ import annotations

from collections.abc import Iterable

#: The protocol's version, `v` of every datagram either way.
PROTOCOL_VERSION = 1

# -- where reports go ------------------------------------------------------------------------
#: The daemon's runtime directory when neither the configuration nor the environment says.
DEFAULT_RUNTIME_DIR = "/run/gpuwatch"
#: The environment variable naming the runtime directory, for the daemon and the agent alike.
RUNTIME_DIR_VARIABLE = "GPUWATCH_RUNTIME_DIR"
#: The socket every agent may report to, in the runtime directory.
SOCKET_NAME = "agent.sock"
#: Beside SOCKET_NAME: `<uid>.sock`, the socket of one user's own (only that user may send to
#: it), made by the daemon at the user's first report.
PRIVATE_SOCKET_DIR = "agent.d"


def user_named(uid: int) -> str:
    """'alice (uid 1000)', or 'uid 1000' with no name: the owner of a runtime directory or
    socket either side refuses, as the refusal names it."""
    # Only when refusing: a name service lookup is on no report's path.
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except Exception:
        return f"uid {uid}"


def users_named(uids: Iterable[int]) -> str:
    """'root or alice (uid 1000)': the owners a refusal wanted instead."""
    return " or ".join("root" if uid == 0 else user_named(uid) for uid in sorted(set(uids)))

# -- reports, agent to daemon ----------------------------------------------------------------
#: The `kind` of a report. `tick`: a process that has not stepped yet (a data worker), on a
#: timer, with what a step report carries but the step.
REPORT_KINDS = ("step", "finished", "exit", "trace", "tick")
#: A datagram's size, at most. It bounds every text a report brings in bytes (docs/security.md,
#: rule 1); each name is bounded besides, below: buffer and discovered names are ASCII (a
#: character a byte), a trace file or thread name at most 4 bytes a character.
MAX_DATAGRAM = 16_384
#: Figures are integers from 0 to below this (a signed 64-bit integer's range).
INT_LIMIT = 1 << 63
#: No figure of a report (bytes, item and allocation counts, steps) may exceed this: a pebibyte,
#: more memory than any one machine holds, and more steps than any run takes (and every figure
#: up to it is exact as a double, as the history keeps it). Beyond it a report is rejected as
#: `implausible`; the receiver also rejects bytes and counts beyond the node's own memory
#: (MemTotal and every GPU's total, once NVML has answered).
MAX_FIGURE = 1 << 50
#: Watched buffers in one report, and distinct buffer names a process may use over its life.
MAX_BUFFERS = 64
#: A buffer name: 1 to 64 of these characters.
BUFFER_NAME_PATTERN = r"[A-Za-z0-9_.:/-]{1,64}"
#: Discovered containers in one report.
MAX_DISCOVERED_PER_REPORT = 8
#: A discovered container's name: at most this long, of the characters below.
MAX_DISCOVERED_NAME = 128
DISCOVERED_NAME_PATTERN = r"[A-Za-z0-9_.:/<>-]{1,128}"
#: A discovered name ending in this is no container but a tensor whose autograd history grows
#: (`total_loss += loss`): its `items` are the nodes of the graph it holds, and it has no `bytes`.
AUTOGRAD_SUFFIX = ":autograd"
#: An exit report: at most this many thread names, each at most this long.
MAX_EXIT_THREADS = 64
MAX_THREAD_NAME = 64
#: An exit report's `thread_pools`: at most MAX_EXIT_THREADS pools, each naming at most this many
#: of its worker threads (its `workers` counts them all).
MAX_POOL_THREAD_NAMES = 4
#: A trace report: its `status`, at most this many sites and traceback frames, a file name and
#: a `why` at most this long.
TRACE_STATUSES = ("done", "refused", "failed")
MAX_TRACE_SITES = 8
MAX_TRACEBACK = 16
MAX_TRACE_FILE = 256
MAX_TRACE_WHY = 200

# -- requests, daemon to agent ---------------------------------------------------------------
#: A request's size, at most (they are a few dozen bytes).
MAX_REQUEST_DATAGRAM = 512
#: A trace request's `steps`: 1 to this.
MAX_TRACE_STEPS = 100
#: A search request's `seconds`: 1 to this (the daemon's `agent.search_seconds`).
MAX_SEARCH_SECONDS = 60
