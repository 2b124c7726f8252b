"""The short chaos run: bench/chaos.py's machinery for about half a minute, its hard goals
asserted.

The daemon under its unit's limits (uid 65534 with its three capabilities, MemoryMax and TasksMax
as cgroups), while NVML faults come and go, the driver leaves and returns, 200 processes a second
come and go, four users flood agent.sock, 200 idle connections sit on the port, the state
directory fills, its wall clock jumps an hour each way and it is SIGKILLed inside an auto-reap's
grace. What must hold whatever the machine: every scrape answered, no wrong finding, no wrong
signal, no audit line lost. The figures are printed whether the test passes or not; no duration
or size is asserted.
Skipped where the bench cannot run (not root, no setpriv, no memory and pids cgroups).
"""

from __future__ import annotations

import pytest

from tests.benchscripts import load_bench_script

chaos = load_bench_script("chaos")


def test_short_chaos_meets_the_hard_goals(capsys: pytest.CaptureFixture[str]) -> None:
    why = chaos.cannot_run()
    if why is not None:
        pytest.skip(f"bench/chaos.py cannot run here: {why}")
    lines: list[str] = []
    opts = chaos.quick_options(
        duration=20.0, storm_rate=200.0, storm_max_live=400, memory_reporters=30,
        memory_rate=300.0, slot_processes=60, fuzz_processes=2, fuzz_rate=200.0,
        mixed_processes=4, mixed_rate=80.0, driver_gone=2.0, state_full=2.0,
        clock_hold=2.0,
        auto_after=1.0, grace=2.0,
        log=lines.append)
    result = chaos.run_chaos(opts)
    assert not result.skipped, result.skipped
    with capsys.disabled():  # CI prints the figures of every run
        print("\nshort chaos:\n" + chaos.format_rows(result.rows))
    assert not result.skipped, result.skipped
    f = result.figures
    report = "\n".join([chaos.format_rows(result.rows), *result.problems, "", "log:", *lines])

    # The chaos was done: the reap was carried out across the SIGKILL, faults injected.
    assert result.row("reap")["met"], report
    assert sum(f["nvml_faults"].values()) > 0, report
    assert f["storm"].get("spawned", 0) > 0, report
    # /metrics answered every scrape (those while the bench had the daemon down not counted).
    assert f["scrapes_attempted"] > 0, report
    assert f["scrapes_answered"] == f["scrapes_attempted"], report
    # Nothing innocent was flagged or signalled.
    assert f["wrong_findings"] == 0, report
    assert f["wrong_signals"] == 0, report
    # Every process the daemon ended, and every signal it sent, is in reap.jsonl.
    assert f["audit_lost"] == 0, report
