"""The benchmarks run: `bench/run.py --quick` on the fake node finishes, prints its summary table
and writes its report. Figures only, no timing asserted: CI machines are too noisy for that."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_benchmark_run_prints_the_summary_table(tmp_path: Path) -> None:
    report = tmp_path / "BENCHMARKS.md"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--write", "--output",
         str(report)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = done.stdout.split("== summary", 1)[1]
    for figure in ("poll CPU (wall), 8 GPUs x 64 GPU processes",
                   "daemon CPU per poll / nvitop-exporter per collection",
                   "daemon RSS / nvitop-exporter RSS", "/metrics scrape",
                   "`gpuwatch status --json` / `gpustat --json`", "daemon RSS after",
                   "`agent.step()` / bare `sendto`", "daemon ingest",
                   "`gpuwatch run -- true` - `true`", "`gpuwatch run` supervisor CPU",
                   "`gpuwatch top` CPU", "agent flood, ", "chaos: ",
                   "processes of one user with 2 MiB command lines",
                   "flooding agent.sock with junk: a second user's leak found",
                   "/metrics over HTTPS + basic auth, good scrapes under",
                   "daemon process CPU per poll / its poll after an idle interval"):
        assert figure in summary, summary
    assert "failed (exit" not in summary
    text = report.read_text()
    assert "## Machine" in text and "| figure | value | goal | |" in text
    assert "python bench/run.py --quick" in text
