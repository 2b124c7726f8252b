"""Run every benchmark under bench/, print one table of headline figures with each goal marked,
and write BENCHMARKS.md (the machine, the command, the table, each bench's own figures).

    python bench/run.py            # the full run (`make bench`), writes BENCHMARKS.md
    python bench/run.py --quick    # small sizes, a few minutes: a smoke run, writes nothing
    python bench/run.py --smoke --only oneshot   # the smallest sizes: does it run, in seconds
    python bench/run.py --only poll_cost oneshot --no-write

Every bench runs in its own process on its own simulated node and hands its figures back as JSON
(--figures). Absolute times depend on the machine; the ratios against the peers measured in the
same run are the headline.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

from cmdline import columns, verdict

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BENCHES = ["poll_cost", "exporter_vs_nvitop", "exporter_vs_nvitop_scraped", "render_cost",
           "equal_work", "oneshot", "oneshot_1024",
           "daemon_rss", "rss_plateau",
           "agent_step", "culprit_torch", "culprit_torch_auto", "seeded_auto", "agent_ingest",
           "run_overhead",
           "agent_bootstrap", "top_cpu", "daemon_poll",
           "agent_flood", "agent_junk_flood", "argv_flood", "web_auth_flood", "chaos"]
#: Benches that run a script under another name, with arguments of their own (a --quick run
#: still gives way to the script's quick sizes where these name none).
SCRIPTS: dict[str, tuple[str, list[str], list[str]]] = {
    # name: (script, arguments of a full run, arguments of a quick run)
    "agent_junk_flood": ("agent_flood", ["--junk", "--processes", "2000"], ["--junk"]),
    # The goals' sizes: 64 and 1,024 GPU processes, a poll a second (the daemon's and
    # nvitop-exporter's collection alike), without scrapes and with one every poll.
    "poll_cost": ("poll_cost", ["--ratio-procs", "64,1024"], []),
    "exporter_vs_nvitop": ("exporter_vs_nvitop", ["--gpu-procs", "64,512,1024", "--interval", "1"],
                           []),
    "exporter_vs_nvitop_scraped": ("exporter_vs_nvitop", [
        "--gpu-procs", "64,1024", "--interval", "1", "--scrapes", "10", "--paced", "3",
        "--scraped"], ["--scraped"]),
    "oneshot_1024": ("oneshot", ["--gpu-procs", "1024"], ["--gpu-procs", "64"]),
    # The same PyTorch program with no line of gpuwatch: the bootstrap counts its steps.
    "culprit_torch_auto": ("culprit_torch", ["--auto", "--cases", "0.3:8,2:8", "--no-closure"],
                           ["--auto", "--no-closure"]),
}
PACKAGES = ["gpuwatch", "nvidia-ml-py", "psutil", "prometheus-client", "nvitop",
            "nvitop-exporter", "gpustat"]

Figures = dict[str, Any]


@dataclass
class Row:
    figure: str
    value: str
    goal: str = ""
    met: Optional[bool] = None  # None: a figure with no goal

    @property
    def verdict(self) -> str:
        return verdict(self.met)


def run_bench(name: str, quick: bool, figures_path: Path, smoke: bool = False
              ) -> tuple[int, str]:
    """Run one bench, its output shown as it comes and kept for BENCHMARKS.md."""
    script, full, small = SCRIPTS.get(name, (name, [], []))
    argv = [sys.executable, str(HERE / f"{script}.py"), "--figures", str(figures_path),
            *(small if quick or smoke else full)]
    if smoke:
        argv.append("--smoke")
    elif quick:
        argv.append("--quick")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    return proc.wait(), "".join(lines)


# -- the headline rows, one function per bench ---------------------------------------------------

def _ms(x: float) -> str:
    return f"{x:.2f} ms" if x < 100 else f"{x:.0f} ms"


def poll_rows(f: Figures) -> list[Row]:
    by_gpu, by_host = f["by_gpu_procs"], f["by_host_procs"]
    rows = [Row(f"poll CPU (wall), {f['gpus']} GPUs x {n} GPU processes",
                f"{_ms(s['cpu_ms'])} ({_ms(s['wall_ms'])})") for n, s in by_gpu.items()]
    rows += [Row(f"poll CPU (wall), {f['base_gpu_procs']} GPU processes + {int(n):,} host "
                 "processes", f"{_ms(s['cpu_ms'])} ({_ms(s['wall_ms'])})")
             for n, s in by_host.items()]
    gpu_sizes, host_sizes = [int(n) for n in by_gpu], [int(n) for n in by_host]
    rows.append(Row(f"poll CPU growth, {gpu_sizes[-1] // gpu_sizes[0]}x the GPU processes",
                    f"{f['gpu_growth']:.2f}x ({f['us_per_gpu_proc']:.1f} us per GPU process)"))
    rows.append(Row(f"poll CPU growth, {host_sizes[-1] // host_sizes[0]}x the host processes",
                    f"{f['host_growth']:.2f}x ({f['us_per_host_proc']:.3f} us per host process)",
                    "flat: <= 1.25x", f["host_growth"] <= 1.25))
    return (rows + floor_rows(f.get("ratios", {}), f["gpus"])
            + dataloader_rows(f.get("dataloader")) + churn_rows(f.get("churn")))


#: Goals of the poll against its floors (bench/poll_cost.py (c), (d)).
FLOOR_GOAL = 1.2
FIRST_SIGHTING_GOAL_US = 60.0
DATALOADER_GOAL_MS = 4.0


def floor_rows(ratios: Figures, gpus: int) -> list[Row]:
    rows = []
    for n, r in ratios.items():
        if not n.isdigit():
            continue  # a revision measured with --against
        at = f"{gpus} GPUs x {n} GPU processes"
        rows += [
            Row(f"warm poll / stat-only floor (NVML calls + stat of the same PIDs), {at}",
                f"{_ms(r['poll_ms'])} / {_ms(r['floor_ms'])} = {r['vs_floor']:.2f}x",
                f"<= {FLOOR_GOAL}x", r["vs_floor"] <= FLOOR_GOAL),
            Row(f"the same, each the first of its block (after the other variants took the "
                f"caches), {at}",
                f"{_ms(r['poll_after_ms'])} / {_ms(r['floor_after_ms'])} = "
                f"{r['vs_floor_after']:.2f}x"),
            Row(f"warm poll / floor reading stat + status + cmdline, {at}",
                f"{_ms(r['poll_ms'])} / {_ms(r['floor_full_ms'])} = {r['vs_floor_full']:.2f}x"),
            Row(f"NVML's share of a warm poll (fake driver), {at}; poll / floor without NVML",
                f"{_ms(r['nvml_read_ms'])} = {100 * r['nvml_share']:.0f}%; "
                f"{r['vs_floor_without_nvml']:.2f}x"),
        ]
        if n == "64":
            first = r["first_sighting_us"]
            rows.append(Row(
                f"first sighting of a process: (cold poll - warm poll) / processes, {at}",
                f"({_ms(r['cold_ms'])} - {_ms(r['poll_ms'])}) / {r['processes']} = {first:.0f} us",
                f"<= {FIRST_SIGHTING_GOAL_US:.0f} us", first <= FIRST_SIGHTING_GOAL_US))
            rows.append(Row(
                "its floor: status, cmdline, cgroup, environ and children of each process, read "
                f"with os.open/os.read alone, {at}; first sighting / floor",
                f"{r['first_floor_us']:.0f} us; {r['first_over_floor']:.2f}x"))
    return rows


def dataloader_rows(loaders: Optional[Figures]) -> list[Row]:
    d = (loaders or {}).get("this")
    if not d:
        return []
    node = f"8 ranks x {d['workers']} dataloader workers ({d['processes']} processes read)"
    return [
        Row(f"poll CPU, {node}", _ms(d["steady_ms"]), f"<= {DATALOADER_GOAL_MS:g} ms",
            d["steady_ms"] <= DATALOADER_GOAL_MS),
        Row(f"churn: one rank's {d['workers']} workers replaced every {d['every']} polls, "
            "CPU per poll / steady; per new process",
            f"{_ms(d['churn_ms'])} / {_ms(d['steady_ms'])} = {d['churn_over_steady']:.2f}x; "
            f"{d['per_new_us']:.0f} us"),
    ]


#: Churn of short-lived processes inside a job adds at most this to a poll (bench/poll_cost.py (e)).
CHURN_GOAL = 1.1


def churn_rows(churn: Optional[Figures]) -> list[Row]:
    c = (churn or {}).get("this")
    if not c:
        return []
    before = (churn or {}).get("against")
    versus = f" (against: {before['churn_over_steady']:.2f}x)" if before else ""
    return [Row(f"churn inside a job: a rank starting {c['pids_per_second']:.0f} short-lived "
                "processes a second, polls 1 s apart, CPU per poll churning / steady",
                f"{_ms(c['churn_ms'])} / {_ms(c['steady_ms'])} = "
                f"{c['churn_over_steady']:.2f}x" + versus,
                f"<= {CHURN_GOAL:g}x", c["churn_over_steady"] <= CHURN_GOAL)]


def _us_per_kb(f: Figures) -> float:
    return 1e3 * f["scrape_ms"] / (f["bytes"] / 1024)


#: Daemon CPU per poll against nvitop-exporter's per collection, at 64 and 1,024 GPU processes,
#: without scrapes and with one every poll.
EXPORTER_CPU_GOAL = 0.1
EXPORTER_CPU_GOAL_AT = ("64", "1024")


def exporter_rows(f: Figures) -> list[Row]:
    rows = []
    scraped = f.get("scraped", False)
    for n, r in f["by_gpu_procs"].items():
        gw, nv = r["gpuwatch"], r["nvitop-exporter"]
        cpu, rss = gw["cpu_ms"] / nv["cpu_ms"], gw["rss_mib"] / nv["rss_mib"]
        at = f"8 GPUs x {n} GPU processes"
        saturated = " (nvitop-exporter saturated: a lower bound)" if nv["saturated"] else ""
        goal = n in EXPORTER_CPU_GOAL_AT
        rows.append(Row(f"daemon CPU per poll / nvitop-exporter per collection, {at}, a poll "
                        f"every {f['interval']:g} s, "
                        + ("both scraped (gzipped) once a poll" if scraped else "unscraped"),
                        f"{_ms(gw['cpu_ms'])} / {_ms(nv['cpu_ms'])} = {cpu:.3f}x{saturated}",
                        f"<= {EXPORTER_CPU_GOAL:g}x" if goal else "",
                        cpu <= EXPORTER_CPU_GOAL if goal else None))
        if scraped:  # the other figures are the unscraped run's
            continue
        rows.append(Row(f"daemon RSS / nvitop-exporter RSS, {at}",
                        f"{gw['rss_mib']:.1f} / {nv['rss_mib']:.1f} MiB = {rss:.2f}x",
                        "<= 1x", rss <= 1))
        rows.append(Row(f"/metrics scrape, {at} ({gw['series']} / {nv['series']} PID series)",
                        f"{_ms(gw['scrape_ms'])} / {_ms(nv['scrape_ms'])} = "
                        f"{gw['scrape_ms'] / nv['scrape_ms']:.2f}x"))
        if "paced_scrape_ms" in gw:
            rows.append(Row(f"daemon /metrics scrape, a scrape a second (rendered ahead, served "
                            f"bytes; bare socket), {at}", _ms(gw["paced_scrape_ms"]),
                            "< 1 ms" if n == "512" else "",
                            gw["paced_scrape_ms"] < 1 if n == "512" else None))
        if "gzip_bytes" in gw:
            rows.append(Row(f"/metrics scrape per KB served; gzipped scrape, {at}",
                            f"{_us_per_kb(gw):.1f} / {_us_per_kb(nv):.1f} us/KB; gzipped "
                            f"{_ms(gw['gzip_scrape_ms'])} ({gw['gzip_bytes'] / 1024:.0f} KiB) / "
                            f"{_ms(nv['gzip_scrape_ms'])} ({nv['gzip_bytes'] / 1024:.0f} KiB)"))
    return rows


#: The daemon's cost of answering `gpuwatch status --json` at 1,024 GPU processes.
STATUS_ANSWER_GOAL_MS = 5.0


def render_rows(f: Figures) -> list[Row]:
    """What answering costs the daemon after a poll (bench/render_cost.py)."""
    rows = []
    for n, r in f["by_gpu_procs"].items():
        at = f"{f['gpus']} GPUs x {n} GPU processes"
        this, before = r["this"], r.get("against")
        versus = (f" (against: {_ms(before['text_ms'])} / {_ms(before['openmetrics_ms'])} / "
                  f"{_ms(before['gzip_ms'])})" if before else "")
        rows.append(Row(
            f"daemon's /metrics render after a poll, text / OpenMetrics / gzipped text, {at} "
            f"({this['samples']} samples)",
            f"{_ms(this['text_ms'])} / {_ms(this['openmetrics_ms'])} / "
            f"{_ms(this['gzip_ms'])} = {this['text_ms'] / this['poll_ms']:.2f}x its poll"
            + versus))
        goal = n == "1024"
        rows.append(Row(
            f"daemon's cost of answering `status --json` after a poll, {at}",
            _ms(this["document_ms"]) + (f" (against: {_ms(before['document_ms'])})"
                                        if before else ""),
            f"<= {STATUS_ANSWER_GOAL_MS:g} ms" if goal else "",
            this["document_ms"] <= STATUS_ANSWER_GOAL_MS if goal else None))
    return rows


def equal_work_rows(f: Figures) -> list[Row]:
    """nvitop-exporter's per-process collection alone against the daemon's poll, alternating in
    one run (bench/equal_work.py): the ratio at equal work, not at each tool's defaults."""
    rows = []
    for n, r in f["by_gpu_procs"].items():
        at = f"{f['gpus']} GPUs x {n} GPU processes"
        rows.append(Row(
            f"daemon poll / nvitop-exporter's per-process collection alone (equal work), {at}",
            f"{_ms(r['gpuwatch_ms'])} / {_ms(r['nvitop_processes_ms'])} = {r['ratio']:.2f}x "
            f"({r['gpuwatch_us_per_gpu_proc']:.0f} / {r['nvitop_us_per_gpu_proc']:.0f} us per "
            f"GPU process); without detectors {_ms(r['gpuwatch_no_detectors_ms'])} = "
            f"{r['ratio_no_detectors']:.2f}x",
            "<= 1x" if n == "64" else "", r["ratio"] <= 1 if n == "64" else None))
    return rows


