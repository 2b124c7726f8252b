"""Soak: the real daemon on a simulated node under everything at once, for a sustained run.

    python bench/soak.py [--duration 600] [--storm-rate 200] [--datagram-rate 1000] ...

While it runs, together:
- a process storm: hundreds of short-lived real processes a second, a share of them registered
  with the fake driver as GPU holders while they live;
- NVML faults injected at random through the fake driver, with the errors real drivers return:
  a GPU lost (GPU_IS_LOST on every call aimed at it), TIMEOUT and UNKNOWN on one call of one GPU,
  and the driver gone and back (DRIVER_NOT_LOADED on every call, init included, for a while);
- agents at full rate: instrumented trainers (gpuwatch.agent) stepping faster than the agent's
  coalescing lets them report, plus a raw sender with a known share of malformed datagrams;
- a scraper GETting /metrics every second (and a real Prometheus, with --prometheus);
- SIGHUP reloads alternating a valid change and a bad file;
- planted problems, round after round: a job whose launcher is SIGKILLed (its GPU-holding workers
  are orphans) and a trainer whose fetch buffer leaks; and a healthy job with a steady trainer
  that must never get a finding.

At the end it checks every pass criterion (docs/soak.md), prints the figures and exits 1 naming
each criterion that failed. `run_soak()` and `check()` are what tests/test_soak.py calls for the
short variant.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from gpuwatch.simulate.demo import DemoError, read_json, wait_for
from gpuwatch.simulate.fakenvml import (
    DRIVER_NOT_LOADED,
    GPU_IS_LOST,
    STATE_ENV,
    TIMEOUT,
    UNKNOWN,
    FakeFailure,
    FakeNode,
    build_fake_nvml,
)

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))  # harness.py and cmdline.py, imported as modules

from cmdline import columns  # noqa: E402
from harness import (  # noqa: E402
    GIB,
    MIB,
    Pacer,
    Processes,
    RunOptions,
    Sampler,
    Samples,
    SharedNode,
    StormFeed,
    console,
    cpu_seconds,
    daemon_config,
    parse_metrics,
    python,
    run_arguments,
    signal_all,
    storm,
    total,
    unwind_on_signals,
    work_dir,
)

#: The fault kinds, with the NVML error each injects.
FAULT_KINDS = {"gpu_lost": GPU_IS_LOST, "timeout": TIMEOUT, "unknown": UNKNOWN,
               "driver_gone": DRIVER_NOT_LOADED}
#: Calls of one GPU that a TIMEOUT or UNKNOWN fault hits, one at a time (prefixes match the
#: versioned symbols pynvml actually calls, such as nvmlDeviceGetComputeRunningProcesses_v3).
DEVICE_CALLS = ("nvmlDeviceGetMemoryInfo*", "nvmlDeviceGetUtilizationRates",
                "nvmlDeviceGetComputeRunningProcesses*", "nvmlDeviceGetGraphicsRunningProcesses*")
#: Malformed datagrams the raw sender mixes in, each with the reason the daemon must count.
MALFORMED_REASONS = ("malformed", "version", "oversized", "bad_name", "bad_value", "bad_type",
                     "too_many_buffers")


@dataclass
class SoakOptions(RunOptions):
    agents: int = 3
    datagram_rate: float = 1000.0
    malformed_share: float = 0.2
    #: How long a fault lasts (min, max).
    fault_length: tuple[float, float] = (1.0, 4.0)
    reload_every: float = 10.0
    plant_every: float = 120.0
    #: Seconds a planted problem may take to be found (faults can hide it for a while).
    find_within: float = 90.0
    #: RSS is compared between the window that starts at `warmup` and the last window.
    warmup: Optional[float] = None
    rss_window: Optional[float] = None
    rss_tolerance: float = 0.05
    nvml_retry_max: float = 2.0
    prometheus: bool = False

    def warmup_seconds(self) -> float:
        return self.warmup if self.warmup is not None else max(10.0, 0.25 * self.duration)

    def rss_window_seconds(self) -> float:
        return self.rss_window if self.rss_window is not None else max(8.0, 0.1 * self.duration)


# ---- reading /metrics ----------------------------------------------------------------------------


def nvml_errors(samples: Samples) -> float:
    return total(samples, "gpuwatch_poll_errors_total", source="nvml")


class MetricsClient:
    """Every GET of /metrics in the soak goes through here, so every failure is counted."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ok = 0
        self.failed = 0
        self.failures: list[str] = []
        self.latencies: list[float] = []
        self._lock = threading.Lock()

    def get(self) -> Optional[Samples]:
        started = time.monotonic()
        try:
            with urllib.request.urlopen(self.url, timeout=10) as r:
                text = r.read().decode()
            samples = parse_metrics(text)
        except Exception as exc:  # any failure at all is what this counts
            with self._lock:
                self.failed += 1
                if len(self.failures) < 20:
                    self.failures.append(f"{time.strftime('%H:%M:%S')} {exc!r}")
            return None
        with self._lock:
            self.ok += 1
            self.latencies.append(time.monotonic() - started)
        return samples


# ---- what runs alongside the daemon --------------------------------------------------------------


@dataclass
class FaultWindow:
    kind: str
    symbol: str
    error: int
    device: Optional[int]
    seconds: float = 0.0
    #: Polls completed while the fault was in place (the first may have begun before it).
    polls_under: int = 0
    polls: int = 0
    #: NVML errors counted from just before the fault to two polls after it was cleared.
    errors_counted: int = 0
    #: The daemon showed it while it lasted: gpu_read_ok 0 for the GPU, or nvml_up 0.
    seen: bool = False
    #: Seconds from clearing the fault until the daemon read every GPU again.
    recovery: Optional[float] = None


