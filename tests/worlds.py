"""A world of its own for each parallel test worker (pytest-xdist): its own PID namespace and /proc.

Many tests watch the whole machine: a daemon polls every process, `reap --job` and the epilog end
a job's processes wherever they are, the /proc reader is compared with psutil over all of them,
a test steers the next PID with ns_last_pid. Side by side on one host, two workers (or two whole
suites) would see each other's jobs, orphans and PIDs. So, where the suite runs as root and the
kernel allows it, each worker runs as `unshare --pid --fork --mount-proc --kill-child` makes it:
PID 2 of a PID namespace of its own, with its own /proc, under tests/worker_init.py as PID 1 (which
reaps the orphans reparented to it and passes signals on). The kernel ends what is left in the
namespace when the worker ends, and when the controller goes (--kill-child).

What stays shared, and how the tests keep it apart: the file system (each worker has its own
temporary directories from pytest, so runtime and state directories too), the network (ports
come from the kernel: port 0), the local accounts of tests/localusers.py (made under a lock),
the cgroup hierarchy (cgroups named with a job id unique to the run).

Without root (or where unshare is refused) the workers share the host, and `make test` runs the
suite in one process instead (docs/testing.md).
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional

INIT = Path(__file__).resolve().parent / "worker_init.py"
#: Set (to anything but "" or "0") to make the workers share the host even as root.
SHARED_HOST_KEY = "GPUWATCH_TEST_SHARED_HOST"


@functools.cache
def unavailable() -> Optional[str]:
    """Why the workers cannot have worlds of their own here, or None when they can."""
    if os.environ.get(SHARED_HOST_KEY, "") not in ("", "0"):
        return f"{SHARED_HOST_KEY} is set"
    if os.geteuid() != 0:
        return "not root: PID namespaces and a /proc of their own need root"
    unshare = shutil.which("unshare")
    if unshare is None:
        return "no unshare(1) (util-linux)"
    try:
        probe = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "--kill-child",
                                "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare cannot run: {exc}"
    if probe.returncode != 0:
        return f"unshare refused a PID namespace: {probe.stderr.strip()[:200]}"
    return None


def worker_command(python: str = sys.executable) -> Optional[str]:
    """What xdist runs instead of `python` for a worker (a `popen//python=` spec), or None
    where workers share the host."""
    if unavailable() is not None:
        return None
    unshare = shutil.which("unshare")
    assert unshare is not None
    return shlex.join([unshare, "--pid", "--fork", "--mount-proc", "--kill-child", "--",
                       sys.executable, "-I", str(INIT), python])


def in_own_world() -> bool:
    """Whether this process is a worker in a PID namespace of its own (tests/worker_init.py is
    PID 1 there)."""
    try:
        with open("/proc/1/cmdline", "rb") as f:
            return INIT.name.encode() in f.read()
    except OSError:
        return False


# ---- the host worker -----------------------------------------------------------------------------

#: The tests that need the host's own PID namespace: its kernel threads (children of kthreadd,
#: PID 2), which no other PID namespace shows. Marked `host_pids` (tests/conftest.py); under
#: `pytest -n N` they run on one more worker, HOST_WORKER, that shares the host and runs nothing
#: else. In a worker of its own world, such a test skips, saying why.
HOST_PIDS: tuple[str, ...] = (
    "tests/test_process_source.py::test_kernel_threads_read_with_their_name_and_no_command_line",
    "tests/test_reap.py::test_pid_1_the_daemon_kernel_threads_and_protected_processes_are_refused_with_reasons",
)
HOST_WORKER = "gwhost"
_HOST_SCOPE = "host-pids"


def needs_host_pids(nodeid: str) -> bool:
    path, _, name = nodeid.partition("::")
    return f"{path}::{name.split('[', 1)[0]}" in HOST_PIDS


def worker_specs(specs: list[str]) -> list[str]:
    """xdist's `--tx` specs with each local worker in a world of its own, and the host worker
    after them; `specs` as they are where that cannot be."""
    command = worker_command()
    if command is None or not specs or any(s != "popen" for s in specs):
        return specs
    return [f"popen//python={command}"] * len(specs) + [f"popen//id={HOST_WORKER}"]


def make_scheduler(config: Any, log: Any, order: Callable[[str], int],
                   together: frozenset[str] = frozenset()) -> Any:
    """xdist's one-test-at-a-time scheduling (`--dist load`), where the HOST_PIDS tests go to
    HOST_WORKER and it takes nothing else, and the tests of each module in `together` (paths)
    go to one worker, which then sets up their module's fixtures once; in the order `order`
    gives each test (tests/conftest.py's run_order: the modules that keep both cores busy for
    a minute first, then the other slow ones, as they are what the run waits for, then the
    rest)."""
    from xdist.scheduler import LoadScopeScheduling

    class HostAwareScheduling(LoadScopeScheduling):  # type: ignore[misc]
        host: Optional[str] = HOST_WORKER

        def _split_scope(self, nodeid: str) -> str:
            if needs_host_pids(nodeid):
                return _HOST_SCOPE
            path = nodeid.split("::", 1)[0]
            return path if path in together else nodeid

        def _takes(self, node: Any, scope: str) -> bool:
            if self.host is None:
                return True
            return (scope == _HOST_SCOPE) == (node.gateway.id == self.host)

        def _assign_work_unit(self, node: Any) -> None:
            scope = next((s for s in self.workqueue if self._takes(node, s)), None)
            if scope is None:
                node.shutdown()
                return
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid)
                                    for nodeid, done in work_unit.items() if not done])

        def _reschedule(self, node: Any) -> None:
            if node.shutting_down:
                return
            if not any(self._takes(node, s) for s in self.workqueue):
                node.shutdown()
                return
            # Three tests queued: a worker runs one only once it knows the next (or is told
            # to stop), and has one more in hand while the next is on its way.
            while (not node.shutting_down and self._pending_of(self.assigned_work[node]) < 3
                   and any(self._takes(node, s) for s in self.workqueue)):
                self._assign_work_unit(node)

        def remove_node(self, node: Any) -> Any:
            if node.gateway.id == self.host:
                self.host = None  # its tests, if it crashed before them, go to any worker
            return super().remove_node(node)

        def schedule(self) -> None:
            assert self.collection_is_completed
            if self.collection is not None:
                for node in self.nodes:
                    self._reschedule(node)
                return
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = list(next(iter(self.registered_collections.values())))
            if not self.collection:
                return
            if not any(n.gateway.id == self.host for n in self.nodes):
                self.host = None
            units: dict[str, dict[str, bool]] = {}
            for nodeid in self.collection:
                units.setdefault(self._split_scope(nodeid), {})[nodeid] = False
            # Stable: each part in the order collected.
            for scope in sorted(units, key=lambda s: order(next(iter(units[s])))):
                self.workqueue[scope] = units[scope]
            for node in self.nodes:
                self._reschedule(node)

    return HostAwareScheduling(config, log)
