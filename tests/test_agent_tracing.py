"""The agent's allocation tracer, with the real tracemalloc.

tracemalloc is process-wide, so every test that starts it runs a small program in its own
interpreter; the program prints one JSON line with what it saw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuwatch.agent._tracing import (
    MAX_BODY_BYTES,
    Tracer,
    _by_line,
    _largest_stack,
    _raw_traces,
)

REPO = Path(__file__).resolve().parent.parent
DATAGRAM = 16384
MIB = 1 << 20


def run_program(tmp_path: Path, source: str, env_extra: Optional[dict[str, str]] = None,
                timeout: float = 120) -> dict[str, Any]:
    """Run `source` as tmp_path/prog.py (so its sites read "prog.py": sys.path[0] is tmp_path)
    and return the JSON of its last stdout line."""
    program = tmp_path / "prog.py"
    program.write_text(textwrap.dedent(source))
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    env.pop("PYTHONTRACEMALLOC", None)
    proc = subprocess.run([sys.executable, str(program)], env=env, text=True,
                          capture_output=True, timeout=timeout, cwd=tmp_path)
    assert proc.returncode == 0, f"exited with {proc.returncode}: {proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def line_of(source: str, marker: str) -> int:
    lines = textwrap.dedent(source).splitlines()
    return next(i for i, text in enumerate(lines, 1) if marker in text)


def envelope(body: dict[str, Any]) -> bytes:
    """The largest a trace report with this body can be: big numbers, every character escaped
    as the most cautious encoder would."""
    report = {"v": 1, "kind": "trace", "seq": (1 << 63) - 1, "step": (1 << 63) - 1,
              "rss": (1 << 63) - 1, "trace": body}
    return json.dumps(report, separators=(",", ":")).encode()


LEAK = """
    import json
    import tracemalloc
    from gpuwatch.agent._tracing import Tracer

    def make_step():
        kept = []
        def train_step():
            scratch = [bytes(1000) for _ in range(100)]  # freed each step: no growth
            kept.append(bytearray(1 << 20))  # LEAK
            del scratch
        return train_step

    train_step = make_step()
    for _ in range(3):
        train_step()
    tracer = Tracer()
    step = 1000
    started = tracer.start(STEPS, step)
    during = (tracer.active, tracemalloc.is_tracing(), tracemalloc.get_traceback_limit())
    report = None
    calls = 0
    while report is None:
        train_step()  # CALL
        step += 1
        calls += 1
        report = tracer.on_step(step)
    print(json.dumps({"started": started, "during": during, "report": report, "calls": calls,
                      "after": [tracer.active, tracemalloc.is_tracing()]}))
