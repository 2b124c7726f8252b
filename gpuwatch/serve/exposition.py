"""The metrics as scrapes get them: rendered at most once per poll, ahead of the scrape.

What /metrics serves changes only when a poll ends. Rendering it for every scrape costs the whole
render each time (18 ms at 512 GPU processes), for every scraper (an HA pair of Prometheus
servers, a federation, a person with curl); rendering it after every poll costs as much at every
poll, 2 s apart by default, for a Prometheus that scrapes every 15 s or every minute. So after
each poll the daemon renders a format (text or OpenMetrics, plain or gzipped) only where a scrape
for it is due before the next poll: the last scrape for it plus one of the recent gaps between
its scrapes lands before then. In the steady state that is one render per scrape (with two
scrapers taking turns, at most three for two), done before the scrape arrives, which is then
served bytes. A scrape the daemon could not see coming (the first two for a format, before
their rhythm shows; one that came early) renders then, and what it rendered is kept until the
next poll, so a second scraper gets the same bytes.

Everything in a body, the metrics port's own counters (connections, responses) included, is as
of the poll. A gzipped body is compressed once per render, never per scrape; the daemon hands in
a writer that writes the exporter's per-process lines again only where they changed
(sinks/exposition_text.py).
"""

from __future__ import annotations

import copy
import gzip
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from typing import Callable, Optional

from gpuwatch.metrics import Metric, Registry
from gpuwatch.serve.gzip_parts import PartsGzip

Encoder = Callable[[Registry], bytes]
#: How a body is written, in parts whose concatenation is what `encoder(registry)` returns: the
#: application layer hands one in (the exporter's writer, which keeps lines that did not change
#: and gives a part a family: sinks/exposition_text.py).
Writer = Callable[[Encoder, "Registry | Selection"], Sequence[bytes]]
#: (encoder_key of the encoder, gzipped): equal for the equal encoders of two requests.
Key = tuple[object, bool]
#: zlib's fastest level. A scraped body is mostly the same label sets again, which level 1
#: finds as well: measured on the daemon's text body, 8 fake GPUs, 0.07 ms and 7.5 KiB at 64
#: GPU processes, 0.79 ms and 31 KiB at 1,024, where level 6 (prometheus-client's) took 0.29 ms
#: for 6.7 KiB and 1.88 ms for 28 KiB: a tenth more bytes on the wire for a quarter to a half of
#: the CPU, paid at every scrape.
GZIP_LEVEL = 1
#: Gzipped formats whose last body's deflate is kept (text and OpenMetrics under each escaping
#: of names a scraper may ask for).
GZIPPERS_KEPT = 8
#: A format nobody asked for in this long is no longer rendered ahead.
FORGET_AFTER = 300.0
#: Gaps between scrapes remembered per format: the shortest says when the next may come.
GAPS_KEPT = 4
#: Scrapes closer than this are not a rhythm of their own.
MIN_GAP = 0.5


def encoder_key(encoder: Encoder) -> object:
    """A key equal for equal encoders: gpuwatch.metrics' encoders compare by their format;
    a `partial` (prometheus-client's choose_encoder makes a new one for every OpenMetrics
    request) by what it wraps."""
    if isinstance(encoder, partial):
        return (encoder.func, encoder.args, tuple(sorted(encoder.keywords.items())))
    return encoder


def render(encoder: Encoder, registry: Registry | Selection, gzipped: bool,
           writer: Optional[Writer] = None, gzipper: Optional[PartsGzip] = None) -> bytes:
    """The body, gzipped where asked: by `gzipper` where one is given (compressing only the
    parts that changed since its last body), else whole."""
    # The encoders call only collect(), which a Selection has.
    parts = (writer(encoder, registry) if writer is not None
             else [encoder(registry)])  # type: ignore[arg-type]
    if not gzipped:
        return b"".join(parts)
    if gzipper is not None:
        return gzipper.compress(parts)
    return gzip.compress(b"".join(parts), compresslevel=GZIP_LEVEL)


class Selection:
    """What `/metrics?name[]=...` asks for, out of `registry`: each family named (its help and
    type even while it has no series), and each sample named (`gpuwatch_polls_total`,
    `gpuwatch_build_info`, `..._bucket`: what prometheus-client's restricted registry selects
    too).

    Taken from what the registry collects, not from what its collectors describe: a collector
    that renders the latest report describes nothing (there may be none when it registers), and
    a family it serves must be selectable all the same."""

    def __init__(self, registry: Registry, names: Iterable[str]) -> None:
        self.registry = registry
        self.names = frozenset(names)

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if family.name in self.names:
                yield family
                continue
            samples = [s for s in family.samples if s.name in self.names]
            if samples:
                chosen = copy.copy(family)
                chosen.samples = samples
                yield chosen


