"""The agent, its socket and the daemon together: real training loops (gpuwatch.simulate.trainer)
instrumented with gpuwatch.agent, reporting to a real daemon polling the fake driver."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuwatch.simulate.demo import DemoError, wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from tests.daemonproc import running_daemon, status_now, value
from tests.realprocs import GIB, MIB, gpuwatch, killed_after, progress_step, status_json
from tests.scenarios import hung_at_exit

INTERVAL = 0.2
WARMUP = 10


@contextmanager
def trainer(env: dict[str, str], tmp_path: Path, *args: str) -> Iterator[tuple[int, Path]]:
    progress = tmp_path / f"progress-{time.monotonic_ns()}"
    with killed_after([sys.executable, "-m", "gpuwatch.simulate.trainer", "--progress",
                       str(progress), *args], env) as proc:
        yield proc.pid, progress


def daemon_doc(env: dict[str, str]) -> dict[str, Any]:
    _, doc = status_json(env)
    assert doc["source"] == "daemon", doc.get("source_detail")
    return doc


def finding_of(doc: dict[str, Any], kind: str, pid: int) -> Optional[dict[str, Any]]:
    return next((f for f in doc["findings"] if f["kind"] == kind and f["pid"] == pid), None)


def process_of(doc: dict[str, Any], pid: int) -> dict[str, Any]:
    return next(p for p in doc["processes"] if p["pid"] == pid)


def test_a_buffer_leaking_4_mib_a_step_is_named_with_its_projected_oom_step(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    rss_now = _rss_of_a_fresh_trainer(cli_env)
    limit = rss_now + 300 * MIB  # a set limit: about 75 steps of 4 MiB
    config = (f"[detectors]\nleak_warmup_steps = {WARMUP}\n"
              f"host_memory_limit_bytes = {limit}\n")
    # Steps twice as long as a poll interval, so a poll that runs late on a busy machine
    # costs at most a step or two: the bound below is on the detector, not on the scheduler.
    step_seconds = 2 * INTERVAL
    with running_daemon(cli_env, tmp_path, config=config,
                        args=("--interval", str(INTERVAL))) as daemon, \
            trainer(cli_env, tmp_path, "--pattern", "leak", "--leak-mib", "4",
                    "--noise-mib", "2", "--step-seconds", str(step_seconds)) as (pid, _):
        fake_node.hold(pid, device=0, used=GIB)

        def flagged() -> Optional[tuple[dict[str, Any], dict[str, Any]]]:
            doc = status_now(cli_env)
            f = finding_of(doc, "leak", pid)
            return (f, doc) if f is not None else None

        leak, doc = wait_for("the leak finding", flagged, 30, alive=daemon.proc)
        # And `gpuwatch status --json` shows it.
        assert finding_of(daemon_doc(cli_env), "leak", pid) is not None
        agent = process_of(doc, pid)["agent"]
        # Named within 10 steps after warm-up (plus the steps a late poll can lag).
        assert leak["details"]["window_steps"][1] <= WARMUP + 10 + 2
        assert agent["step"] <= WARMUP + 10 + 4
        assert leak["reason"].startswith("RSS grows every step; buffer `fetch_buffer` explains")
        assert leak["reason"].endswith("runs out against the configured limit")
        assert abs(leak["details"]["growth_bytes_per_step"] - 4 * MIB) < 0.15 * 4 * MIB
        # The true step of running out: where 4 MiB a step reaches the limit from here.
        rss, step = process_of(doc, pid)["rss_bytes"], agent["step"]
        true_oom_step = step + (limit - rss) / (4 * MIB)
        projected = leak["details"]["projected_oom_step"]
        assert abs(projected - true_oom_step) <= 0.1 * true_oom_step, (projected, true_oom_step)

        samples = daemon.scrape()
        labels = {"pid": str(pid), "series": "RSS", "culprit": "fetch_buffer"}
        assert value(samples, "gpuwatch_leak_growth_bytes_per_step", **labels) > 3 * MIB
        assert value(samples, "gpuwatch_leak_projected_oom_step", **labels) > step
        assert value(samples, "gpuwatch_agent_buffer_items", pid=str(pid),
                     buffer="fetch_buffer") >= step
        assert value(samples, "gpuwatch_agent_step", pid=str(pid)) >= step


def test_steady_sawtooth_and_plateauing_workers_raise_nothing_over_500_steps(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    config = f"[detectors]\nleak_warmup_steps = {WARMUP}\n"
    with running_daemon(cli_env, tmp_path, config=config,
                        args=("--interval", str(INTERVAL))) as daemon, \
            trainer(cli_env, tmp_path, "--pattern", "steady", "--steps", "500",
                    "--step-seconds", "0.012", "--noise-mib", "6", "--linger", "60") as steady, \
            trainer(cli_env, tmp_path, "--pattern", "sawtooth", "--steps", "500",
                    "--step-seconds", "0.012", "--leak-mib", "8", "--linger", "60") as saw, \
            trainer(cli_env, tmp_path, "--pattern", "plateau", "--steps", "500",
                    "--step-seconds", "0.012", "--leak-mib", "16", "--linger", "60") as flat:
        for pid, _ in (steady, saw, flat):
            fake_node.hold(pid, device=0, used=GIB)
        progresses = [progress for _, progress in (steady, saw, flat)]
        seen_leaks = 0.0
        deadline = time.monotonic() + 60
        while min(progress_step(p) or 0 for p in progresses) < 499:
            assert time.monotonic() < deadline, "the trainers did not reach step 500"
            samples = daemon.scrape()
            seen_leaks = max(seen_leaks, value(samples, "gpuwatch_findings", kind="leak") or 0)
            time.sleep(0.05)
        assert seen_leaks == 0
        doc = daemon_doc(cli_env)
        assert [f for f in doc["findings"] if f["kind"] == "leak"] == []
        assert all(process_of(doc, pid)["agent"]["step"] >= 450 for pid, _ in (steady, saw, flat))


def test_gpu_memory_growing_every_step_alone_is_a_leak(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    config = f"[detectors]\nleak_warmup_steps = {WARMUP}\n"
    with running_daemon(cli_env, tmp_path, config=config,
                        args=("--interval", str(INTERVAL))) as daemon, \
            trainer(cli_env, tmp_path, "--pattern", "steady", "--step-seconds", "0.2") as (
                pid, progress):
        done = threading.Event()

        def follow() -> None:
            """The driver's figure for the PID grows with every step, as a real CUDA
            allocation would: updated as soon as the trainer moves on."""
            seen = None
            while not done.wait(0.01):
                step = progress_step(progress)
                if step is not None and step != seen:
                    fake_node.hold(pid, device=0, used=GIB + step * 64 * MIB)
                    seen = step

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        try:
            leak = wait_for("the GPU leak",
                            lambda: finding_of(status_now(cli_env), "leak", pid), 40,
                            alive=daemon.proc)
        finally:
            done.set()
            follower.join()
        assert leak["reason"] == "GPU memory grows every step; runs out against the GPU limit"
        # The daemon pairs the agent's latest step with NVML's figure of the same poll; on a
        # loaded machine the follower may have moved the figure on a step before the report of
        # that step is read, and a pair off by one step moves a slope fitted over a few dozen
        # steps by a tenth or more. A wrong unit or rate (per second: 5x here) is far outside.
        assert abs(leak["details"]["growth_bytes_per_step"] - 64 * MIB) < 0.3 * 64 * MIB
        assert leak["details"]["limit_source"] == "GPU"


def test_a_stall_is_flagged_after_the_threshold_and_cleared_when_steps_resume(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    config = "[detectors]\nstall_after = 1.0\n"
    with running_daemon(cli_env, tmp_path, config=config,
                        args=("--interval", str(INTERVAL))) as daemon, \
            trainer(cli_env, tmp_path, "--step-seconds", "0.05", "--stall-at", "10",
                    "--stall-seconds", "3") as (pid, progress):
        fake_node.hold(pid, device=0, used=GIB)
        stalled = wait_for("the stall",
                           lambda: finding_of(status_now(cli_env), "stalled", pid),
                           20, alive=daemon.proc)
        assert stalled["reason"].startswith("step 9 has not advanced since")
        assert progress_step(progress) == 9
        wait_for("steps to resume and the stall to clear", lambda: (
            (progress_step(progress) or 0) > 12
            and finding_of(status_now(cli_env), "stalled", pid) is None) or None, 20,
            alive=daemon.proc)


def test_a_trainer_that_says_it_finished_leaves_its_helper_a_leftover_while_it_lingers(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    config = "[detectors]\nleftover_grace = 1.0\n"
    # The daemon first: the trainer tells its agent it finished 1.5 s after it starts, once.
    with running_daemon(cli_env, tmp_path, config=config,
                        args=("--interval", str(INTERVAL))) as daemon:
        launcher = subprocess.Popen(
            ["sh", "-c", f"{sys.executable} -m gpuwatch.simulate.trainer --steps 15 "
                         "--step-seconds 0.1 --finish --linger 600 & "
                         f"{sys.executable} -m gpuwatch.simulate.job --helper redis & wait"],
            env=cli_env)
        try:
            # Until a child has exec'd, its command line is the shell's, naming both programs.
            pids = wait_for("both children, each running its program",
                            lambda: _programs(launcher.pid), 20)
            trainer_pid = next(pid for cmd, pid in pids.items() if "trainer" in cmd)
            helper_pid = next(pid for cmd, pid in pids.items() if "--helper" in cmd)
            fake_node.hold(trainer_pid, device=0, used=2 * GIB)
            try:
                wait_for("the helper as a leftover", lambda: (
                    d if finding_of(d := status_now(cli_env), "leftover", helper_pid) else None),
                    30, alive=daemon.proc)
            except DemoError as exc:
                # What the daemon made of the two, for the failure to say why.
                seen = status_now(cli_env)
                view = {pid: (next((p for p in seen["processes"] if p["pid"] == pid), None),
                              [f for f in seen["findings"] if f["pid"] == pid])
                        for pid in (trainer_pid, helper_pid)}
                raise AssertionError(f"{exc}; the daemon's view: {view}") from None
            doc = daemon_doc(cli_env)  # as `gpuwatch status --json` shows it
            assert process_of(doc, trainer_pid)["agent"]["finished_at"] is not None
            assert f"its trainer {trainer_pid} (" in finding_of(doc, "leftover",
                                                                 helper_pid)["reason"]
            lingering = finding_of(doc, "leftover", trainer_pid)
            assert lingering is not None and "told the agent it finished" in lingering["reason"]
        finally:
            for pid in _children(launcher.pid, 0) or []:
                os.kill(pid, 9)
            launcher.kill()
            launcher.wait()


def test_exit_hygiene_reaches_the_daemon_log_and_stderr(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    program = ("import threading, time\n"
               "from gpuwatch import agent\n"
               "agent.step(1)\n"
               "threading.Thread(target=time.sleep, args=(1.5,), name='heartbeat').start()\n")
    with running_daemon(cli_env, tmp_path, args=("--interval", str(INTERVAL))) as daemon:
        proc = subprocess.Popen([sys.executable, "-c", program], env=cli_env,
                                stderr=subprocess.PIPE, text=True)
        fake_node.hold(proc.pid, device=0, used=GIB)
        _, stderr = proc.communicate(timeout=30)
        assert "non-daemon thread 'heartbeat'" in stderr
        daemon.wait_for_log("reached interpreter exit with non-daemon thread 'heartbeat'")


def test_a_rank_hung_at_exit_by_an_executor_never_shut_down_is_stalled_within_a_few_polls(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    # The step-stall threshold stays at its default (600 s): the exit report alone opens it.
    with running_daemon(cli_env, tmp_path, args=("--interval", str(INTERVAL))) as daemon, \
            hung_at_exit(cli_env) as proc:
        fake_node.hold(proc.pid, device=0, used=8 * GIB)
        reached_exit = time.monotonic()

        def hung(doc: dict[str, Any]) -> Optional[dict[str, Any]]:
            f = finding_of(doc, "stalled", proc.pid)
            return f if f is not None and f["gpu_memory_bytes"] == 8 * GIB else None

        # A few polls, and the time `gpuwatch status` takes on a loaded machine.
        wait_for("the stalled finding", lambda: hung(status_now(cli_env)), 30,
                 alive=daemon.proc)
        stalled = hung(daemon_doc(cli_env))  # as `gpuwatch status --json` shows it
        assert stalled is not None
        assert time.monotonic() - reached_exit < 30
        cause = ("a ThreadPoolExecutor with 1 live worker thread ('reward_buffer_0') was never "
                 "shut down")
        assert stalled["reason"] == f"hung at exit: the interpreter began to exit, but {cause}"
        assert stalled["severity"] == "critical"
        assert stalled["details"] == {"hung_at_exit": True}
        text = gpuwatch(["status"], {**cli_env, "COLUMNS": "400"}).stdout
        assert "from the running daemon" in text and cause in text, text
        assert proc.poll() is None  # still there, holding its 8 GiB


def test_hostile_agent_input_is_counted_and_bounded_while_the_daemon_keeps_working(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_daemon(cli_env, tmp_path, args=("--interval", str(INTERVAL))) as daemon:
        sock_path = daemon.runtime_dir / "agent.sock"
        payloads = [b"not json", b"[1, 2]", b"\xff\xfe", json.dumps({"v": 9}).encode(),
                    b"x" * 20_000,
                    json.dumps({"v": 1, "kind": "step", "step": "seven"}).encode(),
                    json.dumps({"v": 1, "kind": "step", "step": 1, "buffers": {
                        f"b{i}": {"items": i} for i in range(65)}}).encode(),
                    json.dumps({"v": 1, "kind": "step", "step": 1, "pid": 1}).encode()]
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sent = 0
        for i in range(100_000):
            try:
                sender.sendto(payloads[i % len(payloads)], str(sock_path))
                sent += 1
            except (BlockingIOError, ConnectionRefusedError):
                pass
        polls = value(daemon.scrape(), "gpuwatch_polls_total") or 0
        samples = daemon.wait_for_metrics("every rejection reason counted", lambda s: s if all(
            (value(s, "gpuwatch_agent_reports_rejected_total", reason=r) or 0) > 0
            for r in ("malformed", "version", "oversized", "bad_type", "too_many_buffers"))
            else None)
        assert (value(samples, "gpuwatch_agent_reports_total") or 0) > 0  # the "pid": 1 one
        doc = daemon_doc(cli_env)
        me = process_of(doc, os.getpid())  # the claim of PID 1 was credited to the sender
        assert me["agent"] is not None and 1 not in {
            p["pid"] for p in doc["processes"] if p.get("agent")}
        daemon.wait_for_metrics("polls going on", lambda s: (
            value(s, "gpuwatch_polls_total") > polls + 3) or None)
        assert daemon.proc.poll() is None
        assert _rss_mib(daemon.proc.pid) < 200


def _rss_of_a_fresh_trainer(env: dict[str, str]) -> int:
    """RSS of the trainer module before it allocates: the base the leak grows from."""
    probe = subprocess.run(
        [sys.executable, "-c", "import gpuwatch.simulate.trainer, gpuwatch.agent, os;"
         "print(int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE'))"],
        env=env, capture_output=True, text=True, check=True)
    return int(probe.stdout)


def _children(pid: int, at_least: int) -> Optional[list[int]]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(c) for c in f.read().split()]
    except OSError:
        return None
    return kids if len(kids) >= at_least else None


def _programs(pid: int) -> Optional[dict[str, int]]:
    """The command line of each child of `pid`, once two have exec'd Python (not a copy of the
    shell that forked them, nor one whose exec has yet to set its arguments)."""
    try:
        pids = {_cmd(kid): kid for kid in _children(pid, 2) or []}
    except OSError:
        return None
    if len(pids) < 2 or not all(cmd.startswith(sys.executable) for cmd in pids):
        return None
    return pids


def _cmd(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


@pytest.fixture(autouse=True)
def _unbuffered(cli_env: dict[str, str]) -> None:
    cli_env["PYTHONUNBUFFERED"] = "1"