#: `gpuwatch status --json` asking a running daemon: a socket read and a render (docs/cli.md).
ONESHOT_DAEMON_GOAL_MS = 120
#: ... and at most this much of `nvitop -1`'s wall time, at 64 and at 1,024 GPU processes.
ONESHOT_DAEMON_RATIO_GOAL = 0.5


def oneshot_rows(f: Figures) -> list[Row]:
    """Every comparison gives wall and CPU: gpustat's wall time is mostly a 0.1 s sleep per GPU
    (its CPU-percent sample), so against it only CPU compares like with like."""
    wall, cpu = f["wall_ms"], f["cpu_ms"]
    daemon, poll = "gpuwatch status --json", "gpuwatch status --json --poll"

    def both(ours: str, peer: str) -> str:
        return (f"wall {wall[ours]:.0f} / {wall[peer]:.0f} ms = {wall[ours] / wall[peer]:.2f}x; "
                f"CPU {cpu[ours]:.0f} / {cpu[peer]:.0f} ms = {cpu[ours] / cpu[peer]:.2f}x")

    at = f"8 GPUs x {f['gpu_procs']} GPU processes"
    ratio = wall[daemon] / wall["nvitop -1"]
    return [
        Row(f"`gpuwatch status --json`, daemon running / `nvitop -1`, {at}",
            both(daemon, "nvitop -1"),
            f"wall <= {ONESHOT_DAEMON_RATIO_GOAL:g}x and < {ONESHOT_DAEMON_GOAL_MS} ms",
            ratio <= ONESHOT_DAEMON_RATIO_GOAL and wall[daemon] < ONESHOT_DAEMON_GOAL_MS),
        Row(f"`gpuwatch status --json --poll` / `nvitop -1`, {at}", both(poll, "nvitop -1"),
            "wall < 1x", wall[poll] < wall["nvitop -1"]),
        Row(f"`gpuwatch status --json` / `gpustat --json` (gpustat's wall is mostly its sleeps), "
            f"{at}", f"daemon running: {both(daemon, 'gpustat --json')}; --poll: "
            f"{both(poll, 'gpustat --json')}", "--poll CPU < 1x",
            cpu[poll] < cpu["gpustat --json"]),
    ]


