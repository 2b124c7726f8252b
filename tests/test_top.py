"""`gpuwatch top`: its layouts as pure functions, then the real thing in a real terminal.

The end-to-end tests run `gpuwatch top` in a shell inside a private tmux server, against a
simulated node (fake GPUs, the real daemon, real jobs), type at it with `send-keys` and read the
screen with `capture-pane`. Every wait polls the screen against a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from gpuwatch import __version__
from gpuwatch.model import NodeReport
from gpuwatch.serve.state_socket import StateServer
from gpuwatch.simulate.demo import SimulatedNode, simulated_node, wait_for
from gpuwatch.sinks.document import from_json, status_document
from gpuwatch.sinks.top.feed import Feed, Samples
from gpuwatch.sinks.top.view import (
    ASCII,
    UNICODE,
    Chrome,
    TopView,
    ViewState,
    build_rows,
    clean,
    details_lines,
    glyphs_for,
    sparkline,
)
from tests.daemonproc import wait_first_poll

GIB, MIB = 1 << 30, 1 << 20
NOW = 1_800_000_000.0


# ---- documents ---------------------------------------------------------------------------------

def proc(pid: int, ppid: int, *, job: Optional[str] = None, user: str = "alice",
         gpu: Optional[int] = None, used: int = 0, rss: int = GIB, root: Optional[int] = None,
         cmd: Optional[list[str]] = None) -> dict[str, Any]:
    """A process as the status document has it."""
    return {"pid": pid, "ppid": ppid, "pgid": root or pid, "sid": root or pid,
            "job_root": root, "start_time": NOW - 3600, "name": "python", "user": user,
            "uid": 1000, "state": "sleeping", "rss_bytes": rss, "uss_bytes": None,
            "pss_bytes": None, "num_threads": 4,
            "gpu_memory_bytes": used if gpu is not None else 0,
            "gpus": [] if gpu is None else [{"index": gpu, "uuid": f"GPU-{gpu}",
                                             "memory_bytes": used, "type": "compute",
                                             "gpu_instance_id": None,
                                             "compute_instance_id": None}],
            "holds_gpu": gpu is not None,
            "job": {"id": job, "source": "slurm"} if job else None, "cgroup": "/",
            "system_unit": None, "exe": None, "launch_env": {},
            "cmdline": cmd or ["python", "-u", "train.py"],
            "in_procfs": True, "read_errors": [], "wchan": None, "kernel_stack": [],
            "agent": None}


def finding(kind: str, p: dict[str, Any], severity: str = "critical", reason: str = "",
            details: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    return {"kind": kind, "severity": severity, "pid": p["pid"], "start_time": p["start_time"],
            "name": p["name"], "user": p["user"], "job": p["job"],
            "gpus": [u["index"] for u in p["gpus"]], "gpu_memory_bytes": p["gpu_memory_bytes"],
            "reason": reason or f"{kind} evidence", "summary": f"{kind} in figures",
            "since": NOW - 30,
            "details": details or {}}


def document(processes: list[dict[str, Any]], findings: Optional[list[dict[str, Any]]] = None,
             gpus: int = 2) -> dict[str, Any]:
    """A whole status document, as the daemon writes it (test_documents_are_the_writers
    checks)."""
    return {"schema": 1, "gpuwatch_version": __version__, "source": "daemon", "source_detail": None,
            "node": "gpu-node-07", "taken_at": NOW, "poll_duration_seconds": 0.01,
            "nvml": {"available": True, "error": None, "error_code": None,
                     "driver_version": "550.54.15", "nvml_version": "12.550.54.15",
                     "cuda_driver_version": "12.4", "device_count": gpus},
            "gpus": [{"index": i, "uuid": f"GPU-{i}", "name": "NVIDIA H100 80GB HBM3",
                      "pci_bus_id": f"0000:{i:02x}:00.0", "memory_total_bytes": 80 * GIB,
                      "memory_used_bytes": sum(p["gpu_memory_bytes"] or 0 for p in processes
                                               if p["gpus"] and p["gpus"][0]["index"] == i),
                      "memory_free_bytes": None, "memory_reserved_bytes": 0,
                      "unattributed_memory_bytes": 0, "utilization_gpu_percent": 97,
                      "utilization_memory_percent": 40, "mig_enabled": False,
                      "process_count": sum(1 for p in processes
                                           if p["gpus"] and p["gpus"][0]["index"] == i),
                      "holders_unknown": False, "lost": False, "errors": []}
                     for i in range(gpus)],
            "processes": sorted([proc(1, 0, user="root", cmd=["/sbin/init"]), *processes],
                                key=lambda p: p["pid"]),
            "findings": findings or [], "errors": []}


LONG_ARGS = ["--config", "configs/pretrain/llama-70b/stage2.yaml", "--resume-from",
             "/checkpoints/llama-70b/stage2/step-120000", "--max-steps", "250000"]
LEAK = {"series": "RSS", "unit": "step", "window_steps": [10, 40], "culprit": "fetch_buffer",
        "found_by": "watched", "growth_bytes_per_step": 2 * MIB,
        "culprit_bytes_per_step": 2 * MIB, "culprit_items_per_step": 1,
        "limit_source": "cgroup", "limit_bytes": 64 * GIB, "available_bytes": 40 * GIB,
        "projected_oom_step": 20520, "projected_oom_in_seconds": 4100}


def two_jobs() -> dict[str, Any]:
    """Job 41 (alice): launcher 100, workers 101 (1 GiB) and 102 (5 GiB), small RSS. Job 52
    (bob): launcher 200, worker 201 (4 GiB) with a large RSS, leaking. And an orphan of job 63,
    300 (2 GiB), under PID 1."""
    procs = [
        proc(100, 1, job="41", root=100, cmd=["torchrun", "--nproc-per-node", "2", "train.py",
                                               *LONG_ARGS]),
        proc(101, 100, job="41", root=100, gpu=0, used=GIB),
        proc(102, 100, job="41", root=100, gpu=1, used=5 * GIB),
        proc(200, 1, job="52", user="bob", root=200, cmd=["torchrun", "sft.py"]),
        proc(201, 200, job="52", user="bob", root=200, gpu=0, used=4 * GIB, rss=30 * GIB),
        proc(300, 1, job="63", user="carol", root=300, gpu=1, used=2 * GIB),
    ]
    by_pid = {p["pid"]: p for p in procs}
    return document(procs, [
        finding("leak", by_pid[201], reason="RSS grows every step; buffer `fetch_buffer` "
                                            "explains it (watched)", details=LEAK),
        finding("orphan", by_pid[300], reason="parent 299 (torchrun) exited; now under 1"),
    ])


def report(doc: dict[str, Any]) -> NodeReport:
    """The report top reads from `doc` (its feed's producer does the same)."""
    return from_json(doc)  # type: ignore[arg-type]


def test_documents_are_the_writers() -> None:
    """What these tests render is what a daemon could serve: the writer renders each document
    read back to the same JSON, so no view is tested on a field the daemon never writes."""
    for doc in (two_jobs(), big_node(64, 4)):
        assert json.loads(json.dumps(status_document(report(doc)))) == doc


def roots(rows: list[Any]) -> list[int]:
    return [r.pid for r in rows if not r.prefix]


# ---- the view, without a terminal ----------------------------------------------------------------

def test_sorting_orders_whole_trees_and_the_siblings_in_each() -> None:
    node = report(two_jobs())
    by_gpu = build_rows(node, "gpu")
    # Trees by their total GPU memory (6, 4 and 2 GiB), siblings by theirs.
    assert [r.pid for r in by_gpu] == [100, 102, 101, 200, 201, 300]
    assert [r.prefix for r in by_gpu] == ["", "├─ ", "└─ ", "", "└─ ", ""]
    assert roots(build_rows(node, "rss")) == [200, 100, 300]  # job 52's 30 GiB RSS first
    assert [r.pid for r in build_rows(node, "pid")] == [100, 101, 102, 200, 201, 300]
    assert roots(build_rows(node, "job")) == [100, 200, 300]
    for sort in ("gpu", "rss", "pid", "job"):
        rows = build_rows(node, sort)
        # Every tree stays whole: each worker right under its launcher or a sibling.
        for i, row in enumerate(rows):
            if row.prefix:
                assert rows[i - 1].pid in (row.proc.ppid, *(
                    r.pid for r in rows if r.proc.ppid == row.proc.ppid))
    state = ViewState()
    seen = []
    for _ in range(4):
        state.next_sort()
        seen.append(state.sort)
    assert seen == ["rss", "pid", "job", "gpu"]


def test_filter_keeps_the_trees_of_the_matching_job_or_user() -> None:
    node = report(two_jobs())
    assert [r.pid for r in build_rows(node, "pid", "slurm:41")] == [100, 101, 102]
    assert [r.pid for r in build_rows(node, "pid", "52")] == [200, 201]
    assert [r.pid for r in build_rows(node, "pid", "CAROL")] == [300]
    assert build_rows(node, "pid", "nobody") == []
    view = TopView()
    view.set_report(node)
    text = [line.text for line in view.render(ViewState(filter="nobody"), 80, 24, None,
                                               Chrome())]
    assert any("no process matches the filter" in line for line in text)
    assert any("filter: nobody (Esc clears)" in line for line in text)


@pytest.mark.parametrize("width,height", [(80, 24), (300, 60), (40, 10)])
def test_every_layout_fits_its_terminal_with_header_bars_selection_and_keys(
        width: int, height: int) -> None:
    view = TopView()
    view.set_report(report(two_jobs()))
    state = ViewState()
    lines = view.render(state, width, height, Samples(), Chrome())
    text = [line.text for line in lines]
    assert len(lines) == height
    assert all(len(line) <= width for line in text), [t for t in text if len(t) > width]
    assert text[0].startswith("node gpu-node-07")
    assert width < 80 or "from the running daemon" in text[0]
    assert "NVML 12.550.54.15" in text[1]
    assert "q quit" in text[-1]
    assert sum(line.selected for line in lines) == 1
    if height >= 24:
        assert text[2].startswith("GPU 0") and "[█" in text[2] and "util  97%" in text[2]
        assert text[3].startswith("GPU 1")
    else:  # room for one line of GPUs: all of them in one
        assert text[2].startswith("2 GPUs: 12.0 GiB/160.0 GiB used (8%)")
    head = next(t for t in text if t.startswith("PID"))
    if width >= 300:
        # The whole command line of the launcher, and every column.
        assert all(name in head for name in ("USER", "JOB", "STATE", "RSS", "GPU MEM"))
        assert any(" ".join(LONG_ARGS) in t for t in text)
        assert text[0].endswith("gpuwatch top · every 2 s")
    elif width == 80:
        assert not any(" ".join(LONG_ARGS) in t for t in text)
        assert any(t.endswith("…") for t in text)  # COMMAND cut short, marked
    # The leak's figures and culprit stand under its row where there is a body to hold them.
    if height >= 24:
        assert any("out of memory at step ~20520" in t for t in text)
        assert any("culprit `fetch_buffer` (watched)" in t for t in text)


def test_columns_give_way_in_order_once_command_is_cut_to_its_minimum() -> None:
    view = TopView()
    view.set_report(report(two_jobs()))
    shown = {}
    for width in (80, 70, 60, 50, 40):
        lines = view.render(ViewState(), width, 24, None, Chrome())
        head = next(line.text for line in lines if line.text.startswith("PID"))
        shown[width] = [name for name in ("USER", "JOB", "STATE", "RSS", "GPU MEM", "COMMAND")
                        if name in head]
        assert len(head) - head.index("COMMAND") >= 7
        assert all(len(line.text) <= width for line in lines)
    assert shown == {80: ["USER", "JOB", "STATE", "RSS", "GPU MEM", "COMMAND"],
                     70: ["USER", "JOB", "RSS", "GPU MEM", "COMMAND"],
                     60: ["JOB", "RSS", "GPU MEM", "COMMAND"],
                     50: ["JOB", "GPU MEM", "COMMAND"],
                     40: ["GPU MEM", "COMMAND"]}


def test_a_terminal_too_small_says_so() -> None:
    view = TopView()
    view.set_report(report(two_jobs()))
    lines = view.render(ViewState(), 39, 9, None, Chrome())
    assert len(lines) == 9 and lines[0].text.startswith("terminal too small (39x9)")
    assert all(len(line.text) <= 39 for line in lines)


def big_node(processes: int = 512, gpus: int = 8) -> dict[str, Any]:
    """Jobs of one launcher and seven workers each, one GPU process per worker."""
    procs = []
    for j in range(processes // 8):
        launcher = 1000 + 100 * j
        procs.append(proc(launcher, 1, job=str(5000 + j), root=launcher, user=f"user{j % 5}",
                          cmd=["torchrun", "--nproc-per-node", "7", "train.py"]))
        for w in range(7):
            procs.append(proc(launcher + 1 + w, launcher, job=str(5000 + j), root=launcher,
                              user=f"user{j % 5}", gpu=(j + w) % gpus,
                              used=GIB + ((j * 7 + w) % 97) * MIB))
    return document(procs, gpus=gpus)


def test_a_512_process_node_renders_in_80x24_and_scrolls_to_every_row() -> None:
    doc = big_node()
    view = TopView()
    view.set_report(report(doc))
    state = ViewState()
    started = time.perf_counter()
    lines = view.render(state, 80, 24, Samples(), Chrome())
    first_render = time.perf_counter() - started
    rows = view.rows(state)
    assert len(rows) == 512
    assert all(len(line.text) <= 80 for line in lines) and len(lines) == 24
    page = view.page(80, 24)
    for key_delta in (1, page, page, 10_000, -page):
        view.move(state, key_delta)
        lines = view.render(state, 80, 24, Samples(), Chrome())
        selected = [line for line in lines if line.selected]
        assert len(selected) == 1, "the selected row is always on screen"
        assert selected[0].text.lstrip("├└─ ").startswith(str(state.selected))
        assert all(len(line.text) <= 80 for line in lines)
    view.move_to(state, len(rows) - 1)
    lines = view.render(state, 80, 24, Samples(), Chrome())
    assert "512/512 processes" in lines[-2].text
    # Cheap enough to redraw on every key: a key re-renders without rebuilding the rows.
    started = time.perf_counter()
    for _ in range(50):
        view.move(state, -1)
        view.render(state, 80, 24, Samples(), Chrome())
    per_key = (time.perf_counter() - started) / 50
    assert per_key < first_render + 0.05  # no rebuild of the 512 rows per key


def test_sparkline_and_the_samples_it_draws() -> None:
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7], 8, UNICODE) == "▁▂▃▄▅▆▇█"
    assert sparkline([5, 5, 5], 3, UNICODE) == "▁▁▁"  # a flat line sits on the floor
    assert sparkline([1, None, 3], 3, UNICODE) == "▁ █"
    assert sparkline(list(range(100)), 10, UNICODE) == "▁▂▃▃▄▅▆▆▇█"  # the newest 10
    assert sparkline([0, 7], 2, ASCII) == "_#"
    # A terminal whose encoding is not UTF-8 (LC_ALL=C) gets ASCII bars, trees and sparks.
    assert glyphs_for("UTF-8") is UNICODE and glyphs_for("ANSI_X3.4-1968") is ASCII
    prefixes = [r.prefix for r in build_rows(report(two_jobs()), "pid", glyphs=ASCII)]
    assert prefixes[:3] == ["", "|- ", "`- "]
    samples = Samples(capacity=5)
    doc = two_jobs()
    for i in range(8):
        doc = {**doc, "taken_at": NOW + i,
               "processes": [{**p, "rss_bytes": p["rss_bytes"] + i * MIB}
                             for p in doc["processes"]]}
        samples.record(report(doc))
        # The same snapshot again (a daemon slower than top): not counted.
        samples.record(report(doc))
    assert len(samples.of(201)) == 5  # bounded
    assert [s.at for s in samples.of(201)] == [NOW + i for i in range(3, 8)]
    # A process that leaves is forgotten; a PID taken by a new process starts afresh.
    doc = {**doc, "taken_at": NOW + 10,
           "processes": [{**p, "start_time": NOW} if p["pid"] == 201 else p
                         for p in doc["processes"] if p["pid"] != 300]}
    samples.record(report(doc))
    assert samples.of(300) == [] and 300 not in samples.pids()
    assert len(samples.of(201)) == 1
    view = TopView()
    view.set_report(report(doc))
    state = ViewState(sort="pid")
    view.move_to(state, 4)
    assert state.selected == 201
    panel = [line.text for line in view.render(state, 80, 24, samples, Chrome())[-5:-2]]
    assert panel[0].startswith("PID 201 python · leak (critical)")
    assert panel[1].startswith("RSS  ▁ 30.0 GiB") and "1 sample" in panel[1]


