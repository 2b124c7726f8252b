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
        extra = labels - {"pid", "name", "user", "job_id", "job_source", "pod_namespace",
                          "pod_name", "pod_container"}
        assert extra == {"series", "culprit", "found_by"}
        assert all(f"`{label}`" in row for label in extra) or "as above" in row, row
    for found_by in ("watched", "discovered", "traced"):
        assert f"`{found_by}`" in documented


def test_every_config_key_is_documented() -> None:
    documented = (DOCS / "config.md").read_text()
    for key, _, _, _ in describe():
        assert f"`{key}`" in documented, f"{key} is not in docs/config.md"


# ---- the monitoring recipe of docs/prometheus.md, run as a user runs it ---------------------

ROOT = DOCS.parent


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", text, re.M | re.S)


def test_the_prometheus_recipe_runs_verbatim_and_puts_each_file_where_it_is_read(
        tmp_path: Path) -> None:
    """The shell blocks of docs/prometheus.md (the README's "Prometheus and Grafana" links
    there), in order, as written (root: `sudo` stands
    for itself), in a mount namespace whose /etc/prometheus and /var/lib are empty: the rules end
    up at the path prometheus.yml's rule_files names, promtool accepts them, the dashboards land
    in the folder the Grafana provider reads, and nothing else goes to Prometheus' rules."""
    import os
    import shutil
    import subprocess

    import pytest
    import yaml

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a mount namespace of its own")
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (make test-deps)")
    section = (DOCS / "prometheus.md").read_text()
    (prometheus_yml,) = [b for b in _blocks(section, "yaml") if "# prometheus.yml" in b]
    rule_files = yaml.safe_load(prometheus_yml)["rule_files"]
    provider = yaml.safe_load((ROOT / "dashboards" / "grafana-provider.yaml").read_text())
    grafana_dir = provider["providers"][0]["options"]["path"]
    blocks = _blocks(section, "sh")
    assert len(blocks) >= 2 and any("build.py" in b for b in blocks)

    work = tmp_path / "checkout"
    shutil.copytree(ROOT / "dashboards", work / "dashboards")
    shims = tmp_path / "bin"
    shims.mkdir()
    if shutil.which("sudo") is None:
        (shims / "sudo").write_text('#!/bin/sh\nexec "$@"\n')
        (shims / "sudo").chmod(0o755)
    listing = tmp_path / "installed.txt"
    steps = "\n".join(f"( set -ex\n{block})\n" for block in blocks)
    script = ("set -e\nmkdir -p /etc/prometheus && mount -t tmpfs gpuwatch-test /etc/prometheus\n"
              "mount -t tmpfs gpuwatch-test /var/lib\n"
              f"cd {work}\n{steps}"
              f"find /etc/prometheus /var/lib -type f | sort > {listing}\n")
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        env={**os.environ, "PATH": f"{shims}:{os.environ['PATH']}"},
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("SUCCESS: ") >= 2, done.stdout  # each promtool check
    installed = listing.read_text().split()
    rules = [f for f in installed if f.startswith("/etc/prometheus/")]
    assert rules == rule_files, "the rules are where prometheus.yml loads them, and only they"
    assert sorted(f for f in installed if f.startswith(grafana_dir + "/")) == [
        f"{grafana_dir}/gpuwatch-fleet.json", f"{grafana_dir}/gpuwatch-node.json"]
    assert len(installed) == 3, installed
    assert (work / "build" / "monitoring" / "gpuwatch-alerts.yml").exists()
    assert 'job="gpu-nodes"' in (work / "build" / "monitoring" / "gpuwatch-alerts.yml").read_text()


# ---- links: the README is short and points into docs/, so every pointer must land --------------

def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md")),
            ROOT / "contrib" / "slurm" / "README.md"]


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a link in a shell block is not a link)."""
    return re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of `path`: lower case, punctuation but `-` and `_`
    dropped, spaces as `-`, a repeated one numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    for title in re.findall(r"^#{1,6} (.+)$", _prose(path.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_relative_link_of_the_readme_and_docs_resolves_to_a_file_and_heading() -> None:
    checked = 0
    for source in _markdown_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(source.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            name, _, anchor = target.partition("#")
            path = (source.parent / name).resolve() if name else source
            assert path.exists(), f"{source.relative_to(ROOT)} links to {target}: no such file"
            if anchor:
                assert anchor in _anchors(path), (
                    f"{source.relative_to(ROOT)} links to {target}: no such heading")
            checked += 1
    assert checked > 50


def test_the_readme_links_every_doc() -> None:
    """A newcomer finds the rest from the README: no page of docs/ is reachable only by luck."""
    readme = (ROOT / "README.md").read_text()
    for doc in sorted(DOCS.glob("*.md")):
        assert f"](docs/{doc.name}" in readme, f"the README does not link docs/{doc.name}"


def test_every_slow_test_is_named_in_the_testing_doc_and_exists() -> None:
    """`make test-fast` leaves out what tests/conftest.py marks `slow`: docs/testing.md says
    what each of those proves, and none names a module or test that is gone."""
    from tests.conftest import SLOW

    root = DOCS.parent
    section = (DOCS / "testing.md").read_text().split("## The fast tier", 1)[1]
    named = re.findall(r"^- `([^`]+)`", section, re.M)
    assert sorted(named) == sorted(SLOW)
    for entry in SLOW:
        path, _, test = entry.partition("::")
        assert (root / path).exists(), entry
        if test:
            assert f"def {test}(" in (root / path).read_text(), entry
