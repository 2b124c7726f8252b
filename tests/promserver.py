"""A real Prometheus server for the end-to-end tests: started on a free port against scrape
targets (with the alert rules as the build step makes them), queried through its HTTP API; and
the dashboards' queries as Grafana would send them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import pytest

from gpuwatch.simulate.demo import wait_for
from tests.realprocs import terminate

DASHBOARDS = Path(__file__).resolve().parent.parent / "dashboards"

#: Prometheus is Debian's package, which `make test` installs (and CI always has): elsewhere the
#: tests that need it skip.
needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None and not os.environ.get("CI"),
    reason="prometheus is not installed (make test installs Debian's package)")
RATE_INTERVAL = "10s"  # what Grafana's $__rate_interval is at a 1 s scrape, and then some


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


def substituted(expr: str, instances: Sequence[str]) -> str:
    """A dashboard query as Grafana sends it with `instances` picked in the Node(s) variable:
    each value escaped for a regex inside a PromQL string, several joined as alternatives."""
    picked = "|".join(re.escape(i).replace("\\", "\\\\") for i in instances)
    if len(instances) > 1:
        picked = f"({picked})"
    for var, value in (("$__rate_interval", RATE_INTERVAL), ("$job_id", ".*"),
                       ("$instance", picked), ("$job", "gpuwatch")):
        expr = expr.replace(var, value)
    assert "$" not in expr, expr
    return expr


def built_rules(out: Path, for_scale: float = 0.002) -> Path:
    """The alert rules as `dashboards/build.py` builds them, with every `for:` scaled down (5m
    to 1 s, 1h to 7 s): the tests check what fires and what is sent, not the minutes the real
    durations wait."""
    subprocess.run([sys.executable, str(DASHBOARDS / "build.py"), "--for-scale", str(for_scale),
                    "--out", str(out)], check=True, capture_output=True)
    return out / "gpuwatch-alerts.yml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def prometheus_scraping(targets: Union[str, Sequence[str]], tmp_path: Path,
                        rule_files: Sequence[Path] = (),
                        alertmanager: Optional[str] = None, job_options: str = "",
                        extra_jobs: str = "") -> Iterator[str]:
    """Prometheus scraping `targets` every second as scrape job `gpuwatch`, evaluating
    `rule_files` every second and sending alerts to `alertmanager` (HOST:PORT), re-sending
    firing ones every second (so that the test sees Alertmanager take updates without
    notifying again); yields its base URL once it is ready. `job_options` (YAML keys of a scrape
    config: `scheme`, `tls_config`, `basic_auth`) go into the job; `extra_jobs` (YAML list
    items, indented by two spaces) follow it."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    rules = ("rule_files:\n" + "".join(f'  - "{path}"\n' for path in rule_files)
             if rule_files else "rule_files: []\n")
    alerting = (f"""alerting:
  alertmanagers:
    - static_configs:
        - targets: ["{alertmanager}"]
""" if alertmanager else "")
    listed = ", ".join(f'"{t}"' for t in ([targets] if isinstance(targets, str) else targets))
    config.write_text(f"""
global:
  scrape_interval: 1s
  scrape_timeout: 900ms
  evaluation_interval: 1s
{rules}{alerting}scrape_configs:
  - job_name: gpuwatch
    static_configs:
      - targets: [{listed}]
{textwrap.indent(job_options, "    ")}{extra_jobs}
""")
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--rules.alert.resend-delay=1s"],
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for("prometheus to be ready", lambda: ready(base), 60, alive=proc)
        yield base
    finally:
        terminate(proc)
        log.close()


def ready(base: str) -> Optional[bool]:
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as r:
            return True if r.status == 200 else None
    except OSError:
        return None


def api(base: str, path: str, **params: str) -> Any:
    """The `data` of a Prometheus HTTP API answer, failing on an error answer."""
    url = f"{base}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as exc:  # a bad query answers 400 with the reason
        body = json.loads(exc.read())
    assert body["status"] == "success", (path, params, body)
    return body["data"]


def query(base: str, promql: str) -> list[dict[str, Any]]:
    return list(api(base, "query", query=promql)["result"])
