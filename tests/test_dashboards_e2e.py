"""The dashboards and alert rules against a real Prometheus scraping a real daemon on the
simulated node, while its story runs: a job's launcher is killed (orphans), a finished job's
helpers linger (leftovers), an instrumented trainer leaks, an orphan is reaped, a corrupt agent
datagram arrives.

Every panel query and template variable of both dashboards must return data, and the orphan and
leak alerts must reach `firing` through the rules API, with nothing else firing.

Skipped only where Prometheus is absent and we are not in CI; CI installs Debian's package.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuwatch.simulate.demo import DemoError, SimulatedNode, simulated_node, wait_for
from tests.daemonproc import wait_first_poll
from tests.promserver import (
    api,
    built_rules,
    needs_prometheus,
    panel_queries,
    prometheus_scraping,
    query,
    substituted,
    variable_queries,
)

pytestmark = needs_prometheus

#: The daemon's host-memory limit: the leaking trainer (2 MiB a step, 5 steps a second) reaches
#: it in about a minute and a half, inside the alert's one-hour horizon.
LIMIT = 1 << 30
EXPECTED_FIRING = {"GpuwatchOrphansHoldGpuMemory", "GpuwatchLeftoverProcesses",
                   "GpuwatchMemoryLeakOutOfMemorySoon", "GpuwatchMemoryLeakOutOfMemoryImminent"}


def gpuwatch(sim: SimulatedNode, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**sim.node.env(), "GPUWATCH_RUNTIME_DIR": str(sim.runtime_dir),
           "GPUWATCH_STATE_DIR": str(sim.work_dir / "state")}
    return subprocess.run([sys.executable, "-m", "gpuwatch", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def daemon_findings(sim: SimulatedNode) -> list[dict[str, Any]]:
    done = gpuwatch(sim, "status", "--json")
    return list(json.loads(done.stdout)["findings"]) if done.stdout else []


def firing(prom: str) -> dict[str, list[dict[str, Any]]]:
    alerts: dict[str, list[dict[str, Any]]] = {}
    for group in api(prom, "rules", type="alert")["groups"]:
        for rule in group["rules"]:
            active = [a for a in rule.get("alerts", []) if a["state"] == "firing"]
            if active:
                alerts[rule["name"]] = active
    return alerts


def test_every_panel_has_data_and_the_orphan_and_leak_alerts_fire(tmp_path: Path) -> None:
    with simulated_node(tmp_path, listen="127.0.0.1:0", workers=2, interval=0.5, pace=1.0,
                        detectors=f"host_memory_limit_bytes = {LIMIT}") as sim:
        wait_first_poll(sim.runtime_dir, sim.daemon)
        target = sim.metrics_url.split("//", 1)[1].split("/", 1)[0]
        with prometheus_scraping(target, tmp_path, [built_rules(tmp_path / "rules")]) as prom:
            kept, reaped = sim.training.workers
            os.kill(sim.training.launcher.pid, signal.SIGKILL)

            def story_told() -> Optional[list[dict[str, Any]]]:
                found = daemon_findings(sim)
                kinds = {(f["kind"], f["pid"]) for f in found}
                leftovers = sum(f["kind"] == "leftover" for f in found)
                told = ({("orphan", kept), ("orphan", reaped), ("leak", sim.leaking.pid)}
                        <= kinds and leftovers == 3)
                return found if told else None

            wait_for("orphans, leftovers and the leak", story_told, 60, alive=sim.daemon)
            done = gpuwatch(sim, "reap", "--yes", "--pid", str(reaped), "--grace", "2")
            assert done.returncode == 0, done.stdout + done.stderr
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(b"\x00not a report", str(sim.runtime_dir / "agent.sock"))

            def empty_queries() -> list[str]:
                empty = [where for name in ("gpuwatch-node.json", "gpuwatch-fleet.json")
                         for where, expr in panel_queries(name)
                         if not query(prom, substituted(expr, [target]))]
                for name in ("gpuwatch-node.json", "gpuwatch-fleet.json"):
                    for where, series, label in variable_queries(name):
                        values = api(prom, f"label/{label}/values",
                                     **{"match[]": substituted(series, [target])})
                        if not values:
                            empty.append(where)
                return empty

            last: list[str] = []

            def all_have_data() -> Optional[bool]:
                last[:] = empty_queries()
                return True if not last else None

            try:
                wait_for("every panel query to return data", all_have_data, 90,
                         alive=sim.daemon)
            except DemoError:
                pytest.fail(f"queries without data: {last}")

            def expected_alerts_firing() -> Optional[dict[str, list[dict[str, Any]]]]:
                alerts = firing(prom)
                return alerts if set(alerts) >= EXPECTED_FIRING else None

            alerts = wait_for("the orphan and leak alerts to fire", expected_alerts_firing, 60)
            assert set(alerts) == EXPECTED_FIRING, sorted(alerts)
            # One alert for job A's orphans on this node, whatever the number of its PIDs.
            (orphan,) = alerts["GpuwatchOrphansHoldGpuMemory"]
            labels = orphan["labels"]
            assert set(labels) == {"alertname", "severity", "instance", "job", "node",
                                   "job_id", "job_source"}, labels
            assert labels["severity"] == "critical" and labels["job_source"] == "torchelastic"
            assert labels["node"] == socket.gethostname() and labels["job_id"]
            description = orphan["annotations"]["description"]
            assert description.startswith(
                f"1 process of job torchelastic:{labels['job_id']} on {labels['node']} holds "), \
                description
            assert f"PID {kept} (python" in description and "12GiB" in description
            # Its evidence summed up from PIDs and names; the rest is `gpuwatch status`.
            assert f"parent {sim.training.launcher.pid} " in description
            assert "`gpuwatch status` for the full evidence" in description
            assert str(reaped) not in description  # the reaped one is gone
            assert orphan["annotations"]["runbook_url"].endswith(
                "docs/runbooks.md#gpuwatchorphansholdgpumemory")
            (leak,) = alerts["GpuwatchMemoryLeakOutOfMemoryImminent"]
            assert leak["labels"]["severity"] == "critical"
            assert f"PID {sim.leaking.pid} (" in leak["annotations"]["description"]
            assert "RSS grows" in leak["annotations"]["description"]
            assert "buffer `fetch_buffer` explains it" in leak["annotations"]["description"]
