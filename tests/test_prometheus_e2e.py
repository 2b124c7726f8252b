"""A real Prometheus scrapes a real daemon on the simulated node.

Skipped only where Prometheus is absent and we are not in CI; CI installs Debian's package
(`make test-deps`), so there it always runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from tests.daemonproc import running_daemon
from tests.realprocs import GIB, MIB, running_job

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None and not os.environ.get("CI"),
    reason="prometheus is not installed (make test installs Debian's package)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def prometheus_scraping(target: str, tmp_path: Path) -> Iterator[str]:
    port = _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""
global:
  scrape_interval: 1s
  scrape_timeout: 900ms
scrape_configs:
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


def query(base: str, promql: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def test_prometheus_stores_what_the_fake_driver_says_each_process_holds(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_job(tmp_path, workers=3, env={"SLURM_JOB_ID": "9001"}) as job, \
            running_daemon(cli_env, tmp_path, args=("--interval", "0.5")) as d:
        truth = {pid: (rank % 2, (rank + 1) * GIB + rank * 7 * MIB)
                 for rank, pid in enumerate(job.workers)}
        for pid, (gpu, used) in truth.items():
            fake_node.hold(pid, device=gpu, used=used)
        target = d.metrics_url.split("//", 1)[1].split("/", 1)[0]
        with prometheus_scraping(target, tmp_path) as prom:
            def stored() -> Optional[dict[int, tuple[int, float]]]:
                rows = query(prom, "gpuwatch_process_gpu_memory_bytes")
                got = {int(r["metric"]["pid"]): (int(r["metric"]["gpu"]), float(r["value"][1]))
                       for r in rows}
                return got if set(got) == set(truth) else None

            got = wait_for("Prometheus to store every worker's series", stored, 60)
            assert got == {pid: (gpu, float(used)) for pid, (gpu, used) in truth.items()}

            rows = query(prom, 'gpuwatch_process_gpu_memory_bytes{job_id="9001"}')
            assert len(rows) == 3
            assert {r["metric"]["job"] for r in rows} == {"gpuwatch"}  # Prometheus's own label
            assert query(prom, 'up{job="gpuwatch"}')[0]["value"][1] == "1"
            assert query(prom, "gpuwatch_nvml_up")[0]["value"][1] == "1"
            total = query(prom, "sum(gpuwatch_process_gpu_memory_bytes)")
            assert float(total[0]["value"][1]) == sum(used for _, used in truth.values())