def test_details_of_a_leak_name_its_culprit_and_its_out_of_memory_step() -> None:
    doc = two_jobs()
    leaking = next(p for p in doc["processes"] if p["pid"] == 201)
    leaking["agent"] = {"step": 40, "step_changed_at": NOW - 1, "first_seen": NOW - 100,
                        "last_seen": NOW, "finished_at": None, "rss_bytes": 30 * GIB,
                        "cuda_allocated_bytes": 3 * GIB, "cuda_reserved_bytes": 4 * GIB,
                        "cuda_active_bytes": None, "cuda_allocations": None,
                        "buffers": {"fetch_buffer": {"items": 40, "bytes": 80 * MIB}},
                        "exit": None}
    samples = Samples()
    for i, rss in enumerate((20, 25, 30)):
        samples.record(report({**doc, "taken_at": NOW + i, "processes": [
            {**p, "rss_bytes": rss * GIB} if p["pid"] == 201 else p
            for p in doc["processes"]]}))
    # Wrapped at the width: read as one text.
    lines = details_lines(report(doc), 201, samples, 100)
    text = " ".join(" ".join(line.text for line in lines).split())
    for wanted in ("PID 201", "python -u train.py",
                   "slurm:52", "GPU 0: 4.0 GiB (compute)", "leak (critical)",
                   "out of memory at step ~20520 (in ~68 min)",
                   "culprit `fetch_buffer` (watched): +1 items/step, ~2.0 MiB/step",
                   "projected_oom_step: 20520", "found_by: watched",
                   "RSS: min 20.0 GiB, max 30.0 GiB, last 30.0 GiB", "3 taken by top",
                   "step 40", "CUDA allocated 3.0 GiB, reserved 4.0 GiB",
                   "`fetch_buffer`: 40 items, 80.0 MiB"):
        assert wanted in text, wanted
    assert all(len(line.text) <= 100 for line in details_lines(report(doc), 201, samples, 100))
    gone = details_lines(report(doc), 999, samples, 80)
    assert "no longer in the document" in gone[0].text


