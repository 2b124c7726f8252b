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

from cmdline import arguments, write_figures
from node import (
    bench_node,
    check_room_for,
    cli_env,
    free_port,
    rss_bytes,
    scrape,
    start_daemon,
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
    """The highest RSS of a process, sampled every 50 ms."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.05):
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, rss_bytes(self.pid))


def poll_seconds(runtime: Path) -> float:
    return float(json.loads(document(runtime))["poll_duration_seconds"])


def main() -> None:
    args = arguments(__doc__, quick={"processes": 100, "batch": 50}, processes=1000, batch=100,
                     interval=0.5)
    check_room_for(2 * args.batch + 16)
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    batches = -(-args.processes // args.batch)
    with bench_node(gpus=2, gpu_procs=4) as b:
        daemon = start_daemon(b, port, args.interval)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            wait_http(url, daemon)
            os.chmod(b.tmp, 0o711)  # the flooders' user must reach agent.sock inside it
            runtime = Path(cli_env(b)["GPUWATCH_RUNTIME_DIR"])
            path = str(runtime / "agent.sock")
            time.sleep(4 * args.interval)
            before = rss_bytes(daemon.pid)
            unloaded_doc = len(document(runtime))
            unloaded_polls = []
            for _ in range(5):
                unloaded_polls.append(poll_seconds(runtime))
                time.sleep(args.interval)
            peak = Peak(daemon.pid)
            peak.start()
            largest_doc = 0
            loaded_polls = []
            cut_shown = 0
            read_seconds = []
            started = time.monotonic()
            for batch in range(batches):
                size = min(args.batch, args.processes - batch * args.batch)
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

                body, shown = wait_until(f"batch {batch} read", all_read)
                read_seconds.append(time.monotonic() - t0)
                largest_doc = max(largest_doc, len(body))
                cut_shown += sum(1 for p in shown if p["cmdline"][-1].startswith("…[cut"))
                time.sleep(2 * args.interval)  # past the batch's first reads: polls as they run
                loaded_polls.append(poll_seconds(runtime))
                end_batch(procs)
                procs = []

                def gone(pids: set[int] = pids) -> Optional[bool]:
                    left = [p for p in json.loads(document(runtime))["processes"]
                            if p["pid"] in pids]
                    return None if left else True

                wait_until(f"batch {batch} gone", gone)
            flood_seconds = time.monotonic() - started
            time.sleep(4 * args.interval)
            after = rss_bytes(daemon.pid)
            peak.stopping.set()
            peak.join()
            metrics = scrape(url)[1].decode()
            cut_counted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                              if line.startswith(CUT_SERIES))
        finally:
            end_batch(procs)
            stop([daemon])
    mib = 2 ** 20
    who = f"UID {FLOODER_UID}" if os.geteuid() == 0 else "this user"
    print(f"{args.processes} processes of one user ({who}) with 2 MiB command lines and 64 KiB "
          f"environments, {batches} batches of {args.batch}, each reporting to agent.sock "
          f"(polls every {args.interval:g} s); all in {flood_seconds:.0f} s, a batch read "
          f"in {statistics.median(read_seconds):.1f} s (median)")
    print(f"daemon RSS: unloaded {before / mib:.0f} MiB, peak {peak.peak / mib:.0f} MiB, "
          f"after they are gone {after / mib:.0f} MiB ({(after - before) / mib:+.1f} MiB)")
    print(f"status document: unloaded {unloaded_doc / 1024:.0f} KiB, largest "
          f"{largest_doc / mib:.2f} MiB")
    print(f"poll: unloaded {1000 * statistics.median(unloaded_polls):.1f} ms, with a batch "
          f"alive {1000 * statistics.median(loaded_polls):.1f} ms (medians)")
    print(f"command lines shown cut: {cut_shown} of {args.processes}; "
          f"gpuwatch_text_truncated_total{{what=\"command_line\"}} {cut_counted:.0f}")
    write_figures(args.figures, {
        "processes": args.processes, "batch": args.batch,
        "rss_before_mib": before / mib, "rss_peak_mib": peak.peak / mib,
        "rss_after_mib": after / mib, "document_unloaded_kib": unloaded_doc / 1024,
        "document_largest_mib": largest_doc / mib,
        "poll_unloaded_ms": 1000 * statistics.median(unloaded_polls),
        "poll_loaded_ms": 1000 * statistics.median(loaded_polls),
        "cut_shown": cut_shown, "cut_counted": cut_counted, "flood_seconds": flood_seconds})
    if (peak.peak / mib >= RSS_LIMIT_MIB or (after - before) / mib > RSS_BACK_WITHIN_MIB
            or largest_doc / mib >= DOCUMENT_LIMIT_MIB or cut_shown < args.processes):
        sys.exit(1)


if __name__ == "__main__":
    main()
