"""What answering costs the daemon: one /metrics render (text, OpenMetrics, gzipped) and one
status document, after each poll, on a simulated node of 8 fake GPUs and real processes.

A daemon object polls the node in this process; after each poll it renders what a scrape every
poll and a `gpuwatch status --json` every poll would ask of it: the text exposition, the
OpenMetrics one, the gzipped text (as Prometheus asks for it) and the status document. Each is
timed in CPU (the process's clock), medians over the rounds. With --against DIR the gpuwatch
package in DIR (another revision's) is measured too, alternating, in the same run: the ratio
between the two is the figure that holds on a busy machine.

    python bench/render_cost.py [--gpu-procs 64,1024] [--rounds 40] [--against DIR]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from cmdline import options, parse_args, write_figures
from node import ROOT, bench_node, cli_env

# Runs in a fresh interpreter on the fake node, importing gpuwatch from PYTHONPATH.
_CHILD = r"""
import json, sys, time
try:
    from gpuwatch.metrics import choose_encoder
except ImportError:  # a revision before gpuwatch.metrics
    from prometheus_client.exposition import choose_encoder
from gpuwatch.config import load_config
from gpuwatch.daemon import Daemon
rounds = int(sys.argv[1])
daemon = Daemon(load_config())
text, _ = choose_encoder("")
openmetrics, _ = choose_encoder("application/openmetrics-text; version=1.0.0")
clock = time.process_time
for _ in range(3):  # caches filled, imports done
    daemon.poll_once()
    daemon.rendered.body(text, False)
    daemon.document_bytes()
times = {"poll": [], "text": [], "openmetrics": [], "gzip": [], "document": []}
sizes = {}
for _ in range(rounds):
    c0 = clock()
    daemon.poll_once()
    c1 = clock()
    body = daemon.rendered.body(text, False)
    c2 = clock()
    om = daemon.rendered.body(openmetrics, False)
    c3 = clock()
    zipped = daemon.rendered.body(text, True)
    c4 = clock()
    document = daemon.document_bytes()
    c5 = clock()
    for name, t in (("poll", c1 - c0), ("text", c2 - c1), ("openmetrics", c3 - c2),
                    ("gzip", c4 - c3), ("document", c5 - c4)):
        times[name].append(t)
    sizes = {"text": len(body), "openmetrics": len(om), "gzip": len(zipped),
             "document": len(document or b""),
             "samples": sum(1 for line in body.splitlines() if not line.startswith(b"#"))}
print(json.dumps({"times": times, "sizes": sizes,
                  "processes": len(daemon.latest.snapshot.processes)}))
"""

PARTS = ("poll", "text", "openmetrics", "gzip", "document")


def run_child(rounds: int, env: dict[str, str], code: Optional[Path]) -> dict[str, Any]:
    env = {**env, "PYTHONPATH": str(code or ROOT)}
    with tempfile.TemporaryDirectory() as cwd:  # nothing importable where it runs
        out = subprocess.run([sys.executable, "-c", _CHILD, str(rounds)], env=env, cwd=cwd,
                             check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def main() -> None:
    parser = options(__doc__, rounds=40, gpus=8, gpu_procs=[64, 1024])
    parser.add_argument("--against", type=Path, default=None,
                        help="also measure the gpuwatch package in DIR (another revision's), "
                             "alternating with this checkout's")
    args = parse_args(parser, quick={"rounds": 10, "gpu_procs": [64]},
                      smoke={"rounds": 2, "gpu_procs": [8]})
    codes: list[tuple[str, Optional[Path]]] = [("this checkout", None)]
    if args.against:
        codes.append((f"against {args.against}", args.against))
    print(f"what answering costs the daemon after each poll, {args.gpus} fake GPUs, "
          f"{args.rounds} rounds; CPU ms, medians")
    header = (f"{'':<34}{'poll':>8}{'text':>8}{'OpenMetr':>9}{'gzip':>8}{'status':>8}"
              f"{'samples':>9}{'text KiB':>10}{'status KiB':>11}")
    figures: dict[str, Any] = {"gpus": args.gpus, "rounds": args.rounds, "by_gpu_procs": {}}
    for n in args.gpu_procs:
        print(header)
        with bench_node(args.gpus, n) as b:
            env = cli_env(b)
            # Alternating, twice each when there are two: the machine's mood is shared.
            for label, code in codes * (2 if args.against else 1):
                r = run_child(args.rounds, env, code)
                ms = {p: statistics.median(r["times"][p]) * 1e3 for p in PARTS}
                s = r["sizes"]
                print(f"{label + f', {n} GPU processes':<34}{ms['poll']:>8.2f}{ms['text']:>8.2f}"
                      f"{ms['openmetrics']:>9.2f}{ms['gzip']:>8.2f}{ms['document']:>8.2f}"
                      f"{s['samples']:>9}{s['text'] / 1024:>10.0f}{s['document'] / 1024:>11.0f}",
                      flush=True)
                key = "this" if code is None else "against"
                figures["by_gpu_procs"].setdefault(str(n), {}).setdefault(
                    key, {**{f"{p}_ms": ms[p] for p in PARTS}, **s})
        print()
    write_figures(args.figures, figures)


if __name__ == "__main__":
    main()