def test_control_characters_in_a_command_line_never_reach_the_terminal() -> None:
    assert clean("python\x1b]0;owned\x07 -c x\nnext") == "python?]0;owned? -c x?next"
    assert clean("train.py ✓") == "train.py ✓" and clean("数据.py") == "??.py"
    doc = two_jobs()
    doc["processes"][1]["cmdline"] = ["python", "\x1b[2J\x1b[31mred"]
    rows = build_rows(report(doc), "pid")
    assert "\x1b" not in rows[0].command


def test_the_feed_hands_each_document_once_and_says_why_a_refresh_failed() -> None:
    answers: list[Any] = [{"n": 1}, RuntimeError("socket closed"), {"n": 2}]
    # The feed keeps the newest update only, as top wants it; here each answer waits until the
    # one before it is taken, so that a loaded machine's slow taker sees all three.
    turn = threading.Semaphore(1)

    def produce() -> dict[str, Any]:
        turn.acquire(timeout=30)
        answer = answers.pop(0) if answers else {"n": 2}
        if isinstance(answer, Exception):
            raise answer
        return dict(answer)

    feed = Feed(produce, interval=0.05)
    feed.start()
    got: list[Any] = []

    def three() -> Optional[bool]:
        update = feed.take()
        if update is not None:
            got.append(update)
            turn.release()
        return len(got) >= 3 or None

    try:
        wait_for("three updates", three, 30)
        assert got[0].report == {"n": 1} and got[0].error is None
        assert got[1].report is None and got[1].error == "RuntimeError: socket closed"
        assert got[2].report == {"n": 2}
        assert len({u.generation for u in got}) == 3
    finally:
        turn.release(100)
        feed.stop()


