"""One local user's processes with 2 MiB command lines, each reporting to agent.sock: the daemon's
memory, its status document and its poll, beside the same figures unloaded.

1,000 real processes of one user (UID 4243 when this runs as root: a user of its own, as a
hostile local user would be) in batches of 100: each sends one step report to agent.sock (which
makes it a process the daemon reads at every poll, gpuwatch/poll.py) and execs a shell whose
command line is as long as the kernel allows (15 arguments of 128,000 bytes: ARG_MAX is 2 MiB)
with a 64 KiB environment of its own. Each batch lives until the daemon's status document shows
all of it, then is killed, and the next starts. Prints the daemon's RSS before, at its peak and
once they are all gone, the status document's size unloaded and at its largest, and the poll's
time unloaded and with a batch alive (docs/security.md, "Bytes, not entries").

    python bench/argv_flood.py [--processes 1000] [--batch 100] [--interval 0.5]
        [--against DIR [--against-processes 150] [--against-rss-limit 2048]]

--against DIR runs the same flood, after this checkout's, on a daemon importing the gpuwatch
package in DIR (another revision's checkout or worktree), and prints both side by side. Its own
count of processes (--against-processes: a daemon that reads command lines whole takes about
6 MiB of RSS for each), and its daemon is killed past --against-rss-limit MiB, which the figures
then say.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from cmdline import options, parse_args, write_figures
from node import (
    ROOT,
    BenchNode,
    bench_node,
    check_room_for,
    cli_env,
    free_port,
    rss_bytes,
    scrape,
    stop,
    wait_http,
)

#: The flooders' user when this runs as root, as in agent_flood.py.
FLOODER_UID = 4243
#: 15 arguments just under the kernel's 128 KiB each and a 64 KiB environment: about ARG_MAX.
LONG_ARG = "m" * 128_000
LONG_ARGS = 15
#: The bounds the daemon holds (docs/security.md).
RSS_LIMIT_MIB = 128
RSS_BACK_WITHIN_MIB = 8
DOCUMENT_LIMIT_MIB = 8
CUT_SERIES = 'gpuwatch_text_truncated_total{what="command_line"}'


def document(runtime: Path) -> bytes:
    """The status document, byte for byte as the state socket serves it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(str(runtime / "state.sock"))
        s.sendall(b"status\n")
        chunks = []
        while chunk := s.recv(1 << 20):
            chunks.append(chunk)
    return b"".join(chunks)


def _reporting(path: str) -> Callable[[], None]:
    """Run in the child before its exec: as the flooders' user, one step report to agent.sock
    (the kernel stamps it with the PID the exec keeps)."""
    report = json.dumps({"v": 1, "kind": "step", "seq": 0, "step": 0}).encode()

    def send() -> None:
        if os.geteuid() == 0:
            os.setgroups([])
            os.setgid(FLOODER_UID)
            os.setuid(FLOODER_UID)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(report, path)
    return send


def start_batch(path: str, batch: int, size: int) -> list[subprocess.Popen[bytes]]:
    procs = []
    for i in range(size):
        procs.append(subprocess.Popen(
            ["/bin/sh", "-c", "sleep 3600; :", f"flood-{batch}-{i}", *[LONG_ARG] * LONG_ARGS],
            env={"PATH": "/usr/bin:/bin", "PAD": f"{i % 100:02d}" * 32_768},
            preexec_fn=_reporting(path), start_new_session=True, stdin=subprocess.DEVNULL))
    return procs


def end_batch(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()


def wait_until(what: str, probe: Callable[[], Optional[Any]], limit: float = 300) -> Any:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        found = probe()
        if found is not None:
            return found
        time.sleep(0.1)
    raise RuntimeError(f"{what}: not within {limit:.0f} s")


class Peak(threading.Thread):
    """The highest RSS of a process, sampled every 50 ms; the process is killed past `limit`
    bytes (0: no limit)."""

    def __init__(self, pid: int, limit: int = 0) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.limit = limit
        self.peak = 0
        self.killed = False
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.05):
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, rss_bytes(self.pid))
                if self.limit and self.peak > self.limit and not self.killed:
                    os.kill(self.pid, signal.SIGKILL)
                    self.killed = True


