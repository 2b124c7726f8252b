"""The metrics check: an HTTP scrape of the daemon's /metrics, and whose metrics they are."""

from __future__ import annotations

import http.client
import os
import re
import socket
import ssl
import urllib.error
import urllib.request
from typing import Optional

from gpuwatch.config import split_listen
from gpuwatch.doctor.base import (
    FAIL,
    OK,
    RESTART_DAEMON,
    START_SHORT,
    Check,
    Context,
    read_daemon_info,
)
from gpuwatch.runtime_dir import DAEMON_INFO_NAME
from gpuwatch.units import plural

_MAX_METRICS_BYTES = 32 << 20


def _local_url(listen: str) -> str:
    host, port = split_listen(listen)
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"  # listening on every interface: ask the loopback one
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def check_metrics(ctx: Context) -> list[Check]:
    info = read_daemon_info(ctx.runtime_dir)
    if info is not None and info.metrics_url is not None:
        url, where = info.metrics_url, f"from {DAEMON_INFO_NAME}"
    else:
        url, where = _local_url(ctx.config.daemon.listen), "from daemon.listen"
    # A proxy from the environment must not stand between us and a local port.
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if url.startswith("https:"):
        # Whether it answers is the question here, not whether its certificate is one this
        # host trusts (Prometheus checks that with its own CA file): no verification.
        unverified = ssl.create_default_context()
        unverified.check_hostname = False
        unverified.verify_mode = ssl.CERT_NONE
        handlers.append(urllib.request.HTTPSHandler(context=unverified))
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(url, timeout=ctx.timeout) as response:
            body = response.read(_MAX_METRICS_BYTES).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        if exc.code == 401 and exc.headers.get("WWW-Authenticate", "").startswith("Basic"):
            return [Check("metrics", OK, f"{url} answers, behind basic auth (the web config's "
                                         "users; doctor has no password to read the metrics)",
                          detail=where)]
        return [Check("metrics", FAIL, f"{url} ({where}) answers HTTP {exc.code} {exc.reason}",
                      fix="another program holds the port: `ss -ltnp` names it; give the daemon "
                          "a free one (daemon.listen)")]
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, ConnectionRefusedError):
            return [Check("metrics", FAIL, f"nothing listens on {url} ({where})",
                          fix=f"{START_SHORT}; if it runs, it listens elsewhere "
                              "(daemon.listen, --listen, or a --runtime-dir whose daemon.json "
                              "says where)")]
        if isinstance(reason, (socket.timeout, TimeoutError)):
            return [Check("metrics", FAIL, f"{url} ({where}) did not answer within "
                                           f"{ctx.timeout:g} s",
                          fix="the daemon may be overloaded or stuck: " + RESTART_DAEMON)]
        return [Check("metrics", FAIL, f"{url} ({where}): {reason}",
                      fix="`curl -v " + url + "` shows what answers; " + RESTART_DAEMON)]
    families = re.findall(r"^# TYPE (gpuwatch_\w+) ", body, re.M)
    if not families:
        return [Check("metrics", FAIL, f"{url} ({where}) answers, but with no gpuwatch_ metric",
                      fix="another program holds the port: `ss -ltnp` names it; give the daemon "
                          "a free one (daemon.listen)")]
    found = (f"{url} serves "
             + plural(len(families), "gpuwatch_ metric family", "gpuwatch_ metric families"))
    served = served_by(body)
    if served is None:  # a daemon from before the `pid` label: whose it is cannot be told
        return [Check("metrics", OK, found, detail=where)]
    expected = info.pid if info is not None else None
    if isinstance(expected, int) and expected != served:
        return [Check("metrics", FAIL, f"{url} ({where}) is served by gpuwatch PID {served}, "
                                       f"not by the daemon {DAEMON_INFO_NAME} names (PID "
                                       f"{expected})",
                      fix="another daemon holds the port: `ss -ltnp` names it; stop one of "
                          "them, or give it another port (daemon.listen)")]
    if expected is None and not os.path.lexists(ctx.runtime_dir / DAEMON_INFO_NAME):
        return [Check("metrics", FAIL, f"{url} ({where}) is another daemon's (gpuwatch PID "
                                       f"{served}): no daemon runs on {ctx.runtime_dir}",
                      fix=f"that daemon has a runtime directory of its own: `gpuwatch doctor "
                          f"--runtime-dir DIR` checks it (`cat /proc/{served}/cmdline` shows "
                          f"its options); or {START_SHORT} on another port")]
    if expected is None:
        return [Check("metrics", OK, f"{found}, from gpuwatch PID {served} ({DAEMON_INFO_NAME} "
                                     "is unreadable here: whose it is is not confirmed)",
                      detail=where)]
    return [Check("metrics", OK, f"{found}, from the daemon (PID {served})", detail=where)]


_BUILD_INFO_PID = re.compile(r'^gpuwatch_build_info\{[^}\n]*\bpid="(\d+)"', re.M)


def served_by(body: str) -> Optional[int]:
    """The PID of the daemon whose metrics `body` is (its `gpuwatch_build_info` says), or None
    for a daemon that does not say."""
    match = _BUILD_INFO_PID.search(body)
    return int(match.group(1)) if match else None