@dataclass
class Round:
    started: float
    orphans: list[int]
    leaker: int
    seen_holding: Optional[float] = None
    launcher_killed: Optional[float] = None
    orphans_found: dict[int, float] = field(default_factory=dict)
    leak_found: Optional[float] = None


class Scraper(threading.Thread):
    """Scrapes every second, as Prometheus would, and remembers what the checks need."""

    def __init__(self, client: MetricsClient, every: float, stop: threading.Event) -> None:
        super().__init__(name="scraper", daemon=True)
        self.client = client
        self.every = every
        self.stop = stop
        self.latest: Samples = {}
        self.scheduled = 0
        #: (kind, pid) -> (monotonic time first seen, the process's name as served).
        self.findings: dict[tuple[str, str], tuple[float, str]] = {}
        #: (kind, pid) -> in how many scrapes it was open.
        self.findings_scrapes: Counter[tuple[str, str]] = Counter()
        self.holders_seen: set[str] = set()

    def run(self) -> None:
        next_at = time.monotonic()
        while not self.stop.is_set():
            self.scrape_once()
            next_at += self.every
            self.stop.wait(max(0.0, next_at - time.monotonic()))

    def scrape_once(self) -> Optional[Samples]:
        self.scheduled += 1
        samples = self.client.get()
        if samples is None:
            return None
        now = time.monotonic()
        for (name, labels), v in samples.items():
            if name == "gpuwatch_finding" and v:
                d = dict(labels)
                key = (d.get("kind", ""), d.get("pid", ""))
                self.findings_scrapes[key] += 1
                self.findings.setdefault(key, (now, d.get("name", "")))
            elif name == "gpuwatch_process_gpu_memory_bytes":
                self.holders_seen.add(dict(labels).get("pid", ""))
        self.latest = samples
        return samples

    def has_finding(self, kind: str, pid: int) -> Optional[float]:
        seen = self.findings.get((kind, str(pid)))
        return seen[0] if seen is not None else None


class FaultInjector(threading.Thread):
    def __init__(self, node: SharedNode, client: MetricsClient, opts: SoakOptions,
                 rng: random.Random, stop: threading.Event) -> None:
        super().__init__(name="faults", daemon=True)
        self.node, self.client, self.opts, self.rng, self.stop = node, client, opts, rng, stop
        self.windows: list[FaultWindow] = []
        #: NVML errors counted while no fault was injected (must stay 0).
        self.errors_between = 0
        self.problems: list[str] = []

    def _samples(self) -> Samples:
        return wait_for("a scrape", self.client.get, 30)

    def _after_polls(self, polls: float, more: int, timeout: float = 30) -> Samples:
        """A scrape taken once `more` polls have completed after `polls`."""
        def probe() -> Optional[Samples]:
            s = self.client.get()
            return s if s is not None and total(s, "gpuwatch_polls_total") >= polls + more \
                else None
        return wait_for(f"{more} more polls", probe, timeout)

    def run(self) -> None:
        kinds = list(FAULT_KINDS)
        previous: Optional[Samples] = None
        try:
            while not self.stop.wait(self.rng.uniform(*self.opts.fault_gap)):
                kind = kinds[len(self.windows) % len(kinds)]
                before = self._samples()
                if previous is not None:
                    self.errors_between += int(nvml_errors(before) - nvml_errors(previous))
                previous = self.inject(kind, before)
        except DemoError as exc:
            self.problems.append(f"fault injection: {exc}")
        finally:
            self.node.clear_failures()

    def inject(self, kind: str, before: Samples) -> Samples:
        error = FAULT_KINDS[kind]
        device: Optional[int] = self.rng.randrange(self.opts.gpus)
        if kind == "gpu_lost":
            symbol = "*"
        elif kind == "driver_gone":
            symbol, device = "*", None
        else:
            symbol = self.rng.choice(DEVICE_CALLS)
        window = FaultWindow(kind, symbol, error, device)
        started = time.monotonic()
        self.node.fail(FakeFailure(symbol, error, device))
        # Polls are counted from a scrape taken once the fault is in place: on a busy machine a
        # poll can complete between `before` and the injection. Of the polls after this one,
        # only the one in flight at the injection may have begun before it.
        start = self._samples()
        self.stop.wait(self.rng.uniform(*self.opts.fault_length))
        # However busy the machine, the fault stays until two polls have run wholly under it,
        # so the daemon's view of it can be checked.
        during = self._after_polls(total(start, "gpuwatch_polls_total"), 3, timeout=120)
        if kind == "driver_gone":
            window.seen = total(during, "gpuwatch_nvml_up") == 0
        else:
            window.seen = total(during, "gpuwatch_gpu_read_ok", gpu=str(device)) == 0
        self.node.clear_failures()
        cleared = time.monotonic()
        window.seconds = cleared - started
        polls_at_clear = total(during, "gpuwatch_polls_total")
        window.polls_under = int(polls_at_clear - total(start, "gpuwatch_polls_total"))

        def recovered() -> Optional[Samples]:
            s = self.client.get()
            if s is None or total(s, "gpuwatch_nvml_up") != 1:
                return None
            ok = [v for (n, _), v in s.items() if n == "gpuwatch_gpu_read_ok"]
            return s if len(ok) == self.opts.gpus and all(ok) else None

        # The driver is retried with backoff (daemon.nvml_retry_max), a GPU on the next poll.
        with contextlib.suppress(DemoError):
            wait_for("recovery", recovered, self.opts.nvml_retry_max + 30)
            window.recovery = time.monotonic() - cleared
        after = self._after_polls(max(polls_at_clear, total(self._samples(),
                                                             "gpuwatch_polls_total")), 2)
        window.polls = int(total(after, "gpuwatch_polls_total")
                           - total(before, "gpuwatch_polls_total"))
        window.errors_counted = int(nvml_errors(after) - nvml_errors(before))
        self.windows.append(window)
        self.opts.log(f"fault {kind} {symbol} device={device}: {window.seconds:.1f} s, "
                      f"{window.polls} polls, {window.errors_counted} NVML errors counted, "
                      f"recovered in {window.recovery}")
        return after