def rss_rows(f: Figures) -> list[Row]:
    (first_at, first), (last_at, last) = f["readings"][0], f["readings"][-1]
    return [Row(f"daemon RSS after {first_at:,.0f} -> {last_at:,.0f} polls",
                f"{first:.1f} -> {last:.1f} MiB ({100 * f['growth']:+.1f}%)", "within 5%",
                abs(f["growth"]) <= 0.05)]


#: Daemon RSS after warm-up against nvitop-exporter's (bench/rss_plateau.py).
RSS_PLATEAU_GOAL = 0.8


def rss_plateau_rows(f: Figures) -> list[Row]:
    rows = []
    for n, r in f["by_gpu_procs"].items():
        gw, nv = r["gpuwatch"], r["nvitop-exporter"]
        ratio = gw["end_mib"] / nv["end_mib"]
        before = r.get("against")
        versus = (f" (against: {before['end_mib']:.1f} MiB = "
                  f"{before['end_mib'] / nv['end_mib']:.2f}x)" if before else "")
        rows.append(Row(
            f"daemon RSS / nvitop-exporter RSS after {gw['seconds']:.0f} s (the history's span), "
            f"{f['gpus']} GPUs x {n} GPU processes; the daemon's at warm-up -> end",
            f"{gw['end_mib']:.1f} / {nv['end_mib']:.1f} MiB = {ratio:.2f}x; "
            f"{gw['warm_mib']:.1f} -> {gw['end_mib']:.1f} MiB" + versus,
            f"<= {RSS_PLATEAU_GOAL:g}x", ratio <= RSS_PLATEAU_GOAL))
    return rows