def test_the_confirmation_shows_what_reap_dry_run_prints(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuwatch.app.top import Reaping
    from gpuwatch.config import load_config
    from gpuwatch.sinks.top.view import confirm_lines

    run = tmp_path / "run"
    run.mkdir()
    env = {"GPUWATCH_CONFIG": "/dev/null", "GPUWATCH_RUNTIME_DIR": str(run),
           "GPUWATCH_STATE_DIR": str(tmp_path / "state")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    doc = two_jobs()
    server = StateServer(run / "state.sock", lambda: json.dumps(doc).encode(), group=None)
    server.start()
    try:
        printed = subprocess.run(
            [sys.executable, "-m", "gpuwatch", "reap", "--dry-run", "--pid", "300", "--kind",
             "orphan"], capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    finally:
        server.stop()
    assert printed.returncode == 0, printed.stderr
    plan = Reaping(load_config(None), lambda: None, False, lambda: None).plan(report(doc), 300,
                                                                              "orphan")
    assert plan.text == printed.stdout
    assert plan.command == "gpuwatch reap --dry-run --pid 300 --kind orphan"
    shown = [line.text for line in confirm_lines(plan.text, plan.command, 300, plan.in_full)]
    assert shown[:len(printed.stdout.splitlines())] == printed.stdout.splitlines()
    shown = [line.text for line in confirm_lines(plan.text, plan.command, 80, plan.in_full)]
    head, *table = printed.stdout.splitlines()
    assert " ".join(shown[:2]).split() == head.split()  # the sentence wrapped, not cut
    assert shown[2:2 + len(table)] == table  # the table as printed (cut on screen)
    assert "the same plan: gpuwatch reap --dry-run --pid 300 --kind orphan" in shown
    # Narrower than the table: each action in full, wrapped, under it.
    assert any(line.startswith("PID 300 (orphan): ") for line in shown)
    audit = (tmp_path / "state" / "reap.jsonl").read_text().splitlines()
    assert [json.loads(line)["dry_run"] for line in audit] == [True, True]


# ---- in a real terminal ------------------------------------------------------------------------

needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="the terminal tests drive gpuwatch top in tmux, which is "
                                       "not installed (apt-get install tmux)")

GPUWATCH = (str(Path(sys.executable).with_name("gpuwatch"))
            if Path(sys.executable).with_name("gpuwatch").exists()
            else f"{shlex.quote(sys.executable)} -m gpuwatch")
SCREEN_TIMEOUT = 30.0


class Terminal:
    """A shell in a tmux pane of a private tmux server."""

    def __init__(self, work: Path, env: dict[str, str], width: int, height: int) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.work = work
        self.socket = str(work / "tmux.sock")
        conf = work / "tmux.conf"
        # No status line (the pane is the whole window); Esc reaches top at once.
        conf.write_text('set -g default-terminal "screen-256color"\nset -sg escape-time 0\n'
                        "set -g status off\nset -g history-limit 100\n")
        rc = work / "rc.sh"
        rc.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
                      + "export HISTFILE=/dev/null\nPS1='$ '\n")
        self._tmux_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                          "HOME": os.environ.get("HOME", "/"), "LANG": "C.UTF-8",
                          "TERM": "screen-256color", "TMUX_TMPDIR": str(work)}
        self.tmux("-f", str(conf), "new-session", "-d", "-x", str(width), "-y", str(height),
                  "-s", "top", f"bash --noprofile --rcfile {shlex.quote(str(rc))} -i")
        self.wait("the shell's prompt", lambda s: s.rstrip().endswith("$"))

    def tmux(self, *args: str) -> str:
        done = subprocess.run(["tmux", "-u", "-S", self.socket, *args], capture_output=True,
                              text=True, timeout=30, env=self._tmux_env)
        assert done.returncode == 0, f"tmux {' '.join(args)}: {done.stderr}"
        return done.stdout

    def screen(self, escapes: bool = False) -> str:
        return self.tmux("capture-pane", "-p", *(["-e"] if escapes else []), "-t", "top")

    def lines(self) -> list[str]:
        return self.screen().split("\n")

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "top", *keys)

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", "top", "-l", text)
        self.keys("Enter")

    def wait(self, what: str, ready: Callable[[str], Any], timeout: float = SCREEN_TIMEOUT
             ) -> str:
        last = [""]

        def probe() -> Optional[str]:
            last[0] = self.screen()
            return last[0] if ready(last[0]) else None

        try:
            return wait_for(what, probe, timeout)
        except Exception:
            pytest.fail(f"{what}: not on screen after {timeout:g} s; the screen:\n{last[0]}")

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True,
                           timeout=10, env=self._tmux_env)


