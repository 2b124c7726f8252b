"""A wrong-password flood against the metrics port; the authenticated scraper's latency.

The daemon on a simulated node serves /metrics over HTTPS with basic auth (a web config with a
self-signed certificate and a bcrypt hash at cost 10, htpasswd -B's default: ~60 ms a check). A
scraper with the right password asks every 0.25 s, on a new TLS connection each time (as the
server closes each one). Its latency and success are measured three ways, side by side:

1. unloaded;
2. while 250 connections (threads of a second process) each send a fresh wrong password, read
   the answer and send the next, over TLS, as fast as they are answered;
3. right after a reload under the same flood: the certificate files are rewritten (a renewal)
   and the web config edited (a header added), which the daemon picks up within a second.

    python bench/web_auth_flood.py [--connections 250] [--scrapes 40] [--flood-from 127.0.0.1]

--flood-from sets the attackers' source address (127.0.0.2: another peer than the scraper's;
the default, the scraper's own address, is the harder case for a per-peer limit).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from node import bench_node, cli_env, free_port, parse_args, write_figures

PASSWORD = "scraper's right password"
USER = "prometheus"


def _certificate(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "node.crt", directory / "node.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return cert, key


def _web_config(path: Path, cert: Path, key: Path, hashed: str, header: bool = False) -> None:
    text = (f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
            f"basic_auth_users:\n  {USER}: {hashed}\n")
    if header:
        text += "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"
    path.write_text(text)


def _request(port: int, ctx: ssl.SSLContext, user: str, password: str, source: str,
             timeout: float) -> int:
    """The status code of one GET /metrics on a new TLS connection (0: no answer)."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    raw = socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                   source_address=(source, 0))
    with raw, ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        s.sendall(f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Basic "
                  f"{token}\r\n\r\n".encode())
        head = b""
        while b"\r\n" not in head:
            chunk = s.recv(65536)
            if not chunk:
                return 0
            head += chunk
        code = int(head.split(b" ", 2)[1])
        while s.recv(65536):
            pass
        return code


def _flood(port: int, cert: Path, connections: int, source: str, counts_to: int) -> None:
    """The attacker (a child process): `connections` threads, each sending wrong passwords in a
    loop; every second, writes "answered 401 429 other" to `counts_to`."""
    ctx = ssl.create_default_context(cafile=str(cert))
    counts = {"401": 0, "429": 0, "other": 0}
    lock = threading.Lock()

    def attack(n: int) -> None:
        i = 0
        while True:
            i += 1
            try:
                code = _request(port, ctx, USER, f"wrong-{n}-{i}", source, 15)
            except (OSError, ValueError):
                code = 0
            with lock:
                key = str(code) if str(code) in counts else "other"
                counts[key] += 1
            if code == 0:
                time.sleep(0.05)

    for n in range(connections):
        threading.Thread(target=attack, args=(n,), daemon=True).start()
    while True:
        time.sleep(1)
        with lock:
            line = f"{counts['401']} {counts['429']} {counts['other']}\n"
        os.write(counts_to, line.encode())


def _scrapes(port: int, ctx: ssl.SSLContext, n: int, every: float) -> list[Optional[float]]:
    """Latency of each good scrape, None for one not answered 200 within 10 s."""
    out: list[Optional[float]] = []
    for _ in range(n):
        started = time.monotonic()
        try:
            ok = _request(port, ctx, USER, PASSWORD, "127.0.0.1", 10) == 200
        except (OSError, ValueError):
            ok = False
        took = time.monotonic() - started
        out.append(took if ok else None)
        time.sleep(max(0.0, every - took))
    return out


def _summary(latencies: list[Optional[float]]) -> dict[str, Any]:
    good = [t for t in latencies if t is not None]
    return {"answered": len(good), "of": len(latencies),
            "median_ms": 1000 * statistics.median(good) if good else None,
            "max_ms": 1000 * max(good) if good else None,
            "under_1s": sum(t < 1.0 for t in good)}


