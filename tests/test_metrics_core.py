"""gpuwatch.metrics, the daemon's metrics core: its families, counters, histograms and process
metrics are prometheus-client's, and its encoders write prometheus-client's bytes for every
`Accept` header, without the daemon importing prometheus-client (the oracle here)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from prometheus_client import core as theirs
from prometheus_client.exposition import choose_encoder as their_encoder
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om

from gpuwatch import metrics as ours
from gpuwatch.metrics import choose_encoder
from tests.daemonproc import running_daemon

#: Accept headers: the text format's versions and escapings, OpenMetrics', Prometheus's own,
#: and what prometheus-client answers with its defaults.
ACCEPTS = [
    "", "*/*", "text/plain", "text/plain; version=0.0.4", "text/plain;version=1.0.0",
    *(f"text/plain; version=1.0.0; escaping={e}"
      for e in ("allow-utf-8", "underscores", "dots", "values", "nonsense")),
    "application/openmetrics-text", "application/openmetrics-text; version=1.0.0",
    "application/openmetrics-text; version=0.0.1",
    *(f"application/openmetrics-text; version=1.0.0; escaping={e}"
      for e in ("allow-utf-8", "underscores", "dots", "values")),
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "text/html, application/openmetrics-text; version=2.0.0",
]
HOSTILE = 'a"b\\c\nd ünï'
HELP = 'Help with a backslash \\, a newline\nand "quotes".'
VALUES = [0, 1, -1, 0.1, -0.0, 1e-9, 7516192768, 123456.789, 1e22, float("inf"),
          float("-inf"), float("nan")]


def _families(m: Any) -> Iterator[Any]:
    """The same families, built with `m`'s family classes (gpuwatch's or prometheus-client's)."""
    gauge = m.GaugeMetricFamily("x_gauge_bytes", HELP, labels=["pid", "name", "colon:ok"])
    for i, value in enumerate(VALUES):
        gauge.add_metric([str(i), HOSTILE, "v"], value)
    yield gauge
    yield m.GaugeMetricFamily("x_plain", "A gauge without labels.", value=3)
    yield m.GaugeMetricFamily("x_empty", "A family with no series yet.", labels=["a"])
    counter = m.CounterMetricFamily("x_events_total", "Events, by kind.", labels=["kind"])
    counter.add_metric(["b"], 2)
    counter.add_metric(["a"], 1.5)
    yield counter
    yield m.CounterMetricFamily("x_once", "A counter with a value.", value=7)
    info = m.InfoMetricFamily("x_build", "Build.", labels=["z"])
    info.add_metric(["last"], {"version": "1.2", "python": HOSTILE})
    yield info


def _instruments(m: Any, registry: Any) -> None:
    """A counter and a histogram of each kind, counted the same (prometheus-client's with
    `registry=None`, their `_created` samples left out below)."""
    kw: dict[str, Any] = {"registry": None} if m is prometheus_client else {}
    plain = m.Counter("x_polls", "Polls.", **kw)
    plain.inc()
    plain.inc(2.5)
    labelled = m.Counter("x_errors", "Errors by source.", ["source"], **kw)
    for source in ("nvml", "procfs", "poll"):
        labelled.labels(source)
    labelled.labels("procfs").inc(3)
    hist = m.Histogram("x_poll_duration_seconds", "Wall time.", buckets=(0.001, 0.01, 0.5, 1.0),
                       **kw)
    for value in (0.0005, 0.003, 0.003, 0.7, 12.0):
        hist.observe(value)
    for instrument in (plain, labelled, hist):
        registry.register(_NoCreated(instrument))


class _NoCreated:
    def __init__(self, instrument: Any) -> None:
        self.instrument = instrument

    def collect(self) -> Iterator[Any]:
        for metric in self.instrument.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class _Families:
    def __init__(self, m: Any) -> None:
        self.m = m

    def collect(self) -> Iterator[Any]:
        return _families(self.m)


def _registries() -> tuple[ours.Registry, prometheus_client.CollectorRegistry]:
    mine, their = ours.Registry(), prometheus_client.CollectorRegistry(auto_describe=False)
    mine.register(_Families(ours))
    their.register(_Families(theirs))
    _instruments(ours, mine)
    _instruments(prometheus_client, their)
    return mine, their


