"""The on-call path end to end, on a fleet: eight simulated nodes (eight real daemons, each with
its own fake driver and a healthy real job), one real Prometheus with the project's rules as the
build step makes them, one real Alertmanager routing to a webhook receiver here.

One node's job is SIGKILLed with four GPU workers. The on-call engineer must get exactly one
notification, naming the node, the job, the GPU memory and the runbook; nothing when the evidence
reads differently a moment later (the launcher reaped) or when some of the workers are reaped;
exactly one resolved notification once the last is reaped; and nothing at all from the seven
healthy nodes. The fleet dashboard's queries must return every node by its name.

Skipped only where Prometheus or Alertmanager is absent and we are not in CI; `make test`
installs Debian's packages.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from gpuwatch.simulate.demo import DemoError, wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from tests.alertmanager import (
    Notification,
    WebhookReceiver,
    alertmanager_binary,
    alertmanager_routing_to,
)
from tests.daemonproc import RunningDaemon, by_pid, running_daemon
from tests.promserver import (
    api,
    built_rules,
    panel_queries,
    prometheus_scraping,
    query,
    substituted,
)
from tests.realprocs import GIB, RunningJob, gpuwatch, running_job, status_json

pytestmark = pytest.mark.skipif(
    (shutil.which("prometheus") is None or alertmanager_binary() is None)
    and not os.environ.get("CI"),
    reason="prometheus or alertmanager is not installed (make test installs Debian's packages)")

NODES = 8
#: The node whose job loses its launcher.
STRICKEN = 3
WORKER_MEMORY = 3 * GIB
DETECTORS = "[detectors]\nmin_age = 0\n"


@dataclass
class FleetNode:
    name: str
    fake: FakeNode
    env: dict[str, str]
    daemon: RunningDaemon
    healthy: RunningJob

    @property
    def target(self) -> str:
        return self.daemon.metrics_url.split("//", 1)[1].split("/", 1)[0]


@contextlib.contextmanager
def fleet_node(index: int, lib: Path, tmp_path: Path) -> Iterator[FleetNode]:
    """A simulated GPU node: its own fake driver state with two GPUs, a healthy two-worker job
    holding memory on them, and a daemon that calls the node `sim-node-NN`."""
    name = f"sim-node-{index:02d}"
    home = tmp_path / name
    home.mkdir()
    fake = FakeNode(home / "nvml.state", lib, gpus=2)
    fake.write()
    env = fake.env()
    env.update(GPUWATCH_RUNTIME_DIR=str(home / "run"), GPUWATCH_STATE_DIR=str(home / "state"),
               GPUWATCH_CONFIG="/dev/null", GPUWATCH_NODE_NAME=name)
    env.pop("NOTIFY_SOCKET", None)
    with running_job(home, workers=2) as healthy:
        for rank, pid in enumerate(healthy.workers):
            fake.hold(pid, device=rank, used=20 * GIB)
        with running_daemon(env, home, config=DETECTORS, args=("--interval", "0.5")) as daemon:
            yield FleetNode(name, fake, env, daemon, healthy)


def stays(what: str, holds: Callable[[], bool], seconds: float) -> None:
    """Fail as soon as `holds()` is false within `seconds`. For what must NOT happen: a
    notification Alertmanager would send goes out within a group_interval (1 s) of the change
    that causes it, so three of them is the deadline."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert holds(), what
        time.sleep(0.1)


def firing_alert(prom: str, name: str) -> Optional[dict[str, Any]]:
    for group in api(prom, "rules", type="alert")["groups"]:
        for rule in group["rules"]:
            if rule["name"] == name:
                active = [a for a in rule.get("alerts", []) if a["state"] == "firing"]
                assert len(active) <= 1, active
                return active[0] if active else None
    raise AssertionError(f"no rule {name}")