def start_daemon(b: BenchNode, port: int, interval: float,
                 code: Optional[Path]) -> subprocess.Popen[bytes]:
    """`gpuwatch daemon` on the fake node, importing gpuwatch from `code` (default: this
    checkout), /metrics on 127.0.0.1:`port`."""
    env = cli_env(b)
    env["PYTHONPATH"] = str(code or ROOT)
    return subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "daemon", "--listen", f"127.0.0.1:{port}",
         "--interval", str(interval), "--log-level", "warning"], env=env, cwd=b.tmp)


def poll_seconds(runtime: Path) -> float:
    return float(json.loads(document(runtime))["poll_duration_seconds"])


def flood(processes: int, batch_size: int, interval: float, code: Optional[Path] = None,
          rss_limit_mib: int = 0) -> dict[str, Any]:
    """The flood on a daemon importing gpuwatch from `code` (default: this checkout): its
    figures, in MiB, KiB and ms."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    batches = -(-processes // batch_size)
    mib = 2 ** 20
    with bench_node(gpus=2, gpu_procs=4) as b:
        daemon = start_daemon(b, port, interval, code)
        procs: list[subprocess.Popen[bytes]] = []
        peak = Peak(daemon.pid, rss_limit_mib * mib)
        done = 0
        try:
            wait_http(url, daemon)
            os.chmod(b.tmp, 0o711)  # the flooders' user must reach agent.sock inside it
            runtime = Path(cli_env(b)["GPUWATCH_RUNTIME_DIR"])
            path = str(runtime / "agent.sock")
            time.sleep(4 * interval)
            before = rss_bytes(daemon.pid)
            unloaded_doc = len(document(runtime))
            unloaded_polls = []
            for _ in range(5):
                unloaded_polls.append(poll_seconds(runtime))
                time.sleep(interval)
            peak.start()
            largest_doc = 0
            loaded_polls = []
            cut_shown = 0
            read_seconds = []
            started = time.monotonic()
            for batch in range(batches):
                size = min(batch_size, processes - batch * batch_size)
                t0 = time.monotonic()
                procs = start_batch(path, batch, size)
                pids = {p.pid for p in procs}

                def all_read(pids: set[int] = pids, batch: int = batch
                             ) -> Optional[tuple[bytes, list[dict[str, Any]]]]:
                    body = document(runtime)
                    shown = [p for p in json.loads(body)["processes"] if p["pid"] in pids
                             and p["cmdline"][3:4] and p["cmdline"][3].startswith(
                                 f"flood-{batch}-")]
                    return (body, shown) if len(shown) == len(pids) else None

                try:
                    body, shown = wait_until(f"batch {batch} read", all_read)
                except (OSError, ValueError):  # refused, or a cut answer, once it is killed
                    if peak.killed:
                        break
                    raise
                read_seconds.append(time.monotonic() - t0)
                largest_doc = max(largest_doc, len(body))
                cut_shown += sum(1 for p in shown if p["cmdline"][-1].startswith("…[cut"))
                time.sleep(2 * interval)  # past the batch's first reads: polls as they run
                with contextlib.suppress(OSError):
                    loaded_polls.append(poll_seconds(runtime))
                end_batch(procs)
                procs = []
                if peak.killed:
                    break

                def gone(pids: set[int] = pids) -> Optional[bool]:
                    left = [p for p in json.loads(document(runtime))["processes"]
                            if p["pid"] in pids]
                    return None if left else True

                try:
                    wait_until(f"batch {batch} gone", gone)
                except (OSError, ValueError):  # refused, or a cut answer, once it is killed
                    if peak.killed:
                        break
                    raise
                done += size
            flood_seconds = time.monotonic() - started
            time.sleep(4 * interval)
            after = 0 if peak.killed else rss_bytes(daemon.pid)
            peak.stopping.set()
            peak.join()
            cut_counted = 0.0
            if not peak.killed:
                metrics = scrape(url)[1].decode()
                cut_counted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                                  if line.startswith(CUT_SERIES))
        finally:
            peak.stopping.set()
            end_batch(procs)
            stop([daemon])
    return {
        "processes": processes, "batch": batch_size, "done": done, "killed": peak.killed,
        "rss_limit_mib": rss_limit_mib,
        "rss_before_mib": before / mib, "rss_peak_mib": peak.peak / mib,
        "rss_after_mib": after / mib, "document_unloaded_kib": unloaded_doc / 1024,
        "document_largest_mib": largest_doc / mib,
        "poll_unloaded_ms": 1000 * statistics.median(unloaded_polls),
        "poll_loaded_ms": 1000 * statistics.median(loaded_polls) if loaded_polls else 0.0,
        "read_seconds": statistics.median(read_seconds) if read_seconds else 0.0,
        "cut_shown": cut_shown, "cut_counted": cut_counted, "flood_seconds": flood_seconds}


def print_figures(label: str, f: dict[str, Any], interval: float) -> None:
    who = f"UID {FLOODER_UID}" if os.geteuid() == 0 else "this user"
    batches = -(-f["processes"] // f["batch"])
    print(f"{label}{f['processes']} processes of one user ({who}) with 2 MiB command lines and "
          f"64 KiB environments, {batches} batches of {f['batch']}, each reporting to agent.sock "
          f"(polls every {interval:g} s); all in {f['flood_seconds']:.0f} s, a batch read "
          f"in {f['read_seconds']:.1f} s (median)")
    if f["killed"]:
        print(f"{label}daemon killed past {f['rss_limit_mib']} MiB of RSS (this bench's limit), "
              f"{f['done']} of the processes read and gone by then")
    after = ("-" if f["killed"] else
             f"{f['rss_after_mib']:.0f} MiB ({f['rss_after_mib'] - f['rss_before_mib']:+.1f} MiB)")
    print(f"{label}daemon RSS: unloaded {f['rss_before_mib']:.0f} MiB, peak "
          f"{f['rss_peak_mib']:.0f} MiB, after they are gone {after}")
    print(f"{label}status document: unloaded {f['document_unloaded_kib']:.0f} KiB, largest "
          f"{f['document_largest_mib']:.2f} MiB")
    print(f"{label}poll: unloaded {f['poll_unloaded_ms']:.1f} ms, with a batch "
          f"alive {f['poll_loaded_ms']:.1f} ms (medians)")
    print(f"{label}command lines shown cut: {f['cut_shown']} of {f['processes']}; "
          f"gpuwatch_text_truncated_total{{what=\"command_line\"}} {f['cut_counted']:.0f}")


def main() -> None:
    parser = options(__doc__, processes=1000, batch=100, interval=0.5,
                     against_processes=(150, "processes of the --against run"),
                     against_rss_limit=(2048, "MiB of RSS past which the --against daemon "
                                        "is killed"))
    parser.add_argument("--against", type=Path, default=None,
                        help="also flood a daemon importing the gpuwatch package in this "
                             "directory (another revision's checkout)")
    args = parse_args(parser, quick={"processes": 100, "batch": 50, "against_processes": 50},
                      smoke={"processes": 10, "batch": 5, "against_processes": 5})
    check_room_for(2 * args.batch + 16)
    mine = flood(args.processes, args.batch, args.interval)
    theirs = (flood(args.against_processes, args.batch, args.interval, args.against.resolve(),
                    args.against_rss_limit) if args.against else None)
    print_figures("this checkout: " if theirs else "", mine, args.interval)
    if theirs is not None:
        print_figures(f"{args.against}: ", theirs, args.interval)
    figures = {k: v for k, v in mine.items() if k not in ("done", "killed", "rss_limit_mib",
                                                          "read_seconds")}
    if theirs is not None:
        figures["against"] = theirs
    write_figures(args.figures, figures)
    mib_peak, back = mine["rss_peak_mib"], mine["rss_after_mib"] - mine["rss_before_mib"]
    if (mib_peak >= RSS_LIMIT_MIB or back > RSS_BACK_WITHIN_MIB
            or mine["document_largest_mib"] >= DOCUMENT_LIMIT_MIB
            or mine["cut_shown"] < mine["processes"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