def agent_step_rows(f: Figures) -> list[Row]:
    ns = f["ns"]
    bare = ns["bare sendto"]
    amortised = next(v for k, v in ns.items() if k.endswith("amortised"))
    sends = ns["step() that sends"]
    sized = ns["step() that sends and sizes"]
    return [
        Row("`agent.step()` / bare `sendto`, amortised (10 kHz loop, default coalescing)",
            f"{amortised / 1e3:.2f} / {bare / 1e3:.2f} us = {amortised / bare:.2f}x", "<= 3x",
            amortised <= 3 * bare),
        Row("`agent.step()` that sends a report / bare `sendto`",
            f"{sends / 1e3:.1f} / {bare / 1e3:.1f} us = {sends / bare:.2f}x", "<= 3x",
            sends <= 3 * bare),
        Row("`agent.step()` that sends and sizes 3 buffers / bare `sendto` (one report in 0.1 s)",
            f"{sized / 1e3:.1f} / {bare / 1e3:.1f} us = {sized / bare:.2f}x", "", None),
        *discovery_rows(f.get("discovery")), *tracing_rows(f.get("tracing")),
    ]


def discovery_rows(d: Optional[Figures]) -> list[Row]:
    if not d:
        return []
    return [
        Row(f"discovery slice, {d['generated']:,.0f} modules + {d['objects']:,.0f} objects "
            "(median / max)", f"{d['slice_ms_median']:.2f} / {d['slice_ms_max']:.2f} ms",
            "budget 2 ms", d["slice_ms_median"] <= 2.5),
        Row("discovery, a full pass over them: work / slices",
            f"{d['pass_ms']:.0f} ms / {d['slices_per_pass']:.0f}", "", None),
        Row("discovery's share of the training thread at the default cadence",
            f"{100 * d['duty']:.2f}%", "<= 1%", d["duty"] <= 0.0105),
    ]


def tracing_rows(t: Optional[Figures]) -> list[Row]:
    if not t:
        return []
    return [Row("allocation-heavy Python step, traced / untraced",
                f"{t['step_on_ms']:.1f} / {t['step_off_ms']:.2f} ms = {t['ratio']:.1f}x", "",
                None),
            Row("ending a trace (snapshot + comparison)", f"{t['end_ms']:.0f} ms, once", "",
                None)]


