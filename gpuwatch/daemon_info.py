"""`daemon.json`: what the running daemon says of itself in its runtime directory (its PID,
version, where /metrics and the state socket are), for the CLI, `doctor`, the demo and a second
daemon to read. Written in one place (the daemon, through DaemonInfo.to_json) and read in one:
DaemonInfo.from_json, which takes each field only where it has its type. Where the file may be
believed (a runtime directory that is the daemon's) is gpuwatch.runtime_dir's to say."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class DaemonInfo:
    #: None where the file names none (or not as a number).
    pid: Optional[int]
    version: Optional[str] = None
    metrics_url: Optional[str] = None
    port: Optional[int] = None
    state_socket: Optional[str] = None

    def to_json(self) -> bytes:
        return json.dumps({"pid": self.pid, "version": self.version,
                           "metrics_url": self.metrics_url, "port": self.port,
                           "state_socket": self.state_socket}).encode()

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> DaemonInfo:
        """The fields of a daemon.json document, each None where it is missing or not of its
        type."""
        return cls(pid=_typed(doc.get("pid"), int), version=_typed(doc.get("version"), str),
                   metrics_url=_typed(doc.get("metrics_url"), str),
                   port=_typed(doc.get("port"), int),
                   state_socket=_typed(doc.get("state_socket"), str))


def _typed(value: Any, kind: type) -> Any:
    return value if isinstance(value, kind) and not isinstance(value, bool) else None
