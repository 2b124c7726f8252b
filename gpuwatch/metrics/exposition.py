"""The text format (0.0.4, and 1.0.0 with its escaping) and OpenMetrics (1.0.0), written as
prometheus-client 0.26 writes them, byte for byte, and `choose_encoder`, which picks one by a
scrape's `Accept` header as prometheus-client's does.

An encoder takes anything with `collect()` yielding families (name, documentation, type, unit,
samples of name, labels, value, timestamp): gpuwatch's own, or prometheus-client's.
"""

from __future__ import annotations

import functools
import math
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

CONTENT_TYPE_PLAIN_0_0_4 = "text/plain; version=0.0.4; charset=utf-8"
CONTENT_TYPE_PLAIN_1_0_0 = "text/plain; version=1.0.0; charset=utf-8"
CONTENT_TYPE_OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"

#: Escaping schemes of names (the `escaping` parameter of an Accept header).
ALLOWUTF8 = "allow-utf-8"
UNDERSCORES = "underscores"
DOTS = "dots"
VALUES = "values"
_ESCAPINGS = (ALLOWUTF8, UNDERSCORES, DOTS, VALUES)

_INF = float("inf")


def go_string(value: float) -> str:
    """A float as Go writes it (exponents sooner than Python's repr), as Prometheus reads it."""
    d = float(value)
    if d == _INF:
        return "+Inf"
    if d == -_INF:
        return "-Inf"
    if math.isnan(d):
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def _label_rune(c: str, i: int) -> bool:
    return "a" <= c <= "z" or "A" <= c <= "Z" or c == "_" or ("0" <= c <= "9" and i > 0)


def _metric_rune(c: str, i: int) -> bool:
    return _label_rune(c, i) or c == ":"


# What _metric_rune and _label_rune allow at each place, whole: checked in one match, as a
# render checks every sample's name and label names.
_LEGACY_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LEGACY_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _legacy_name(s: str) -> bool:
    return _LEGACY_NAME.fullmatch(s) is not None


def _legacy_label(s: str) -> bool:
    return _LEGACY_LABEL.fullmatch(s) is not None


def _escape_text(s: str) -> str:
    """Backslash, newline and double quote escaped (label values, OpenMetrics help)."""
    return s.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape(s: str, escaping: str, valid: Callable[[str, int], bool]) -> str:
    if escaping == ALLOWUTF8:
        return _escape_text(s)
    if escaping == UNDERSCORES:
        return "".join(c if valid(c, i) else "_" for i, c in enumerate(s))
    if escaping == DOTS:
        out = []
        for i, c in enumerate(s):
            if c == "_":
                out.append("__")
            elif c == ".":
                out.append("_dot_")
            else:
                out.append(c if valid(c, i) else "__")
        return "".join(out)
    if escaping == VALUES:
        out = ["U__"]
        for i, c in enumerate(s):
            if c == "_":
                out.append("__")
            elif valid(c, i):
                out.append(c)
            elif 0xD800 <= ord(c) <= 0xDFFF or ord(c) > sys.maxunicode:
                out.append("_FFFD_")
            else:
                out.append(f"_{ord(c):x}_")
        return "".join(out)
    return s


def _escape_name(s: str, escaping: str, legacy: Callable[[str], bool],
                 valid: Callable[[str, int], bool]) -> str:
    if not s:
        return s
    if escaping == ALLOWUTF8:
        return _escape(s, escaping, valid) if legacy(s) else f'"{_escape(s, escaping, valid)}"'
    if escaping in (UNDERSCORES, VALUES) and legacy(s):
        return s
    return _escape(s, escaping, valid)


# A render escapes the same few names for every sample: each is escaped once per escaping
# (the names are the exporter's own, bounded; the cache is bounded all the same).
@functools.lru_cache(maxsize=4096)
def escape_metric_name(s: str, escaping: str = UNDERSCORES) -> str:
    return _escape_name(s, escaping, _legacy_name, _metric_rune)


@functools.lru_cache(maxsize=4096)
def escape_label_name(s: str, escaping: str = UNDERSCORES) -> str:
    return _escape_name(s, escaping, _legacy_label, _label_rune)


def _text_help(doc: str) -> str:
    return doc.replace("\\", r"\\").replace("\n", r"\n")