class Reloader(threading.Thread):
    """SIGHUP every `reload_every` s, alternating a valid change and a bad file; each reload is
    awaited (two SIGHUPs within one loop turn would be one reload)."""

    BAD_FILES = ("[daemon]\ninterval = 0\n", "[daemon\ninterval = 1\n",
                 "[no_such_section]\nkey = 1\n")

    def __init__(self, daemon_pid: int, config_path: Path, base_config: str,
                 client: MetricsClient, opts: SoakOptions, stop: threading.Event) -> None:
        super().__init__(name="reloader", daemon=True)
        self.daemon_pid, self.config_path, self.base = daemon_pid, config_path, base_config
        self.client, self.opts, self.stop = client, opts, stop
        self.sent = Counter[str]()
        self.problems: list[str] = []

    def run(self) -> None:
        n = 0
        while not self.stop.wait(self.opts.reload_every):
            valid = n % 2 == 0
            text = (self.base.replace("max_process_series = 1000",
                                      f"max_process_series = {1000 - (n // 2) % 2}")
                    if valid else self.BAD_FILES[(n // 2) % len(self.BAD_FILES)])
            result = "applied" if valid else "refused"
            before = self.client.get()
            if before is None:
                continue
            tmp = self.config_path.with_name(self.config_path.name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.config_path)
            want = total(before, "gpuwatch_config_reloads_total", result=result) + 1
            os.kill(self.daemon_pid, signal.SIGHUP)
            self.sent[result] += 1
            n += 1
            try:
                wait_for(f"reload {result}", lambda want=want, result=result: True if (
                    (s := self.client.get()) is not None
                    and total(s, "gpuwatch_config_reloads_total", result=result) >= want)
                    else None, 30)
            except DemoError as exc:
                self.problems.append(str(exc))
        # Leave a valid file, as an operator would.
        self.config_path.write_text(self.base)


# ---- the soak ------------------------------------------------------------------------------------


@dataclass
class SoakResult:
    options: SoakOptions
    elapsed: float = 0.0
    daemon_alive_at_end: bool = False
    daemon_exit_code: Optional[int] = None
    log_problems: list[str] = field(default_factory=list)
    log_counts: dict[str, int] = field(default_factory=dict)
    final: Samples = field(default_factory=dict)
    scrapes_scheduled: int = 0
    scrapes_ok: int = 0
    scrapes_failed: int = 0
    scrape_failures: list[str] = field(default_factory=list)
    scrape_latencies: list[float] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)
    daemon_cpu_seconds: Optional[float] = None
    storm: dict[str, Any] = field(default_factory=dict)
    storm_pids: set[int] = field(default_factory=set)
    datagrams: dict[str, int] = field(default_factory=dict)
    rejected_counted: dict[str, int] = field(default_factory=dict)
    accepted_counted: int = 0
    faults: list[FaultWindow] = field(default_factory=list)
    nvml_errors_between_faults: int = 0
    reloads_sent: dict[str, int] = field(default_factory=dict)
    reloads_counted: dict[str, int] = field(default_factory=dict)
    rounds: list[Round] = field(default_factory=list)
    healthy_pids: set[int] = field(default_factory=set)
    healthy_seen_holding: bool = False
    findings: dict[tuple[str, str], tuple[float, str]] = field(default_factory=dict)
    findings_scrapes: dict[tuple[str, str], int] = field(default_factory=dict)
    prometheus: Optional[dict[str, float]] = None
    problems: list[str] = field(default_factory=list)

    def rss_windows(self) -> tuple[Optional[float], Optional[float]]:
        """Median RSS of the window after warm-up and of the last window."""
        warmup = self.options.warmup_seconds()
        window = self.options.rss_window_seconds()
        early = [r for t, r in self.rss if warmup <= t < warmup + window]
        late = [r for t, r in self.rss if t >= self.elapsed - window]
        return (statistics.median(early) if early else None,
                statistics.median(late) if late else None)

    def rss_change(self) -> Optional[float]:
        early, late = self.rss_windows()
        return None if early is None or late is None else (late - early) / early


def _start_job(procs: Processes, work: Path, name: str, env: dict[str, str]
               ) -> tuple[subprocess.Popen[bytes], list[int]]:
    ready = work / f"{name}.json"
    launcher = procs.start(python("-m", "gpuwatch.simulate.job", "--workers", "2",
                                  "--ready", str(ready)), env=env)
    info = wait_for(f"job {name}", lambda: read_json(ready), 60, alive=launcher)
    workers = [int(p) for p in info["workers"]]
    procs.adopt(*workers)
    return launcher, workers


def _trainer(procs: Processes, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    return procs.start(python("-m", "gpuwatch.simulate.trainer", *args), env=env,
                       stdout=subprocess.DEVNULL)


def _base_config(opts: SoakOptions, work: Path) -> str:
    # A bad value in the file is refused rather than masked by a flag.
    return (daemon_config("127.0.0.1:0", opts.interval, work / "run", work / "state",
                          opts.nvml_retry_max)
            + "[exporter]\nmax_process_series = 1000\n")


def _start_prometheus(procs: Processes, work: Path, target: str) -> Optional[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = work / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                      "scrape_configs:\n  - job_name: gpuwatch\n"
                      f"    static_configs:\n      - targets: ['{target}']\n")
    procs.start([binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                stderr=open(work / "prometheus.log", "wb"))  # noqa: SIM115
    return f"http://127.0.0.1:{port}"


def _prometheus_query(base: str, query: str) -> Optional[float]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            result = json.load(r)["data"]["result"]
    except (OSError, ValueError, KeyError):
        return None
    return float(result[0]["value"][1]) if result else None


def run_soak(opts: SoakOptions) -> SoakResult:
    result = SoakResult(opts)
    rng = random.Random(opts.seed)
    work = work_dir(opts.work_dir, "gpuwatch-soak-")
    procs = Processes()
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        _soak(opts, result, rng, work, procs, stop, threads)
    finally:
        stop.set()
        procs.kill_all()
        if opts.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return result


def _soak(opts: SoakOptions, result: SoakResult, rng: random.Random, work: Path,
          procs: Processes, stop: threading.Event, threads: list[threading.Thread]) -> None:
    log = opts.log
    node = FakeNode(work / "nvml-state", build_fake_nvml(), gpus=opts.gpus)
    node.write()
    shared = SharedNode(node)
    # The daemon's settings come from its file alone: GPUWATCH_* variables would beat it.
    env = {k: v for k, v in node.env().items()
           if not k.startswith("GPUWATCH_") or k == STATE_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    agent_env = {**env, "GPUWATCH_RUNTIME_DIR": str(work / "run")}
    config_path = work / "gpuwatch.toml"
    base_config = _base_config(opts, work)
    config_path.write_text(base_config)
    log_path = work / "daemon.log"

    # The healthy job and its trainer first, so the daemon knows them from its first poll.
    healthy_launcher, healthy_workers = _start_job(procs, work, "healthy", env)
    healthy_trainer = _trainer(procs, agent_env, "--pattern", "steady", "--step-seconds",
                               "0.02", "--noise-mib", "0.5", "--seed", "1")
    for i, pid in enumerate(healthy_workers):
        shared.hold(pid, device=i % opts.gpus, used=(12 + 2 * i) * GIB)
    shared.hold(healthy_trainer.pid, device=(opts.gpus - 1), used=6 * GIB)
    result.healthy_pids = {healthy_launcher.pid, *healthy_workers, healthy_trainer.pid}

    with open(log_path, "wb") as daemon_log:
        daemon = procs.start(python("-m", "gpuwatch", "daemon", "--config", str(config_path)),
                             env=env, stdout=daemon_log, stderr=subprocess.STDOUT)
    info = wait_for("the daemon", lambda: read_json(work / "run" / "daemon.json"), 60,
                    alive=daemon)
    started = time.monotonic()
    client = MetricsClient(info["metrics_url"])
    log(f"daemon PID {daemon.pid} serving {info['metrics_url']}; work dir {work}")

    prometheus = _start_prometheus(procs, work, info["metrics_url"].split("/")[2]) \
        if opts.prometheus else None

    # Agents at full rate: each steps faster than the agent's 50 ms coalescing.
    for i in range(opts.agents):
        _trainer(procs, agent_env, "--pattern", "steady", "--step-seconds", "0.01",
                 "--noise-mib", "0.25", "--seed", str(10 + i))
    datagram_report = work / "datagrams.json"
    sender = procs.start(python(str(HERE), "_datagrams", str(work / "run" / "agent.sock"),
                                str(opts.datagram_rate), str(opts.malformed_share),
                                str(opts.seed), str(datagram_report)))
    storm_report = work / "storm.json"
    storm_proc = procs.start(python(str(HERE), "_storm", str(opts.storm_rate),
                                    str(opts.storm_gpu_share), str(opts.gpus), str(opts.seed),
                                    str(storm_report)), stdout=subprocess.PIPE, text=True)
    feed = StormFeed(storm_proc, shared)
    scraper = Scraper(client, opts.scrape_every, stop)
    faults = FaultInjector(shared, client, opts, random.Random(opts.seed + 1), stop)
    reloader = Reloader(daemon.pid, config_path, base_config, client, opts, stop)
    threads += [feed, scraper, faults, reloader]
    for t in threads:
        t.start()

    rss_thread = Sampler(lambda: daemon.pid, 1.0, stop)
    rss_thread.started = started
    result.rss = rss_thread.rss
    rss_thread.start()

    # Planted problems, round after round, until too little time is left for another.
    deadline = started + opts.duration
    next_round = started + 2.0
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            result.problems.append(f"the daemon exited with code {daemon.returncode} "
                                   f"after {time.monotonic() - started:.0f} s")
            break
        if time.monotonic() >= next_round and (
                not result.rounds or deadline - time.monotonic() > opts.find_within):
            result.rounds.append(_plant_round(procs, shared, scraper, work, env, agent_env,
                                              opts, rng, len(result.rounds), daemon))
            next_round = time.monotonic() + opts.plant_every
        stop.wait(0.2)

    result.elapsed = time.monotonic() - started
    result.daemon_alive_at_end = daemon.poll() is None
    stop.set()
    for t in (scraper, faults, reloader, rss_thread):
        t.join(60)
    for worker in (sender, storm_proc):  # their reports are written on SIGTERM
        worker.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.wait(30)
    feed.join(10)
    result.datagrams = read_json(datagram_report) or {}
    if not result.datagrams:
        result.problems.append(
            f"the raw sender wrote no report of what it sent (exit code {sender.poll()}, None: "
            "still running 30 s after SIGTERM)")
    result.storm = read_json(storm_report) or {}
    result.storm_pids = feed.pids

    if result.daemon_alive_at_end:
        # What the raw sender sent has all been handled once the counters stop moving.
        def settled() -> Optional[Samples]:
            s = client.get()
            want = {r: result.datagrams.get(r, 0) for r in MALFORMED_REASONS}
            if s is None:
                return None
            got = {r: int(total(s, "gpuwatch_agent_reports_rejected_total", reason=r))
                   for r in MALFORMED_REASONS}
            return s if got == want else None
        with contextlib.suppress(DemoError):  # a mismatch is reported by check()
            wait_for("the rejected counters", settled, 15)
        final = client.get()
        result.final = final or {}
        if final is None:
            result.problems.append("the last scrape failed")
    if prometheus is not None:
        window = f"{int(result.elapsed) + 5}s"
        result.prometheus = {
            "scrapes": _prometheus_query(prometheus, f"count_over_time(up[{window}])") or 0.0,
            "up": _prometheus_query(prometheus, f"sum_over_time(up[{window}])") or 0.0,
        }
    result.daemon_cpu_seconds = cpu_seconds(daemon.pid)
    if result.daemon_alive_at_end:
        daemon.send_signal(signal.SIGTERM)
        try:
            result.daemon_exit_code = daemon.wait(30)
        except subprocess.TimeoutExpired:
            result.problems.append("the daemon did not stop within 30 s of SIGTERM")
    else:
        result.daemon_exit_code = daemon.returncode

    s = result.final
    result.rejected_counted = {r: int(total(s, "gpuwatch_agent_reports_rejected_total", reason=r))
                               for r in (*MALFORMED_REASONS, "no_credentials",
                                         "too_many_processes")}
    result.accepted_counted = int(total(s, "gpuwatch_agent_reports_total"))
    result.reloads_sent = dict(reloader.sent)
    result.reloads_counted = {r: int(total(s, "gpuwatch_config_reloads_total", result=r))
                              for r in ("applied", "refused")}
    result.faults = faults.windows
    result.nvml_errors_between_faults = faults.errors_between
    result.problems += faults.problems + reloader.problems
    result.scrapes_scheduled = scraper.scheduled
    result.scrapes_ok, result.scrapes_failed = client.ok, client.failed
    result.scrape_failures = client.failures
    result.scrape_latencies = client.latencies
    result.findings = dict(scraper.findings)
    result.findings_scrapes = dict(scraper.findings_scrapes)
    result.healthy_seen_holding = {str(p) for p in healthy_workers} <= scraper.holders_seen
    result.log_problems, result.log_counts = _read_log(log_path)
    (work / "rss.csv").write_text("".join(f"{t:.1f},{rss}\n" for t, rss in result.rss))


def _plant_round(procs: Processes, node: SharedNode, scraper: Scraper, work: Path,
                 env: dict[str, str], agent_env: dict[str, str], opts: SoakOptions,
                 rng: random.Random, n: int, daemon: subprocess.Popen[bytes]) -> Round:
    """A job whose launcher is SIGKILLed (its workers hold GPU memory: orphans) and a trainer
    whose fetch buffer keeps every batch (a leak), each found within `find_within` s."""
    t0 = time.monotonic()
    launcher, workers = _start_job(procs, work, f"orphaned-{n}", env)
    leaker = _trainer(procs, agent_env, "--pattern", "leak", "--leak-mib", "2", "--noise-mib",
                      "0.5", "--step-seconds", "0.1", "--steps", "600", "--linger", "3600")
    for pid in workers:
        node.hold(pid, device=rng.randrange(opts.gpus), used=8 * GIB)
    node.hold(leaker.pid, device=rng.randrange(opts.gpus), used=4 * GIB)
    r = Round(t0, workers, leaker.pid)
    opts.log(f"round {n}: orphan-to-be workers {workers}, leaker {leaker.pid}")
    try:
        # Orphaned only counts once the daemon knew the launcher as their parent.
        wait_for("the workers seen holding GPU memory", lambda: True if {
            str(p) for p in workers} <= scraper.holders_seen else None, opts.find_within,
            alive=daemon)
        r.seen_holding = time.monotonic() - t0
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        r.launcher_killed = time.monotonic() - t0

        def found() -> Optional[bool]:
            for pid in workers:
                if pid not in r.orphans_found and scraper.has_finding("orphan", pid):
                    r.orphans_found[pid] = time.monotonic() - t0 - (r.launcher_killed or 0)
            if r.leak_found is None and scraper.has_finding("leak", leaker.pid):
                r.leak_found = time.monotonic() - t0
            return True if len(r.orphans_found) == len(workers) and r.leak_found else None

        wait_for("the planted orphans and leak found", found, opts.find_within, alive=daemon)
    except DemoError as exc:
        opts.log(f"round {n}: {exc}")
    finally:
        signal_all(workers)
        leaker.kill()
        leaker.wait()
        node.release(*workers, leaker.pid)
    opts.log(f"round {n}: orphans found after {r.orphans_found}, leak after {r.leak_found}")
    return r


def _read_log(path: Path) -> tuple[list[str], dict[str, int]]:
    """Lines that must not be there (tracebacks, errors other than a refused reload), and how
    many lines of each level there were."""
    problems: list[str] = []
    counts: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        parts = line.split(" ", 3)
        level = parts[1] if len(parts) > 2 else "?"
        if level in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            counts[level] += 1
        expected = "configuration reload refused" in line
        if ("Traceback" in line or "Exception" in line or level == "CRITICAL"
                or (level == "ERROR" and not expected)) and len(problems) < 20:
            problems.append(line)
    return problems, dict(counts)


# ---- pass criteria and figures -------------------------------------------------------------------


def classify(r: SoakResult) -> dict[str, list[tuple[str, str]]]:
    """Every finding seen, by whose it was: the healthy job's, planted, or anyone else's (the
    storm's included: a storm process exiting between NVML's calls and the /proc read looks like
    a ghost for a poll, which `detectors.ghost_grace` must absorb). Planted PIDs come before the
    storm's: the storm recycles PIDs."""
    planted = {str(p) for rnd in r.rounds for p in (*rnd.orphans, rnd.leaker)}
    healthy = {str(p) for p in r.healthy_pids}
    out: dict[str, list[tuple[str, str]]] = {k: [] for k in ("healthy", "planted", "unexpected")}
    for key in sorted(r.findings):
        pid = key[1]
        if pid in healthy:
            out["healthy"].append(key)
        elif pid in planted:
            out["planted"].append(key)
        else:
            out["unexpected"].append(key)
    return out


def check(r: SoakResult, rss_tolerance: Optional[float] = None) -> list[str]:
    """Every pass criterion that failed, in words (empty: the soak passed)."""
    failed: list[str] = list(r.problems)
    tolerance = r.options.rss_tolerance if rss_tolerance is None else rss_tolerance
    if not r.daemon_alive_at_end:
        failed.append("no crash: the daemon did not survive the soak")
    if r.daemon_exit_code != 0:
        failed.append(f"no crash: the daemon exited with {r.daemon_exit_code} on SIGTERM")
    if r.log_problems:
        failed.append(f"no unhandled exception in the log: {len(r.log_problems)} line(s), "
                      f"first: {r.log_problems[0]}")
    poll_raised = total(r.final, "gpuwatch_poll_errors_total", source="poll")
    if poll_raised:
        failed.append(f"no unhandled exception: {poll_raised:g} poll(s) raised")
    if r.scrapes_failed:
        failed.append(f"/metrics answers every scrape: {r.scrapes_failed} failed "
                      f"({r.scrape_failures[:3]})")
    if not r.scrapes_ok:
        failed.append("/metrics answers every scrape: none answered")
    if r.prometheus is not None and (not r.prometheus["scrapes"]
                                     or r.prometheus["up"] != r.prometheus["scrapes"]):
        failed.append(f"Prometheus scraped successfully {r.prometheus['up']:g} times "
                      f"of {r.prometheus['scrapes']:g}")
    change = r.rss_change()
    if change is None:
        failed.append("RSS flat: not enough RSS samples after warm-up")
    elif abs(change) > tolerance:
        early, late = r.rss_windows()
        failed.append(f"RSS flat within {tolerance:.0%}: {early / MIB:.1f} MiB after warm-up, "
                      f"{late / MIB:.1f} MiB at the end ({change:+.1%})")
    if not r.rounds:
        failed.append("every planted orphan and leak found: nothing was planted")
    for i, rnd in enumerate(r.rounds):
        missing = [p for p in rnd.orphans if p not in rnd.orphans_found]
        if rnd.launcher_killed is None:
            failed.append(f"round {i}: the orphans-to-be were never seen holding GPU memory")
        elif missing:
            failed.append(f"every planted orphan found: round {i} missed {missing}")
        if rnd.leak_found is None:
            failed.append(f"every planted leak found: round {i} missed PID {rnd.leaker}")
    kinds = classify(r)
    healthy = kinds["healthy"]
    if healthy:
        failed.append(f"no finding on the healthy job: {healthy} "
                      f"({r.findings[healthy[0]][1]})")
    if not r.healthy_seen_holding:
        failed.append("no finding on the healthy job: its workers were never seen holding")
    unexpected = kinds["unexpected"]
    if unexpected:
        failed.append(f"no finding but the planted ones: "
                      f"{unexpected} ({r.findings[unexpected[0]][1]}; open in "
                      f"{r.findings_scrapes.get(unexpected[0])} scrapes)")
    for w in r.faults:
        where = f"{w.kind} ({w.symbol}, device {w.device}, {w.seconds:.1f} s)"
        if not w.seen:
            failed.append(f"every fault visible: the daemon did not show {where}")
        if w.errors_counted < 1:
            failed.append(f"every fault counted: {where} counted no NVML error")
        # Each poll under a GPU fault meets at least one failing call, except perhaps the one
        # that began before the fault was put in place. (Without a driver, init is retried
        # with backoff, so not every poll tries: one error is all that can be asked.)
        if w.kind != "driver_gone" and w.errors_counted < w.polls_under - 1:
            failed.append(f"every fault counted: {where} counted {w.errors_counted} NVML "
                          f"errors in {w.polls_under} polls under it")
        if w.recovery is None:
            failed.append(f"recovery: the daemon did not read every GPU again after {where}")
    if not r.faults:
        failed.append("every fault counted: no fault was injected")
    if r.nvml_errors_between_faults:
        failed.append(f"faults counted, and nothing else: {r.nvml_errors_between_faults} NVML "
                      "errors counted while no fault was injected")
    for reason in MALFORMED_REASONS:
        sent, counted = r.datagrams.get(reason, 0), r.rejected_counted.get(reason, 0)
        if sent != counted:
            failed.append(f"every malformed datagram counted: {reason} sent {sent}, "
                          f"counted {counted}")
    if not sum(r.datagrams.get(x, 0) for x in MALFORMED_REASONS):
        failed.append("every malformed datagram counted: none was sent")
    if r.accepted_counted < r.datagrams.get("valid", 0):
        failed.append(f"agent reports: {r.datagrams.get('valid')} valid sent by the raw sender "
                      f"alone, {r.accepted_counted} accepted")
    if r.datagrams.get("send_failed"):
        failed.append(f"agent socket: {r.datagrams['send_failed']} datagrams could not be sent")
    for result in ("applied", "refused"):
        if r.reloads_sent.get(result, 0) != r.reloads_counted.get(result, 0):
            failed.append(f"reloads counted: {r.reloads_sent.get(result, 0)} {result} sent, "
                          f"{r.reloads_counted.get(result, 0)} counted")
    if not r.reloads_sent.get("applied") or not r.reloads_sent.get("refused"):
        failed.append(f"reloads: too few sent ({r.reloads_sent})")
    return failed


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def figures(r: SoakResult) -> list[tuple[str, str]]:
    s = r.final
    polls = total(s, "gpuwatch_polls_total")
    poll_sum = total(s, "gpuwatch_poll_duration_seconds_sum")
    early, late = r.rss_windows()
    change = r.rss_change()
    rows = [
        ("duration", f"{r.elapsed:.0f} s (warm-up {r.options.warmup_seconds():.0f} s)"),
        ("polls", f"{polls:.0f} every {r.options.interval:g} s, mean "
                  f"{1000 * poll_sum / polls if polls else float('nan'):.1f} ms"),
        ("daemon CPU", f"{r.daemon_cpu_seconds or 0:.1f} s "
                       f"({100 * (r.daemon_cpu_seconds or 0) / max(r.elapsed, 1):.0f}% of a core)"),
        ("scrapes", f"{r.scrapes_ok} ok, {r.scrapes_failed} failed "
                    f"({r.scrapes_scheduled} by the 1 s scraper); latency p50 "
                    f"{1000 * _pct(r.scrape_latencies, 0.5):.0f} ms, p99 "
                    f"{1000 * _pct(r.scrape_latencies, 0.99):.0f} ms, max "
                    f"{1000 * max(r.scrape_latencies, default=float('nan')):.0f} ms"),
    ]
    if r.prometheus is not None:
        rows.append(("Prometheus", f"{r.prometheus['up']:g} of {r.prometheus['scrapes']:g} "
                                   "scrapes up"))
    spawned = r.storm.get("spawned", 0)
    rows += [
        ("processes spawned", f"{spawned} by the storm ({spawned / max(r.elapsed, 1):.0f}/s), "
                              f"{r.storm.get('holders', 0)} of them GPU holders; "
                              f"{r.storm.get('spawn_failed', 0)} spawns failed"),
        ("procfs errors counted", f"{total(s, 'gpuwatch_poll_errors_total', source='procfs'):.0f}"
                                  " (processes that exited while being read)"),
    ]
    by_kind: dict[str, list[FaultWindow]] = {}
    for w in r.faults:
        by_kind.setdefault(w.kind, []).append(w)
    for kind in FAULT_KINDS:
        ws = by_kind.get(kind, [])
        rec = [w.recovery for w in ws if w.recovery is not None]
        rows.append((f"fault {kind}",
                     f"{len(ws)} injected ({sum(w.seconds for w in ws):.0f} s), "
                     f"{sum(w.seen for w in ws)} shown by the daemon, "
                     f"{sum(w.errors_counted for w in ws)} NVML errors counted in "
                     f"{sum(w.polls_under for w in ws)} polls under them; recovery max "
                     f"{max(rec, default=float('nan')):.1f} s"))
    rows += [
        ("NVML errors, total", f"{total(s, 'gpuwatch_poll_errors_total', source='nvml'):.0f} "
                               f"counted, {r.nvml_errors_between_faults} outside faults"),
        ("datagrams sent", f"{sum(r.datagrams.get(k, 0) for k in ('valid', *MALFORMED_REASONS))}"
                           f" by the raw sender, {r.datagrams.get('valid', 0)} valid, "
                           f"{r.datagrams.get('send_failed', 0)} send failures"),
        ("malformed sent/counted", ", ".join(
            f"{k} {r.datagrams.get(k, 0)}/{r.rejected_counted.get(k, 0)}"
            for k in MALFORMED_REASONS)),
        ("agent reports accepted", f"{r.accepted_counted} (the raw sender's valid ones and "
                                   "the trainers')"),
        ("reloads sent/counted", f"applied {r.reloads_sent.get('applied', 0)}/"
                                 f"{r.reloads_counted.get('applied', 0)}, refused "
                                 f"{r.reloads_sent.get('refused', 0)}/"
                                 f"{r.reloads_counted.get('refused', 0)}"),
        ("RSS", f"{(early or 0) / MIB:.1f} MiB after warm-up, {(late or 0) / MIB:.1f} MiB at "
                f"the end ({change if change is not None else float('nan'):+.1%}); "
                f"max {max((x for _, x in r.rss), default=0) / MIB:.1f} MiB"),
    ]
    orphans = [t for rnd in r.rounds for t in rnd.orphans_found.values()]
    leaks = [rnd.leak_found for rnd in r.rounds if rnd.leak_found is not None]
    rows += [
        ("planted orphans found", f"{len(orphans)} of {sum(len(x.orphans) for x in r.rounds)}"
                                  f" ({len(r.rounds)} rounds), max "
                                  f"{max(orphans, default=float('nan')):.1f} s after the kill"),
        ("planted leaks found", f"{len(leaks)} of {len(r.rounds)}, max "
                                f"{max(leaks, default=float('nan')):.1f} s after the start"),
    ]
    kinds = classify(r)

    def tally(keys: list[tuple[str, str]]) -> str:
        return ", ".join(f"{k} {n}" for k, n in sorted(Counter(k for k, _ in keys).items())) \
            or "0"

    rows += [
        ("findings on the healthy job", tally(kinds["healthy"])),
        ("unexpected findings", tally(kinds["unexpected"])),
        ("daemon log lines", ", ".join(f"{k} {n}" for k, n in sorted(r.log_counts.items()))),
    ]
    return rows


def format_figures(r: SoakResult) -> str:
    return columns(figures(r))


# ---- the two helper processes: the storm and the raw datagram sender -----------------------------


def _storm_main(rate: float, gpu_share: float, gpus: int, seed: int, report: Path) -> int:
    report.write_text(json.dumps(storm(rate, gpu_share, gpus, seed)))
    return 0


def malformed_datagram(reason: str, seq: int) -> bytes:
    """A datagram the daemon must reject for `reason` (docs/agent-protocol.md)."""
    if reason == "malformed":
        return (b"{not json", b"[1, 2, 3]", b"\xff\xfe\xfd", b'{"v": 1, "kind": "step"}')[seq % 4]
    doc: dict[str, Any] = {"v": 1, "kind": "step", "seq": seq, "step": seq}
    if reason == "version":
        doc["v"] = 2
    elif reason == "oversized":
        doc["pad"] = "x" * 17_000
    elif reason == "bad_name":
        doc["buffers"] = {"no spaces allowed": {"items": 1}}
    elif reason == "bad_value":
        doc["step"] = -1
    elif reason == "bad_type":
        doc["rss"] = "12 MiB"
    elif reason == "too_many_buffers":
        doc["buffers"] = {f"b{i}": {"items": i} for i in range(65)}
    return json.dumps(doc).encode()


def _datagrams_main(path: str, rate: float, malformed_share: float, seed: int,
                    report: Path) -> int:
    """Send `rate` datagrams a second to the agent socket, `malformed_share` of them malformed;
    write how many of each were sent on SIGTERM. Blocking sends: none is dropped on this side."""
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    rng = random.Random(seed)
    sent: Counter[str] = Counter()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.settimeout(5)
    seq = 0
    pacer = Pacer(rate, stopping)
    while not stopping.is_set():
        for _ in range(pacer.due()):
            if stopping.is_set():
                break  # a daemon slow to drain can hold each send: SIGTERM is heard between
            seq += 1
            if rng.random() < malformed_share:
                reason = rng.choice(MALFORMED_REASONS)
                payload = malformed_datagram(reason, seq)
            else:
                reason = "valid"
                payload = json.dumps({"v": 1, "kind": "step", "seq": seq, "step": seq,
                                      "rss": 64 * MIB, "buffers": {"queue": {"items": seq % 8}}}
                                     ).encode()
            try:
                sock.sendto(payload, path)
            except OSError:
                sent["send_failed"] += 1
                continue
            sent[reason] += 1
        pacer.wait()
    report.write_text(json.dumps(dict(sent)))
    return 0


# ---- command line --------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_storm"]:
        return _storm_main(float(argv[1]), float(argv[2]), int(argv[3]), int(argv[4]),
                           Path(argv[5]))
    if argv[:1] == ["_datagrams"]:
        return _datagrams_main(argv[1], float(argv[2]), float(argv[3]), int(argv[4]),
                               Path(argv[5]))
    d = SoakOptions()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=d.duration, help="seconds (default 600)")
    p.add_argument("--interval", type=float, default=d.interval, help="daemon poll interval")
    p.add_argument("--gpus", type=int, default=d.gpus)
    p.add_argument("--storm-rate", type=float, default=d.storm_rate,
                   help="short-lived processes spawned a second")
    p.add_argument("--storm-gpu-share", type=float, default=d.storm_gpu_share,
                   help="share of them registered as GPU holders")
    p.add_argument("--agents", type=int, default=d.agents,
                   help="instrumented trainers reporting at full rate, besides the planted ones")
    p.add_argument("--datagram-rate", type=float, default=d.datagram_rate,
                   help="raw datagrams a second to agent.sock")
    p.add_argument("--malformed-share", type=float, default=d.malformed_share)
    p.add_argument("--reload-every", type=float, default=d.reload_every, help="seconds")
    p.add_argument("--plant-every", type=float, default=d.plant_every,
                   help="seconds between rounds of planted orphans and leaks")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds before the RSS baseline (default: a quarter of the duration)")
    p.add_argument("--rss-window", type=float, default=None,
                   help="seconds of RSS samples per median (default: a tenth of the duration)")
    p.add_argument("--rss-tolerance", type=float, default=d.rss_tolerance)
    p.add_argument("--prometheus", action="store_true",
                   help="also run a real Prometheus scraping every second (needs `prometheus`)")
    run_arguments(p, seed=d.seed, keep="daemon log, fake driver state")
    a = p.parse_args(argv)
    say = console(a.quiet)

    if a.prometheus and shutil.which("prometheus") is None:
        p.error("--prometheus: no `prometheus` on PATH")
    if a.keep is not None and a.keep.is_dir() and any(a.keep.iterdir()):
        p.error(f"--keep: {a.keep} is not empty (an earlier run's files would be read as this "
                "run's)")
    opts = SoakOptions(
        duration=a.duration, interval=a.interval, gpus=a.gpus, storm_rate=a.storm_rate,
        storm_gpu_share=a.storm_gpu_share, agents=a.agents, datagram_rate=a.datagram_rate,
        malformed_share=a.malformed_share, reload_every=a.reload_every,
        plant_every=a.plant_every, warmup=a.warmup, rss_window=a.rss_window,
        rss_tolerance=a.rss_tolerance, prometheus=a.prometheus, seed=a.seed, work_dir=a.keep,
        log=say)
    unwind_on_signals()
    result = run_soak(opts)
    print(format_figures(result))
    failed = check(result)
    for line in failed:
        print(f"FAIL  {line}")
    print("soak: PASS" if not failed else f"soak: FAIL ({len(failed)} criteria)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