class _Scrapes:
    """When one format was last asked for, and the recent gaps between asks."""

    __slots__ = ("gaps", "last")

    def __init__(self, now: float) -> None:
        self.last = now
        self.gaps: list[float] = []

    def asked(self, now: float) -> None:
        gap = now - self.last
        self.last = now
        if gap >= MIN_GAP:  # closer ones are one scrape each from two scrapers: one render
            self.gaps = [*self.gaps[-(GAPS_KEPT - 1):], gap]

    def due_within(self, start: float, end: float) -> bool:
        """Whether the next scrape may come in (start, end]: one of the recent gaps after the
        last one lands there (several scrapers make gaps that take turns). No while the rhythm
        is unknown: a person's one curl is not rendered for at every poll."""
        return any(start < self.last + gap <= end for gap in self.gaps)


class RenderedMetrics:
    """The registry's exposition by (encoder, gzip), kept until `refresh()`."""

    def __init__(self, registry: Registry,
                 clock: Callable[[], float] = time.monotonic,
                 writer: Optional[Writer] = None) -> None:
        self.registry = registry
        self._clock = clock
        self._lock = threading.Lock()
        self._generation = 0
        self._bodies: dict[Key, bytes] = {}
        self._scrapes: dict[Key, _Scrapes] = {}
        #: The encoder of each key, to render it ahead.
        self._encoders: dict[Key, Encoder] = {}
        #: Writes a body in the encoder's place, where one is given.
        self.writer = writer
        #: By key, what compresses its gzipped bodies (the deflate of each group of families kept
        #: for the next render of that key: serve/gzip_parts.py).
        self._gzippers: dict[Key, PartsGzip] = {}
        #: Renders done, for tests and benches: one per scrape, at most one per poll and format.
        self.renders = 0

    def kept(self, encoder: Encoder, gzipped: bool) -> Optional[bytes]:
        """What was rendered since the last poll in that form, or None (then `body` renders)."""
        with self._lock:
            key = (encoder_key(encoder), gzipped)
            self._asked(key, encoder)
            return self._bodies.get(key)

    def body(self, encoder: Encoder, gzipped: bool) -> bytes:
        """The body in that form, rendered now if it was not since the last poll. A scrape is
        counted by `kept`, asked first."""
        key = (encoder_key(encoder), gzipped)
        with self._lock:
            kept = self._bodies.get(key)
            generation = self._generation
        if kept is not None:
            return kept
        body = self._render(encoder, gzipped, key)
        with self._lock:
            if generation == self._generation:  # a poll ended meanwhile: this one is older
                self._bodies[key] = body
        return body

    def refresh(self, next_poll_in: float) -> None:
        """A poll ended, the next in `next_poll_in` seconds: drop what was rendered, and render
        each format whose next scrape is due before then."""
        now = self._clock()
        with self._lock:
            self._generation += 1
            self._bodies.clear()
            self._scrapes = {key: s for key, s in self._scrapes.items()
                             if now - s.last < FORGET_AFTER}
            self._encoders = {key: e for key, e in self._encoders.items()
                              if key in self._scrapes}
            wanted = [(key, self._encoders[key]) for key, s in self._scrapes.items()
                      if s.due_within(now, now + next_poll_in)]
            generation = self._generation
        for key, encoder in wanted:
            body = self._render(encoder, key[1], key)
            with self._lock:
                if generation != self._generation:
                    return
                self._bodies[key] = body

    def _asked(self, key: Key, encoder: Encoder) -> None:
        now = self._clock()
        scrapes = self._scrapes.get(key)
        if scrapes is None:
            self._scrapes[key] = _Scrapes(now)
            self._encoders[key] = encoder
        else:
            scrapes.asked(now)

    def _render(self, encoder: Encoder, gzipped: bool, key: Key) -> bytes:
        self.renders += 1
        gzipper = None
        if gzipped and self.writer is not None:
            with self._lock:
                gzipper = self._gzippers.get(key)
                if gzipper is None:
                    if len(self._gzippers) >= GZIPPERS_KEPT:  # a bound all the same
                        self._gzippers.clear()
                    gzipper = self._gzippers[key] = PartsGzip(GZIP_LEVEL)
        return render(encoder, self.registry, gzipped, self.writer, gzipper)