def generate_text(registry: Any, escaping: str = UNDERSCORES) -> bytes:
    """The Prometheus text format of what `registry.collect()` yields."""
    def line(s: Any) -> str:
        labels = ",".join([f'{escape_label_name(k, escaping)}="{_escape_text(v)}"'
                           for k, v in sorted(s.labels.items())]) if s.labels else ""
        timestamp = f" {int(float(s.timestamp) * 1000):d}" if s.timestamp is not None else ""
        name = escape_metric_name(s.name, escaping)
        if escaping != ALLOWUTF8 or _legacy_name(s.name):
            labels = "{" + labels + "}" if labels else ""
            return f"{name}{labels} {go_string(s.value)}{timestamp}\n"
        return f"{{{name}{',' if labels else ''}{labels}}} {go_string(s.value)}{timestamp}\n"

    output: list[str] = []
    for metric in registry.collect():
        name, typ = metric.name, metric.type
        if typ == "counter":
            name += "_total"
        elif typ == "info":
            name, typ = name + "_info", "gauge"
        elif typ == "stateset":
            typ = "gauge"
        elif typ == "gaugehistogram":
            typ = "histogram"
        elif typ == "unknown":
            typ = "untyped"
        escaped = escape_metric_name(name, escaping)
        output.append(f"# HELP {escaped} {_text_help(metric.documentation)}\n")
        output.append(f"# TYPE {escaped} {typ}\n")
        separate: dict[str, list[str]] = {}
        for s in metric.samples:
            for suffix in ("_created", "_gsum", "_gcount"):
                if s.name == metric.name + suffix:
                    separate.setdefault(suffix, []).append(line(s))
                    break
            else:
                output.append(line(s))
        for suffix, lines in sorted(separate.items()):
            escaped = escape_metric_name(metric.name + suffix, escaping)
            output.append(f"# HELP {escaped} {_text_help(metric.documentation)}\n")
            output.append(f"# TYPE {escaped} gauge\n")
            output.extend(lines)
    return "".join(output).encode("utf-8")


def generate_openmetrics(registry: Any, escaping: str = UNDERSCORES) -> bytes:
    """OpenMetrics 1.0.0 of what `registry.collect()` yields (no exemplars, no native
    histograms: gpuwatch's families have none)."""
    output: list[str] = []
    for metric in registry.collect():
        name = escape_metric_name(metric.name, escaping)
        output.append(f"# HELP {name} {_escape_text(metric.documentation)}\n")
        output.append(f"# TYPE {name} {metric.type}\n")
        if metric.unit:
            output.append(f"# UNIT {name} {metric.unit}\n")
        for s in metric.samples:
            if s.exemplar or s.native_histogram:
                raise ValueError(f"{metric.name}: exemplars and native histograms are not "
                                 "written")
            utf8_name = escaping == ALLOWUTF8 and not _legacy_name(s.name)
            labelstr = escape_metric_name(s.name, escaping) if utf8_name else ""
            if s.labels:
                if labelstr:
                    labelstr += ","
                labelstr += ",".join([f'{escape_label_name(k, escaping)}="{_escape_text(v)}"'
                                      for k, v in sorted(s.labels.items())])
            if labelstr:
                labelstr = "{" + labelstr + "}"
            timestamp = f" {s.timestamp}" if s.timestamp is not None else ""
            value = go_string(s.value) if s.value is not None else ""
            if utf8_name:
                output.append(f"{labelstr} {value}{timestamp}\n")
            else:
                output.append(f"{_escape(s.name, escaping, _label_rune)}{labelstr} "
                              f"{value}{timestamp}\n")
    output.append("# EOF\n")
    return "".join(output).encode("utf-8")


@dataclass(frozen=True)
class Encoder:
    """One format: OpenMetrics or the text format, with an escaping of names. Equal for equal
    formats, so that what was rendered for one scrape serves the next."""
    openmetrics: bool = False
    escaping: str = UNDERSCORES
    version: str = ""

    def __call__(self, registry: Any) -> bytes:
        if self.openmetrics:
            return generate_openmetrics(registry, self.escaping)
        return generate_text(registry, self.escaping)


TEXT = Encoder()


def _parameter(tokens: list[str], key: str) -> str:
    for token in tokens:
        if "=" not in token:
            continue
        name, value = token.strip().split("=", 1)
        if name == key:
            return value
    return ""


def _version_at_least_1(version: str) -> bool:
    parts: list[Any] = []
    for part in version.split("."):
        try:
            parts.append(int(part))
        except ValueError:
            parts.append(part)
    try:
        return tuple(parts) >= (1, 0, 0)
    except TypeError:  # "x.1": not a version
        return False


def choose_encoder(accept_header: str) -> tuple[Encoder, str]:
    """The encoder and content type for an `Accept` header, as prometheus-client chooses."""
    for accepted in (accept_header or "").split(","):
        tokens = accepted.split(";")
        kind = tokens[0].strip()
        if kind not in ("application/openmetrics-text", "text/plain"):
            continue
        version = _parameter(tokens, "version")
        escaping = _parameter(tokens, "escaping")
        if escaping not in _ESCAPINGS:
            escaping = UNDERSCORES
        if kind == "application/openmetrics-text":
            if not version:
                return Encoder(True, UNDERSCORES, "1.0.0"), CONTENT_TYPE_OPENMETRICS
            if _version_at_least_1(version):
                return (Encoder(True, escaping, version),
                        f"application/openmetrics-text; version={version}; charset=utf-8; "
                        f"escaping={escaping}")
        elif version and _version_at_least_1(version):
            return Encoder(False, escaping), f"{CONTENT_TYPE_PLAIN_1_0_0}; escaping={escaping}"
    return TEXT, CONTENT_TYPE_PLAIN_0_0_4