#: The PyTorch program of culprit_torch with no line of gpuwatch (`--auto`), as its rows say.
AUTO_PROGRAM = "PyTorch program without a line (auto agent)"


def culprit_rows(f: Figures) -> list[Row]:
    program = AUTO_PROGRAM if f.get("auto") else "PyTorch program"
    if f.get("skipped"):
        return [Row(f"culprit named in a {program}", f"not measured: {f['skipped']}")]
    rows = []
    for c in f["cases"]:
        if c["holder"] == "none":
            share = c["agent_share"]
            rows += [
                Row(f"healthy {program}, {c['steps']:,} steps of 0.3 s "
                    f"({c['wall_s'] / 60:.0f} min): polls that showed a leak",
                    f"{c['leak_polls']}", "0", c["leak_polls"] == 0),
                Row(f"agent's share of the training thread, {program}, no leak (0.3 s steps)"
                    if f.get("auto") else
                    "agent's share of a PyTorch program's training thread, no leak (0.3 s steps)",
                    f"{100 * share:.2f}%" if share is not None else "no steps",
                    "<= 1%", share is not None and share <= 0.01)]
            continue
        what = (f"{program}, {c['step_seconds']:g} s steps, {c['leak_mib']:.0f} MiB a step"
                + (", held by a closure" if c["holder"] == "closure" else ""))
        steps = c["steps_to_name"]
        value = (f"{steps} (raised at step {c['raised_step']}, `{c['named']}` ({c['found_by']}) "
                 f"at {c['named_step']})" if steps is not None else
                 f"not named (raised at step {c['raised_step']}, stopped at {c['steps']})")
        if c["holder"] == "dict":
            # The bounded cache beside it never named: the only culprit ever shown is the dict.
            right = c["culprits"] == ["__main__._fetch_buffer"]
            rows.append(Row(f"{what}: steps from the leak raised to its culprit named",
                            value + ("" if right else f"; also named: {c['culprits']}"),
                            "<= 15 steps, only it",
                            steps is not None and steps <= 15 and right))
        else:
            rows.append(Row(f"{what}: steps from the leak raised to its culprit named", value))
        if "escalated_share" in c:
            share = c["escalated_share"]
            rows.append(Row(
                f"{what}: agent's share of the training thread while escalated (faster search "
                f"and trace, {c['escalated_s']:.0f} s)",
                f"{100 * share:.1f}% (step() {100 * c['escalated_agent_share']:.1f}%, slower "
                f"compute {100 * c['escalated_compute_share']:.1f}%)", "<= 10%", share <= 0.10))
    return rows


def seeded_rows(f: Figures) -> list[Row]:
    what = "seeded healthy PyTorch programs without a line (auto agent)"
    if f.get("skipped"):
        return [Row(f"false leaks, {what}", f"not measured: {f['skipped']}")]
    rows = [Row(f"false leaks, {f['programs']} {what}, {f['steps']} steps of "
                f"{f['step_seconds']:g} s", f"{f['false_leaks']} ({f['judged']} judged past "
                f"{f['steps'] - 8} steps, {len(f['failed'])} failed)", "0",
                f["false_leaks"] == 0)]
    if f.get("controls"):
        rows.append(Row("the same programs leaking 1 to 16 MiB a step (controls): named",
                        f"{f['controls_named']} of {f['controls']} (raised: "
                        f"{f['controls_raised']})", "all",
                        f["controls_named"] == f["controls"]))
    return rows


def ingest_rows(f: Figures) -> list[Row]:
    rows = [Row("daemon ingest, realistic agent reports per CPU second",
                f"{f['handle_per_cpu_s']:,.0f}/s", f">= {f['goal']:,}/s",
                f["handle_per_cpu_s"] >= f["goal"])]
    if "blocking" in f:
        rows.append(Row("daemon ingest end to end over the socket (floor)",
                        f"{f['blocking']['per_s']:,.0f}/s"))
    return rows


def run_overhead_rows(f: Figures) -> list[Row]:
    over = f["startup"]["overhead_ms"]
    wall = f["startup"]["wall_ms"]
    main = over["run, fake NVML, cgroup"]
    cli = wall["python -c 'import gpuwatch.cli'"]["median"] - wall["python -c pass"]["median"]
    rows = [
        Row("`gpuwatch run -- true` - `true`, wall: start-up overhead (8 fake GPUs, own cgroup)",
            f"{main['median']:.0f} ms (p90 {main['p90']:.0f} ms)", "< 300 ms",
            main["median"] < 300),
        Row("same, NVML absent / --no-cgroup / both",
            " / ".join(f"{over[k]['median']:.0f}" for k in (
                "run, no NVML, cgroup", "run, fake NVML, --no-cgroup",
                "run, no NVML, --no-cgroup")) + " ms"),
        Row("`gpuwatch run -- true` - `python -c pass` (the interpreter's floor); "
            "`import gpuwatch.cli`, which `run` skips", f"{main['over_python']:.0f} ms; "
                                                        f"{cli:.0f} ms"),
    ]
    sample = f"{f['gpu_sample_s']:g} s"
    for name, v in f["steady"].items():
        with_nvml = name.startswith("fake NVML")
        rows.append(Row(
            f"`gpuwatch run` supervisor CPU while its job runs (sh + {f['job_sleeps']} sleeps, "
            f"{name}, a wake-up every {sample})",
            f"{v['cpu_s_per_min'] * 1e3:.0f} ms/min = {v['core_pct']:.2f}% of a core "
            f"({v['ms_per_wakeup']:.1f} ms a wake-up); RSS {v['rss_mib']:.1f} MiB",
            "< 0.5% of a core" if with_nvml else "", v["core_pct"] < 0.5 if with_nvml else None))
    return rows


