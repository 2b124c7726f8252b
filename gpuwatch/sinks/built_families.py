"""Families a collector built, kept with what they were built from.

Most of what /metrics shows does not change from one poll to the next: the build, the GPUs'
totals, the findings, the agent counters. A collector that builds those families again for
every render pays for objects equal to the last ones, and the writer then compares them line
by line to find nothing changed. Kept here, a section is built again only when its inputs
differ (`==`) from the last build's, and the very family objects come back otherwise, which
LineWriter (sinks/exposition_text.py) writes from the text it kept for them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable

from gpuwatch.metrics import Metric


class BuiltFamilies:
    """The families of each section at its last build, with the inputs they were built from.

    Replaced whole on a build, so renders on two threads at once each read a consistent pair.
    A family handed out is never changed afterwards: it may be handed out again."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[object, list[Metric]]] = {}

    def get(self, section: str, inputs: object,
            build: Callable[[], Iterable[Metric]]) -> list[Metric]:
        """The families of `section` built from `inputs`: those of the last build where its
        inputs equal these, else `build()`'s (which may raise: then nothing is kept)."""
        kept = self._kept.get(section)
        if kept is not None and kept[0] == inputs:
            return kept[1]
        built = list(build())
        self._kept = {**self._kept, section: (inputs, built)}
        return built
