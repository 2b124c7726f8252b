"""What the daemon's listeners did with their connections: `ConnectionStats`, counted by each
listener (gpuwatch.serve.listener) as a connection ends, and `ConnectionCollector`, which the
daemon registers to export them (`gpuwatch_connections_total`, `gpuwatch_connections_open`,
`gpuwatch_http_responses_total`)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

from gpuwatch.metrics import CounterMetricFamily, GaugeMetricFamily

RESULTS = ("answered", "refused", "evicted", "timed_out", "failed")
SOCKETS = ("metrics", "state")
#: HTTP status codes present at 0 from the start, so that `increase()` sees the first of each.
COMMON_CODES = ("200", "401", "404")


class ConnectionStats:
    """What the listeners of one daemon did with their connections; read by the collector."""

    def __init__(self, sockets: Iterable[str] = SOCKETS) -> None:
        self._lock = threading.Lock()
        self.results: dict[tuple[str, str], int] = {
            (s, r): 0 for s in sockets for r in RESULTS}
        self.open: dict[str, int] = dict.fromkeys(sockets, 0)
        self.responses: dict[str, int] = dict.fromkeys(COMMON_CODES, 0)

    def ended(self, sock: str, result: str) -> None:
        with self._lock:
            self.results[(sock, result)] = self.results.get((sock, result), 0) + 1

    def set_open(self, sock: str, n: int) -> None:
        self.open[sock] = n

    def response(self, code: int) -> None:
        with self._lock:
            self.responses[str(code)] = self.responses.get(str(code), 0) + 1

    def result(self, sock: str, result: str) -> int:
        return self.results.get((sock, result), 0)


class ConnectionCollector:
    """`gpuwatch_connections_total`, `gpuwatch_connections_open` and
    `gpuwatch_http_responses_total`, from a `ConnectionStats`."""

    def __init__(self, stats: ConnectionStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        s = self.stats
        with s._lock:
            results = sorted(s.results.items())
            responses = sorted(s.responses.items())
        ended = CounterMetricFamily(
            "gpuwatch_connections", "Connections to /metrics and state.sock, by how they ended: "
            "answered, refused (over the cap), evicted (idle, closed for a newer one), "
            "timed_out (too slow to send its request or to read the answer), failed.",
            labels=["socket", "result"])
        for (sock, result), n in results:
            ended.add_metric([sock, result], n)
        yield ended
        opened = GaugeMetricFamily("gpuwatch_connections_open",
                                   "Connections open now, by socket.", labels=["socket"])
        for sock, n in sorted(s.open.items()):
            opened.add_metric([sock], n)
        yield opened
        codes = CounterMetricFamily("gpuwatch_http_responses",
                                    "HTTP responses sent on the metrics port, by status code.",
                                    labels=["code"])
        for code, n in responses:
            codes.add_metric([code], n)
        yield codes
