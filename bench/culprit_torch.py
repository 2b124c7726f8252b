"""Steps from a leak being raised to its culprit named, in a real PyTorch training program that
calls only `agent.step()`; what the agent costs that program's training thread.

The program (gpuwatch/simulate/torch_trainer.py, run with this interpreter) imports torch, torch.nn,
torch.nn.functional, torch.optim, torch.utils.data and torch.distributed, trains a small model on
the CPU from a DataLoader, and calls `agent.step(step)` once a step, padded to a fixed step
length. From step `--leak-from` (the daemon's warm-up, 10 steps) it adds a tensor of `--leak`
bytes a step to a module-level dict, `__main__._fetch_buffer`; beside it a bounded cache (16
tensors of 256 KiB, one new a step) fills up and must never be named. A daemon on a simulated
node polls every second with its default configuration. For each case the bench records the
training step at which the daemon first shows the leak (raised) and the one at which the leak's
culprit is named, by reading the daemon's state socket every 0.2 s, and stops the program a few
steps after (at once at 256 MiB a step: the machine's memory is shared).

Cases: 0.3 s and 2 s steps, 8 MiB and 256 MiB a step; a leak held by a closure, which discovery
cannot see (8 MiB of bytes a step, 0.3 s steps): the daemon then escalates (a faster search and
a trace), and the case measures what that costs; and a healthy run (no leak) that must never be
called a leak, whose agent share is the no-leak overhead.

The agent's share of the training thread: the program takes the CPU time of its thread
(time.thread_time) in each `agent.step()` call and in its own compute (the training step without
the padding sleep), so that a busy machine's other processes do not count. No-leak share: CPU
time in `agent.step()` over the steps' wall time, after the first 10 steps (imports, the first
pass sorting and recording every module). Escalated share: over the steps while the agent
searched faster or traced, CPU time in `agent.step()` plus what the training step's compute grew
by (tracing slows the program's own allocations), over their wall time.

With `--auto` the program has no line of gpuwatch: it runs with the agent's bootstrap on
PYTHONPATH and GPUWATCH_AGENT=auto, as `gpuwatch run` runs a job, and the agent counts its
optimizer steps; its share of the training thread is then the CPU time of the optimizer step
hook (torch_trainer.py --auto). bench/run.py runs it as `culprit_torch_auto`: 0.3 s and 2 s
steps at 8 MiB a step, and a healthy run of 10 minutes (`--healthy-seconds`) that must show no
leak.

    python bench/culprit_torch.py [--healthy-seconds 600] [--cases 0.3:8,0.3:256,2:8,2:256]
        [--auto]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from node import GIB, MIB, ROOT, bench_node, cli_env, parse_args, start_daemon, stop, write_figures

from gpuwatch.serve.state_client import STATE_SOCKET_NAME, StateUnavailable, fetch_status

WARMUP = 10  # the daemon's default leak_warmup_steps

@dataclass
class Step:
    step: int
    agent_s: float
    compute_s: float
    started: float
    escalated: int  # 1: searching faster, + 2: tracing


def read_steps(path: Path) -> list[Step]:
    steps = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5:
                steps.append(Step(int(parts[0]), float(parts[1]), float(parts[2]),
                                  float(parts[3]), int(parts[4])))
    return steps


def last_step(path: Path) -> Optional[int]:
    steps = read_steps(path)
    return steps[-1].step if steps else None


@dataclass
class Case:
    step_seconds: float
    leak: int
    holder: str = "dict"  # "dict": __main__._fetch_buffer; "closure": a closure's list; "none"
    seconds: float = 0.0  # a healthy run's length

    @property
    def label(self) -> str:
        if self.holder == "none":
            return f"healthy, {self.step_seconds:g} s steps, {self.seconds:g} s"
        return (f"{self.step_seconds:g} s steps, {self.leak // MIB} MiB a step"
                + (", held by a closure" if self.holder == "closure" else ""))

    @property
    def expected(self) -> str:
        return "__main__._fetch_buffer" if self.holder == "dict" else "torch_trainer.py:"


@dataclass
class Outcome:
    case: Case
    raised_step: Optional[int] = None
    named_step: Optional[int] = None
    named: Optional[str] = None
    found_by: Optional[str] = None
    culprits: set[str] = field(default_factory=set)
    leaks_seen: int = 0  # polls showing a leak finding for the program (a healthy run: false)
    steps: list[Step] = field(default_factory=list)
    escalated_seconds: float = 0.0

    def figures(self) -> dict[str, Any]:
        steps = self.steps
        wall = (steps[-1].started - steps[0].started) if len(steps) > 1 else float("nan")
        # After the warm-up steps (imports, the first pass sorting and recording every module):
        # what the agent costs a run that goes on.
        calm = [s for s in steps if not s.escalated and s.step >= WARMUP]
        hot = [s for s in steps if s.escalated]
        base = statistics.median(s.compute_s for s in calm) if calm else 0.0
        calm_wall = len(calm) * self.case.step_seconds
        out: dict[str, Any] = {
            "label": self.case.label, "step_seconds": self.case.step_seconds,
            "leak_mib": self.case.leak / MIB, "holder": self.case.holder,
            "raised_step": self.raised_step, "named_step": self.named_step,
            "named": self.named, "found_by": self.found_by, "culprits": sorted(self.culprits),
            "steps_to_name": (self.named_step - self.raised_step
                              if self.named_step is not None and self.raised_step is not None
                              else None),
            "leak_polls": self.leaks_seen, "steps": len(steps), "wall_s": wall,
            "agent_share": (sum(s.agent_s for s in calm) / calm_wall if calm_wall else None),
            "agent_max_ms": max((s.agent_s for s in steps), default=0.0) * 1e3,
            "compute_ms_median": base * 1e3,
        }
        if hot:
            hot_wall = len(hot) * self.case.step_seconds
            # What the compute grew by, against the median step before: summed with its sign,
            # so that the noise of one step cancels another's.
            extra = max(0.0, sum(s.compute_s - base for s in hot))
            out.update(escalated_steps=len(hot), escalated_s=hot_wall,
                       escalated_share=(sum(s.agent_s for s in hot) + extra) / hot_wall,
                       escalated_agent_share=sum(s.agent_s for s in hot) / hot_wall,
                       escalated_compute_share=extra / hot_wall)
            # The faster search alone, once the trace is over.
            alone = [s for s in hot if s.escalated == 1]
            if alone:
                wall = len(alone) * self.case.step_seconds
                out.update(search_steps=len(alone), search_share=(
                    sum(s.agent_s for s in alone)
                    + max(0.0, sum(s.compute_s - base for s in alone))) / wall)
        return out


def leak_of(doc: dict[str, Any], pid: int) -> Optional[dict[str, Any]]:
    return next((f for f in doc.get("findings", ())
                 if f.get("kind") == "leak" and f.get("pid") == pid), None)


@contextlib.contextmanager
def trainer(env: dict[str, str], tmp: Path, case: Case, auto: bool = False
            ) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    progress = tmp / f"progress-{time.monotonic_ns()}"
    holder = "closure" if case.holder == "closure" else "dict"
    if auto:
        from gpuwatch.launch_env import AGENT_BOOTSTRAP_DIR

        env = {**env, "GPUWATCH_AGENT": "auto",
               "PYTHONPATH": os.pathsep.join([AGENT_BOOTSTRAP_DIR, str(ROOT)])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch.simulate.torch_trainer", "--progress", str(progress),
         "--step-seconds", str(case.step_seconds), "--leak-bytes", str(case.leak),
         "--leak-from", str(WARMUP), "--holder", holder, *(["--auto"] if auto else [])],
        env=env, cwd=ROOT)
    try:
        yield proc, progress
    finally:
        proc.kill()
        proc.wait()


def run_case(b: Any, port: int, case: Case, after_named: int, max_leak: int,
             auto: bool = False) -> Outcome:
    env = cli_env(b)
    state = Path(env["GPUWATCH_RUNTIME_DIR"]) / STATE_SOCKET_NAME
    daemon = start_daemon(b, port, 1.0)
    out = Outcome(case)
    try:
        with trainer(env, b.tmp, case, auto) as (proc, progress):
            b.node.hold(proc.pid, device=0, used=GIB)
            started = time.monotonic()
            # A leak case ends once named (and a few steps after), or when the leak has taken
            # max_leak bytes; a healthy one after its seconds.
            leak_steps = max(1, max_leak // max(case.leak, 1))
            while proc.poll() is None and daemon.poll() is None:
                time.sleep(0.2)
                step = last_step(progress)
                if step is None:
                    continue
                if case.holder == "none":
                    if time.monotonic() - started >= case.seconds and step > WARMUP:
                        break
                elif ((out.named_step is not None and step >= out.named_step + after_named)
                      or step - WARMUP >= leak_steps):
                    break
                try:
                    doc = fetch_status(state)
                except StateUnavailable:
                    continue
                step = last_step(progress) or step
                leak = leak_of(doc, proc.pid)
                if leak is None:
                    continue
                out.leaks_seen += 1
                if out.raised_step is None:
                    out.raised_step = step
                details = leak.get("details", {})
                culprit, found_by = details.get("culprit"), details.get("found_by")
                if culprit:
                    out.culprits.add(culprit)
                if culprit and out.named_step is None:
                    out.named_step, out.named, out.found_by = step, culprit, found_by
            b.node.release(proc.pid)
            out.steps = read_steps(progress)
    finally:
        stop([daemon])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="0.3:8,0.3:256,2:8,2:256",
                        help="step seconds:MiB a step, comma-separated")
    parser.add_argument("--closure", action=argparse.BooleanOptionalAction, default=True,
                        help="also a leak held by a closure (0.3 s steps, 8 MiB a step)")
    parser.add_argument("--healthy-seconds", type=float, default=600.0,
                        help="a healthy run (0.3 s steps) that must never be called a leak")
    parser.add_argument("--after-named", type=int, default=8,
                        help="steps watched after the culprit is named (below 256 MiB a step)")
    parser.add_argument("--max-leak-gib", type=float, default=6.0,
                        help="a case stops once its leak holds this much, named or not")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--auto", action="store_true",
                        help="no agent.step() in the program: the agent's bootstrap counts its "
                             "optimizer steps")
    args = parse_args(parser, quick={"cases": "0.3:8", "healthy_seconds": 20.0},
                      smoke={"healthy_seconds": 2.0, "closure": False, "after_named": 1})
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        why = ("PyTorch is not installed here (make test installs its CPU build): "
               "nothing to measure")
        print(why)
        write_figures(args.figures, {"cases": [], "skipped": why, "auto": args.auto})
        return
    import socket

    cases = []
    for spec in filter(None, args.cases.split(",")):
        seconds, mib = spec.split(":")
        cases.append(Case(float(seconds), int(mib) * MIB))
    if args.closure:
        cases.append(Case(0.3, 8 * MIB, "closure"))
    if args.healthy_seconds > 0:
        cases.append(Case(0.3, 0, "none", args.healthy_seconds))
    results = []
    with bench_node(gpus=1, gpu_procs=1) as b:
        for case in cases:
            with socket.socket() as s:
                s.bind(("127.0.0.1", args.port))
                port = s.getsockname()[1]
            print(f"-- {case.label}", flush=True)
            after = args.after_named if case.leak < 64 * MIB else 0
            out = run_case(b, port, case, after, int(args.max_leak_gib * GIB), args.auto)
            f = out.figures()
            results.append(f)
            report(f)
    write_figures(args.figures, {"cases": results, "warmup": WARMUP, "auto": args.auto})


def report(f: dict[str, Any]) -> None:
    if f["holder"] == "none":
        print(f"  {f['steps']} steps in {f['wall_s']:.0f} s: {f['leak_polls']} polls showed a "
              f"leak (a false one); agent share {100 * (f['agent_share'] or 0):.3f}% of the "
              f"training thread, slowest step() {f['agent_max_ms']:.1f} ms")
        return
    print(f"  leak raised at step {f['raised_step']}, culprit named at step {f['named_step']} "
          f"({f['steps_to_name']} steps later): `{f['named']}` ({f['found_by']}); every culprit "
          f"shown: {f['culprits']}")
    print(f"  agent share before escalation {100 * (f['agent_share'] or 0):.3f}%, slowest "
          f"step() {f['agent_max_ms']:.1f} ms; compute median {f['compute_ms_median']:.1f} ms")
    if "escalated_share" in f:
        print(f"  escalated for {f['escalated_steps']} steps ({f['escalated_s']:.1f} s): "
              f"{100 * f['escalated_share']:.2f}% of the training thread (step() "
              f"{100 * f['escalated_agent_share']:.2f}%, slower compute "
              f"{100 * f['escalated_compute_share']:.2f}%)")
    if "search_share" in f:
        print(f"  of which the faster search alone, after the trace, {f['search_steps']} steps: "
              f"{100 * f['search_share']:.2f}%")


if __name__ == "__main__":
    sys.exit(main())
