"""Run every benchmark under bench/ and print its figures: `make bench`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = ["poll_cost.py", "exporter_vs_nvitop.py", "daemon_rss.py", "agent_ingest.py",
           "agent_step.py"]

if __name__ == "__main__":
    failed = 0
    for name in BENCHES:
        print(f"== {name}", flush=True)
        failed |= subprocess.run([sys.executable, str(HERE / name)]).returncode
    sys.exit(failed)