def agent_bootstrap_rows(f: Figures) -> list[Row]:
    w = f["wall_ms"]
    off = w["bootstrap on PYTHONPATH, GPUWATCH_AGENT unset"]
    on = w["bootstrap on PYTHONPATH, GPUWATCH_AGENT=auto"]
    return [Row("`python -c pass` with the agent bootstrap on PYTHONPATH - without, wall: "
                "GPUWATCH_AGENT unset / auto",
                f"{off['over_median']:+.1f} / {on['over_median']:+.1f} ms "
                f"(of {w['python -c pass']['median']:.1f} ms)", "< 5 ms",
                max(off["over_median"], on["over_median"]) < 5)]


def top_rows(f: Figures) -> list[Row]:
    d, w, o = f["daemon"]["80x24"], f["daemon"]["300x60"], f["own_polls"]
    return [
        Row(f"`gpuwatch top` CPU, {f['processes']} GPU processes, a refresh every "
            f"{f['interval_s']:g} s, from the daemon, 80x24 (300x60)",
            f"{d['cpu_ms_per_refresh']:.1f} ms a refresh = {d['core_pct']:.2f}% of a core "
            f"({w['core_pct']:.2f}%)", "< 2% of a core", d["core_pct"] < 2),
        Row("`gpuwatch top` CPU, its own polls (no daemon)",
            f"{o['cpu_ms_per_refresh']:.1f} ms a refresh = {o['core_pct']:.2f}% of a core"),
        Row("`gpuwatch top`, a key that moves the selection", f"{f['key_ms']:.2f} ms"),
    ]


#: docs/agent-protocol.md: what the daemon may hold however the agent socket is flooded.
AGENT_FLOOD_BOUND_MIB = 256


def agent_flood_rows(f: Figures) -> list[Row]:
    flood = (f"{f['processes']} processes of one user x {f['reports']} reports of "
             f"{f['buffers']} buffers")
    found = f.get("victim_found_after_s")
    return [
        Row(f"agent flood, {flood}: daemon RSS before -> peak -> after they exit",
            f"{f['rss_before_mib']:.0f} -> {f['rss_peak_mib']:.0f} -> "
            f"{f['rss_after_mib']:.0f} MiB", f"peak < {AGENT_FLOOD_BOUND_MIB} MiB",
            f["rss_peak_mib"] < AGENT_FLOOD_BOUND_MIB),
        Row(f"agent flood, {flood}: /metrics", f"{f['series']:,} series, "
            f"{f['metrics_kib']:.0f} KiB, scrape {_ms(f['scrape_ms'])}"),
        Row("agent flood: a second user's leak (4 MiB a step) found",
            f"{found:.1f} s after it started" if found is not None else "not found",
            "found", found is not None),
    ]


def agent_junk_rows(f: Figures) -> list[Row]:
    """docs/agent-protocol.md: one user's junk flood delays another user's leak by at most 2x."""
    unloaded, flooded = f["unloaded_found_s"], f["flooded_found_s"]
    who = f"{f['processes']:,} processes of one user flooding agent.sock with junk"
    if unloaded is None or flooded is None:
        return [Row(f"{who}: a second user's leak found flooded / unloaded", "not found",
                    "<= 2x", False)]
    return [
        Row(f"{who}: a second user's leak found flooded / unloaded",
            f"{flooded:.1f} / {unloaded:.1f} s = {flooded / unloaded:.2f}x", "<= 2x",
            flooded <= 2 * unloaded),
        Row(f"{who}: the second user's reports dropped, flooded",
            f"{f['flooded_dropped']} (unloaded {f['unloaded_dropped']})"),
    ]


def argv_flood_rows(f: Figures) -> list[Row]:
    """docs/security.md, "Bytes, not entries": one user's long command lines leave the daemon
    under 128 MiB, back within 8 MiB of where it was once they are gone, its document < 8 MiB."""
    who = (f"{f['processes']:,} processes of one user with 2 MiB command lines, "
           f"{f['processes'] // f['batch']} batches")
    before, peak, after = f["rss_before_mib"], f["rss_peak_mib"], f["rss_after_mib"]
    return [
        Row(f"{who}: daemon RSS unloaded -> peak -> after they exit",
            f"{before:.0f} -> {peak:.0f} -> {after:.0f} MiB",
            "peak < 128 MiB, after <= unloaded + 8 MiB", peak < 128 and after <= before + 8),
        Row(f"{who}: status document unloaded -> largest",
            f"{f['document_unloaded_kib']:.0f} KiB -> {f['document_largest_mib']:.2f} MiB",
            "< 8 MiB", f["document_largest_mib"] < 8),
        Row(f"{who}: poll unloaded / with a batch alive",
            f"{_ms(f['poll_unloaded_ms'])} / {_ms(f['poll_loaded_ms'])}"),
        Row(f"{who}: command lines shown cut at 4 KiB",
            f"{f['cut_shown']:,} of {f['processes']:,}", "all", f["cut_shown"] == f["processes"]),
    ]