def test_a_fleet_pages_once_for_one_jobs_orphans_and_resolves_once_when_they_are_reaped(
        tmp_path: Path, fake_nvml_lib: Path) -> None:
    receiver = WebhookReceiver()
    with contextlib.ExitStack() as stack:
        stack.callback(receiver.close)
        nodes = [stack.enter_context(fleet_node(i, fake_nvml_lib, tmp_path))
                 for i in range(1, NODES + 1)]
        node = nodes[STRICKEN - 1]
        job = stack.enter_context(running_job(tmp_path / node.name, workers=4))
        for rank, pid in enumerate(job.workers):
            node.fake.hold(pid, device=rank % 2, used=WORKER_MEMORY)
        wait_for("the stricken job's workers seen holding memory", lambda: True if set(
            job.workers) <= {p["pid"] for p in status_json(node.env)[1]["processes"]
                             if p["holds_gpu"]} else None, 20, alive=node.daemon.proc)
        alertmanager = stack.enter_context(alertmanager_routing_to(receiver, tmp_path))
        prom = stack.enter_context(prometheus_scraping(
            [n.target for n in nodes], tmp_path, [built_rules(tmp_path / "rules")],
            alertmanager=alertmanager))

        # -- the fleet dashboard sees every node, by its name -----------------------------------
        names = {n.name for n in nodes}
        targets = [n.target for n in nodes]  # all of them picked in the Nodes variable
        # The per-node panels that have data on a healthy node (stranded memory has none).
        per_node = {where: expr for where, expr in panel_queries("gpuwatch-fleet.json")
                    if "in use and unattributed, per node" in where
                    or "Poll duration p99, per node" in where}
        assert len(per_node) == 3
        seen: dict[str, set[Optional[str]]] = {}

        def every_node_in_every_per_node_panel() -> Optional[bool]:
            for where, expr in per_node.items():
                seen[where] = {r["metric"].get("node")
                               for r in query(prom, substituted(expr, targets))}
            return True if all(found == names for found in seen.values()) else None

        try:
            wait_for("every node in the fleet dashboard's per-node panels",
                     every_node_in_every_per_node_panel, 60)
        except DemoError:
            pytest.fail(f"nodes seen per panel: {seen}")
        reporting = next(expr for where, expr in panel_queries("gpuwatch-fleet.json")
                         if "Nodes reporting" in where)
        assert query(prom, substituted(reporting, targets))[0]["value"][1] == str(NODES)
        assert receiver.notifications == []

        # -- the launcher is SIGKILLed and left unreaped for now: four orphans -----------------
        os.kill(job.launcher_pid, signal.SIGKILL)
        first = wait_for("the first notification", lambda: receiver.notifications or None, 60)
        (page,) = first
        assert page.status == "firing"
        (alert,) = page.alerts
        labels = alert["labels"]
        assert labels == {"alertname": "GpuwatchOrphansHoldGpuMemory", "severity": "critical",
                          "node": node.name, "instance": node.target, "job": "gpuwatch",
                          "job_id": job.run_id, "job_source": "torchelastic"}
        description = alert["annotations"]["description"]
        assert description.startswith(
            f"4 processes of job torchelastic:{job.run_id} on {node.name} hold 12GiB of GPU "
            "memory although their launcher has exited"), description
        for pid in job.workers:
            assert f"PID {pid} (python" in description
        # Each one's evidence summed up (docs/security.md, rule 5), and where the rest is.
        assert "(not reaped yet)" in description
        assert "`gpuwatch status` for the full evidence" in description
        assert alert["annotations"]["runbook_url"].endswith(
            "docs/runbooks.md#gpuwatchorphansholdgpumemory")
        active_since = firing_alert(prom, "GpuwatchOrphansHoldGpuMemory")["activeAt"]

        # -- the evidence reads differently now, and one worker is reaped: no new page ----------
        reasons = {pid: f["reason"] for pid, f in by_pid(status_json(node.env)[1],
                                                          "orphan").items()}
        job.launcher.wait()  # reaped: the launcher is gone from /proc now
        done = gpuwatch(["reap", "--yes", "--pid", str(job.workers[0]), "--grace", "2"],
                        node.env)
        assert done.returncode == 0, done.stdout + done.stderr
        left = job.workers[1:]

        def alertmanager_has_the_update() -> Optional[bool]:
            """Prometheus re-sends the firing alert every second: Alertmanager holds the new
            description, with three processes, under the same labels."""
            with urllib.request.urlopen(f"http://{alertmanager}/api/v2/alerts", timeout=10) as r:
                held = json.loads(r.read())
            return True if [a["annotations"]["description"][:14] for a in held] == \
                ["3 processes of"] else None

        wait_for("Alertmanager to hold the alert with three orphans", alertmanager_has_the_update,
                 30)
        now = by_pid(status_json(node.env)[1], "orphan")
        assert set(now) == set(left)
        assert all(now[pid]["reason"] == reasons[pid] for pid in left)
        assert firing_alert(prom, "GpuwatchOrphansHoldGpuMemory")["activeAt"] == active_since
        stays("no second notification while the alert stays put",
              lambda: len(receiver.notifications) == 1, 3.0)

        # -- the epilog reaps the rest: one resolved notification --------------------------------
        done = gpuwatch(["reap", "--yes", "--job", job.run_id, "--grace", "2"], node.env)
        assert done.returncode == 0, done.stdout + done.stderr
        try:
            wait_for("the resolved notification",
                     lambda: True if len(receiver.notifications) >= 2 else None, 60)
        except DemoError:
            pytest.fail(f"no resolved notification: {receiver.notifications}")
        stays("nothing more", lambda: len(receiver.notifications) == 2, 3.0)
        resolved: Notification = receiver.notifications[1]
        assert resolved.status == "resolved"
        assert [a["labels"] for a in resolved.alerts] == [labels]
        assert all(n.group_labels.get("node") == node.name for n in receiver.notifications)