"""


@pytest.mark.parametrize("steps", [1, 10])
def test_a_growing_list_is_found_at_its_append_line_with_its_call_stack(
        tmp_path: Path, steps: int) -> None:
    source = LEAK.replace("STEPS", str(steps))
    out = run_program(tmp_path, source)
    assert out["started"] is None
    assert out["during"] == [True, True, 16]
    assert out["after"] == [False, False]  # it started tracemalloc, so it stopped it
    assert out["calls"] == steps
    report = out["report"]
    assert report["status"] == "done"
    assert report["steps"] == steps
    top = report["sites"][0]
    assert (top["file"], top["line"]) == ("prog.py", line_of(source, "# LEAK"))
    assert abs(top["bytes"] / steps - MIB) < 0.1 * MIB
    assert top["count"] >= steps
    assert len(report["sites"]) <= 8
    assert [s["bytes"] for s in report["sites"]] == sorted(
        (s["bytes"] for s in report["sites"]), reverse=True)
    assert all(s["bytes"] > 0 and s["count"] >= 0 for s in report["sites"])
    assert report["traceback"][-1] == {"file": "prog.py", "line": line_of(source, "# LEAK")}
    assert report["traceback"][-2] == {"file": "prog.py", "line": line_of(source, "# CALL")}
    # Nothing of the tracer itself is reported.
    assert not any("_tracing" in s["file"] or "tracemalloc" in s["file"]
                   for s in report["sites"] + report["traceback"])


def test_a_program_already_tracing_keeps_tracing_and_old_memory_is_not_reported(
        tmp_path: Path) -> None:
    source = """
        import json
        import tracemalloc
        tracemalloc.start(5)
        from gpuwatch.agent._tracing import Tracer

        old = [bytearray(1 << 20) for _ in range(32)]  # OLD: live before the trace, stays
        kept = []
        tracer = Tracer()
        assert tracer.start(4, 0) is None
        limit_during = tracemalloc.get_traceback_limit()
        report = None
        step = 0
        while report is None:
            kept.append(bytearray(1 << 20))  # LEAK
            step += 1
            report = tracer.on_step(step)
        print(json.dumps({"report": report, "tracing": tracemalloc.is_tracing(),
                          "limit": [limit_during, tracemalloc.get_traceback_limit()]}))
    """
    out = run_program(tmp_path, source)
    assert out["tracing"] is True
    assert out["limit"] == [5, 5]
    report = out["report"]
    assert report["status"] == "done" and report["steps"] == 4
    top = report["sites"][0]
    assert (top["file"], top["line"]) == ("prog.py", line_of(source, "# LEAK"))
    assert abs(top["bytes"] / 4 - MIB) < 0.1 * MIB
    assert line_of(source, "# OLD") not in [s["line"] for s in report["sites"]]
    assert report["traceback"][-1]["line"] == line_of(source, "# LEAK")


def test_refusals_busy_then_cooldown_then_a_new_trace_after_it(tmp_path: Path) -> None:
    source = """
        import json
        import tracemalloc
        from gpuwatch.agent._tracing import Tracer

        now = [100.0]
        tracer = Tracer(cooldown=60.0, clock=lambda: now[0])
        out = {"first": tracer.start(2, 0), "busy": tracer.start(2, 0)}
        tracer.on_step(1)
        out["report"] = tracer.on_step(2)["status"]
        now[0] += 59.0
        out["cooldown"] = tracer.start(2, 2)
        out["tracing_in_cooldown"] = tracemalloc.is_tracing()
        now[0] += 2.0
        out["again"] = tracer.start(500, 2)
        out["clamped_report"] = [tracer.on_step(101), tracer.on_step(102)["steps"]]
        print(json.dumps(out))
    """
    out = run_program(tmp_path, source)
    assert out["first"] is None
    assert out["busy"] == {"status": "refused", "why": "busy"}
    assert out["report"] == "done"
    assert out["cooldown"] == {"status": "refused", "why": "cooldown"}
    assert out["tracing_in_cooldown"] is False
    assert out["again"] is None
    assert out["clamped_report"] == [None, 100]  # 500 steps asked, 100 traced


@pytest.mark.parametrize("value", ["0", "false", "no", "off", " OFF "])
def test_tracing_turned_off_in_the_environment_is_refused_without_tracing(
        monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    import tracemalloc
    was_tracing = tracemalloc.is_tracing()
    monkeypatch.setenv("GPUWATCH_AGENT_TRACING", value)
    tracer = Tracer()
    assert tracer.start(5, 0) == {"status": "refused", "why": "GPUWATCH_AGENT_TRACING=0"}
    assert not tracer.active
    assert tracemalloc.is_tracing() == was_tracing


def test_tracing_turned_on_in_the_environment_traces(tmp_path: Path) -> None:
    out = run_program(tmp_path, """
        import json
        from gpuwatch.agent._tracing import Tracer
        tracer = Tracer()
        started = tracer.start(1, 0)
        print(json.dumps({"started": started, "report": tracer.on_step(1)["status"]}))
    """, env_extra={"GPUWATCH_AGENT_TRACING": "1"})
    assert out == {"started": None, "report": "done"}


def test_cancel_stops_without_a_report_and_without_a_cooldown(tmp_path: Path) -> None:
    out = run_program(tmp_path, """
        import json
        import tracemalloc
        from gpuwatch.agent._tracing import Tracer
        tracer = Tracer()
        tracer.start(3, 0)
        tracer.cancel()
        out = {"after_cancel": [tracer.active, tracemalloc.is_tracing(), tracer.on_step(5)]}
        out["restart"] = tracer.start(3, 5)
        tracer.cancel()
        print(json.dumps(out))
    """)
    assert out == {"after_cancel": [False, False, None], "restart": None}


def test_a_failure_is_reported_and_tracing_is_stopped(tmp_path: Path) -> None:
    out = run_program(tmp_path, """
        import json
        import tracemalloc
        from gpuwatch.agent._tracing import Tracer
        tracer = Tracer(cooldown=0)
        tracer.start(3, 10)
        tracer.on_step(11)
        back = tracer.on_step(2)  # the program restarted its count
        back_tracing = tracemalloc.is_tracing()
        tracer.start(3, 0)
        tracemalloc.stop()  # someone else stopped it
        stopped = tracer.on_step(3)
        print(json.dumps({"back": back, "back_tracing": back_tracing, "stopped": stopped,
                          "active": tracer.active}))
    """)
    assert out["back"] == {"status": "failed", "why": "the step went back from 10 to 2"}
    assert out["back_tracing"] is False
    assert out["stopped"]["status"] == "failed"
    assert out["stopped"]["why"].startswith("RuntimeError: ")
    assert out["active"] is False


def test_a_start_before_any_step_counts_from_the_next_step(tmp_path: Path) -> None:
    out = run_program(tmp_path, """
        import json
        from gpuwatch.agent._tracing import Tracer
        tracer = Tracer()
        tracer.start(2, None)
        reports = [tracer.on_step(s) for s in (7, 8, 9)]
        print(json.dumps([r if r is None else r["steps"] for r in reports]))
    """)
    assert out == [None, None, 2]


def test_the_body_fits_a_datagram_with_1000_growing_sites_and_huge_file_names(
        tmp_path: Path) -> None:
    source = """
        import json
        from gpuwatch.agent._tracing import Tracer

        kept = []
        # Names that grow most when escaped: astral characters, control characters, quotes,
        # backslashes and an undecodable byte.
        weird = "\\U0001F600\\u00e9\\x01\\"\\\\\\udcff"

        def long_name(kind, i):
            return "/srv/" + weird * 40 + "/" + "d" * 300 + f"/{kind}_{i}.py"

        allocators = []
        for i in range(1000):
            code = compile("kept.append(bytearray(%d))" % (1000 + i), long_name("site", i),
                           "exec")
            allocators.append(code)

        # A call chain 30 deep through long-named files, its innermost frame allocating most.
        namespace = {"kept": kept}
        exec(compile("def f0():\\n    kept.append(bytearray(1 << 20))\\n",
                     long_name("deep", 0), "exec"), namespace)
        for d in range(1, 30):
            exec(compile(f"def f{d}():\\n    f{d - 1}()\\n", long_name("deep", d), "exec"),
                 namespace)

        tracer = Tracer(frames=64)
        tracer.start(3, 0)
        report = None
        step = 0
        while report is None:
            for code in allocators:
                exec(code, {"kept": kept})
            namespace["f29"]()
            step += 1
            report = tracer.on_step(step)
        print(json.dumps(report))
    """
    report = run_program(tmp_path, source)
    assert report["status"] == "done"
    assert len(report["sites"]) == 8
    assert len(report["traceback"]) == 16
    assert report["sites"][0]["file"].endswith("/deep_0.py")
    assert report["traceback"][-1]["file"].endswith("/deep_0.py")
    assert report["traceback"][0]["file"].endswith("/deep_15.py")  # the 16 most recent
    for entry in report["sites"] + report["traceback"]:
        assert len(entry["file"]) <= 256
        assert entry["file"].startswith("...")
        entry["file"].encode("utf-8")  # no lone surrogates left
    assert len(json.dumps(report, separators=(",", ":"))) <= MAX_BODY_BYTES
    assert len(envelope(report)) < DATAGRAM
    compact = json.dumps(report, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    assert len(compact) < DATAGRAM


def test_costs_of_tracing_a_step_and_of_the_final_snapshot(tmp_path: Path) -> None:
    """Every final snapshot ends its trace "done": one site, a thousand sites, tracemalloc already
    started by the program, and ten times the blocks. Prints what each took (pytest -s shows them)
    at sizes that keep the suite fast; bench/agent_step.py measures the costs."""
    out = run_program(tmp_path, """
        import json
        import time
        import tracemalloc
        from gpuwatch.agent._tracing import Tracer

        def alloc_step():
            # An allocation-heavy Python step: many short-lived small objects.
            rows = [{"id": i, "name": str(i), "vals": [i, i + 1, (i, i)]} for i in range(20000)]
            return len(rows)

        def time_steps(n, tracer=None, step=0):
            best = float("inf")
            for _ in range(n):
                t = time.perf_counter()
                alloc_step()
                best = min(best, time.perf_counter() - t)
                step += 1
                if tracer is not None:
                    assert tracer.on_step(step) is None
            return best

        for _ in range(3):
            alloc_step()
        plain = time_steps(3)
        traced = {}
        for frames in (1, 16):
            tracer = Tracer(frames=frames, cooldown=0)
            tracer.start(100, 0)
            traced[frames] = time_steps(3, tracer)
            tracer.cancel()

        # Small ints only, so that the loops themselves allocate nothing tracemalloc would see.
        steps = [s % 50 + 1 for s in range(100_000)]

        def per_call(tracer=None):
            t = time.perf_counter()
            for s in steps:
                pass
            empty = time.perf_counter() - t
            t = time.perf_counter()
            for s in steps:
                tracer.on_step(s)
            return (time.perf_counter() - t - empty) / len(steps)

        tracer = Tracer(cooldown=0)
        on_step_inactive = per_call(tracer)
        tracer.start(100, 0)
        on_step_active = per_call(tracer)
        tracer.cancel()

        def final_snapshot(blocks, sites, already):
            if already:
                tracemalloc.start(16)
                before = [bytes(100 + i % 50) for i in range(blocks)]
            tracer = Tracer(cooldown=0)
            tracer.start(1, 0)
            kept = []
            source = f"kept.extend(bytes(100 + i % 50) for i in range({blocks // sites}))"
            codes = [compile(source, f"/srv/site_{j}.py", "exec") for j in range(sites)]
            for code in codes:
                exec(code, {"kept": kept})
            live = len(tracemalloc.take_snapshot().traces)
            t = time.perf_counter()
            report = tracer.on_step(1)
            took = time.perf_counter() - t
            assert report["status"] == "done", report
            if already:
                tracemalloc.stop()
            return {"live_blocks": live, "sites": sites, "already_tracing": already,
                    "final_step_s": round(took, 4)}

        finals = [final_snapshot(20_000, 1, False), final_snapshot(20_000, 1000, False),
                  final_snapshot(20_000, 1, True), final_snapshot(200_000, 1, False)]
        print(json.dumps({"step_plain_ms": round(plain * 1e3, 2),
                          "step_traced_1_frame_ms": round(traced[1] * 1e3, 2),
                          "step_traced_16_frames_ms": round(traced[16] * 1e3, 2),
                          "on_step_inactive_ns": round(on_step_inactive * 1e9),
                          "on_step_active_ns": round(on_step_active * 1e9),
                          "final": finals}))
    """, timeout=300)
    print("\ntracing costs:", json.dumps(out, indent=1))
    assert len(out["final"]) == 4


class _PublicOnly:
    """A snapshot seen through the public API alone."""

    def __init__(self, snapshot: Any) -> None:
        self.traces = list(snapshot.traces)


def test_grouping_reads_the_same_through_the_public_api() -> None:
    import tracemalloc
    leak, other = ("/a/leak.py", 7), ("/a/other.py", 3)
    raw = [(0, 1000, (leak, ("/a/main.py", 20), ("/a/main.py", 1)), 3),
           (0, 3000, (leak, ("/a/main.py", 21), ("/a/main.py", 1)), 3),
           (0, 500, (leak, ("/a/main.py", 21), ("/a/main.py", 1)), 3),
           (0, 200, (other,), 1)]
    snapshot = tracemalloc.Snapshot(raw, 3)
    private, public = _raw_traces(snapshot), _raw_traces(_PublicOnly(snapshot))
    assert private is snapshot.traces._traces
    assert [t[1:3] for t in private] == [t[1:3] for t in public]
    for traces in (private, public):
        assert _by_line(traces) == {leak: (4500, 3), other: (200, 1)}
        assert _largest_stack(traces, leak) == [("/a/main.py", 1), ("/a/main.py", 21), leak]
