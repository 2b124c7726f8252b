"""What `gpuwatch run -- COMMAND` adds to a job: the start-up it costs before and after COMMAND,
and the CPU and memory the supervisor uses while the job runs.

Start-up: `gpuwatch run -- true` through the console script, as a user starts it, timed from
fork to exit next to `true` alone and `python -c pass` (the interpreter's floor), with NVML absent
and with the fake driver, in a cgroup of the job's own (the default, where one can be made) and
with --no-cgroup. Two more commands split the time: `import gpuwatch.cli` (what every other
command imports, and `gpuwatch run` skips: gpuwatch/entry.py) and the supervisor called
directly. The commands take turns, round after round, so that a noisy neighbour slows all of them
alike; the overhead is the median (and p90) of each round's difference to `true`.

Steady state: the supervisor's own CPU (utime + stime of its /proc/PID/stat, not its children's)
over a window while it supervises a job of a shell and 8 `sleep`s, which hold memory on the 8
fake GPUs: every GPU_SAMPLE seconds it wakes, reads NVML and looks at the job's processes. The
same job without NVML runs beside it, in the same window; the full run also measures it with
1,000 unrelated processes on the host, which it must not pay for (it looks at NVML's holders and
at its own descendants, never at all of /proc).

    python bench/run_overhead.py [--rounds 25] [--window 60] [--host-procs 1000]
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from cmdline import arguments, write_figures
from node import (
    GIB,
    MIB,
    FakeProcess,
    bench_node,
    console_script,
    cpu_seconds,
    rss_bytes,
    unrelated_host_processes,
)

from gpuwatch.actions.supervisor import GPU_SAMPLE

JOB_SLEEPS = 8


# -- start-up ------------------------------------------------------------------------------------

def base_env(tmp: Path) -> dict[str, str]:
    """No config, no system directories, no systemd socket; NVML as the host has it (absent on
    a machine without a driver)."""
    env = dict(os.environ)
    env.update(GPUWATCH_CONFIG="/dev/null", GPUWATCH_RUNTIME_DIR=str(tmp / "run"),
               GPUWATCH_STATE_DIR=str(tmp / "state"))
    env.pop("NOTIFY_SOCKET", None)
    return env


def commands(plain: dict[str, str], fake: dict[str, str]) -> dict[str, tuple[list[str],
                                                                              dict[str, str]]]:
    gpuwatch = console_script("gpuwatch")
    direct = ("import sys; from gpuwatch.app.run import main; "
              "sys.exit(main(['--', 'true']))")
    return {
        "true": (["true"], plain),
        "python -c pass": ([sys.executable, "-c", "pass"], plain),
        "python -c 'import gpuwatch.cli'": ([sys.executable, "-c", "import gpuwatch.cli"],
                                             plain),
        "supervisor without gpuwatch.cli": ([sys.executable, "-c", direct], plain),
        "run, no NVML, cgroup": ([gpuwatch, "run", "--", "true"], plain),
        "run, no NVML, --no-cgroup": ([gpuwatch, "run", "--no-cgroup", "--", "true"], plain),
        "run, fake NVML, cgroup": ([gpuwatch, "run", "--", "true"], fake),
        "run, fake NVML, --no-cgroup": ([gpuwatch, "run", "--no-cgroup", "--", "true"], fake),
    }


def run_once(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: "
                           f"{done.stderr.decode(errors='replace')[-500:]}")
    return elapsed


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[8] if len(values) > 1 \
        else values[0]


def what_run_did(argv: list[str], env: dict[str, str], tmp: Path) -> dict[str, Any]:
    """One run with --json: was NVML read, was there a cgroup."""
    out = tmp / "run.json"
    subprocess.run([argv[0], "run", "--json", str(out), *argv[2:]], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    doc = json.loads(out.read_text())
    return {"nvml": doc["gpu"]["nvml"], "cgroup": doc["cgroup"],
            "cgroup_reason": doc["cgroup_reason"]}


def import_breakdown(env: dict[str, str], top: int = 7) -> tuple[float, list[tuple[str, float]]]:
    """What `gpuwatch run --no-cgroup -- true` spends importing (-X importtime, which inflates it
    somewhat): the total, and the packages that cost most, by their own modules' time (gpuwatch
    by module)."""
    done = subprocess.run([sys.executable, "-X", "importtime", console_script("gpuwatch"), "run",
                           "--no-cgroup", "--", "true"], env=env, capture_output=True,
                          text=True, check=True)
    by_package: dict[str, float] = {}
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or line.count("|") != 2:
            continue
        own, _, name = line.removeprefix("import time:").split("|")
        with contextlib.suppress(ValueError):
            parts = name.strip().split(".")
            key = ".".join(parts[:2]) if parts[0] == "gpuwatch" else parts[0]
            key = "editable-install finder" if key.startswith("__editable__") else key
            by_package[key] = by_package.get(key, 0.0) + int(own) / 1e3
    ranked = sorted(by_package.items(), key=lambda kv: -kv[1])
    return sum(by_package.values()), ranked[:top]


def startup(rounds: int) -> dict[str, Any]:
    with bench_node(gpus=8, gpu_procs=0) as b:
        plain = base_env(b.tmp)
        fake = b.node.env(plain)
        cmds = commands(plain, fake)
        seen = {"no NVML": what_run_did(cmds["run, no NVML, cgroup"][0], plain, b.tmp),
                "fake NVML": what_run_did(cmds["run, fake NVML, cgroup"][0], fake, b.tmp)}
        for argv, env in cmds.values():
            run_once(argv, env)  # page cache and .pyc files warm for everyone
        times: dict[str, list[float]] = {name: [] for name in cmds}
        for _ in range(rounds):
            for name, (argv, env) in cmds.items():
                times[name].append(run_once(argv, env) * 1e3)
        imports = import_breakdown(plain)
    stats = {name: {"median": statistics.median(t), "p90": p90(t), "min": min(t)}
             for name, t in times.items()}
    overhead = {}
    for name, t in times.items():
        if name.startswith("run,"):
            diffs = [a - b for a, b in zip(t, times["true"])]
            floor = [a - b for a, b in zip(t, times["python -c pass"])]
            overhead[name] = {"median": statistics.median(diffs), "p90": p90(diffs),
                              "over_python": statistics.median(floor)}
    return {"rounds": rounds, "wall_ms": stats, "overhead_ms": overhead, "seen": seen,
            "imports_total_ms": imports[0], "imports_ms": imports[1]}


# -- steady state --------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(p) for p in (task / "children").read_text().split()]
    return out


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def _run_ns(pid: int) -> Optional[int]:
    """CPU time in ns (/proc/PID/schedstat: the main thread's, exact where it is the only one)."""
    if len(os.listdir(f"/proc/{pid}/task")) != 1:
        return None
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


def _hwm_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class Supervised:
    """`gpuwatch run` in front of a shell that starts JOB_SLEEPS sleeps and waits for them."""

    def __init__(self, name: str, env: dict[str, str], tmp: Path, seconds: float) -> None:
        self.name = name
        self.json = tmp / f"{name.replace(' ', '-')}.json"
        sleeps = " ".join(f"sleep {seconds:.0f} &" for _ in range(JOB_SLEEPS))
        self.proc = subprocess.Popen(
            [console_script("gpuwatch"), "run", "--grace", "1", "--job-name",
             name.replace(" ", "-"), "--json", str(self.json), "--", "sh", "-c",
             f"{sleeps} wait"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.pid = self.proc.pid

    def job(self, timeout: float = 30) -> list[int]:
        """The job's sleeps, once all have started."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gpuwatch run exited {self.proc.returncode}")
            sleeps = []
            for pid in _descendants(self.pid):
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{pid}/comm").read_text().strip() == "sleep":
                        sleeps.append(pid)
            if len(sleeps) == JOB_SLEEPS:
                return sleeps
            time.sleep(0.05)
        raise RuntimeError("the job's sleeps did not all start")

    def stop(self) -> dict[str, Any]:
        """SIGTERM (forwarded to the job), then the summary it wrote."""
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=60)
        if self.proc.returncode not in (128 + signal.SIGTERM,):
            raise RuntimeError(f"gpuwatch run exited {self.proc.returncode}: "
                               f"{err.decode(errors='replace')[-500:]}")
        doc = json.loads(self.json.read_text())
        return {"nvml": doc["gpu"]["nvml"], "processes": len(doc["processes"]),
                "gpu_holders": sum(1 for p in doc["processes"] if p["gpus"])}


def steady(window: float, variants: list[tuple[str, bool]], host_procs: int) -> dict[str, Any]:
    """Each variant (name, fake NVML?) supervises its job through the same window."""
    with bench_node(gpus=JOB_SLEEPS, gpu_procs=0) as b, \
            (unrelated_host_processes(host_procs) if host_procs else contextlib.nullcontext()):
        plain = base_env(b.tmp)
        runs = [Supervised(name, b.node.env(plain) if fake else plain, b.tmp, window + 120)
                for name, fake in variants]
        for r, (_, fake) in zip(runs, variants):
            for i, pid in enumerate(r.job()):
                if fake:
                    b.node.processes.append(FakeProcess(device=i, pid=pid, used=GIB + i * MIB))
        b.node.write()
        # Past start-up and the first sample: the window holds only the periodic wake-ups.
        time.sleep(1.0)
        before = {r.name: (cpu_seconds(r.pid), _run_ns(r.pid)) for r in runs}
        started = time.monotonic()
        time.sleep(window)
        elapsed = time.monotonic() - started
        after = {r.name: (cpu_seconds(r.pid), _run_ns(r.pid)) for r in runs}
        memory = {r.name: (rss_bytes(r.pid), _hwm_bytes(r.pid)) for r in runs}
        b.node.processes.clear()  # the job's GPU memory released before it ends
        b.node.write()
        ended = {r.name: r.stop() for r in runs}
    out = {}
    for r in runs:
        (cpu0, ns0), (cpu1, ns1) = before[r.name], after[r.name]
        cpu = cpu1 - cpu0
        exact = (ns1 - ns0) / 1e9 if ns0 is not None and ns1 is not None else None
        wakeups = elapsed / GPU_SAMPLE
        out[r.name] = {"window_s": elapsed, "cpu_s": cpu, "cpu_s_per_min": cpu / elapsed * 60,
                       "core_pct": 100 * cpu / elapsed, "schedstat_cpu_s": exact,
                       "ms_per_wakeup": 1e3 * (cpu if exact is None else exact) / wakeups,
                       "rss_mib": memory[r.name][0] / MIB, "hwm_mib": memory[r.name][1] / MIB,
                       "host_procs": host_procs, **ended[r.name]}
    return out


# -- the report ----------------------------------------------------------------------------------

def main() -> None:
    args = arguments(
        __doc__, quick={"rounds": 2, "window": 6.0, "host_procs": 0},
        smoke={"rounds": 1, "window": 1.0}, rounds=25,
        window=(60.0, "seconds of steady state measured"),
        host_procs=(1000, "unrelated host processes for the last steady-state run (0: skip)"),
        host_window=30.0)

    s = startup(args.rounds)
    wall, over = s["wall_ms"], s["overhead_ms"]
    print(f"start-up: wall from fork to exit, {args.rounds} interleaved rounds, a fresh process "
          "each run (8 fake GPUs where NVML is faked)")
    for kind, seen in s["seen"].items():
        print(f"  {kind}: NVML {'read' if seen['nvml'] else 'not available'}; cgroup by default: "
              f"{seen['cgroup'] or 'none (' + str(seen['cgroup_reason']) + ')'}")
    print(f"{'':<34}{'median ms':>10}{'p90':>8}{'min':>8}{'- true':>9}{'p90':>8}"
          f"{'- python':>10}")
    for name, t in wall.items():
        o = over.get(name)
        extra = (f"{o['median']:>9.0f}{o['p90']:>8.0f}{o['over_python']:>10.0f}" if o else "")
        print(f"{name:<34}{t['median']:>10.1f}{t['p90']:>8.1f}{t['min']:>8.1f}{extra}")
    cli = wall["python -c 'import gpuwatch.cli'"]["median"] - wall["python -c pass"]["median"]
    direct = wall["supervisor without gpuwatch.cli"]["median"]
    via_cli = wall["run, no NVML, cgroup"]["median"]
    print(f"importing gpuwatch.cli (click) costs {cli:.0f} ms over the bare interpreter, which "
          f"`gpuwatch run` skips; the supervisor called directly takes {direct:.0f} ms, through "
          f"the console script {via_cli - direct:+.0f} ms")
    print(f"imports of `gpuwatch run -- true`: {s['imports_total_ms']:.0f} ms under -X importtime; "
          "most, by package (own modules' ms): " +
          ", ".join(f"{name} {ms:.0f}" for name, ms in s["imports_ms"]))
    print()

    variants = [("fake NVML", True), ("no NVML", False)]
    st = steady(args.window, variants, 0)
    if args.host_procs:
        st.update({f"fake NVML, +{args.host_procs:,} host processes": v for v in
                   steady(args.host_window, [("fake NVML", True)], args.host_procs).values()})
    print(f"steady state: the supervisor's own CPU (utime+stime of its /proc/PID/stat) while it "
          f"supervises `sh` + {JOB_SLEEPS} sleeps, a wake-up every {GPU_SAMPLE:g} s")
    print(f"{'':<36}{'window s':>9}{'CPU ms':>8}{'exact':>7}{'CPU s/min':>10}{'% core':>8}"
          f"{'ms/wake':>9}"
          f"{'RSS MiB':>9}{'peak':>7}  job seen")
    for name, v in st.items():
        exact = "-" if v["schedstat_cpu_s"] is None else f"{v['schedstat_cpu_s'] * 1e3:.1f}"
        print(f"{name:<36}{v['window_s']:>9.1f}{v['cpu_s'] * 1e3:>8.0f}{exact:>7}"
              f"{v['cpu_s_per_min']:>10.3f}"
              f"{v['core_pct']:>8.3f}{v['ms_per_wakeup']:>9.1f}{v['rss_mib']:>9.1f}"
              f"{v['hwm_mib']:>7.1f}  {v['processes']} processes, {v['gpu_holders']} on GPUs"
              f"{'' if v['nvml'] else ', NVML not read'}")
    print(f"(CPU ms: utime+stime, counted in ticks of {1e3 / os.sysconf('SC_CLK_TCK'):.0f} ms; "
          "exact: /proc/PID/schedstat, ns, the one thread; ms/wake: exact / wake-ups in the "
          "window)")
    write_figures(args.figures, {"rounds": args.rounds, "startup": s, "steady": st,
                                 "gpu_sample_s": GPU_SAMPLE, "job_sleeps": JOB_SLEEPS})


if __name__ == "__main__":
    main()
