"""What each detector reports, checked against what it declares (its EMITS), wherever a test
runs the detectors in-process: a test module imports `detectors_report_only_declared_kinds` and
every finding any of its scenarios raises is checked, and recorded in `EMITTED`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gpuwatch.detectors import DETECTORS

#: (detector module name, kind) of every finding raised under the fixture, this session.
EMITTED: set[tuple[str, str]] = set()


@pytest.fixture(autouse=True)
def detectors_report_only_declared_kinds(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for module in DETECTORS:
        def checked(*args: Any, _module: Any = module, _detect: Any = module.detect,
                    **kwargs: Any) -> Iterator[Any]:
            for f in _detect(*args, **kwargs):
                assert f.kind in _module.EMITS, (
                    f"{_module.__name__} reported a {f.kind!r} finding; it declares "
                    f"{sorted(_module.EMITS)}")
                EMITTED.add((_module.__name__, str(f.kind)))
                yield f
        monkeypatch.setattr(module, "detect", checked)
    yield
