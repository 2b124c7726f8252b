"""The exposition written faster: the text and OpenMetrics formats of gpuwatch.metrics, byte
for byte, without their general formatter where that is the cost.

The exporter's families of many series (one or more per process) are `Family`s: rows of label
values and a value. Writing them through the general encoder costs a `Sample` and a dict per
series, the label names escaped on every line, and the value formatted again each
time, though most of a node's processes show the same figures from one poll to the next. A
`LineWriter` writes a Family's lines itself and keeps each line until its value or labels
change: a render after a poll formats only the series that changed. Every other family (the
daemon's counters, its process metrics, info families) is written by the general encoder, one
family at a time, so the body is what that encoder would have written whole; what it wrote is
kept while the family's samples are the same (most of the daemon's own counters do not move
from one poll to the next).

A Family is a `Metric` all the same: its samples are made when something asks
for them (a `name[]` selection, an encoder this module does not write, a test).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from math import copysign
from typing import Any, Callable, Optional

from gpuwatch.metrics.core import Metric, Sample
from gpuwatch.metrics.exposition import ALLOWUTF8, UNDERSCORES
from gpuwatch.metrics.exposition import Encoder as Format
from gpuwatch.metrics.exposition import go_string as _go_string

#: Escapings under which a legacy name is written as it is (all of gpuwatch's names are).
_PLAIN_NAMES = (UNDERSCORES, ALLOWUTF8)


def _escape_value(value: str) -> str:
    """A label value as both formats write it (backslash, newline, double quote)."""
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


#: One series of a Family: its label values, in the family's label order, and its value.
Row = tuple[tuple[str, ...], float]


def row(values: Sequence[str], value: float) -> Row:
    """A Family's row, checked: a label value is text (a str enumeration's value, escaped as
    text) and the value a number; anything else raises here, inside the collector that makes
    it, not in the middle of a body."""
    return tuple(map(str.__str__, values)), float(value)


class Family(Metric):
    """A family of series with the same label names: rows of (label values, value).

    `add` takes the values as GaugeMetricFamily.add_metric does; a value that is not a number
    raises there, inside the collector that adds it, not in the middle of a body."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str] = (),
                 typ: str = "gauge") -> None:
        super().__init__(name, documentation, typ)
        self.labels = tuple(labels)
        self.rows: list[Row] = []
        # Label names in the order the formats write them (sorted), with where each value is.
        order = sorted(range(len(self.labels)), key=self.labels.__getitem__)
        self.sorted_labels = tuple((self.labels[i], i) for i in order)

    def add(self, values: Sequence[str], value: float) -> None:
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name}: {len(values)} label values for "
                             f"{len(self.labels)} labels")
        self.rows.append(row(values, value))

    def extend(self, rows: Sequence[Row]) -> None:
        """Rows made by `row()` (checked there), each with as many values as this family has
        labels: a collector that keeps its rows from one render to the next adds them again
        without checking them again, and LineWriter finds their lines by the rows' identity."""
        self.rows.extend(rows)

    # Metric sets and reads `samples`: made from the rows when read, unless
    # something (a name[] selection) set them.
    @property
    def samples(self) -> list[Sample]:
        chosen = self.__dict__.get("_chosen")
        if chosen is not None:
            return list(chosen)
        return [Sample(self.name, dict(zip(self.labels, values)), value, None)
                for values, value in self.rows]

    @samples.setter
    def samples(self, samples: list[Sample]) -> None:
        self.__dict__["_chosen"] = samples if samples else None

    @property
    def written_whole(self) -> bool:
        """Whether the rows are the family (no selection set samples of its own)."""
        return self.__dict__.get("_chosen") is None


Encoder = Callable[[Any], bytes]


def encoder_form(encoder: Encoder) -> Optional[bool]:
    """Whether `encoder` (as gpuwatch.metrics.choose_encoder gives it) writes OpenMetrics
    (True), the text format (False), or something this module does not write (None)."""
    if not isinstance(encoder, Format) or encoder.escaping not in _PLAIN_NAMES:
        return None
    return encoder.openmetrics


class _One:
    """One family, as an encoder's registry."""

    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def collect(self) -> Iterator[Metric]:
        yield self.metric


