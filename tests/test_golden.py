"""Golden files: each report of tests/golden_reports.py rendered as every sink renders it (the
metrics a scrape gets, `gpuwatch status` wide, narrow and verbose, its JSON, top's page of each
process with findings), diffed against the files under tests/golden/<case>/.

A change in what any of them prints shows here as a diff of the whole output. Where the change
is meant, `GPUWATCH_UPDATE_GOLDEN=1` rewrites the files (docs/testing.md); review them as code.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpuwatch.document_types import StatusDocument
from gpuwatch.model import NodeReport
from gpuwatch.sinks.details_doc import details_doc, details_of
from gpuwatch.sinks.document import bounded_json, from_json, status_document
from gpuwatch.sinks.exporter import ReportCollector
from gpuwatch.sinks.status_view import render_status
from gpuwatch.sinks.top.view import details_lines
from tests.golden_reports import CASES

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("GPUWATCH_UPDATE_GOLDEN") == "1"
#: A narrow terminal: the less telling columns give way, sentences wrap.
NARROW = 60
#: What depends on the build that renders, not on the report.
_BUILD_INFO = re.compile(r'^gpuwatch_build_info\{.*\} 1\.0$', re.M)


def _metrics(report: NodeReport) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReportCollector(lambda: report))
    text = generate_latest(registry).decode()
    return _BUILD_INFO.sub('gpuwatch_build_info{pid="<pid>",python="<python>",'
                           'version="<version>"} 1.0', text)


def _document(report: NodeReport) -> StatusDocument:
    """The document as `status` gets it from a daemon: bounded, over the state socket."""
    body, _ = bounded_json(status_document(report))
    doc: StatusDocument = json.loads(body)
    doc["gpuwatch_version"] = "<version>"
    return doc


def _top_details(report: NodeReport) -> str:
    pids = sorted({f.pid for f in report.findings if f.pid is not None})
    pages = ["\n".join(line.text.rstrip() for line in details_lines(report, pid, None, 100))
             for pid in pids]
    return "\n\n".join(pages) + "\n"


def _outputs(report: NodeReport) -> dict[str, str]:
    doc = _document(report)
    shown = from_json(doc)  # as `gpuwatch status` reads it
    return {
        "metrics.prom": _metrics(report),
        "status.json": json.dumps(doc, indent=2) + "\n",
        "status.txt": render_status(shown),
        "status-narrow.txt": render_status(shown, width=NARROW),
        "status-verbose.txt": render_status(shown, width=100, verbose=True),
        "top-details.txt": _top_details(shown),
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_sink_renders_each_reference_report_exactly_as_its_golden_files_say(
        case: str) -> None:
    outputs = _outputs(CASES[case]())
    folder = GOLDEN / case
    if UPDATE:
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in outputs.items():
            (folder / name).write_text(text)
    differences = []
    for name, text in outputs.items():
        path = folder / name
        if not path.exists():
            differences.append(f"{path} is missing: GPUWATCH_UPDATE_GOLDEN=1 writes it")
            continue
        expected = path.read_text()
        if text != expected:
            differences.append("".join(difflib.unified_diff(
                expected.splitlines(keepends=True), text.splitlines(keepends=True),
                f"{path} (golden)", f"{path} (rendered now)")))
    assert not differences, "\n".join(differences)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_findings_evidence_reads_back_from_the_document_as_it_was_written(
        case: str) -> None:
    for f in CASES[case]().findings:
        assert details_of(json.loads(json.dumps(details_doc(f.details)))) == f.details, f


def test_the_golden_folders_are_exactly_the_reference_reports() -> None:
    """A case renamed or removed leaves no stale folder behind that nothing checks."""
    assert sorted(p.name for p in GOLDEN.iterdir() if p.is_dir()) == sorted(CASES)
