"""A real Prometheus server for the end-to-end tests: started on a free port against a scrape
target (and rule files), queried through its HTTP API."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

from gpuwatch.simulate.demo import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def prometheus_scraping(target: str, tmp_path: Path,
                        rule_files: Sequence[Path] = ()) -> Iterator[str]:
    """Prometheus scraping `target` every second as scrape job `gpuwatch` and evaluating
    `rule_files` every second; yields its base URL once it is ready."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    rules = ("rule_files:\n" + "".join(f'  - "{path}"\n' for path in rule_files)
             if rule_files else "rule_files: []\n")
    config.write_text(f"""
global:
  scrape_interval: 1s
  scrape_timeout: 900ms
  evaluation_interval: 1s
{rules}scrape_configs:
  - job_name: gpuwatch
    static_configs:
      - targets: ["{target}"]
""")
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for("prometheus to be ready", lambda: _ready(base), 60, alive=proc)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _ready(base: str) -> Optional[bool]:
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
