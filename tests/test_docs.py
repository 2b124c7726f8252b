"""The reference docs list what the code serves, so they cannot fall behind it silently."""

from __future__ import annotations

import re
from pathlib import Path

from gpuwatch.config import describe
from gpuwatch.simulate.fakenvml import FakeNode
from gpuwatch.sinks.exporter import ReportCollector
from tests import leakreports
from tests.daemonproc import running_daemon
from tests.realprocs import GIB, running_job

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_every_metric_family_served_is_documented(fake_node: FakeNode, cli_env: dict[str, str],
                                                  tmp_path: Path) -> None:
    with running_job(tmp_path, workers=1) as job, running_daemon(cli_env, tmp_path) as d:
        fake_node.hold(job.workers[0], device=0, used=GIB)
        d.wait_for_metrics("a process series",
                           lambda s: any(n == "gpuwatch_process_gpu_memory_bytes"
                                         for n, _ in s) or None)
        served = re.findall(r"^# TYPE (gpuwatch_\w+) ", d.scrape_text(), re.M)
    documented = (DOCS / "metrics.md").read_text()
    assert len(served) > 10
    for name in served:
        assert f"`{name}`" in documented, f"{name} is served but not in docs/metrics.md"


def test_every_leak_metric_and_its_labels_are_documented() -> None:
    """A node with leaks of every kind of culprit serves series that a quiet node does not."""
    report = leakreports.leak_report()
    documented = (DOCS / "metrics.md").read_text()
    leak_families = [m for m in ReportCollector(lambda: report).collect()
                     if m.name.startswith("gpuwatch_leak_")]
    assert len(leak_families) == 6 and all(m.samples for m in leak_families)
    for family in leak_families:
        assert f"`{family.name}`" in documented, family.name
        row = next(line for line in documented.splitlines()
                   if line.startswith(f"| `{family.name}` |"))
        labels = {label for sample in family.samples for label in sample.labels}
        extra = labels - {"pid", "name", "user", "job_id", "job_source"}
        assert extra == {"series", "culprit", "found_by"}
        assert all(f"`{label}`" in row for label in extra) or "as above" in row, row
    for found_by in ("watched", "discovered", "traced"):
        assert f"`{found_by}`" in documented


def test_every_config_key_is_documented() -> None:
    documented = (DOCS / "config.md").read_text()
    for key, _, _, _ in describe():
        assert f"`{key}`" in documented, f"{key} is not in docs/config.md"
