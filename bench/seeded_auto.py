"""False leaks over the 100 seeded healthy programs, auto-instrumented: the healthy programs of
tests/test_culprit_seeds.py as real PyTorch training processes with no line of gpuwatch
(bench/seeded_program.py), under the agent's bootstrap as `gpuwatch run` runs a job
(GPUWATCH_AGENT=auto, the bootstrap first on PYTHONPATH), against a real daemon on a simulated
node with its default configuration (1 s polls).

Each program holds 1 GiB of fake GPU memory while it runs, so that the daemon judges it. The
bench reads the daemon's state socket every 0.5 s: a program shown with a leak finding at any
read is a false leak (the programs are all healthy), and each program's agent must have reported
at least `--steps` - 8 steps (it was judged well past the daemon's 10 steps of warm-up). The
`--leaking` seeds are controls, run after the healthy ones: the same programs that also keep 1
to 4 MiB entries in a module-level dict every step from step 10 on, which must be called leaks
and have the dict named, so that a count of 0 false leaks is a count by a daemon that sees
leaks. It prints a line for each program called a leak, and the totals.

    python bench/seeded_auto.py [--seeds 0-99] [--leaking 100-104] [--parallel 8] [--steps 80]
        [--step-seconds 0.25]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from node import GIB, ROOT, bench_node, cli_env, parse_args, start_daemon, stop, write_figures
from seeded_program import seeds

from gpuwatch.serve.state_client import STATE_SOCKET_NAME, StateUnavailable, fetch_status

HERE = Path(__file__).resolve().parent
#: A program counts as judged when its agent reported at least this many steps short of its end.
JUDGED_SLACK = 8
#: What a leaking control keeps: the culprit its leak must name.
FETCH = "seeded.infra.rpc.rtensor._fetch_buffer"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="0-99", help="'0-99' or '3,5,8'")
    parser.add_argument("--leaking", default="100-104",
                        help="seeds of leaking controls, run after --seeds ('' for none)")
    parser.add_argument("--parallel", type=int, default=8, help="programs running at a time")
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps a program")
    parser.add_argument("--step-seconds", type=float, default=0.25)
    args = parse_args(parser, quick={"seeds": "0-9", "parallel": 5},
                      smoke={"seeds": "0-1", "leaking": "", "parallel": 2, "steps": 16})
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        why = ("PyTorch is not installed here (make test installs its CPU build): "
               "nothing to measure")
        print(why)
        write_figures(args.figures, {"skipped": why})
        return
    wanted = seeds(args.seeds)
    controls = [s for s in seeds(args.leaking) if s not in wanted]
    started = time.monotonic()
    with bench_node(gpus=1, gpu_procs=1) as b:
        env = cli_env(b)
        state = Path(env["GPUWATCH_RUNTIME_DIR"]) / STATE_SOCKET_NAME
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        daemon = start_daemon(b, port, 1.0)
        events = b.tmp / "events"
        from gpuwatch.launch_env import AGENT_BOOTSTRAP_DIR

        launcher = subprocess.Popen(
            [sys.executable, str(HERE / "seeded_program.py"), "--seeds", args.seeds,
             "--leaking", args.leaking, "--parallel", str(args.parallel),
             "--steps", str(args.steps), "--step-seconds", str(args.step_seconds),
             "--events", str(events)],
            env={**env, "GPUWATCH_AGENT": "auto",
                 "PYTHONPATH": os.pathsep.join([AGENT_BOOTSTRAP_DIR, str(ROOT)])}, cwd=ROOT)
        seed_of: dict[int, int] = {}
        ended: dict[int, int] = {}  # seed -> exit status
        steps_seen: dict[int, int] = {}  # seed -> the newest step its agent reported
        leaks: dict[int, dict[str, Any]] = {}  # seed -> its first leak finding
        leak_reads = 0
        named: dict[int, str] = {}  # control seed -> the culprit its leak named
        raised: dict[int, int] = {}  # control seed -> its agent's step when its leak showed
        read = 0  # the events read so far
        try:
            while launcher.poll() is None and daemon.poll() is None:
                time.sleep(0.5)
                lines = _lines(events)
                for line in lines[read:]:
                    what, seed, pid = line[0], int(line[1]), int(line[2])
                    if what == "start":
                        seed_of[pid] = seed
                        b.node.hold(pid, device=0, used=GIB)
                    else:
                        ended[seed] = int(line[3])
                        seed_of.pop(pid, None)
                        b.node.release(pid)
                read = len(lines)
                try:
                    doc = fetch_status(state)
                except StateUnavailable:
                    continue
                for p in doc.get("processes", ()):
                    seed = seed_of.get(p.get("pid"))
                    step = (p.get("agent") or {}).get("step")
                    if seed is not None and seed not in ended and isinstance(step, int):
                        steps_seen[seed] = max(step, steps_seen.get(seed, 0))
                for f in doc.get("findings", ()):
                    seed = seed_of.get(f.get("pid"))
                    if f.get("kind") == "leak" and seed is not None and seed not in ended:
                        culprit = (f.get("details") or {}).get("culprit")
                        if seed in controls:
                            raised.setdefault(seed, steps_seen.get(seed, -1))
                            if culprit and seed not in named:
                                named[seed] = culprit
                                print(f"control seed {seed}: {f.get('reason')}", flush=True)
                            continue
                        leak_reads += 1
                        if seed not in leaks:
                            leaks[seed] = f
                            print(f"seed {seed}: a false leak: {f.get('reason')}", flush=True)
        finally:
            stop([launcher, daemon])
    wall = time.monotonic() - started
    right = sorted(s for s, c in named.items() if c == FETCH)
    judged = [s for s in wanted if steps_seen.get(s, 0) >= args.steps - JUDGED_SLACK]
    failed = sorted(s for s, status in ended.items() if status != 0)
    print(f"{len(wanted)} seeded healthy PyTorch programs under the bootstrap "
          f"({args.steps} steps of {args.step_seconds:g} s, {args.parallel} at a time, "
          f"{wall:.0f} s): {len(leaks)} false leaks ({leak_reads} reads showing one); "
          f"{len(judged)} judged past {args.steps - JUDGED_SLACK} agent steps; "
          f"{len(failed)} failed")
    if controls:
        print(f"{len(controls)} leaking controls (leaking from step 10): {len(raised)} raised, "
              f"at steps {[raised[s] for s in sorted(raised)]}; {len(right)} named `{FETCH}`; "
              f"other culprits named: {sorted(set(named.values()) - {FETCH}) or 'none'}")
    write_figures(args.figures, {
        "programs": len(wanted), "steps": args.steps, "step_seconds": args.step_seconds,
        "parallel": args.parallel, "wall_s": wall, "false_leaks": len(leaks),
        "false_leak_seeds": sorted(leaks), "leak_reads": leak_reads, "judged": len(judged),
        "failed": failed, "controls": len(controls), "controls_named": len(right),
        "controls_raised": len(raised),
        "control_culprits": sorted(set(named.values())),
        "reasons": {str(s): f.get("reason") for s, f in sorted(leaks.items())}})


def _lines(path: Path) -> list[list[str]]:
    """The complete lines of the launcher's events (the last may be half written)."""
    try:
        text = path.read_text()
    except OSError:
        return []
    return [line.split() for line in text.splitlines(keepends=True)
            if line.endswith("\n") and len(line.split()) >= 3]


if __name__ == "__main__":
    main()