@pytest.mark.parametrize("accept", ACCEPTS)
def test_the_encoders_write_prometheus_clients_bytes_and_content_type_for_each_accept_header(
        accept: str) -> None:
    mine, their = _registries()
    encoder, content_type = choose_encoder(accept)
    their_encode, their_type = their_encoder(accept)
    assert content_type == their_type
    assert encoder(mine) == their_encode(their)
    # Either's encoder writes the other's families the same.
    assert encoder(their) == their_encode(mine) == their_encode(their)


def test_equal_accept_headers_get_equal_encoders() -> None:
    """What was rendered for one OpenMetrics scrape is kept for the next (serve/exposition)."""
    accept = "application/openmetrics-text; version=1.0.0"
    assert choose_encoder(accept)[0] == choose_encoder(accept)[0]
    assert choose_encoder(accept)[0] != choose_encoder("")[0]


def test_a_version_that_is_not_one_gets_the_default_text_format() -> None:
    """prometheus-client raises on it (a 500); the daemon answers with the text format."""
    assert choose_encoder("text/plain; version=x.1")[1] == choose_encoder("")[1]


def test_a_counter_cannot_go_down() -> None:
    counter = ours.Counter("x_total", "X.")
    with pytest.raises(ValueError, match="non-negative"):
        counter.inc(-1)
    assert counter.collect()[0].samples == [ours.Sample("x_total", {}, 0.0)]


def test_the_process_metrics_are_prometheus_clients() -> None:
    mine = {m.name: m for m in ours.ProcessCollector().collect()}
    their = {m.name: m for m in prometheus_client.ProcessCollector(registry=None).collect()}
    assert [(m.name, m.documentation, m.type) for m in mine.values()] == [
        (m.name, m.documentation, m.type) for m in their.values()]
    assert len(mine) == 6
    for name in ("process_start_time_seconds", "process_max_fds"):
        assert mine[name].samples == their[name].samples
    assert [s.name for m in mine.values() for s in m.samples] == [
        s.name for m in their.values() for s in m.samples]


def test_the_process_figures_read_through_the_kept_stat_file_move_as_the_process_does() -> None:
    collector = ours.ProcessCollector()

    def figure(name: str) -> float:
        (family,) = [m for m in collector.collect() if m.name == name]
        return family.samples[0].value

    cpu, rss = figure("process_cpu_seconds"), figure("process_resident_memory_bytes")
    deadline = time.monotonic() + 30
    while figure("process_cpu_seconds") <= cpu + 0.05:  # clock ticks: 10 ms each
        assert time.monotonic() < deadline
        sum(range(100_000))
    held = bytearray(64 << 20)
    held[::4096] = b"\x01" * len(held[::4096])  # every page touched: resident
    assert figure("process_resident_memory_bytes") >= rss + (32 << 20)
    del held


def test_open_fds_counts_the_descriptors_open_whichever_way_the_kernel_answers() -> None:
    """One stat() where Linux gives /proc/PID/fd a size, a listing elsewhere: both count what is
    open (the listing also sees its own descriptor, as prometheus-client's does)."""
    def open_fds() -> float:
        (family,) = [m for m in ours.ProcessCollector().collect() if m.name == "process_open_fds"]
        return family.samples[0].value

    before = open_fds()
    extra = [os.open("/dev/null", os.O_RDONLY) for _ in range(5)]
    try:
        listed = len(os.listdir("/proc/self/fd"))
        assert open_fds() == before + 5
        assert open_fds() in (listed - 1, listed)  # a size (6.2 and later) or a listing
    finally:
        for fd in extra:
            os.close(fd)


_IMPORTS = r"""
import json, sys
import gpuwatch.daemon
print(json.dumps(sorted(sys.modules)))
"""
#: What the daemon does not load: prometheus-client, and what its package brings along (an
#: HTTP server, WSGI, e-mail); TLS only with a web config that asks for it.
UNWANTED = ("prometheus_client", "http.server", "wsgiref", "email", "ssl", "_ssl")
#: What a running daemon without basic auth never imports: each would stay in its memory for
#: its whole life (bench/rss_plateau.py).
UNWANTED_RUNNING = ("argparse", "difflib", "uuid", "queue", "base64", "encodings.idna",
                    "stringprep", "platform")