@contextlib.contextmanager
def terminal(work: Path, env: dict[str, str], width: int = 80, height: int = 24
             ) -> Iterator[Terminal]:
    term = Terminal(work, env, width, height)
    try:
        yield term
    finally:
        term.kill()


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimulatedNode]:
    """A simulated node whose job A lost its launcher: its workers are orphans. Job B's helpers
    become leftovers a few seconds in; job C leaks through the agent."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    with simulated_node(tmp_path_factory.mktemp("top-node"), listen="127.0.0.1:0",
                        interval=0.2, pace=1.0) as node:
        wait_first_poll(node.runtime_dir, node.daemon)
        node.training.launcher.kill()
        node.training.launcher.wait()
        yield node


def top_env(sim: SimulatedNode, tmp_path: Path, runtime: Optional[Path] = None,
            **more: str) -> dict[str, str]:
    env = {k: v for k, v in sim.node.env().items()
           if k.startswith(("LD_", "GPUWATCH_FAKE")) or k == "PATH"}
    env.update(GPUWATCH_RUNTIME_DIR=str(runtime or sim.runtime_dir),
               GPUWATCH_STATE_DIR=str(tmp_path / "state"), GPUWATCH_CONFIG="/dev/null",
               LANG="C.UTF-8", **more)
    return env


def table_roots(screen: str) -> list[int]:
    """PIDs of the rows that start a tree (no branch drawn before them)."""
    return [int(m) for m in re.findall(r"^(\d+) ", screen, re.M)]


def drawn(screen: str) -> bool:
    """The table is drawn whole: no tree's first row stands twice (rows of the last frame left
    under the new one's would)."""
    roots = table_roots(screen)
    return bool(roots) and len(roots) == len(set(roots))


