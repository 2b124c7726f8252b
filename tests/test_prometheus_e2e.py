"""A real Prometheus scrapes a real daemon on the simulated node.

Skipped only where Prometheus is absent and we are not in CI; CI installs Debian's package
(`make test-deps`), so there it always runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from tests.daemonproc import running_daemon
from tests.promserver import needs_prometheus, prometheus_scraping, query
from tests.realprocs import GIB, MIB, running_job

pytestmark = needs_prometheus


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