def test_importing_the_daemon_loads_no_prometheus_client_nor_tls() -> None:
    loaded = json.loads(subprocess.run([sys.executable, "-c", _IMPORTS], check=True,
                                       capture_output=True, text=True).stdout)
    assert [m for m in loaded if m.split(".")[0] in UNWANTED or m in UNWANTED] == []


def _get(url: str, headers: dict[str, str]) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
        body: bytes = r.read()
        return gzip.decompress(body) if r.headers.get("Content-Encoding") == "gzip" else body


def test_a_running_daemon_serves_its_metrics_without_prometheus_client_or_tls(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    """Every format a scraper may ask for, and a name[] selection, served by a daemon that
    never imported prometheus-client or ssl (Python lists each import in the daemon's log)."""
    env = {**cli_env, "PYTHONPROFILEIMPORTTIME": "1"}
    with running_daemon(env, tmp_path) as d:
        text = _get(d.metrics_url, {}).decode()
        assert "# TYPE gpuwatch_polls_total counter" in text
        assert "# TYPE process_resident_memory_bytes gauge" in text
        om = _get(d.metrics_url, {"Accept": ACCEPTS[-2], "Accept-Encoding": "gzip"}).decode()
        assert om.endswith("# EOF\n")
        assert {f.name for f in parse_om(om)} >= {"gpuwatch_polls", "gpuwatch_build",
                                                  "process_cpu_seconds"}
        chosen = _get(d.metrics_url + "?name[]=gpuwatch_polls_total", {}).decode()
        assert chosen.startswith("# HELP gpuwatch_polls_total Polls completed.\n")
        assert chosen.count("# TYPE") == 1
        imported = [line.rsplit("|", 1)[1].strip() for line in d.log_path.read_text().splitlines()
                    if line.startswith("import time:") and "|" in line]
    assert "gpuwatch.daemon" in imported and "gpuwatch.metrics" in imported
    assert [m for m in imported if m.split(".")[0] in UNWANTED] == []
    # The daemon process's own imports: those after `gpuwatch daemon` exec'd it (each
    # interpreter's list starts with a header line).
    log = d.log_path.read_text()
    own = log[log.rindex("import time: self [us]"):].splitlines()
    daemon_imported = [line.rsplit("|", 1)[1].strip() for line in own
                       if line.startswith("import time:") and "|" in line]
    assert "gpuwatch.poll" in daemon_imported
    assert [m for m in daemon_imported if m in UNWANTED_RUNNING] == []


def test_a_name_is_escaped_once_however_many_samples_carry_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A render writes the same few metric and label names on every sample: each is escaped
    once, not once per sample (a thousand GPU processes' series), with the same bytes."""
    from gpuwatch.metrics import exposition

    for cached in (exposition.escape_metric_name, exposition.escape_label_name):
        getattr(cached, "cache_clear", lambda: None)()
    escaped: list[str] = []
    real = exposition._escape_name

    def counting(s: str, *args: Any) -> str:
        escaped.append(s)
        return real(s, *args)

    monkeypatch.setattr(exposition, "_escape_name", counting)
    gauge = ours.GaugeMetricFamily("x_rss_bytes", "RSS.", labels=["pid", "name"])
    their_gauge = theirs.GaugeMetricFamily("x_rss_bytes", "RSS.", labels=["pid", "name"])
    for pid in range(1000):
        gauge.add_metric([str(pid), "python"], pid)
        their_gauge.add_metric([str(pid), "python"], pid)
    encoder, _ = choose_encoder("")
    their_encode, _ = their_encoder("")

    class One:
        def __init__(self, family: Any) -> None:
            self.family = family

        def collect(self) -> Iterator[Any]:
            yield self.family

    body = encoder(One(gauge))
    assert encoder(One(gauge)) == body == their_encode(One(their_gauge))
    assert len(escaped) <= 4, escaped[:10]
