"""A real Alertmanager for the end-to-end tests, routing every alert to a webhook receiver that
records what an on-call engineer would have been sent.

Routing as docs/runbooks.md recommends (one group per alert, node and job), with the waits cut to
a second so that a test sees in seconds what a pager sees in minutes.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import MappingProxyType
from typing import Any, Optional

from gpuwatch.simulate.demo import wait_for
from tests.promserver import free_port, ready
from tests.realprocs import terminate

#: Debian's package names the binary so.
ALERTMANAGER = "prometheus-alertmanager"


def alertmanager_binary() -> Optional[str]:
    return shutil.which(ALERTMANAGER) or shutil.which("alertmanager")


@dataclass
class Notification:
    """One webhook delivery: Alertmanager's payload (version 4), as received."""

    payload: dict[str, Any]
    received_at: float = field(default_factory=time.time)

    @property
    def status(self) -> str:
        return str(self.payload["status"])

    @property
    def alerts(self) -> list[dict[str, Any]]:
        return list(self.payload["alerts"])

    @property
    def group_labels(self) -> dict[str, str]:
        return dict(self.payload["groupLabels"])


class WebhookReceiver:
    """An HTTP server on 127.0.0.1 that keeps every notification posted to it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._received: list[Notification] = []
        received, lock = self._received, self._lock

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with lock:
                    received.append(Notification(json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def notifications(self) -> list[Notification]:
        with self._lock:
            return list(self._received)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextlib.contextmanager
def alertmanager_routing_to(receiver: WebhookReceiver, tmp_path: Path,
                            routes: Mapping[str, WebhookReceiver] = MappingProxyType({}),
                            group_by: str = "alertname, node, job_id") -> Iterator[str]:
    """A real Alertmanager sending every notification, resolved ones too, to `receiver`, or
    to the receiver of the first of `routes` (a matcher, `namespace="ml-team"`) the alert
    matches; yields its HOST:PORT (for Prometheus's alerting config) once it is ready."""
    binary = alertmanager_binary()
    assert binary is not None, f"{ALERTMANAGER} is not installed (make test installs it)"
    port = free_port()
    config = tmp_path / "alertmanager.yml"
    sub_routes = "".join(f"""    - matchers: ['{matcher}']
      receiver: routed-{i}
""" for i, matcher in enumerate(routes))
    sub_receivers = "".join(f"""  - name: routed-{i}
    webhook_configs:
      - url: "{routed.url}"
        send_resolved: true
""" for i, routed in enumerate(routes.values()))
    config.write_text(f"""
route:
  receiver: on-call
  group_by: [{group_by}]
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 4h
{"  routes:" + chr(10) + sub_routes if routes else ""}receivers:
  - name: on-call
    webhook_configs:
      - url: "{receiver.url}"
        send_resolved: true
{sub_receivers}""")
    log = open(tmp_path / "alertmanager.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.path={tmp_path / 'alertmanager'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for("alertmanager to be ready", lambda: ready(f"http://127.0.0.1:{port}"), 60,
                 alive=proc)
        yield f"127.0.0.1:{port}"
    finally:
        terminate(proc)
        log.close()
