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
    # From a fleet table row, by the node's name, straight to that node's dashboard.
    row_links = [(o["matcher"]["options"], link["url"]) for p in panels(fleet)
                 for o in p["fieldConfig"]["overrides"] for prop in o["properties"]
                 if prop["id"] == "links" for link in prop["value"]]
    assert row_links
    assert all(column == "node" and "var-instance=${__data.fields.instance}" in url
               for column, url in row_links)


def test_the_fleet_dashboard_names_nodes_by_their_daemons_node_name() -> None:
    fleet = load("gpuwatch-fleet.json")
    per_node = [p for p in panels(fleet) if p["type"] != "stat" and (
        "per node" in p["title"] or p["title"] in ("Nodes with findings", "Top leaking jobs"))]
    assert len(per_node) >= 5
    for panel in per_node:
        for t in panel["targets"]:
            assert "group_left (node)" in t["expr"] and "gpuwatch_node_info" in t["expr"], \
                panel["title"]
            if "legendFormat" in t:
                assert "{{node}}" in t["legendFormat"], panel["title"]


def build(tmp_path: Path, *args: str) -> Path:
    subprocess.run([sys.executable, str(DASHBOARDS / "build.py"), "--out", str(tmp_path), *args],
                   check=True, capture_output=True, text=True)
    return tmp_path


def test_the_scrape_selector_is_a_build_setting_of_the_rules_and_dashboards(
        tmp_path: Path) -> None:
    out = build(tmp_path, "--selector", 'job="gpu-nodes", cluster="a"')
    rules = (out / "gpuwatch-alerts.yml").read_text()
    assert 'job="gpuwatch"' not in rules
    for expr in re.findall(r"expr: \|-\n((?:          .*\n)+)", rules):
        for series in re.findall(r"\b(?:gpuwatch_\w+|up)\{[^}]*\}", expr):
            assert 'job="gpu-nodes", cluster="a"' in series, series
    for name in BOARDS:
        board = json.loads((out / name).read_text())
        job = next(v for v in board["templating"]["list"] if v["name"] == "job")
        assert job["definition"] == \
            'label_values(gpuwatch_build_info{job="gpu-nodes", cluster="a"}, job)'


def test_the_build_scales_alert_durations_for_tests_and_points_runbooks_where_asked(
        tmp_path: Path) -> None:
    out = build(tmp_path, "--for-scale", "0.01", "--runbook-url", "https://wiki.example/gw#")
    rules = (out / "gpuwatch-alerts.yml").read_text()
    shipped = RULES.read_text()
    durations = re.findall(r"^        for: (\S+)$", rules, re.M)
    assert durations and set(durations) <= {"1s", "2s", "3s", "6s", "18s", "36s"}
    assert len(durations) == len(re.findall(r"^        for: ", shipped, re.M))
    assert "1h" not in durations and "5m" in re.findall(r"^        for: (\S+)$", shipped, re.M)
    links = re.findall(r'runbook_url: "([^"]+)"', rules)
    assert links and all(u.startswith("https://wiki.example/gw#gpuwatch") for u in links)
    assert subprocess.run([sys.executable, str(DASHBOARDS / "build.py"), "--for-scale", "2"],
                          capture_output=True).returncode == 2


def test_every_alert_links_to_its_section_of_the_runbooks() -> None:
    runbooks = (ROOT / "docs" / "runbooks.md").read_text()
    sections = {h.strip().lower() for h in re.findall(r"^## (\w+)$", runbooks, re.M)}
    text = RULES.read_text()
    alerts = re.findall(r"^      - alert: (\w+)$", text, re.M)
    links = re.findall(r'runbook_url: "[^"#]+#(\w+)"', text)
    assert [name.lower() for name in alerts] == links
    assert set(links) <= sections, sorted(set(links) - sections)


def test_the_node_dashboard_answers_what_the_on_call_asks() -> None:
    node = load("gpuwatch-node.json")
    titles = {p["title"] for p in panels(node)}
    assert {"GPU memory by process", "GPU memory by job", "Unattributed GPU memory",
            "Open findings", "Leak growth per step", "Projected out-of-memory",
            "Leak culprits", "Watched buffers: bytes", "Reaps since the daemon started", "NVML",
            "Poll duration", "Poll errors and rejected agent reports"} <= titles
    findings = next(p for p in panels(node) if p["type"] == "table"
                    and p["title"] == "Open findings")
    order = findings["transformations"][-1]["options"]["indexByName"]
    assert {"kind", "pid", "name", "job_id", "gpu", "summary"} <= set(order)
    # The evidence summed up from identity and figures; the full reason is not on /metrics.
    assert "reason" not in order
    assert findings["targets"][0]["expr"].startswith("gpuwatch_finding_info{")


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


def test_the_node_dashboard_shows_each_leaks_culprit_and_how_it_was_found() -> None:
    node = {p["title"]: p for p in panels(load("gpuwatch-node.json"))}
    culprits = node["Leak culprits"]
    assert culprits["type"] == "table"
    # Its bytes and its items a step: a leak of `autograd history` has only items (graph
    # nodes), and is in the table all the same.
    by_bytes, by_items = culprits["targets"]
    assert by_bytes["expr"].startswith("gpuwatch_leak_culprit_bytes_per_step{")
    assert by_items["expr"].startswith("gpuwatch_leak_culprit_items_per_step{")
    organize = culprits["transformations"][-1]["options"]
    order = sorted(organize["indexByName"], key=organize["indexByName"].get)
    assert order[:7] == ["pid", "name", "series", "culprit", "found_by", "Value #A", "Value #B"]
    assert organize["renameByName"] == {"Value #A": "bytes/step", "Value #B": "items/step"}
    assert {"watched", "discovered", "autograd", "traced"} <= set(
        re.findall(r"`(\w+)`", culprits["description"]))
    growth = node["Leak growth per step"]
    assert "{{culprit}} {{found_by}}" in growth["targets"][0]["legendFormat"]
    assert "found_by" in growth["description"]
    oom = node["Projected out-of-memory"]["transformations"][-1]["options"]["indexByName"]
    assert {"culprit", "found_by"} <= set(oom)


def test_the_leak_alerts_say_what_explains_each_leak_and_how_it_was_found() -> None:
    blocks = re.split(r"\n(?=      - alert: )", RULES.read_text())
    leaks = [b for b in blocks if "- alert: GpuwatchMemoryLeak" in b]
    assert len(leaks) == 2
    for block in leaks:
        description = block.split("description: >-", 1)[1]
        for found_by in ("traced", "discovered"):
            assert f'eq .Labels.found_by "{found_by}"' in description
        assert "{{ with .Labels.found_by }}" in description  # watched, or whatever comes next
