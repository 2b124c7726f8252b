"""/metrics is rendered once per poll: scrapes between two polls are served the same bytes, in
the format and encoding each asked for, and a poll renders again what scrapes ask for."""

from __future__ import annotations

import gzip
import re
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from gpuwatch.serve.exposition import Encoder, RenderedMetrics
from gpuwatch.simulate.demo import wait_for
from tests.daemonproc import running_daemon

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


class Polls:
    """A collector whose value is the number of times it was collected."""

    def __init__(self) -> None:
        self.collected = 0

    def collect(self) -> Iterable[Metric]:
        self.collected += 1
        yield GaugeMetricFamily("collected", "times collected", value=self.collected)


def _registry() -> tuple[CollectorRegistry, Polls]:
    registry = CollectorRegistry(auto_describe=False)
    polls = Polls()
    registry.register(polls)  # type: ignore[arg-type]
    return registry, polls


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _served(rendered: RenderedMetrics, encoder: Encoder, gzipped: bool = False
            ) -> tuple[bytes, bool]:
    """A scrape as the metrics port makes it: (body, whether it was rendered ahead)."""
    kept = rendered.kept(encoder, gzipped)
    return (kept, True) if kept is not None else (rendered.body(encoder, gzipped), False)


TEXT, _ = choose_encoder("")
OPENMETRICS_ENCODER, _ = choose_encoder(OPENMETRICS)


def test_scrapes_between_two_polls_get_one_rendering_in_each_format_asked_for() -> None:
    registry, polls = _registry()
    rendered = RenderedMetrics(registry, clock=Clock())
    first, ahead = _served(rendered, TEXT)
    assert not ahead and b"collected 1.0" in first
    assert _served(rendered, TEXT) == (first, True)  # a second scraper: the same bytes
    zipped, _ = _served(rendered, TEXT, gzipped=True)
    assert gzip.decompress(zipped).startswith(b"# HELP collected")
    assert _served(rendered, OPENMETRICS_ENCODER)[0].endswith(b"# EOF\n")
    assert polls.collected == rendered.renders == 3  # once per (format, encoding)


def _run(scrapers: list[tuple[float, float]], poll_every: float = 2.0, seconds: float = 600.0
         ) -> tuple[int, int, int]:
    """Polls every `poll_every` s and scrapers (first scrape at, every) for `seconds`: (scrapes,
    scrapes served bytes rendered ahead, renders)."""
    registry, _ = _registry()
    clock = Clock()
    rendered = RenderedMetrics(registry, clock=clock)
    start = clock.now
    events = [(start + t, "poll", 0.0) for t in _times(0.0, poll_every, seconds)]
    for at, every in scrapers:
        events += [(start + t, "scrape", every) for t in _times(at, every, seconds)]
    scrapes = ahead = 0
    for when, what, _every in sorted(events, key=lambda e: (e[0], e[1] == "scrape")):
        clock.now = when
        if what == "poll":
            rendered.refresh(poll_every)
        else:
            scrapes += 1
            ahead += _served(rendered, TEXT)[1]
    return scrapes, ahead, rendered.renders


def _times(first: float, every: float, seconds: float) -> list[float]:
    return [first + i * every for i in range(int((seconds - first) / every) + 1)]


def test_a_prometheus_slower_than_the_polls_is_served_bytes_rendered_once_per_scrape() -> None:
    scrapes, ahead, renders = _run([(1.3, 15.0)])
    assert scrapes == 40
    assert ahead >= scrapes - 2  # all but the first two: the rhythm is not known before
    assert renders <= scrapes + 1  # one a scrape, not one a poll (300 polls)


def test_an_ha_pair_of_scrapers_shares_the_renders() -> None:
    scrapes, ahead, renders = _run([(1.3, 15.0), (6.1, 15.0)])
    assert scrapes == 80
    assert ahead >= scrapes - 4
    assert renders <= 1.5 * scrapes + 2  # not one a poll (300 polls)


def test_a_scraper_faster_than_the_polls_gets_one_render_per_poll() -> None:
    scrapes, ahead, renders = _run([(0.3, 1.0)], poll_every=5.0, seconds=300.0)
    assert ahead >= scrapes - 5
    assert renders <= 300 / 5 + 2


def test_a_format_nobody_asked_for_lately_is_not_rendered_ahead() -> None:
    registry, polls = _registry()
    clock = Clock()
    rendered = RenderedMetrics(registry, clock=clock)
    _served(rendered, TEXT)
    clock.now += 301
    rendered.refresh(2.0)
    rendered.refresh(2.0)
    assert polls.collected == 1


def _scrape(url: str, **headers: str) -> tuple[bytes, dict[str, str]]:
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.read(), dict(r.headers)


def _poll_stamp(body: bytes) -> bytes:
    found = re.search(rb"^gpuwatch_last_poll_timestamp_seconds (\S+)$", body, re.M)
    assert found, body[:2000]
    return found.group(1)


def test_the_daemon_serves_scrapes_between_two_polls_the_same_bytes(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    """Its own counters too: the responses it counted are those before the poll, so two
    scrapes of one poll are identical, whatever each was answered."""
    with running_daemon(cli_env, tmp_path, args=("--interval", "1")) as daemon:
        def same_bytes() -> bytes | None:
            # Rendered per scrape, the second would count the first in its responses. (A poll
            # may end between the two: then they differ, and the next pair is tried.)
            # Until a poll has counted a response: the first polls may have none to count.
            a, _ = _scrape(daemon.metrics_url)
            b, _ = _scrape(daemon.metrics_url)
            counted = re.search(rb'^gpuwatch_http_responses_total\{code="200"\} ', a, re.M)
            return a if a == b and counted else None

        a = wait_for("two scrapes of one poll served the same bytes", same_bytes, 20,
                     alive=daemon.proc)
        assert re.search(rb'^gpuwatch_http_responses_total\{code="200"\} ', a, re.M)
        zipped, headers = _scrape(daemon.metrics_url, **{"Accept-Encoding": "gzip"})
        assert headers.get("Content-Encoding") == "gzip"
        assert gzip.decompress(zipped).startswith(b"# HELP ")
        wait_for("a later poll", lambda: _poll_stamp(_scrape(daemon.metrics_url)[0]) !=
                 _poll_stamp(a) or None, 20, alive=daemon.proc)
