"""The metrics as scrapes get them: rendered once per poll, not once per scrape.

What /metrics serves changes when a poll ends; rendering it again for every scrape in between
(two Prometheus servers, a federation, a person with curl) costs the whole render each time: 18 ms
at 512 GPU processes. So the daemon renders after each poll, in the formats and encodings scrapes
asked for in the last five minutes (a scrape interval longer than the poll interval included),
and a scrape is served those bytes. A format asked for the first time is rendered then, and
kept until the next poll.

The counters the metrics port keeps about itself (connections, responses) are as of the poll,
like everything else in the body.
"""

from __future__ import annotations

import gzip
import threading
import time
from typing import Callable, Optional

from prometheus_client import CollectorRegistry

Encoder = Callable[[CollectorRegistry], bytes]
#: prometheus-client's default: fast, and within a few percent of the smallest body.
GZIP_LEVEL = 6
#: How long after the last scrape that asked for a format it is still rendered at each poll.
KEEP_RENDERING = 300.0


class RenderedMetrics:
    """The registry's exposition by (encoder, gzip), kept until `refresh()`."""

    def __init__(self, registry: CollectorRegistry,
                 keep_rendering: float = KEEP_RENDERING) -> None:
        self.registry = registry
        self.keep_rendering = keep_rendering
        self._lock = threading.Lock()
        self._generation = 0
        self._bodies: dict[tuple[Encoder, bool], bytes] = {}
        #: When each (encoder, gzip) was last asked for (time.monotonic()).
        self._asked: dict[tuple[Encoder, bool], float] = {}

    def kept(self, encoder: Encoder, gzipped: bool) -> Optional[bytes]:
        """What was rendered since the last poll in that form, or None (then `body` renders)."""
        with self._lock:
            self._asked[(encoder, gzipped)] = time.monotonic()
            return self._bodies.get((encoder, gzipped))

    def body(self, encoder: Encoder, gzipped: bool) -> bytes:
        key = (encoder, gzipped)
        with self._lock:
            self._asked[key] = time.monotonic()
            kept = self._bodies.get(key)
            generation = self._generation
        if kept is not None:
            return kept
        body = self._render(encoder, gzipped)
        with self._lock:
            if generation == self._generation:  # a poll ended meanwhile: this one is older
                self._bodies[key] = body
        return body

    def refresh(self) -> None:
        """A poll ended: drop what was rendered, render again what scrapes ask for."""
        since = time.monotonic() - self.keep_rendering
        with self._lock:
            self._generation += 1
            self._bodies.clear()
            self._asked = {key: at for key, at in self._asked.items() if at > since}
            wanted = list(self._asked)
            generation = self._generation
        for encoder, gzipped in wanted:
            body = self._render(encoder, gzipped)
            with self._lock:
                if generation != self._generation:
                    return
                self._bodies[(encoder, gzipped)] = body

    def _render(self, encoder: Encoder, gzipped: bool) -> bytes:
        return render(encoder, self.registry, gzipped)


def render(encoder: Encoder, registry: CollectorRegistry, gzipped: bool) -> bytes:
    body = encoder(registry)
    return gzip.compress(body, compresslevel=GZIP_LEVEL) if gzipped else body
