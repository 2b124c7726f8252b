"""The threat model's proof (docs/security.md): each rule, attacked by a real unprivileged user.

The attacker is a local account with no privileges (`mallory`); the victim is another (`alice`);
the daemon runs as an account of its own (`daemon`, the unit's `gpuwatch` user) or as root, as the
row says. The accounts are real (tests/localusers.py): they are made with useradd where the suite
runs as root (as CI does), and every test here skips, saying why, where it cannot.

One section per rule of docs/security.md, in its order. Each test names the attack it makes and
fails on a daemon that does not hold the rule.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pytest

from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from tests.daemonproc import (
    WAIT,
    RunningDaemon,
    Samples,
    by_pid,
    pids_with_series,
    running_daemon,
    shared_node,
    value,
)
from tests.localusers import LocalUser, local_user
from tests.realprocs import gpuwatch, status_json


@pytest.fixture
def alice() -> LocalUser:
    return local_user("alice")


@pytest.fixture
def mallory() -> LocalUser:
    return local_user("mallory")


@pytest.fixture
def daemon_user() -> LocalUser:
    return local_user("daemon")


# =================================================================================================
# Rule 1. Bytes, not entries: every text a user controls is cut at the read; caches and the
# status document are bounded in bytes; memory comes back when the processes are gone.
# =================================================================================================

# (section 1 ends)


# =================================================================================================
# Rule 2. Authority from what users cannot set: a protected process is known by its executable,
# its uid or its unit, never by comm or argv.
# =================================================================================================

# (section 2 ends)


# =================================================================================================
# Rule 3. No path followed where another user can write: runtime and state directories, the lock,
# and what the CLI trusts.
# =================================================================================================

# (section 3 ends)


# =================================================================================================
# Rule 4. The kernel outranks the agent: RSS from /proc, absurd figures rejected and counted, a
# per-user fair share of every table one user can fill.
# =================================================================================================

# `count` reporting processes (forked), each sending a step report every 0.1 s to agent.sock as
# a training loop's agent would, with the figures `mode` makes up; until stdin closes. Plain
# standard library: it runs as another user, under the system's python3.
_LIAR = r"""
import json, os, signal, socket, sys, time
path, mode, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
HUGE = (1 << 63) - 1

def report(step):
    r = {"v": 1, "kind": "step", "seq": step, "step": step}
    if mode == "rss":  # claims 8 MiB more every step; what it holds stays the same
        r["rss"] = (100 << 20) + step * (8 << 20)
    elif mode == "huge":  # a buffer of 2^63 bytes
        r["buffers"] = {"evil": {"items": 1, "bytes": HUGE}}
    elif mode == "buffer":  # a watched buffer "leaking" 2 MiB a step
        r["buffers"] = {"cache": {"items": step, "bytes": step << 21}}
    return json.dumps(r).encode()

def trace(step):
    return json.dumps({"v": 1, "kind": "trace", "seq": step, "step": step, "trace": {
        "status": "done", "steps": 10,
        "sites": [{"file": "evil.py", "line": 1, "bytes": HUGE, "count": 1}]}}).encode()

def run():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    step = 0
    while True:
        for payload in [report(step)] + ([trace(step)] if mode == "huge" else []):
            try:
                s.sendto(payload, path)
            except OSError:
                pass
        step += 1
        time.sleep(0.1)

children = []
for _ in range(count):
    pid = os.fork()
    if pid == 0:
        run()
    children.append(pid)
print(" ".join(map(str, children)), flush=True)
sys.stdin.read()
for pid in children:
    os.kill(pid, signal.SIGKILL)
for pid in children:
    os.waitpid(pid, 0)