def web_auth_rows(f: Figures) -> list[Row]:
    """docs/web.md: good scrapes answered, all in under 1 s, under a wrong-password flood."""
    flood = f"{f['connections']} wrong-password connections"
    labels = {"unloaded": "unloaded", "flood": f"under {flood}",
              "reload": f"right after a reload, under {flood}"}
    rows = []
    for key, label in labels.items():
        r = f["rows"][key]
        worst = f"{r['max_ms']:.0f} ms" if r["max_ms"] is not None else "-"
        rows.append(Row(f"/metrics over HTTPS + basic auth, good scrapes {label}",
                        f"{r['answered']}/{r['of']} answered, {r['under_1s']} in < 1 s, "
                        f"worst {worst}", "all in < 1 s", r["under_1s"] == r["of"]))
    return rows


def daemon_poll_rows(f: Figures) -> list[Row]:
    at = f"{f['gpus']} GPUs x {f['gpu_procs']} GPU processes"
    idle, process = f["poll_once_idle_ms"], f["process_ms"]
    return [
        Row(f"daemon process CPU per poll / its poll after an idle interval, {at}",
            f"{_ms(process)} / {_ms(idle)} = {process / idle:.2f}x", "<= 1.1x",
            process <= 1.1 * idle),
        Row(f"its poll after an idle interval / back to back (as poll_cost.py), {at}",
            f"{_ms(idle)} / {_ms(f['bare_ms'])} = {idle / f['bare_ms']:.2f}x"),
    ]


def chaos_rows(f: Figures) -> list[Row]:
    return [Row(f"chaos: {r['figure']}", r.get("short") or r["value"], r["goal"], r["met"])
            for r in f["rows"]]


ROWS: dict[str, Callable[[Figures], list[Row]]] = {
    "poll_cost": poll_rows, "exporter_vs_nvitop": exporter_rows,
    "exporter_vs_nvitop_scraped": exporter_rows, "render_cost": render_rows,
    "equal_work": equal_work_rows,
    "oneshot": oneshot_rows, "oneshot_1024": oneshot_rows,
    "daemon_rss": rss_rows, "rss_plateau": rss_plateau_rows,
    "agent_step": agent_step_rows,
    "culprit_torch": culprit_rows, "culprit_torch_auto": culprit_rows,
    "seeded_auto": seeded_rows,
    "agent_ingest": ingest_rows,
    "run_overhead": run_overhead_rows, "agent_bootstrap": agent_bootstrap_rows,
    "top_cpu": top_rows, "agent_flood": agent_flood_rows,
    "agent_junk_flood": agent_junk_rows, "argv_flood": argv_flood_rows,
    "web_auth_flood": web_auth_rows,
    "chaos": chaos_rows, "daemon_poll": daemon_poll_rows,
}


# -- the machine ---------------------------------------------------------------------------------

def machine() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    hypervisor = False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu in (platform.processor(),
                                                             platform.machine()):
                    cpu = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    hypervisor = " hypervisor" in line
    except OSError:
        pass
    memory = "?"
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        memory = f"{kib / 2**20:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    distro = ""
    try:
        with open("/etc/os-release") as f:
            distro = next((line.split("=", 1)[1].strip().strip('"') for line in f
                           if line.startswith("PRETTY_NAME=")), "")
    except OSError:
        pass
    versions = []
    for package in PACKAGES:
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package} (not installed)")
    return {
        "CPU": cpu + (" (virtual machine)" if hypervisor else ""),
        "cores": str(os.cpu_count()),
        "memory": memory,
        "OS": f"{platform.system()} {platform.release()}" + (f", {distro}" if distro else ""),
        "Python": f"{platform.python_implementation()} {platform.python_version()}",
        "packages": ", ".join(versions),
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


# -- output --------------------------------------------------------------------------------------

def text_table(rows: list[Row]) -> str:
    return columns([("figure", "value", "goal", ""),
                    *((r.figure, r.value, r.goal, r.verdict) for r in rows)], rule=True)


def markdown_table(rows: list[Row]) -> str:
    lines = ["| figure | value | goal | |", "|---|---|---|---|"]
    lines += [f"| {r.figure} | {r.value} | {r.goal} | {r.verdict} |" for r in rows]
    return "\n".join(lines)


def write_markdown(path: Path, command: str, info: dict[str, str], rows: list[Row],
                   outputs: dict[str, str], seconds: float) -> None:
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "# Benchmarks",
        "",
        "Figures from `bench/` on a simulated node: the fake NVML driver of `gpuwatch/simulate` "
        "(loaded by the real nvidia-ml-py) with real processes holding its GPU memory. The peers "
        "(nvitop-exporter, gpustat, nvitop) run unmodified against the same node in the same run, "
        "so ratios are the headline; absolute times belong to this machine. Command-line "
        "comparisons give CPU time (user + system) beside wall time: gpustat sleeps 0.1 s per GPU "
        "to sample CPU percentages, so a wall-time ratio against it is won by a sleep, and CPU "
        "is the figure that compares like with like.",
        "",
        f"Produced by `{command}` on {date}, in {seconds / 60:.0f} minutes.",
        "",
        "## Machine",
        "",
        *(f"- {key}: {value}" for key, value in info.items()),
        "",
        "## Headline figures",
        "",
        markdown_table(rows),
        "",
        "## Each benchmark's figures",
    ]
    for name, out in outputs.items():
        script, full, small = SCRIPTS.get(name, (name, [], []))
        source = (HERE / f"{script}.py").read_text()
        doc = (ast.get_docstring(ast.parse(source)) or "").split("\n\n")[0].replace("\n", " ")
        small_sizes = "--quick" in command or "--smoke" in command
        title = " ".join([f"bench/{script}.py", *(small if small_sizes else full)])
        parts += ["", f"### `{title}`", "", doc, "", "```", out.rstrip(), "```"]
    path.write_text("\n".join(parts) + "\n")


