"""NVML that fails for a moment comes back: a failed device count, whatever its code, shuts NVML
down and initialises it again (at once the first time, then with backoff), and the next good
read reports NVML up. Through the fake driver, loaded by the real nvidia-ml-py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.simulate import fakenvml
from gpuwatch.simulate.fakenvml import FakeNode
from tests.daemonproc import running_daemon, value
from tests.realprocs import GIB, gpuwatch, running_job, status_json

#: Codes a device count can fail with for a moment, none of which used to re-initialise NVML:
#: UNKNOWN, TIMEOUT, IRQ_ISSUE, GPU_IS_LOST.
TRANSIENT = (fakenvml.UNKNOWN, fakenvml.TIMEOUT, fakenvml.IRQ_ISSUE, fakenvml.GPU_IS_LOST)

# Runs NvmlSource in a child (LD_LIBRARY_PATH must be set before the library loads): each line
# of stdin is a clock reading, each line of stdout what one read() gave at that time.
SOURCE = textwrap.dedent("""
    import json, sys
    import pynvml
    from gpuwatch.sources.nvml import NvmlSource

    calls = {"init": 0, "shutdown": 0}
    def counted(name, fn):
        def call(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)
        return call
    pynvml.nvmlInit = counted("init", pynvml.nvmlInit)
    pynvml.nvmlShutdown = counted("shutdown", pynvml.nvmlShutdown)
    now = [0.0]
    source = NvmlSource(retry_initial=1.0, retry_max=4.0, nvml=pynvml, clock=lambda: now[0])
    for line in sys.stdin:
        now[0] = float(line)
        r = source.read()
        print(json.dumps({"available": r.status.available, "code": r.status.error_code,
                          "gpus": len(r.gpus), "errors": [e.message for e in r.errors],
                          **calls}), flush=True)
""")


def reads(node: FakeNode, times: list[float]) -> list[dict[str, Any]]:
    done = subprocess.run([sys.executable, "-c", SOURCE], env=node.env(), text=True,
                          input="".join(f"{t}\n" for t in times), capture_output=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.parametrize("code", TRANSIENT)
def test_one_failed_count_is_retried_at_once_and_costs_no_poll(
        fake_node: FakeNode, code: int) -> None:
    fake_node.fail("nvmlDeviceGetCount*", code, times=1)
    first, second = reads(fake_node, [0.0, 1.0])
    assert first["available"] and first["gpus"] == 2
    # The failure is reported, and NVML was shut down and initialised again to get past it.
    assert len(first["errors"]) == 1 and "nvmlDeviceGetCount" in first["errors"][0]
    assert (first["init"], first["shutdown"]) == (2, 1)
    assert second == {**first, "errors": []}


@pytest.mark.parametrize("code", TRANSIENT)
def test_a_count_failing_twice_reads_as_down_for_one_poll_then_up(
        fake_node: FakeNode, code: int) -> None:
    """Before the fix, codes outside a short list left NVML initialised and marked down for
    good: every later good read kept `available` False."""
    fake_node.fail("nvmlDeviceGetCount*", code, times=2)
    down, waiting, up, later = reads(fake_node, [0.0, 0.5, 1.0, 2.0])
    assert not down["available"] and down["code"] == code and len(down["errors"]) == 2
    assert down["init"] == 2 and down["shutdown"] == 2
    assert not waiting["available"] and waiting["init"] == 2  # backing off: no attempt
    assert up["available"] and up["gpus"] == 2 and up["code"] is None and up["init"] == 3
    assert later["available"] and later["init"] == 3 and later["errors"] == []


def test_a_count_that_keeps_failing_backs_off_and_recovers_when_it_stops(
        fake_node: FakeNode) -> None:
    fake_node.fail("nvmlDeviceGetCount*", fakenvml.UNKNOWN)
    times = [0.0, 0.9, 1.0, 2.9, 3.0, 6.9, 7.0, 10.9, 11.0]
    got = reads(fake_node, times)
    inits = [r["init"] for r in got]
    # Two tries at 0 (the one immediate retry), then one each at 1, 3 (after 2 s), 7 (after 4 s)
    # and 11 (after 4 s: retry_max); none in between.
    assert inits == [2, 2, 3, 3, 4, 4, 5, 5, 6]
    assert not any(r["available"] for r in got)

    fake_node.clear_failures()
    assert all(r["available"] for r in reads(fake_node, [0.0, 1.0]))


def test_the_daemon_shows_nvml_up_again_after_transient_count_failures(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_job(tmp_path, workers=1) as job, running_daemon(cli_env, tmp_path) as d:
        (worker,) = job.workers
        fake_node.hold(worker, device=0, used=GIB)
        d.wait_for_metrics("NVML up and the worker's memory", lambda s: value(
            s, "gpuwatch_process_gpu_memory_bytes", pid=str(worker)) == GIB or None)
        for code in TRANSIENT:
            for times in (1, 2):
                before = d.scrape()
                fake_node.fail("nvmlDeviceGetCount*", code, times=times)
                # The fault is seen (counted) and gone, and NVML is up again within a few polls
                # (a second failure in a row waits out the daemon's first backoff, 1 s).
                started = time.monotonic()
                errors = value(before, "gpuwatch_poll_errors_total", source="nvml")
                d.wait_for_metrics(f"code {code} x{times} counted, NVML up again", lambda s, n=(
                    errors + times): (
                    value(s, "gpuwatch_poll_errors_total", source="nvml") >= n
                    and value(s, "gpuwatch_nvml_up") == 1
                    and value(s, "gpuwatch_process_gpu_memory_bytes", pid=str(worker)) == GIB)
                    or None, timeout=30)
                # A few polls and one backoff, late as a loaded machine may make them; a
                # daemon that waited out a long backoff (30 s and more) would fail this.
                assert time.monotonic() - started < 15
                fake_node.clear_failures()
                code_, doc = status_json(cli_env)
                assert doc["source"] == "daemon", doc["source_detail"]
                assert code_ == 0 and doc["nvml"]["available"], (doc["nvml"], doc["errors"],
                                                                 d.log()[-3000:])
        assert "NVML unavailable" in d.log()  # the two-in-a-row faults did show, and passed
        result = gpuwatch(["status"], cli_env)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "NVML unavailable" not in result.stdout