_EOF = b"# EOF\n"
#: A Family of at most this many rows keeps its whole text (header and lines) beside its lines,
#: to be written again as it is when its collector hands in the very same family object (one it
#: kept because nothing it is made of changed: sinks/built_families.py). A larger one (the
#: per-process families on a node of hundreds of processes) keeps its lines alone: its text would
#: hold the body twice.
FAMILY_TEXT_KEPT_ROWS = 256
#: Lines by (label values) -> (value, line), by family name.
_Lines = dict[str, dict[tuple[str, ...], tuple[float, str]]]


#: A family written whole, as a key: its header fields and every sample (name, labels in their
#: order, value, timestamp). None where a sample is written by its sign as well as its value
#: (-0.0) or carries what the encoders refuse (an exemplar).
WholeKey = tuple[Any, ...]


def whole_key(metric: Metric) -> Optional[WholeKey]:
    samples = []
    for s in metric.samples:
        value = s.value
        if s.exemplar is not None or s.native_histogram is not None or (
                value == 0.0 and copysign(1.0, value) < 0):
            return None
        samples.append((s.name, tuple(s.labels.items()), value, s.timestamp))
    return (metric.name, metric.type, metric.documentation, metric.unit, tuple(samples))


class LineWriter:
    """Writes bodies, keeping each Family line until its value changes.

    A line is found again two ways: by its row, where a collector hands in the very row object
    of the last body (it keeps a process's rows while the process is unchanged: no key to build,
    nothing to compare), else by the family's name and the row's label values, written again
    where the value changed. A family handed in again as the very object of the last body (one
    its collector kept: sinks/built_families.py) is written from the text kept for it, without a
    look at its rows. The lines kept are those of the last body written: a series gone
    from the report is gone from the cache at the next render. Renders on several threads at
    once (two formats asked for together) each write a whole body; the caches are replaced
    whole, never changed in place."""

    def __init__(self) -> None:
        self._lines: _Lines = {}
        #: By family name, the Family object of the last body, its whole text and the output
        #: it was written for (OpenMetrics or not), for families of at most
        #: FAMILY_TEXT_KEPT_ROWS rows.
        self._texts: dict[str, tuple[Family, bytes, bool]] = {}
        #: By family name, by id() of a row kept from the last body: (the row, its line). The
        #: row is held, so its id is not another object's while it is here.
        self._by_row: dict[str, dict[int, tuple[Row, str]]] = {}
        self._headers: dict[tuple[str, str, bool], str] = {}
        #: By output (OpenMetrics or not, the escaping of names: four at most, whatever
        #: versions scrapers ask for), each family of its last body written whole, by its key
        #: (whole_key). Scrapers asking for different formats do not undo each other's.
        self._whole: dict[tuple[bool, str], dict[WholeKey, bytes]] = {}
        #: By output, the other families of its last body by id(): (the family, its text), for
        #: one handed in again as the very same object (gpuwatch.metrics' counters and
        #: histograms do while they are unchanged), written without building its key.
        self._objects: dict[tuple[bool, str], dict[int, tuple[Metric, bytes]]] = {}
        self._lock = threading.Lock()
        #: Lines written from their values / kept from an earlier body (for tests and benches).
        self.formatted = 0
        self.kept = 0
        #: Families written whole that were kept from an earlier body (for tests and benches).
        self.whole_kept = 0

    def write(self, encoder: Encoder, registry: Any) -> bytes:
        """What `encoder(registry)` returns, written faster where it can be."""
        return b"".join(self.write_parts(encoder, registry))

    def write_parts(self, encoder: Encoder, registry: Any) -> list[bytes]:
        """What `write` returns, in parts: a family each (the trailer of OpenMetrics, one of its
        own), or the whole body where the encoder is not one this module writes. A family
        written as it was in the last body is the very bytes object of that body's part, for
        families of at most FAMILY_TEXT_KEPT_ROWS rows (serve/gzip_parts.py compresses what
        changed)."""
        form = encoder_form(encoder)
        if form is None:
            return [encoder(registry)]
        chunks: list[bytes] = []
        assert isinstance(encoder, Format)  # encoder_form said so
        output = (form, encoder.escaping)
        old, old_by_row, old_texts = self._lines, self._by_row, self._texts
        old_whole = self._whole.get(output, {})
        old_objects = self._objects.get(output, {})
        new_objects: dict[int, tuple[Metric, bytes]] = {}
        new: _Lines = {}
        new_by_row: dict[str, dict[int, tuple[Row, str]]] = {}
        new_texts: dict[str, tuple[Family, bytes, bool]] = {}
        new_whole: dict[WholeKey, bytes] = {}
        formatted = kept = whole_kept = 0
        for metric in registry.collect():
            if isinstance(metric, Family) and metric.written_whole:
                name = metric.name
                held = old_texts.get(name)
                if held is not None and held[0] is metric and held[2] == form:
                    # The same family as in the last body: its text, and its lines kept.
                    chunks.append(held[1])
                    new_texts[name] = held
                    if name in old:
                        new[name] = old[name]
                    if name in old_by_row:
                        new_by_row[name] = old_by_row[name]
                    kept += len(metric.rows)
                    continue
                out = [self._header(metric, form)]
                by_row: dict[int, tuple[Row, str]] = {}
                lines: dict[tuple[str, ...], tuple[float, str]] = {}
                formatted_here, kept_here = self._rows(
                    metric, old.get(name, _NO_LINES), lines, old_by_row.get(name, _NONE),
                    by_row, out)
                if lines:
                    new[name] = lines
                if by_row:
                    new_by_row[name] = by_row
                text = "".join(out).encode("utf-8")
                if len(metric.rows) <= FAMILY_TEXT_KEPT_ROWS:
                    new_texts[name] = (metric, text, form)
                chunks.append(text)
                formatted += formatted_here
                kept += kept_here
                continue
            same = old_objects.get(id(metric))
            if same is not None and same[0] is metric:
                body = same[1]  # (kept by identity alone, while it is handed in as it was)
                whole_kept += 1
            else:
                key = whole_key(metric)
                body = old_whole.get(key) if key is not None else None
                if body is None:
                    body = encoder(_One(metric))
                    if form and body.endswith(_EOF):
                        body = body[:-len(_EOF)]
                else:
                    whole_kept += 1
                if key is not None:
                    new_whole[key] = body
            new_objects[id(metric)] = (metric, body)
            chunks.append(body)
        if form:
            chunks.append(_EOF)
        with self._lock:
            self._lines = new
            self._by_row = new_by_row
            self._texts = new_texts
            self._whole = {**self._whole, output: new_whole}
            self._objects = {**self._objects, output: new_objects}
            self.formatted += formatted
            self.kept += kept
            self.whole_kept += whole_kept
        return chunks

    def _header(self, family: Family, openmetrics: bool) -> str:
        key = (family.name, family.documentation, openmetrics)
        header = self._headers.get(key)
        if header is None:
            doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
            if openmetrics:
                doc = doc.replace('"', r"\"")
            header = f"# HELP {family.name} {doc}\n# TYPE {family.name} {family.type}\n"
            if len(self._headers) > 1024:  # families are few; a bound all the same
                self._headers.clear()
            self._headers[key] = header
        return header

    @staticmethod
    def _rows(family: Family, old: dict[tuple[str, ...], tuple[float, str]],
              new: dict[tuple[str, ...], tuple[float, str]],
              old_by_row: dict[int, tuple[Row, str]], new_by_row: dict[int, tuple[Row, str]],
              out: list[str]) -> tuple[int, int]:
        """Appends the family's lines to `out`. A row found by identity is kept in `new_by_row`
        alone: while its collector hands it in again it needs no other key; once the collector
        makes it anew (something else of its process changed), its line is written again."""
        name, sorted_labels = family.name, family.sorted_labels
        formatted = kept = 0
        for r in family.rows:
            held = old_by_row.get(id(r))
            if held is not None and held[0] is r:
                new_by_row[id(r)] = held
                out.append(held[1])
                kept += 1
                continue
            values, value = r
            entry = old.get(values)
            # 0.0 == -0.0, but they are written apart (a clock step of -0.0 is "-0.0").
            if entry is None or entry[0] != value or (
                    value == 0.0 and copysign(1.0, value) != copysign(1.0, entry[0])):
                if sorted_labels:
                    labels = ",".join([f'{label}="{_escape_value(values[i])}"'
                                       for label, i in sorted_labels])
                    line = f"{name}{{{labels}}} {_go_string(value)}\n"
                else:
                    line = f"{name} {_go_string(value)}\n"
                entry = (value, line)
                formatted += 1
            else:
                kept += 1
            new[values] = entry
            new_by_row[id(r)] = (r, entry[1])
            out.append(entry[1])
        return formatted, kept


_NONE: dict[int, tuple[Row, str]] = {}
_NO_LINES: dict[tuple[str, ...], tuple[float, str]] = {}