#: A full run starts only below this 1-minute load average per core (bench/run.py --max-load).
MAX_LOAD_PER_CORE = 0.5


def settled_load(max_load: float, wait: float) -> float:
    """The 1-minute load average, once it is at or below `max_load`, or after `wait` seconds."""
    deadline = time.monotonic() + wait
    load = os.getloadavg()[0]
    if load > max_load and wait > 0:
        print(f"waiting up to {wait:g} s for the load average ({load:.2f}) to drop to "
              f"{max_load:g}", flush=True)
    while load > max_load and time.monotonic() < deadline:
        time.sleep(5)
        load = os.getloadavg()[0]
    return load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and few repetitions; writes nothing unless --write")
    parser.add_argument("--smoke", action="store_true",
                        help="each bench at its smallest sizes (seconds each): checks that it "
                             "runs and prints its figures; implies --quick")
    parser.add_argument("--only", nargs="+", choices=BENCHES, default=BENCHES)
    parser.add_argument("--write", action=argparse.BooleanOptionalAction, default=None,
                        help="write the markdown report (default: on a full run of everything)")
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--max-load", type=float, default=MAX_LOAD_PER_CORE * (os.cpu_count() or 1),
                        help="the 1-minute load average above which a full run waits for the "
                             "machine to settle, then refuses to start (default: "
                             f"{MAX_LOAD_PER_CORE:g} per core)")
    parser.add_argument("--settle", type=float, default=180.0, metavar="SECONDS",
                        help="how long a full run waits for the load to drop (default 180)")
    parser.add_argument("--force", action="store_true",
                        help="run above --max-load anyway; the report flags it")
    args = parser.parse_args()
    args.quick = args.quick or args.smoke
    write = args.write if args.write is not None else (not args.quick and args.only == BENCHES)
    command = "python bench/run.py" + "".join(
        f" {shlex.quote(a)}" for a in sys.argv[1:])
    # Figures taken on a busy machine are slower by an unknown factor, and ratios drift too when
    # the neighbour is not evenly spread across the tools: wait for quiet, or say so.
    load = settled_load(args.max_load, 0.0 if args.quick else args.settle)
    if load > args.max_load and not (args.quick or args.force):
        print(f"bench/run.py: the machine is busy (1-minute load average {load:.2f}, above "
              f"--max-load {args.max_load:g}, after waiting {args.settle:g} s); figures taken "
              "now would not compare. Run again when it is quiet, or give --force (the report "
              "then flags the run).", file=sys.stderr)
        sys.exit(2)
    info = machine()
    if load > args.max_load:
        info["load warning"] = (f"started at a 1-minute load average of {load:.2f}, above "
                                f"{args.max_load:g}: figures are flagged as taken on a busy "
                                "machine")
    started = time.monotonic()
    rows: list[Row] = []
    outputs: dict[str, str] = {}
    failed = []
    with tempfile.TemporaryDirectory(prefix="gpuwatch-bench-") as tmp:
        for name in args.only:
            print(f"== {name}", flush=True)
            figures_path = Path(tmp) / f"{name}.json"
            code, out = run_bench(name, args.quick, figures_path, args.smoke)
            outputs[name] = out
            # A bench that missed a goal still wrote its figures: its rows say MISSED.
            if not figures_path.exists():
                failed.append(name)
                rows.append(Row(f"bench/{SCRIPTS.get(name, (name,))[0]}.py",
                                f"failed (exit {code})", "", False))
                continue
            rows += ROWS[name](json.loads(figures_path.read_text()))
            print(flush=True)
    info["load average at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    seconds = time.monotonic() - started

    kind = "smoke" if args.smoke else "quick" if args.quick else ""
    print(f"== summary ({kind + ', not a measurement' if kind else 'full run'}, "
          f"{seconds:.0f} s; {info['cores']} x {info['CPU']})")
    if "load warning" in info:
        print(f"note: {info['load warning']}")
    print(text_table(rows))
    missed = [r.figure for r in rows if r.met is False]
    print(f"goals: {sum(r.met is True for r in rows)} met, {len(missed)} missed")
    if write:
        write_markdown(args.output, command, info, rows, outputs, seconds)
        print(f"wrote {args.output}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