def _counts(fd: int, last: str) -> str:
    with contextlib.suppress(BlockingIOError):
        data = os.read(fd, 1 << 16).decode()
        lines = [line for line in data.splitlines() if line.strip()]
        if lines:
            return lines[-1]
    return last


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--connections", type=int, default=250)
    parser.add_argument("--scrapes", type=int, default=40)
    parser.add_argument("--every", type=float, default=0.25)
    parser.add_argument("--flood-from", default="127.0.0.1")
    parser.add_argument("--interval", type=float, default=2.0)
    args = parse_args(parser, quick={"connections": 40, "scrapes": 8},
                      smoke={"connections": 5, "scrapes": 2})
    import bcrypt

    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
    port = free_port()
    rows: dict[str, dict[str, Any]] = {}
    with bench_node(gpus=2, gpu_procs=4) as b:
        cert, key = _certificate(b.tmp)
        web = b.tmp / "web.yml"
        _web_config(web, cert, key, hashed)
        daemon = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch", "daemon", "--listen", f"127.0.0.1:{port}",
             "--interval", str(args.interval), "--log-level", "warning", "--web-config",
             str(web)], env=cli_env(b))
        flooder: Optional[int] = None
        try:
            ctx = ssl.create_default_context(cafile=str(cert))
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(OSError, ValueError):
                    if _request(port, ctx, USER, PASSWORD, "127.0.0.1", 5) == 200:
                        break
                if time.monotonic() > deadline or daemon.poll() is not None:
                    sys.exit("the daemon did not serve /metrics")
                time.sleep(0.2)
            rows["unloaded"] = _summary(_scrapes(port, ctx, args.scrapes, args.every))

            counts_r, counts_w = os.pipe()
            os.set_blocking(counts_r, False)
            flooder = os.fork()
            if flooder == 0:
                try:
                    os.close(counts_r)
                    _flood(port, cert, args.connections, args.flood_from, counts_w)
                finally:
                    os._exit(0)
            os.close(counts_w)
            time.sleep(3)  # the flood under way
            counts = _counts(counts_r, "0 0 0")
            flood_started = time.monotonic()
            rows["flood"] = _summary(_scrapes(port, ctx, args.scrapes, args.every))
            counts = _counts(counts_r, counts)

            # A certificate renewal and a web-config edit, under the same flood.
            for path in (cert, key):
                path.write_bytes(path.read_bytes())
            _web_config(web, cert, key, hashed, header=True)
            later = time.time() + 5
            for path in (cert, key, web):
                os.utime(path, (later, later))
            time.sleep(1.2)  # looked at once a second, when a connection arrives
            rows["reload"] = _summary(_scrapes(port, ctx, args.scrapes, args.every))
            counts = _counts(counts_r, counts)
            flood_seconds = time.monotonic() - flood_started
        finally:
            if flooder:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(flooder, signal.SIGKILL)
                os.waitpid(flooder, 0)
            daemon.terminate()
            try:
                daemon.wait(20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()

    refused_401, refused_429, other = (int(x) for x in counts.split())
    print(f"good scrapes over HTTPS + basic auth (bcrypt cost 10), one every {args.every} s; "
          f"flood: {args.connections} connections of wrong passwords from {args.flood_from}")
    print(f"{'':32} {'answered':>10} {'< 1 s':>7} {'median':>9} {'max':>9}")
    names = {"unloaded": "unloaded",
             "flood": f"under {args.connections} wrong-password conns",
             "reload": "right after a reload, flooded"}
    for key, row in rows.items():
        median = f"{row['median_ms']:.0f} ms" if row["median_ms"] is not None else "-"
        worst = f"{row['max_ms']:.0f} ms" if row["max_ms"] is not None else "-"
        print(f"{names[key]:32} {row['answered']:>5}/{row['of']:<4} {row['under_1s']:>7} "
              f"{median:>9} {worst:>9}")
    print(f"the attackers' answers over {flood_seconds:.0f} s: {refused_401} x 401, "
          f"{refused_429} x 429 (checks refused), {other} other (closed, timed out)")
    write_figures(args.figures, {"rows": rows, "connections": args.connections,
                                 "attack_401": refused_401,
                                 "attack_429": refused_429, "attack_other": other})
    if any(r["under_1s"] < r["of"] for r in rows.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
