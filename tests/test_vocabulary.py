"""The shared words: each is written as its value wherever it leaves the program."""

from __future__ import annotations

import json

import pytest

from gpuwatch import vocabulary
from gpuwatch.protocol import TRACE_STATUSES
from gpuwatch.vocabulary import (
    FINAL_OUTCOMES,
    ReapOutcome,
    Severity,
    TraceStatus,
    Word,
    severity_rank,
)

ENUMS = [v for v in vars(vocabulary).values()
         if isinstance(v, type) and issubclass(v, Word) and v is not Word]


@pytest.mark.parametrize("enum", ENUMS, ids=lambda e: e.__name__)
def test_a_word_is_written_as_its_value_in_text_labels_and_json(enum: type[Word]) -> None:
    for member in enum:
        assert str(member) == f"{member}" == member.value
        assert f"{member:>12}" == f"{member.value:>12}"
        assert json.dumps([member]) == json.dumps([member.value])
        assert member == member.value and enum.parse(member.value) is member
    assert enum.parse("no such word") is None


def test_severities_rank_most_urgent_first_and_an_unknown_word_last() -> None:
    assert sorted(["info", "bogus", "critical", "warning"], key=severity_rank) == [
        "critical", "warning", "info", "bogus"]
    assert Severity.CRITICAL.rank == 0


def test_a_reap_ends_in_every_outcome_but_planned_and_waiting() -> None:
    assert set(ReapOutcome) - set(FINAL_OUTCOMES) == {ReapOutcome.PLANNED, ReapOutcome.WAITING}


def test_every_trace_status_the_agent_protocol_allows_is_a_trace_status() -> None:
    assert {TraceStatus.parse(s) for s in TRACE_STATUSES} == set(TraceStatus) - {
        TraceStatus.REQUESTED}
