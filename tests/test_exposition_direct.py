"""/metrics and the status document written directly, each part kept while it does not change:
the same bytes as prometheus-client's formatter and json.dumps write, on real reports; one bad
value costs its section of /metrics, never the scrape. prometheus-client is the oracle here: the
daemon does not import it (gpuwatch.metrics)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import choose_encoder as their_encoder
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
from prometheus_client.parser import text_string_to_metric_families as parse_text

from gpuwatch.metrics import choose_encoder
from gpuwatch.model import GpuDevice, Job, NodeReport
from gpuwatch.serve.exposition import RenderedMetrics
from gpuwatch.sinks.document import DocumentWriter, bounded_json, status_document
from gpuwatch.sinks.exporter import ReportCollector
from gpuwatch.sinks.exposition_text import LineWriter
from tests import leakreports
from tests.realprocs import GIB, running_job

#: What Prometheus (2.x, 3.x) sends by default: OpenMetrics first.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
TEXT, _ = choose_encoder("")


def _samples(body: bytes, openmetrics: bool = False) -> set[tuple[object, ...]]:
    parse = parse_om if openmetrics else parse_text
    return {(f.name, f.type, f.documentation, s.name, tuple(sorted(s.labels.items())), s.value)
            for f in parse(body.decode()) for s in f.samples}


def _hostile_report() -> NodeReport:
    """leakreports' findings, agents and buffers, and a process whose name and user need
    escaping in a label."""
    report = leakreports.leak_report()
    p = report.snapshot.processes[700]
    odd = replace(p, pid=799, name='a"b\\c\nd', user="x\\y")
    processes = MappingProxyType({**report.snapshot.processes, 799: odd})
    return replace(report, snapshot=replace(report.snapshot, processes=processes))


def _same_as_prometheus_client(registry: CollectorRegistry, writer: LineWriter) -> bytes:
    for accept, openmetrics in (("", False), (PROMETHEUS_ACCEPT, True)):
        (encoder, content_type), (theirs_encoder, theirs_type) = (
            choose_encoder(accept), their_encoder(accept))
        assert content_type == theirs_type
        ours, theirs = writer.write(encoder, registry), theirs_encoder(registry)
        assert ours == theirs
        assert _samples(ours, openmetrics) == _samples(theirs, openmetrics)
    return writer.write(TEXT, registry)


def test_the_exposition_written_directly_is_prometheus_clients_byte_for_byte() -> None:
    report = _hostile_report()
    registry = CollectorRegistry()
    registry.register(ReportCollector(lambda: report))
    writer = LineWriter()
    body = _same_as_prometheus_client(registry, writer)
    assert b'name="a\\"b\\\\c\\nd"' in body and b'user="x\\\\y"' in body
    # Again, from the lines kept, and after a figure changed.
    _same_as_prometheus_client(registry, writer)
    report = replace(report, snapshot=replace(report.snapshot, processes=MappingProxyType({
        **report.snapshot.processes, 799: replace(report.snapshot.processes[799],
                                                  rss_bytes=7 * GIB)})))
    assert b"7.516192768e+09" in _same_as_prometheus_client(registry, writer)


def test_a_family_written_whole_is_kept_while_its_samples_are_and_written_again_once_not(
) -> None:
    """The daemon's own counters, histograms and gauges go through the general encoder, one
    family at a time; what it wrote is kept while the family's samples are the same, and a
    moved counter, a new label, an observation or a -0.0 (written by its sign) is written
    again."""
    from prometheus_client import Counter, Gauge, Histogram

    registry = CollectorRegistry()
    polls = Counter("polls", "Polls.", registry=registry)
    errors = Counter("errors", "Errors by kind.", ["kind"], registry=registry)
    took = Histogram("took_seconds", "Poll time.", buckets=(0.01, 0.1), registry=registry)
    clock = Gauge("clock_step_seconds", "Clock step.", registry=registry)
    writer = LineWriter()
    _same_as_prometheus_client(registry, writer)
    kept = writer.whole_kept
    _same_as_prometheus_client(registry, writer)
    assert writer.whole_kept - kept == 3 * 4  # each family, in each of the three writes
    for change in (polls.inc, lambda: errors.labels("nvml").inc(), lambda: took.observe(0.05)):
        change()
        kept = writer.whole_kept
        _same_as_prometheus_client(registry, writer)
        # The other three each time; the changed one too at the last write, which is in the
        # format of the first.
        assert writer.whole_kept - kept == 3 + 3 + 4
    clock.set(-0.0)
    kept = writer.whole_kept
    _same_as_prometheus_client(registry, writer)
    assert writer.whole_kept - kept == 3 + 3 + 3  # -0.0 is never kept: 0.0 equals it
    assert b"clock_step_seconds -0.0\n" in writer.write(TEXT, registry)


def test_a_kept_process_is_written_again_when_its_pod_is_named_or_the_clock_steps() -> None:
    """The collector keeps a process's rows while its record is the same object; the pod's
    names (the job's, arriving a poll later) and the wall clock's correction are not in the
    record, and each still changes that process's lines."""
    report = _hostile_report()
    registry = CollectorRegistry()
    registry.register(ReportCollector(lambda: report))
    writer = LineWriter()
    _same_as_prometheus_client(registry, writer)
    formatted = writer.formatted
    _same_as_prometheus_client(registry, writer)
    assert writer.formatted == formatted  # nothing changed: every line kept
    p = report.snapshot.processes[799]
    pod = Job("uid-1", "kubernetes", namespace="team-a", pod="trainer-0", container="main")
    report = replace(report, jobs=MappingProxyType({**report.jobs, 799: pod}))
    assert report.snapshot.processes[799] is p
    body = _same_as_prometheus_client(registry, writer)
    assert b'pod_name="trainer-0"' in body and b'pod_namespace="team-a"' in body
    assert p.start_time is not None
    start = report.snapshot.wall(p.start_time)
    report = replace(report, snapshot=replace(report.snapshot, clock_step=3600.0))
    body = _same_as_prometheus_client(registry, writer)
    moved = [line for line in body.splitlines()
             if line.startswith(b"gpuwatch_process_start_time_seconds{") and b'pid="799"' in line]
    assert len(moved) == 1 and float(moved[0].split()[-1]) == round(start + 3600.0, 2)


def _families(collector: ReportCollector) -> dict[str, object]:
    return {f.name: f for f in collector.collect()}


def test_a_section_whose_inputs_did_not_change_is_the_same_families_written_from_their_text(
) -> None:
    """The exporter hands in the very families of its last render where what a section is made
    of did not change (the GPUs, the findings, the processes' rows, the agent counters), and
    the writer writes them from the text it kept: byte for byte what prometheus-client writes,
    before and after a GPU's figure, a process's RSS and the findings change."""
    report = _hostile_report()
    report = replace(report, snapshot=replace(report.snapshot, gpus=tuple(
        GpuDevice(i, f"GPU-{i}", "NVIDIA H200", memory_total_bytes=141 * GIB,
                  memory_used_bytes=(i + 1) * GIB) for i in range(2))))
    collector = ReportCollector(lambda: report)
    registry = CollectorRegistry()
    registry.register(collector)
    writer = LineWriter()
    _same_as_prometheus_client(registry, writer)
    before = _families(collector)
    formatted = writer.formatted
    _same_as_prometheus_client(registry, writer)
    assert writer.formatted == formatted
    again = _families(collector)
    for name in ("gpuwatch_gpu_memory_used_bytes", "gpuwatch_findings",
                 "gpuwatch_process_resident_memory_bytes", "gpuwatch_leak_projected_oom_step",
                 "gpuwatch_build"):
        assert again[name] is before[name], name
    # Built again each poll: when the poll was taken.
    assert again["gpuwatch_last_poll_timestamp_seconds"] is not before[
        "gpuwatch_last_poll_timestamp_seconds"]

    gpu = report.snapshot.gpus[0]
    assert gpu.memory_used_bytes is not None
    report = replace(report, snapshot=replace(report.snapshot, gpus=(
        replace(gpu, memory_used_bytes=gpu.memory_used_bytes + 1), *report.snapshot.gpus[1:])))
    used = {dict(labels)["gpu"]: value for name, _, _, sample, labels, value
            in _samples(_same_as_prometheus_client(registry, writer))
            if sample == "gpuwatch_gpu_memory_used_bytes"}
    assert used[str(gpu.index)] == gpu.memory_used_bytes + 1
    after = _families(collector)
    assert after["gpuwatch_gpu_memory_used_bytes"] is not before["gpuwatch_gpu_memory_used_bytes"]
    assert after["gpuwatch_findings"] is before["gpuwatch_findings"]
    assert (after["gpuwatch_process_resident_memory_bytes"]
            is before["gpuwatch_process_resident_memory_bytes"])

    report = replace(report, snapshot=replace(report.snapshot, processes=MappingProxyType({
        **report.snapshot.processes, 799: replace(report.snapshot.processes[799],
                                                  rss_bytes=7 * GIB)})))
    assert b"7.516192768e+09" in _same_as_prometheus_client(registry, writer)
    moved = _families(collector)
    assert (moved["gpuwatch_process_resident_memory_bytes"]
            is not after["gpuwatch_process_resident_memory_bytes"])

    served = _same_as_prometheus_client(registry, writer).count(b"gpuwatch_finding{")
    report = replace(report, findings=report.findings[1:])
    body = _same_as_prometheus_client(registry, writer)
    assert _families(collector)["gpuwatch_findings"] is not after["gpuwatch_findings"]
    assert body.count(b"gpuwatch_finding{") == served - 1


# Runs on the fake node: a daemon object's real poll of a real job, rendered both ways.
_REAL = r"""
import json, sys
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder as their_encoder
from gpuwatch.config import load_config
from gpuwatch.metrics import choose_encoder
from gpuwatch.daemon import Daemon
from gpuwatch.sinks.document import bounded_json, status_document
from gpuwatch.sinks.exposition_text import LineWriter
accept = sys.argv[1]
daemon = Daemon(load_config())
registry = CollectorRegistry()  # its own metrics, less the process's CPU time, which moves
registry.register(daemon.collector)
registry.register(daemon.metrics)
writer = LineWriter()
out = []
for _ in range(3):
    daemon.poll_once()
    for header in ("", accept):
        encoder, _ = choose_encoder(header)
        out.append([writer.write(encoder, registry).decode(),
                    their_encoder(header)[0](registry).decode()])
    report = daemon.latest
    out.append([daemon.document_bytes().decode(),
                bounded_json(status_document(report, source="daemon"))[0].decode()])
print(json.dumps({"pairs": out, "kept": writer.kept, "written": daemon.document_writer.written,
                  "parts_kept": daemon.document_writer.kept}))
"""


def test_an_unchanged_counter_or_histogram_is_the_same_family_written_from_its_text() -> None:
    """gpuwatch.metrics' counters and histograms hand out the family they collected last while
    nothing in them changed, and the writer writes it from what it wrote then: byte for byte
    prometheus-client's, before and after each is counted, a series added included."""
    from gpuwatch import metrics

    polls = metrics.Counter("x_polls", "Polls.")
    errors = metrics.Counter("x_errors", "Errors, by source.", ["source"])
    took = metrics.Histogram("x_seconds", "Time.", buckets=(0.01, 0.1, 1.0))
    registry = CollectorRegistry()
    for instrument in (polls, errors, took):
        registry.register(instrument)  # type: ignore[arg-type]
    writer = LineWriter()
    first = _same_as_prometheus_client(registry, writer)
    kept = writer.whole_kept
    assert all(a is b for a, b in zip(polls.collect() + errors.collect() + took.collect(),
                                      polls.collect() + errors.collect() + took.collect()))
    assert _same_as_prometheus_client(registry, writer) == first
    assert writer.whole_kept > kept
    before = {i.name: i.collect()[0] for i in (polls, errors, took)}
    polls.inc()
    errors.labels("nvml").inc()  # a series added
    took.observe(0.05)
    body = _same_as_prometheus_client(registry, writer)
    assert body != first and b"x_polls_total 1.0" in body
    assert b'x_errors_total{source="nvml"} 1.0' in body and b"x_seconds_count 1.0" in body
    assert all(i.collect()[0] is not before[i.name] for i in (polls, errors, took))
    errors.labels("nvml")  # asked for, not counted: nothing changed
    assert errors.collect()[0] is errors.collect()[0]
    assert _same_as_prometheus_client(registry, writer) == body


def test_the_daemons_metrics_and_document_are_the_formatters_own_on_a_real_job(
        fake_node: object, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_job(tmp_path, workers=3) as job:
        for i, pid in enumerate(job.workers):
            fake_node.hold(pid, device=i % 2, used=(i + 1) * GIB)  # type: ignore[attr-defined]
        out = subprocess.run([sys.executable, "-c", _REAL, PROMETHEUS_ACCEPT], env=cli_env,
                             cwd=tmp_path, check=True, capture_output=True, text=True).stdout
    found = json.loads(out)
    for i, (ours, theirs) in enumerate(found["pairs"]):
        assert ours == theirs, i
        if i % 3 < 2:
            openmetrics = i % 3 == 1
            assert _samples(ours.encode(), openmetrics) == _samples(theirs.encode(), openmetrics)
            assert f'pid="{job.workers[0]}"' in ours
    assert found["kept"] > 0  # lines kept from one render to the next
    assert found["parts_kept"] > 0  # and processes' parts of the document


def test_a_status_document_written_from_kept_parts_is_json_dumps_own() -> None:
    report = _hostile_report()
    writer = DocumentWriter()
    for _ in range(2):
        assert writer.json(report, source="daemon") == bounded_json(
            status_document(report, source="daemon"))
    assert writer.kept == len(report.snapshot.processes)
    moved = replace(report, snapshot=replace(report.snapshot, clock_step=0.5))
    assert writer.json(moved, source="daemon") == bounded_json(
        status_document(moved, source="daemon"))


def test_a_status_document_over_its_bound_is_made_to_fit_as_before() -> None:
    report = _hostile_report()
    writer = DocumentWriter(limit=2000)
    assert writer.json(report) == bounded_json(status_document(report), 2000)
    assert writer.json(report)[1] is not None


def test_a_value_that_is_not_a_number_costs_its_section_not_the_scrape() -> None:
    report = leakreports.leak_report()
    # A bug's value: a process's start time that is not a number.
    bad = replace(report.snapshot.processes[700], start_time="lots")  # type: ignore[arg-type]
    report = replace(report, snapshot=replace(report.snapshot, processes=MappingProxyType(
        {**report.snapshot.processes, 700: bad})))
    registry = CollectorRegistry()
    registry.register(ReportCollector(lambda: report))
    body = generate_latest(registry).decode()
    assert "gpuwatch_process_start_time_seconds" not in body
    assert "gpuwatch_process_resident_memory_bytes" not in body  # its section's other families
    assert "gpuwatch_leak_growth_bytes_per_step{" in body  # the next sections are there
    assert "gpuwatch_finding{" in body and "gpuwatch_node_info{" in body
    success = {s.labels["section"]: s.value for f in parse_text(body) for s in f.samples
               if s.name == "gpuwatch_exporter_section_success"}
    assert success["processes"] == 0.0
    assert success["findings"] == success["leaks"] == success["node"] == 1.0


def test_an_openmetrics_scraper_as_prometheus_asks_is_served_bytes_rendered_ahead() -> None:
    """choose_encoder gives every OpenMetrics request an encoder of its own (equal to the
    last's): the second scrape is still served what the first rendered."""
    report = leakreports.leak_report()
    registry = CollectorRegistry()
    registry.register(ReportCollector(lambda: report))
    rendered = RenderedMetrics(registry)
    first = rendered.body(choose_encoder(PROMETHEUS_ACCEPT)[0], True)
    assert rendered.kept(choose_encoder(PROMETHEUS_ACCEPT)[0], True) == first
    assert rendered.renders == 1
