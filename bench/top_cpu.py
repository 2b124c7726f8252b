"""`gpuwatch top` on a 512-process node: CPU per refresh and share of one core at the default 2 s
interval, fed by a daemon's state socket and by polls of its own; CPU per key; RSS.

top runs as a user runs it, in a pseudo-terminal of 80x24 or 300x60 that the bench reads (and
discards). Daemon-fed, the state socket is a real StateServer in the bench's process serving a
synthetic status document of 512 GPU processes in 73 job trees, with findings, new on every
request (a fresh timestamp and RSS figures, so that top redraws every time); its refreshes are
counted at the socket. Own polls, no daemon answers and top polls the fake NVML driver and /proc
of bench/node.py's simulated node (8 GPUs, 512 real processes) itself, a History kept across
polls. CPU is top's, user + system, all its threads, from /proc/PID/stat, over a window after
its first screen; a key is `j` (move the selection) sent 20 times a second, less the idle rate.

    python bench/top_cpu.py [--processes 512] [--seconds 30] [--figures FILE] [--quick]
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from cmdline import arguments, write_figures
from node import GIB, MIB, bench_node, cli_env, console_script, cpu_seconds, rss_bytes

from gpuwatch.serve.state_socket import StateServer

INTERVAL = 2.0  # top's default


def synthetic_document(processes: int, gpus: int = 8, jitter: int = 0) -> dict[str, Any]:
    """A status document of `processes` GPU workers, seven to a launcher; one job's workers
    orphaned, one worker leaking with a culprit."""
    now = time.time()
    procs: list[dict[str, Any]] = []
    findings: list[dict[str, Any]] = []

    def proc(pid: int, ppid: int, root: int, job: str, gpu: Optional[int],
             cmd: list[str]) -> dict[str, Any]:
        used = GIB + (pid % 97) * MIB if gpu is not None else None
        return {"pid": pid, "ppid": ppid, "pgid": root, "sid": root, "job_root": root,
                "start_time": now - 3600, "name": cmd[0].rsplit("/", 1)[-1][:15],
                "user": f"user{int(job) % 7}", "uid": 1000 + int(job) % 7,
                "state": "sleeping", "rss_bytes": 2 * GIB + (pid + jitter) * 4096,
                "num_threads": 24, "gpu_memory_bytes": used,
                "gpus": [] if gpu is None else [{
                    "index": gpu, "uuid": f"GPU-{gpu}", "memory_bytes": used, "type": "compute",
                    "gpu_instance_id": None, "compute_instance_id": None}],
                "holds_gpu": gpu is not None, "job": {"id": job, "source": "slurm"},
                "cgroup": f"/system.slice/slurmstepd.scope/job_{job}",
                "launch_env": {"LOCAL_RANK": "0"} if gpu is not None else {}, "cmdline": cmd,
                "in_procfs": True, "read_errors": [], "wchan": None, "kernel_stack": [],
                "agent": None}

    workers = 0
    job = 0
    while workers < processes:
        launcher = 10_000 + 100 * job
        jid = str(41_000 + job)
        procs.append(proc(launcher, 1, launcher, jid, None,
                          ["/opt/conda/bin/python", "/opt/conda/bin/torchrun",
                           "--nproc-per-node", "7", "train.py", "--config", f"exp{job}.yaml"]))
        for w in range(min(7, processes - workers)):
            p = proc(launcher + 1 + w, launcher, launcher, jid, (job + w) % gpus,
                     ["/opt/conda/bin/python", "-u", "train.py", "--local-rank", str(w)])
            if job == 3:  # its launcher died: orphans
                p["ppid"] = 1
                findings.append({
                    "kind": "orphan", "severity": "critical", "pid": p["pid"],
                    "start_time": p["start_time"], "name": "python", "user": p["user"],
                    "job": p["job"], "gpus": [p["gpus"][0]["index"]],
                    "gpu_memory_bytes": p["gpu_memory_bytes"], "since": now - 60,
                    "reason": f"parent {launcher} (torchrun) exited; now under 1 (init)",
                    "details": {}})
            procs.append(p)
            workers += 1
        if job == 3:
            procs.remove(next(p for p in procs if p["pid"] == launcher))
        job += 1
    leaking = procs[-1]
    findings.insert(0, {
        "kind": "leak", "severity": "critical", "pid": leaking["pid"],
        "start_time": leaking["start_time"], "name": "python", "user": leaking["user"],
        "job": leaking["job"], "gpus": [], "gpu_memory_bytes": None, "since": now - 30,
        "reason": "RSS grows every step; buffer `cache` explains it (watched)",
        "details": {"series": "RSS", "unit": "step", "culprit": "cache", "found_by": "watched",
                    "growth_bytes_per_step": 2 * MIB, "culprit_bytes_per_step": 2 * MIB,
                    "projected_oom_step": 4242, "projected_oom_in_seconds": 600}})
    procs.append(proc(1, 0, 1, "0", None, ["/sbin/init"]) | {"job": None, "job_root": None})
    on = {i: [p for p in procs if p["gpus"] and p["gpus"][0]["index"] == i] for i in range(gpus)}
    return {
        "schema": 1, "gpuwatch_version": "bench", "source": "daemon", "source_detail": None,
        "node": "gpu-node-07", "taken_at": round(now, 3), "poll_duration_seconds": 0.05,
        "nvml": {"available": True, "error": None, "error_code": None,
                 "driver_version": "550.54.15", "nvml_version": "12.550.54.15",
                 "cuda_driver_version": "12.4", "device_count": gpus},
        "gpus": [{"index": i, "uuid": f"GPU-{i}", "name": "NVIDIA H100 80GB HBM3",
                  "pci_bus_id": f"00000000:{i:02X}:00.0", "memory_total_bytes": 80 * GIB,
                  "memory_used_bytes": sum(p["gpu_memory_bytes"] for p in on[i]),
                  "memory_free_bytes": None, "memory_reserved_bytes": 0,
                  "unattributed_memory_bytes": 0, "utilization_gpu_percent": 95,
                  "utilization_memory_percent": 40, "mig_enabled": False,
                  "process_count": len(on[i]), "lost": False, "errors": []}
                 for i in range(gpus)],
        "processes": sorted(procs, key=lambda p: p["pid"]), "findings": findings, "errors": []}


class Terminal:
    """`gpuwatch top` in a pseudo-terminal of the given size, its output read and kept short."""

    def __init__(self, argv: list[str], env: dict[str, str], cols: int, rows: int) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.master = master
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     start_new_session=True)
        os.close(slave)
        self.seen = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            with self._lock:
                self.seen += chunk
                del self.seen[:-(1 << 16)]

    def wait_for(self, text: bytes, timeout: float = 60) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            with self._lock:
                if text in self.seen:
                    return time.monotonic() - started
            if self.proc.poll() is not None:
                raise RuntimeError(f"top exited with {self.proc.returncode}: "
                                   f"{bytes(self.seen[-2000:])!r}")
            time.sleep(0.02)
        raise RuntimeError(f"{text!r} not on top's screen after {timeout} s")

    def keys(self, data: bytes) -> None:
        os.write(self.master, data)

    def quit(self) -> int:
        self.keys(b"q")
        try:
            return self.proc.wait(10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            os.close(self.master)


@contextlib.contextmanager
def fake_daemon(runtime: Path, processes: int) -> Iterator[list[int]]:
    """A state socket serving a new synthetic document per request; yields the request count."""
    served = [0]

    def body() -> bytes:
        served[0] += 1
        return json.dumps(synthetic_document(processes, jitter=served[0])).encode()

    runtime.mkdir(parents=True, exist_ok=True)
    server = StateServer(runtime / "state.sock", body, group=None)
    server.start()
    try:
        yield served
    finally:
        server.stop()


def top_env(base: dict[str, str], runtime: Path, state: Path) -> dict[str, str]:
    return {**base, "GPUWATCH_RUNTIME_DIR": str(runtime), "GPUWATCH_STATE_DIR": str(state),
            "GPUWATCH_CONFIG": "/dev/null", "TERM": "xterm-256color", "LANG": "C.UTF-8"}


def measure(term: Terminal, seconds: float, served: Optional[list[int]] = None
            ) -> dict[str, float]:
    time.sleep(INTERVAL)  # past the first refreshes and their imports
    pid = term.proc.pid
    cpu0, wall0, n0 = cpu_seconds(pid), time.monotonic(), served[0] if served else 0
    time.sleep(seconds)
    cpu, wall = cpu_seconds(pid) - cpu0, time.monotonic() - wall0
    refreshes = (served[0] - n0) if served else wall / INTERVAL
    return {"cpu_ms_per_refresh": 1e3 * cpu / max(refreshes, 1), "core_pct": 100 * cpu / wall,
            "refreshes": refreshes, "window_s": wall, "rss_mib": rss_bytes(pid) / 2**20}


def main() -> None:
    args = arguments(__doc__, quick={"seconds": 6.0},
                     smoke={"seconds": 1.0, "processes": 32}, processes=512,
                     seconds=(30.0, "measuring window of each figure"))
    gpuwatch = [console_script("gpuwatch")]
    if not Path(gpuwatch[0]).exists():
        gpuwatch = [sys.executable, "-m", "gpuwatch"]
    figures: dict[str, Any] = {"processes": args.processes, "interval_s": INTERVAL,
                               "seconds": args.seconds}
    with tempfile.TemporaryDirectory(prefix="gpuwatch-top-bench-") as tmp_name:
        tmp = Path(tmp_name)
        base = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
        env = top_env(base, tmp / "run", tmp / "state")
        daemon_fed: dict[str, Any] = {}
        with fake_daemon(tmp / "run", args.processes) as served:
            for cols, rows in ((80, 24), (300, 60)):
                term = Terminal([*gpuwatch, "top"], env, cols, rows)
                try:
                    startup = term.wait_for(b"from the running daemon")
                    daemon_fed[f"{cols}x{rows}"] = {**measure(term, args.seconds, served),
                                                    "first_screen_s": startup}
                    if cols == 80:
                        # Keys: `j` 20 times a second; the CPU above the idle rate, per key.
                        idle = daemon_fed["80x24"]["core_pct"] / 100
                        pid = term.proc.pid
                        cpu0, wall0, sent = cpu_seconds(pid), time.monotonic(), 0
                        while time.monotonic() - wall0 < args.seconds / 2:
                            term.keys(b"j")
                            sent += 1
                            time.sleep(0.05)
                        cpu, wall = cpu_seconds(pid) - cpu0, time.monotonic() - wall0
                        figures["key_ms"] = 1e3 * max(0.0, cpu - idle * wall) / sent
                finally:
                    code = term.quit()
                if code != 0:
                    raise RuntimeError(f"top exited with {code} after q")
        figures["daemon"] = daemon_fed
        with bench_node(8, args.processes) as b:
            env = top_env(cli_env(b), tmp / "no-daemon", tmp / "state")
            term = Terminal([*gpuwatch, "top"], env, 80, 24)
            try:
                term.wait_for(b"own polls")
                figures["own_polls"] = measure(term, args.seconds)
            finally:
                term.quit()
    print(f"gpuwatch top, {args.processes} GPU processes, refreshing every {INTERVAL:g} s "
          f"(its default); {args.seconds:g} s windows")
    print(f"{'':<30}{'CPU ms/refresh':>15}{'% of a core':>13}{'refreshes':>11}{'RSS MiB':>9}")
    rows_out = [(f"daemon-fed, {size}", f) for size, f in daemon_fed.items()]
    rows_out.append(("own polls (8 GPUs), 80x24", figures["own_polls"]))
    for name, f in rows_out:
        print(f"{name:<30}{f['cpu_ms_per_refresh']:>15.1f}{f['core_pct']:>13.2f}"
              f"{f['refreshes']:>11.0f}{f['rss_mib']:>9.1f}")
    print(f"a key (`j`, 20 a second, 80x24, daemon-fed): {figures['key_ms']:.2f} ms of CPU")
    print(f"first screen after start, daemon-fed: {daemon_fed['80x24']['first_screen_s']:.2f} s")
    write_figures(args.figures, figures)


if __name__ == "__main__":
    main()
