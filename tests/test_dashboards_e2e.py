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
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuwatch.simulate.demo import DemoError, SimulatedNode, simulated_node, wait_for
from tests.promserver import api, prometheus_scraping, query

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None and not os.environ.get("CI"),
    reason="prometheus is not installed (make test installs Debian's package)")

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "dashboards"
RATE_INTERVAL = "10s"  # what Grafana's $__rate_interval is at a 1 s scrape, and then some
#: The daemon's host-memory limit: the leaking trainer (2 MiB a step, 5 steps a second) reaches
#: it in about a minute and a half, inside the alert's one-hour horizon.
LIMIT = 1 << 30
EXPECTED_FIRING = {"GpuwatchOrphanHoldsGpuMemory", "GpuwatchLeftoverProcess",
                   "GpuwatchMemoryLeakOutOfMemorySoon", "GpuwatchMemoryLeakOutOfMemoryImminent"}


def rules_with_short_durations(tmp_path: Path) -> Path:
    """The shipped rules with every `for:` cut to 2 s: the test checks that expressions and
    labels reach firing, not the minutes the real durations wait."""
    text = (DASHBOARDS / "gpuwatch-alerts.yml").read_text()
    short, n = re.subn(r"^(\s+for: )\d+[smh]$", r"\g<1>2s", text, flags=re.M)
    assert n >= 12
    path = tmp_path / "gpuwatch-alerts.yml"
    path.write_text(short)
    return path


def panel_queries(name: str) -> Iterator[tuple[str, str]]:
    board = json.loads((DASHBOARDS / name).read_text())
    for panel in board["panels"]:
        for t in panel.get("targets", []):
            yield f"{name}: {panel['title']} ({t['refId']})", t["expr"]


def variable_queries(name: str) -> Iterator[tuple[str, str, str]]:
    board = json.loads((DASHBOARDS / name).read_text())
    for v in board["templating"]["list"]:
        if v["type"] == "query":
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", v["definition"])
            assert match, v["definition"]
            yield f"{name}: ${v['name']}", match.group(1), match.group(2)


def substituted(expr: str, instance: str) -> str:
    for var, value in (("$__rate_interval", RATE_INTERVAL), ("$job_id", ".*"),
                       # Escaped for a regex inside a PromQL string, as Grafana does.
                       ("$instance", re.escape(instance).replace("\\", "\\\\")),
                       ("$job", "gpuwatch")):
        expr = expr.replace(var, value)
    assert "$" not in expr, expr
    return expr


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
        target = sim.metrics_url.split("//", 1)[1].split("/", 1)[0]
        with prometheus_scraping(target, tmp_path, [rules_with_short_durations(tmp_path)]) \
                as prom:
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
                         if not query(prom, substituted(expr, target))]
                for name in ("gpuwatch-node.json", "gpuwatch-fleet.json"):
                    for where, series, label in variable_queries(name):
                        values = api(prom, f"label/{label}/values",
                                     **{"match[]": substituted(series, target)})
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
            orphan = alerts["GpuwatchOrphanHoldsGpuMemory"]
            assert [a["labels"]["pid"] for a in orphan] == [str(kept)]  # the reaped one is gone
            assert orphan[0]["labels"]["severity"] == "warning"
            assert orphan[0]["labels"]["gpu"] == "0"
            assert f"parent {sim.training.launcher.pid} " in orphan[0]["labels"]["reason"]
            assert f"PID {kept} (python" in orphan[0]["annotations"]["description"]
            assert "12GiB on GPU 0" in orphan[0]["annotations"]["description"]
            leak = alerts["GpuwatchMemoryLeakOutOfMemoryImminent"]
            assert [a["labels"]["pid"] for a in leak] == [str(sim.leaking.pid)]
            assert leak[0]["labels"]["severity"] == "critical"
            assert leak[0]["labels"]["series"] == "RSS"
            assert leak[0]["labels"]["culprit"] == "fetch_buffer"
            assert "buffer `fetch_buffer` explains it" in leak[0]["annotations"]["description"]
