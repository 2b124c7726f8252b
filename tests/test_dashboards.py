"""The Grafana dashboards and alert rules in dashboards/: built from their source, shaped the way
Grafana and the monitoring mixins expect, and naming only metrics gpuwatch documents.

What their queries return against a real daemon is pinned by tests/test_dashboards_e2e.py; the
alerts' behaviour by tests/alerts/*.test.yml through test_alert_rules.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "dashboards"
RULES = DASHBOARDS / "gpuwatch-alerts.yml"
METRICS_DOC = ROOT / "docs" / "metrics.md"
BOARDS = ("gpuwatch-node.json", "gpuwatch-fleet.json")


def load(name: str) -> dict[str, Any]:
    return dict(json.loads((DASHBOARDS / name).read_text()))


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in board["panels"] if p["type"] != "row"]


def exprs(board: dict[str, Any]) -> Iterator[str]:
    for panel in panels(board):
        for t in panel["targets"]:
            yield t["expr"]


def metric_names(promql: str) -> set[str]:
    names = set(re.findall(r"\bgpuwatch_[a-z0-9_]+", promql))
    if re.search(r"\bup\{", promql):
        names.add("up")
    # A histogram is documented by its family name.
    return {re.sub(r"_(bucket|count|sum)$", "", n) if n.startswith("gpuwatch_poll_duration")
            else n for n in names}


def test_the_committed_json_is_what_build_py_builds() -> None:
    done = subprocess.run([sys.executable, str(DASHBOARDS / "build.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", BOARDS)
def test_dashboards_pick_their_datasource_node_and_scrape_job_from_variables(name: str) -> None:
    board = load(name)
    assert board["schemaVersion"] >= 39 and board["uid"] in ("gpuwatch-node", "gpuwatch-fleet")
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for var in ("job", "instance"):
        assert variables[var]["type"] == "query"
        assert variables[var]["datasource"]["uid"] == "${datasource}"
    for panel in panels(board):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for t in panel["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", panel["title"]
            # Every query is narrowed to the picked node(s) of the picked scrape job.
            assert 'job=~"$job"' in t["expr"] and 'instance=~"$instance"' in t["expr"], \
                (panel["title"], t["expr"])


@pytest.mark.parametrize("name", BOARDS)
def test_every_panel_says_what_it_answers_and_in_which_unit(name: str) -> None:
    for panel in panels(load(name)):
        assert len(panel["description"]) > 20, panel["title"]
        if panel["type"] in ("timeseries", "stat"):
            assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        else:
            units = [o for o in panel["fieldConfig"]["overrides"]
                     if o["properties"][0]["id"] == "unit"]
            assert units, panel["title"]


@pytest.mark.parametrize("name", BOARDS)
def test_panels_sit_on_the_grid_without_overlapping(name: str) -> None:
    board = load(name)
    cells: set[tuple[int, int]] = set()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_node_and_fleet_dashboards_link_to_each_other() -> None:
    node, fleet = load("gpuwatch-node.json"), load("gpuwatch-fleet.json")
    assert any("/d/gpuwatch-fleet/" in link["url"] for link in node["links"])
    assert any("/d/gpuwatch-node/" in link["url"] for link in fleet["links"])
    # From a fleet table row straight to that node's dashboard.
    row_links = [link["url"] for p in panels(fleet) for o in p["fieldConfig"]["overrides"]
                 for prop in o["properties"] if prop["id"] == "links" for link in prop["value"]]
    assert row_links and all("var-instance=${__value.raw}" in u for u in row_links)


def test_the_node_dashboard_answers_what_the_on_call_asks() -> None:
    node = load("gpuwatch-node.json")
    titles = {p["title"] for p in panels(node)}
    assert {"GPU memory by process", "GPU memory by job", "Unattributed GPU memory",
            "Open findings", "Leak growth per step", "Projected out-of-memory",
            "Watched buffers: bytes", "Reaps since the daemon started", "NVML",
            "Poll duration", "Poll errors and rejected agent reports"} <= titles
    findings = next(p for p in panels(node) if p["type"] == "table"
                    and p["title"] == "Open findings")
    order = findings["transformations"][-1]["options"]["indexByName"]
    assert {"kind", "pid", "name", "job_id", "gpu", "reason"} <= set(order)


def test_dashboards_and_rules_name_only_documented_metrics() -> None:
    documented = set(re.findall(r"`(gpuwatch_\w+)`", METRICS_DOC.read_text())) | {"up"}
    used: set[str] = set()
    for name in BOARDS:
        for expr in exprs(load(name)):
            used |= metric_names(expr)
    used |= metric_names(RULES.read_text())
    assert len(used) > 20
    assert used <= documented, f"not in docs/metrics.md: {sorted(used - documented)}"


def test_every_alert_carries_a_severity_a_duration_and_words_for_the_on_call() -> None:
    text = RULES.read_text()
    blocks = re.split(r"\n(?=      - alert: )", text)[1:]
    assert len(blocks) >= 12
    for block in blocks:
        name = re.match(r"\s*- alert: (\w+)", block)
        assert name is not None
        assert re.search(r"^        for: \d+[smh]$", block, re.M), name.group(1)
        assert re.search(r"^          severity: (info|warning|critical)$", block, re.M), \
            name.group(1)
        assert "summary:" in block and "description:" in block, name.group(1)
