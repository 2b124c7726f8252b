"""A finding's typed evidence (gpuwatch.evidence) as the JSON object the status document carries
in `details` (docs/json.md), and back: the one place that knows its keys.

Written in the order the keys have always had, so the document and top's list of a finding's
evidence read as before. Read back leniently: a document from an earlier daemon may lack a key
(`found_by`, before culprits were found other ways than watching), and a value it does not know
is left out rather than guessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from gpuwatch.evidence import (
    CopyOnWrite,
    Culprit,
    Details,
    HungAtExit,
    LeakEvidence,
    MemoryLimit,
    OomProjection,
    TracedSite,
    TraceSummary,
)
from gpuwatch.vocabulary import FoundBy, GrowthUnit, LimitSource, Series, TraceStatus

#: The `cause` of a copy-on-write leak, and the key a stall hung at exit is marked with.
COPY_ON_WRITE = "copy-on-write"
HUNG_AT_EXIT = "hung_at_exit"


def details_doc(details: Optional[Details]) -> dict[str, Any]:
    """`details` as the document's JSON object ({} for none)."""
    if details is None:
        return {}
    if isinstance(details, HungAtExit):
        return {HUNG_AT_EXIT: True}
    if isinstance(details, CopyOnWrite):
        return {"series": Series.USS.value, "unit": GrowthUnit.SECOND.value,
                "cause": COPY_ON_WRITE,
                "growth_bytes_per_second": details.growth_bytes_per_second,
                "workers": details.workers, "worker_pids": list(details.worker_pids),
                "private_growth_bytes": details.private_growth_bytes,
                "uss_bytes_from": details.uss_bytes_from, "uss_bytes_to": details.uss_bytes_to}
    return _leak_doc(details)


def _leak_doc(e: LeakEvidence) -> dict[str, Any]:
    out: dict[str, Any] = {"series": e.series_text, "unit": e.unit.value}
    culprit = e.culprit
    if e.unit == GrowthUnit.STEP:
        out["window_steps"] = list(e.window_steps) if e.window_steps is not None else None
    # A leak by time names a culprit only where the process reported on a timer (tick reports).
    if e.unit == GrowthUnit.STEP or culprit is not None:
        out["culprit"] = culprit.name if culprit is not None else None
        out["found_by"] = _value(culprit.found_by) if culprit is not None else None
    if e.growth_bytes_per_step is not None:
        out["growth_bytes_per_step"] = e.growth_bytes_per_step
    if e.growth_bytes_per_second is not None:
        out["growth_bytes_per_second"] = e.growth_bytes_per_second
    if culprit is not None:
        if culprit.since_step is not None:
            out["history_since_step"] = culprit.since_step
            out["graph_nodes_per_step"] = culprit.graph_nodes_per_step
        if culprit.bytes_per_step is not None:
            out["culprit_bytes_per_step"] = culprit.bytes_per_step
        if culprit.items_per_step is not None:
            out["culprit_items_per_step"] = culprit.items_per_step
    if e.trace is not None:
        out["trace"] = trace_doc(e.trace)
    p = e.projection
    if p is not None:
        out.update(limit_source=p.limit.source.value, limit_bytes=p.limit.limit_bytes,
                   available_bytes=p.limit.available_bytes)
        if p.step is not None:
            out["projected_oom_step"] = p.step
        if p.in_seconds is not None:
            out["projected_oom_in_seconds"] = p.in_seconds
        if p.at is not None:
            out["projected_oom_at"] = p.at
    return out


def trace_doc(t: TraceSummary) -> dict[str, Any]:
    return {"status": t.status.value, "why": t.why, "steps": t.steps,
            "sites": [{"site": s.site, "bytes_per_step": s.bytes_per_step,
                       "count_per_step": s.count_per_step} for s in t.sites],
            "traceback": list(t.traceback)}


def _value(word: Optional[FoundBy]) -> Optional[str]:
    return word.value if word is not None else None


# ---- reading ------------------------------------------------------------------------------------


def details_of(doc: object) -> Optional[Details]:
    """The evidence a document's `details` object carries; None for {} and for what it cannot
    read."""
    if not isinstance(doc, Mapping) or not doc:
        return None
    if doc.get(HUNG_AT_EXIT) is True:
        return HungAtExit()
    if doc.get("cause") == COPY_ON_WRITE:
        return _copy_on_write_of(doc)
    return _leak_of(doc)


def _copy_on_write_of(d: Mapping[str, Any]) -> Optional[CopyOnWrite]:
    pids = d.get("worker_pids")
    try:
        return CopyOnWrite(
            growth_bytes_per_second=int(d["growth_bytes_per_second"]),
            workers=int(d["workers"]),
            worker_pids=tuple(int(p) for p in pids) if isinstance(pids, list) else (),
            private_growth_bytes=int(d["private_growth_bytes"]),
            uss_bytes_from=int(d["uss_bytes_from"]), uss_bytes_to=int(d["uss_bytes_to"]))
    except (KeyError, TypeError, ValueError):
        return None


def _leak_of(d: Mapping[str, Any]) -> Optional[LeakEvidence]:
    text = d.get("series")
    if not isinstance(text, str):
        return None
    buffer = None
    if text.startswith("buffer `") and text.endswith("`"):
        series: Optional[Series] = Series.BUFFER
        buffer = text[len("buffer `"):-1]
    else:
        series = Series.parse(text)
    unit = GrowthUnit.parse(d.get("unit"))
    if series is None or unit is None:
        return None
    window = d.get("window_steps")
    culprit = None
    if isinstance(d.get("culprit"), str) and d["culprit"]:
        culprit = Culprit(d["culprit"], FoundBy.parse(d.get("found_by")),
                          _int(d.get("culprit_bytes_per_step")),
                          _float(d.get("culprit_items_per_step")),
                          since_step=_int(d.get("history_since_step")),
                          graph_nodes_per_step=_float(d.get("graph_nodes_per_step")))
    return LeakEvidence(
        series=series, unit=unit, buffer=buffer,
        window_steps=((int(window[0]), int(window[1]))
                      if isinstance(window, list) and len(window) == 2 else None),
        growth_bytes_per_step=_int(d.get("growth_bytes_per_step")),
        growth_bytes_per_second=_int(d.get("growth_bytes_per_second")),
        culprit=culprit, trace=trace_of(d.get("trace")), projection=_projection_of(d))


def trace_of(doc: object) -> Optional[TraceSummary]:
    if not isinstance(doc, Mapping):
        return None
    status = TraceStatus.parse(doc.get("status"))
    if status is None:
        return None
    sites = doc.get("sites") or []
    traceback = doc.get("traceback") or []
    return TraceSummary(
        status=status, why=str(doc.get("why") or ""), steps=_int(doc.get("steps")),
        sites=tuple(TracedSite(str(s.get("site")), _int(s.get("bytes_per_step")),
                               _float(s.get("count_per_step")))
                    for s in sites if isinstance(s, Mapping)),
        traceback=tuple(str(frame) for frame in traceback))


def _projection_of(d: Mapping[str, Any]) -> Optional[OomProjection]:
    source = LimitSource.parse(d.get("limit_source"))
    available = _int(d.get("available_bytes"))
    if source is None or available is None:
        return None
    return OomProjection(MemoryLimit(source, _int(d.get("limit_bytes")), available),
                         step=_int(d.get("projected_oom_step")),
                         in_seconds=_int(d.get("projected_oom_in_seconds")),
                         at=_int(d.get("projected_oom_at")))


def _int(value: object) -> Optional[int]:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _float(value: object) -> Optional[float]:
    return value if isinstance(value, float) else _int(value)
