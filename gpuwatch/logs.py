"""Logging to stderr, in a form journald and log shippers read well.

Under systemd (JOURNAL_STREAM set) each line carries a syslog priority prefix (`<4>`) that journald
turns into the entry's priority, and no timestamp, which journald adds. `--log-format json` writes
one JSON object per line for Loki, Fluent Bit or Vector.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import sys
from typing import Any

from gpuwatch.printable import clean


class _TextFormatter(logging.Formatter):
    """A text line whose message is cleaned (gpuwatch.printable.clean): a message may quote a
    process's command line, name or cgroup, and another user's escape sequence or newline must
    neither reach an admin's terminal nor forge a log line of its own. A traceback appended
    after it keeps its lines; JSON lines are exact (json.dumps escapes what it must)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return clean(super().formatMessage(record))


_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
             logging.CRITICAL: 2}


class _JournalFormatter(_TextFormatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record).replace("\n", "\n  ")
        return f"<{_PRIORITY.get(record.levelno, 6)}>{text}"


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _dt.datetime.fromtimestamp(record.created, tz=_dt.timezone.utc)
            .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(fmt: str = "text", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    elif os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(_JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(_TextFormatter(
            "%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
