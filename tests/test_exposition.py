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

from gpuwatch.simulate.demo import wait_for
from gpuwatch.sinks.exposition import RenderedMetrics
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


def test_scrapes_between_two_refreshes_get_one_rendering_in_each_format_asked_for() -> None:
    registry, polls = _registry()
    rendered = RenderedMetrics(registry)
    text, _ = choose_encoder("")
    openmetrics, _ = choose_encoder(OPENMETRICS)
    first = rendered.body(text, False)
    assert rendered.body(text, False) == first and b"collected 1.0" in first
    zipped = rendered.body(text, True)
    assert gzip.decompress(zipped).startswith(b"# HELP collected")
    assert rendered.body(openmetrics, False).endswith(b"# EOF\n")
    assert polls.collected == 3  # once per (format, encoding), not per scrape

    rendered.refresh()  # a poll ended: each of the three is rendered again, once
    assert polls.collected == 6
    assert rendered.body(text, False) != first
    assert rendered.body(text, True) == rendered.body(text, True)
    assert polls.collected == 6


def test_a_format_nobody_asked_for_lately_is_not_rendered_at_each_poll() -> None:
    registry, polls = _registry()
    rendered = RenderedMetrics(registry, keep_rendering=0.0)
    text, _ = choose_encoder("")
    rendered.body(text, False)
    rendered.refresh()
    rendered.refresh()
    assert polls.collected == 1
    assert b"collected 2.0" in rendered.body(text, False)


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
        def same_poll() -> tuple[bytes, bytes] | None:
            a, _ = _scrape(daemon.metrics_url)
            b, _ = _scrape(daemon.metrics_url)
            return (a, b) if _poll_stamp(a) == _poll_stamp(b) else None

        a, b = wait_for("two scrapes of one poll", same_poll, 20, alive=daemon.proc)
        assert a == b
        assert re.search(rb'^gpuwatch_http_responses_total\{code="200"\} ', a, re.M)
        zipped, headers = _scrape(daemon.metrics_url, **{"Accept-Encoding": "gzip"})
        assert headers.get("Content-Encoding") == "gzip"
        assert gzip.decompress(zipped).startswith(b"# HELP ")
        wait_for("a later poll", lambda: _poll_stamp(_scrape(daemon.metrics_url)[0]) !=
                 _poll_stamp(a) or None, 20, alive=daemon.proc)