def selected_pid(screen: str) -> Optional[int]:
    found = re.search(r"^PID (\d+) ", screen, re.M)
    return int(found.group(1)) if found else None


def assert_terminal_restored(term: Terminal, rc: int) -> None:
    """The shell is back, with the exit status; the terminal is in the mode a shell left it
    in, and on its normal screen."""
    term.wait(f"rc={rc}", lambda s: f"rc={rc}" in s)
    term.type("stty -a")
    modes = set(re.split(r"[\s;]+", term.wait("stty -a", lambda s: "icanon" in s)))
    assert {"icanon", "echo"} <= modes and not {"-icanon", "-echo"} & modes
    assert term.tmux("display", "-p", "-t", "top", "#{alternate_on}").strip() == "0"
    assert "q quit" not in term.screen()


@needs_tmux
def test_without_a_terminal_top_says_what_to_use_instead() -> None:
    done = subprocess.run([sys.executable, "-m", "gpuwatch", "top"], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert done.returncode == 2
    assert "gpuwatch top needs a terminal; use `gpuwatch status --watch` or `status --json`" \
        in done.stderr


@needs_tmux
def test_at_300_columns_commands_show_whole_and_resizing_relays_it_out(
        sim: SimulatedNode, tmp_path: Path) -> None:
    with terminal(tmp_path / "t", top_env(sim, tmp_path), 300, 60) as term:
        term.type(f"{GPUWATCH} top")
        screen = term.wait("the leak, its command whole", lambda s: "[leak]" in s
                           and "--linger 86400 --step-seconds 0.2" in s)
        lines = screen.split("\n")
        assert lines[0].startswith("node ") and "from the running daemon" in lines[0]
        assert "gpuwatch top · every 2 s" in lines[0]
        assert "q quit" in lines[59]
        head = next(line for line in lines if line.startswith("PID"))
        assert all(name in head for name in ("USER", "JOB", "STATE", "RSS", "GPU MEM"))
        term.tmux("resize-window", "-t", "top", "-x", "80", "-y", "24")
        screen = term.wait("the 80x24 layout", lambda s: "q quit" in s.split("\n")[23]
                           and "STATE" not in s and "[leak]" in s)
        assert all(len(line) <= 80 for line in screen.split("\n"))
        term.tmux("resize-window", "-t", "top", "-x", "36", "-y", "8")
        term.wait("too small", lambda s: s.startswith("terminal too small (36x8)"))
        term.tmux("resize-window", "-t", "top", "-x", "80", "-y", "24")
        term.wait("back to 80x24", lambda s: "q quit" in s.split("\n")[23])
        term.keys("q")
        term.type('echo "rc=$?"')
        assert_terminal_restored(term, 0)


@needs_tmux
def test_sigterm_ends_top_with_the_terminal_restored(sim: SimulatedNode, tmp_path: Path) -> None:
    pid_file = tmp_path / "top.pid"
    with terminal(tmp_path / "t", top_env(sim, tmp_path)) as term:
        term.type(f"sh -c 'echo $$ > {pid_file}; exec {GPUWATCH} top'; echo \"rc=$?\"")
        term.wait("top's screen", lambda s: "from the running daemon" in s and "q quit" in s)
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
        assert_terminal_restored(term, 128 + signal.SIGTERM)


@needs_tmux
def test_without_a_daemon_top_polls_itself_and_says_so_without_colour_under_no_color(
        sim: SimulatedNode, tmp_path: Path) -> None:
    empty = tmp_path / "no-daemon"
    empty.mkdir()
    with terminal(tmp_path / "t", top_env(sim, tmp_path, runtime=empty, NO_COLOR="1")) as term:
        term.type(f"{GPUWATCH} top --interval 0.5")
        screen = term.wait("own polls, with the orphans", lambda s: "own polls: no daemon "
                           "socket at /" in s and s.count("[orphan]") >= 2)
        assert screen.startswith("node ")
        colours = {param for sgr in re.findall(r"\x1b\[([0-9;]*)m", term.screen(escapes=True))
                   for param in sgr.split(";")}
        assert not colours & {"31", "32", "33", "36", "38"}, colours
        term.keys("q")
        term.type('echo "rc=$?"')
        term.wait("rc=0", lambda s: "rc=0" in s)


@needs_tmux
def test_the_story_orphans_and_the_leak_shown_sorted_then_an_orphan_reaped_from_top(
        sim: SimulatedNode, tmp_path: Path) -> None:
    orphan = sim.training.workers[0]
    with terminal(tmp_path / "t", top_env(sim, tmp_path)) as term:
        term.type(f"{GPUWATCH} top")
        screen = term.wait("the orphans, the leftovers and the leak with its culprit", lambda s:
                           s.count("[orphan]") >= 2 and "[leftover]" in s and "[leak]" in s
                           and "culprit `fetch_buffer` (watched)" in s
                           and "out of memory at step ~" in s, 60)
        lines = screen.split("\n")
        assert lines[0].startswith("node ") and "from the running daemon" in lines[0]
        assert "q quit" in lines[23] and all(len(line) <= 80 for line in lines)
        colours = {param for sgr in re.findall(r"\x1b\[([0-9;]*)m", term.screen(escapes=True))
                   for param in sgr.split(";")}
        assert "31" in colours  # critical findings in red
        # Sorting: by GPU memory the orphan holding 14 GiB leads; by RSS the leaking job's tree
        # (its RSS grows by the step); by PID, ascending.
        by_gpu = table_roots(screen)
        assert by_gpu[0] == sim.training.workers[1]
        # A screen caught while curses redraws it can show the new header over the old rows:
        # each sort is read from a screen whose rows are drawn whole (no PID twice).
        term.keys("s")
        by_rss = table_roots(term.wait("sorted by RSS", lambda s: "RSS▼" in s and drawn(s)))
        assert by_rss != by_gpu and by_rss[0] == sim.instrumented.launcher.pid
        term.keys("P")
        by_pid = table_roots(term.wait("sorted by PID", lambda s: "PID▲" in s and drawn(s)))
        assert by_pid == sorted(by_pid) and by_pid != by_rss
        # Select the orphan, then `r`: the plan of `gpuwatch reap --dry-run --pid --kind`. The
        # selection follows its process across sorts: Home is seen to take it to the top before
        # it is moved from there, or a `j` could be read as undoing the Home.
        term.keys("Home")
        term.wait("the selection at the top", lambda s: selected_pid(s) == by_pid[0])
        for _ in range(20):
            screen = term.screen()
            if selected_pid(screen) == orphan:
                break
            before = selected_pid(screen)
            term.keys("j")
            term.wait("the selection to move", lambda s, b=before: selected_pid(s) != b)
        assert selected_pid(term.screen()) == orphan
        term.keys("r")
        # The plan is read from a screen it is drawn on whole: tmux can be caught while curses
        # writes it, its header over the table's old rows; its last line comes last.
        screen = term.wait("the reap plan", lambda s: "dry run: nothing is sent" in " ".join(
            s.split())  # its first line wrapped at the width
            and "any other key: cancel" in s)
        assert re.search(rf"^{orphan}\s+\S+\s+\S+\s+torchelastic:\S+\s+orphan\s+12.0 GiB",
                         screen, re.M), screen
        assert "would free up to 12.0 GiB of GPU memory" in screen
        assert f"the same plan: gpuwatch reap --dry-run --pid {orphan} --kind orphan" in screen
        assert f"PID {orphan} (orphan): terminate, SIGTERM, SIGKILL after 10 s" in screen
        term.keys("y")
        wait_for(f"orphan {orphan} to be gone", lambda: not _alive(orphan) or None, 30)
        screen = term.wait("the result, and the orphan gone from the screen", lambda s:
                           f"reap: PID {orphan} (orphan): exited" in s
                           and not re.search(rf"^{orphan} ", s, re.M))
        audit = [json.loads(line) for line in
                 (tmp_path / "state" / "reap.jsonl").read_text().splitlines()]
        # A "signalled" line comes between when the orphan was still there at the first look
        # after its SIGTERM; whether it was depends on how fast it ended.
        assert [(a["phase"], a["dry_run"], a["pid"]) for a in audit
                if a["phase"] != "signalled"] == [
            ("planned", True, orphan), ("planned", False, orphan),
            ("executed", False, orphan)]
        assert all(a["sent"] for a in audit if a["phase"] == "signalled")
        assert audit[-1]["result"] == "exited"
        term.keys("q")
        term.type('echo "rc=$?"')
        assert_terminal_restored(term, 0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): gone is gone from the process table, or defunct.
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return False
