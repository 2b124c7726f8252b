"""CPU time of one poll on a simulated node: 8 GPUs, 64 real processes holding GPU memory.

Run twice side by side: once on a quiet host, once with 2,000 extra idle host processes, to show
that a poll's cost follows GPU processes rather than every process on the host.

    python bench/poll_cost.py [--polls 300] [--gpu-procs 64] [--host-procs 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuwatch.simulate.fakenvml import FakeNode, FakeProcess, build_fake_nvml

# Runs inside a child whose LD_LIBRARY_PATH points at the fake driver.
_MEASURE = r"""
import json, sys, time
from gpuwatch.poll import Poller
polls = int(sys.argv[1])
poller = Poller()
for _ in range(5):
    snap = poller.poll()
cpu, wall = [], []
for _ in range(polls):
    c0, w0 = time.process_time(), time.perf_counter()
    snap = poller.poll()
    cpu.append(time.process_time() - c0)
    wall.append(time.perf_counter() - w0)
print(json.dumps({"cpu": cpu, "wall": wall, "holders": len(snap.gpu_holders),
                  "processes": len(snap.processes), "errors": [e.message for e in snap.errors]}))
"""


def _spawn_idle(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen(["sleep", "3600"]) for _ in range(n)]


def measure(node: FakeNode, polls: int) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(polls)], env=node.env(),
                         check=True, capture_output=True, text=True).stdout
    result: dict[str, object] = json.loads(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--polls", type=int, default=300)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-procs", type=int, default=64)
    parser.add_argument("--host-procs", type=int, default=2000)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        lib = build_fake_nvml(Path(tmp) / "lib")
        node = FakeNode(Path(tmp) / "state", lib, gpus=args.gpus)
        holders = _spawn_idle(args.gpu_procs)
        idle: list[subprocess.Popen[bytes]] = []
        try:
            for i, p in enumerate(holders):
                node.processes.append(
                    FakeProcess(device=i % args.gpus, pid=p.pid, used=(1 << 30) + i * (1 << 20)))
            node.write()
            rows = [("quiet host", measure(node, args.polls))]
            idle = _spawn_idle(args.host_procs)
            rows.append((f"+{args.host_procs} idle host processes", measure(node, args.polls)))
        finally:
            for p in holders + idle:
                p.kill()
            for p in holders + idle:
                p.wait()

    print(f"poll cost: {args.gpus} fake GPUs, {args.gpu_procs} real GPU processes, "
          f"{args.polls} polls each")
    print(f"{'host':<32} {'CPU ms/poll (median)':>21} {'p95':>7} {'wall ms (median)':>17}"
          f" {'procs in snapshot':>18}")
    base = None
    for label, r in rows:
        cpu = sorted(r["cpu"])  # type: ignore[arg-type]
        wall = r["wall"]
        med = statistics.median(cpu) * 1e3
        base = base or med
        print(f"{label:<32} {med:>21.2f} {cpu[int(len(cpu) * 0.95)] * 1e3:>7.2f}"
              f" {statistics.median(wall) * 1e3:>17.2f} {r['processes']:>18}")  # type: ignore[arg-type]
        if r["errors"]:
            print(f"  errors: {r['errors'][:3]}")
    med_busy = statistics.median(rows[1][1]["cpu"]) * 1e3  # type: ignore[arg-type]
    print(f"ratio busy/quiet host: {med_busy / base:.2f}x")


if __name__ == "__main__":
    main()
