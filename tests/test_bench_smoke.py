"""Every benchmark bench/run.py runs still runs: each at its smallest sizes (`--smoke`, seconds
each) hands its figures to bench/run.py, whose summary table prints the bench's rows, and a run
asked to write its report writes it. Figures only, no timing asserted: CI machines are too noisy
for that, and the figures of a smoke run mean nothing (`make bench` measures)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "bench" / "run.py"

#: What each bench's rows in the summary table start with (at least one per bench).
ROWS: dict[str, tuple[str, ...]] = {
    "poll_cost": ("poll CPU (wall), 8 GPUs x 64 GPU processes", "poll CPU growth"),
    "exporter_vs_nvitop": ("daemon CPU per poll / nvitop-exporter per collection",
                           "daemon RSS / nvitop-exporter RSS", "/metrics scrape"),
    "exporter_vs_nvitop_scraped": ("daemon CPU per poll / nvitop-exporter per collection",),
    "render_cost": ("daemon's /metrics render after a poll",),
    "equal_work": ("daemon poll / nvitop-exporter's per-process collection alone (equal work)",),
    "oneshot": ("`gpuwatch status --json` / `gpustat --json`",),
    "oneshot_1024": ("`gpuwatch status --json`, daemon running / `nvitop -1`",),
    "daemon_rss": ("daemon RSS after",),
    "rss_plateau": ("daemon RSS / nvitop-exporter RSS after",),
    "agent_step": ("`agent.step()` / bare `sendto`",),
    "culprit_torch": ("PyTorch program",),
    "culprit_torch_auto": ("PyTorch program without a line (auto agent), 0.3 s steps",
                           "healthy PyTorch program without a line (auto agent)",
                           "agent's share of the training thread, PyTorch program without a line"),
    "seeded_auto": ("false leaks, 2 seeded healthy PyTorch programs without a line (auto "
                    "agent)",),
    "agent_ingest": ("daemon ingest",),
    "agent_bootstrap": ("`python -c pass` with the agent bootstrap on PYTHONPATH - without",),
    "run_overhead": ("`gpuwatch run -- true` - `true`", "`gpuwatch run` supervisor CPU"),
    "top_cpu": ("`gpuwatch top` CPU",),
    "daemon_poll": ("daemon process CPU per poll / its poll after an idle interval",),
    "agent_flood": ("agent flood, ",),
    "agent_junk_flood": ("flooding agent.sock with junk: a second user's leak found",),
    "argv_flood": ("processes of one user with 2 MiB command lines",),
    "web_auth_flood": ("/metrics over HTTPS + basic auth, good scrapes under",),
    "chaos": ("chaos: ",),
}


def benches_run_py_runs() -> list[str]:
    """bench/run.py's BENCHES, read from its source (importing it would run nothing, but needs
    bench/ on sys.path)."""
    for node in ast.parse(RUN.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "BENCHES" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("bench/run.py has no BENCHES list")


def smoke_run(*args: str) -> str:
    """bench/run.py --smoke with `args`; its summary section (the table and what follows)."""
    done = subprocess.run([sys.executable, str(RUN), "--smoke", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "== summary (smoke, not a measurement" in done.stdout, done.stdout[-4000:]
    summary = done.stdout.split("== summary", 1)[1]
    lines = summary.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("figure "))
    header, rule = lines[at:at + 2]
    assert header.split() == ["figure", "value", "goal"], summary
    assert set(rule.replace(" ", "")) == {"-"}, summary
    assert "failed (exit" not in summary, done.stdout[-4000:] + done.stderr[-4000:]
    return summary


def test_every_bench_that_run_py_runs_has_its_smoke_test() -> None:
    assert sorted(ROWS) == sorted(benches_run_py_runs())


@pytest.mark.parametrize("bench", sorted(ROWS))
def test_each_bench_runs_at_its_smallest_sizes_and_prints_its_rows(bench: str) -> None:
    summary = smoke_run("--only", bench, "--no-write")
    for figure in ROWS[bench]:
        assert figure in summary, summary
    assert summary.rstrip().splitlines()[-1].startswith("goals: "), summary


def test_a_run_asked_to_write_its_report_writes_the_machine_and_the_table(tmp_path: Path
                                                                           ) -> None:
    report = tmp_path / "BENCHMARKS.md"
    smoke_run("--only", "agent_ingest", "--write", "--output", str(report))
    text = report.read_text()
    assert "## Machine" in text and "| figure | value | goal | |" in text
    assert "python bench/run.py --smoke --only agent_ingest --write" in text
    assert "### `bench/agent_ingest.py`" in text and "| daemon ingest" in text