"""


@contextlib.contextmanager
def _lying_agents(user: LocalUser, socket_path: Path, mode: str, count: int = 1
                  ) -> Iterator[list[int]]:
    """`count` processes of `user` reporting made-up figures (see _LIAR); their PIDs."""
    proc = user.popen(["/usr/bin/python3", "-c", _LIAR, str(socket_path), mode, str(count)],
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                      start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"the {mode} reporters did not start"
        yield [int(pid) for pid in line.split()]
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def _watched_shared_node(fake_nvml_lib: Path, tmp_path: Path, config: str = ""
                         ) -> Iterator[tuple[FakeNode, dict[str, str], RunningDaemon]]:
    """A fake node in a directory every user can reach, and a daemon (root) watching it."""
    with shared_node(fake_nvml_lib, 0, 0) as (node, env), \
            running_daemon(env, tmp_path, config=config) as daemon:
        yield node, env, daemon


def _agent_step(samples: Samples, pid: int) -> float:
    return value(samples, "gpuwatch_agent_step", pid=str(pid)) or -1.0


def test_an_agent_claiming_its_rss_grows_every_step_raises_no_leak_the_kernel_does_not_see(
        mallory: LocalUser, fake_nvml_lib: Path, tmp_path: Path) -> None:
    """mallory's process reports an RSS 8 MiB larger every step while what it holds stays the
    same: the leak test reads RSS from /proc, so no leak is found, and the claims the kernel
    does not bear out are counted."""
    with _watched_shared_node(fake_nvml_lib, tmp_path) as (_, env, daemon), \
            _lying_agents(mallory, daemon.runtime_dir / "agent.sock", "rss") as (liar,):
        # Well past the warm-up (10 steps) and the points a leak needs (8, and 8 a point
        # earlier): a daemon that believed the claims names the leak by step 20 or so.
        daemon.wait_for_metrics("60 steps of made-up RSS seen",
                                lambda s: _agent_step(s, liar) >= 60 or None)
        _, doc = status_json(env)
        assert doc["source"] == "daemon"
        assert liar not in by_pid(doc, "leak"), by_pid(doc, "leak")[liar]["reason"]
        (process,) = [p for p in doc["processes"] if p["pid"] == liar]
        assert process["rss_bytes"] < 100 << 20  # the kernel's figure, not the claim
        samples = daemon.wait_for_metrics("the claims counted", lambda s: s if (
            value(s, "gpuwatch_agent_rss_disagreements_total") or 0) >= 3 else None)
        assert value(samples, "gpuwatch_finding", kind="leak", pid=str(liar)) is None


def test_figures_of_2_to_the_63_bytes_are_rejected_counted_and_shown_nowhere(
        mallory: LocalUser, fake_nvml_lib: Path, tmp_path: Path) -> None:
    """mallory reports a watched buffer and a traced allocation site of 2^63 - 1 bytes: both
    are more than the node holds, so the reports are rejected as `implausible`, and no such
    figure reaches /metrics, `gpuwatch status` or the log."""
    with _watched_shared_node(fake_nvml_lib, tmp_path) as (_, env, daemon), \
            _lying_agents(mallory, daemon.runtime_dir / "agent.sock", "huge") as (liar,):
        samples = daemon.wait_for_metrics("the reports rejected as implausible", lambda s: s if (
            value(s, "gpuwatch_agent_reports_rejected_total", reason="implausible") or 0
        ) >= 20 else None)
        status = gpuwatch(["status"], env)
        text = daemon.scrape_text()
        assert "from the running daemon" in status.stdout
        for where, shown in (("/metrics", text), ("status", status.stdout),
                             ("the log", daemon.log())):
            assert "PiB" not in shown and "EiB" not in shown, where
        assert max(samples.values()) < 1 << 50
        assert _agent_step(samples, liar) == -1.0  # none of its reports was taken


def test_one_user_s_flood_of_fake_leaks_never_removes_another_user_s_gpu_series(
        alice: LocalUser, mallory: LocalUser, fake_nvml_lib: Path, tmp_path: Path) -> None:
    """alice holds GPU memory; mallory runs 24 reporting processes, each "leaking" a watched
    buffer (a leak finding each) on a daemon exporting at most 8 processes: alice's
    gpuwatch_process_gpu_memory_bytes series stays in every scrape, and mallory's processes
    left out are counted as over their user's share."""
    config = "[exporter]\nmax_process_series = 8\n"
    with _watched_shared_node(fake_nvml_lib, tmp_path, config) as (node, _, daemon):
        victim = alice.popen(["sleep", "300"])
        try:
            node.hold(victim.pid, device=0, used=4 << 30)

            def alice_exported(s: Samples) -> bool:
                return victim.pid in pids_with_series(s, "gpuwatch_process_gpu_memory_bytes")

            daemon.wait_for_metrics("alice's GPU series", lambda s: alice_exported(s) or None)
            with _lying_agents(mallory, daemon.runtime_dir / "agent.sock", "buffer",
                               24) as flood:
                scrapes = 0

                def flood_flagged() -> Optional[bool]:
                    nonlocal scrapes
                    s = daemon.scrape()
                    scrapes += 1
                    assert alice_exported(s), f"alice's series missing at scrape {scrapes}"
                    flagged = {int(dict(ls)["pid"]) for (n, ls), v in s.items()
                               if n == "gpuwatch_finding" and dict(ls)["kind"] == "leak"}
                    dropped = value(s, "gpuwatch_process_series_dropped_total",
                                    reason="user_share") or 0
                    return True if len(flagged & set(flood)) >= 8 and dropped > 0 else None

                wait_for("mallory's fake leaks over the cap", flood_flagged, WAIT,
                         alive=daemon.proc)
                for _ in range(10):  # and while the flood goes on
                    flood_flagged()
        finally:
            victim.kill()
            victim.wait()

# (section 4 ends)


# =================================================================================================
# Rule 5. /metrics discloses identity, not private text.
# =================================================================================================

# (section 5 ends)


# =================================================================================================
# Rule 6. TLS as the exporter toolkit's web config allows; ECDHE with AEAD only by default.
# =================================================================================================

# (section 6 ends)


# =================================================================================================
# Rule 7. The small ones: /metrics?name[]= for every family; top ends with its terminal.
# =================================================================================================

# (section 7 ends)
