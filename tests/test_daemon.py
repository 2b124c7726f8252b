"""`gpuwatch daemon` as systemd runs it: real processes, the fake driver, real signals."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpuwatch.cli import EXIT_CONFIG
from gpuwatch.config import load_config
from gpuwatch.daemon import Daemon
from gpuwatch.model import NodeSnapshot
from gpuwatch.poll import Poller
from gpuwatch.simulate import fakenvml
from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from gpuwatch.sinks.exporter import SUMMARY_LABEL_MAX, ReportCollector
from tests import leakreports
from tests.daemonproc import pids_with_series, running_daemon, value
from tests.realprocs import (
    BLOCKABLE_SIGNALS,
    GIB,
    MIB,
    blocked_signals,
    gpuwatch,
    running_job,
    threads_of,
)
from tests.scenarios import state


def test_a_daemon_a_test_starts_has_finished_its_first_poll_when_the_test_gets_it(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    """The daemon writes daemon.json and opens its sockets before its first poll; a test that
    asked it at once could get "has not finished its first poll" on a loaded machine. Every
    helper that starts one (running_daemon, the simulated node's fixtures) waits for the poll."""
    from gpuwatch.serve.state_client import fetch_status

    with running_daemon(cli_env, tmp_path, args=("--interval", "60")) as d:
        doc = fetch_status(d.runtime_dir / "state.sock")  # once, no retry
        assert doc["source"] == "daemon" and len(doc["gpus"]) == 2
        assert value(d.scrape(), "gpuwatch_polls_total") == 1


def test_daemon_serves_per_process_series_for_a_real_job_and_stops_on_sigterm(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_job(tmp_path, workers=2, env={"SLURM_JOB_ID": "777"}) as job, \
            running_daemon(cli_env, tmp_path) as d:
        w0, w1 = job.workers
        fake_node.hold(w0, device=0, used=3 * GIB)
        fake_node.hold(w1, device=1, used=5 * GIB)
        samples = d.wait_for_metrics(
            "both workers' series",
            lambda s: s if pids_with_series(s, "gpuwatch_process_gpu_memory_bytes") == {w0, w1}
            else None)
        assert value(samples, "gpuwatch_nvml_up") == 1
        assert value(samples, "gpuwatch_process_gpu_memory_bytes", pid=str(w0), gpu="0",
                     job_id="777", job_source="slurm") == 3 * GIB
        assert value(samples, "gpuwatch_process_gpu_memory_bytes", pid=str(w1), gpu="1") == 5 * GIB
        assert value(samples, "gpuwatch_process_resident_memory_bytes", pid=str(w1)) > 0
        assert value(samples, "gpuwatch_gpu_memory_used_bytes", gpu="1") == 5 * GIB
        assert value(samples, "gpuwatch_polls_total") >= 1
        assert "cmdline" not in d.scrape_text() and "--worker" not in d.scrape_text()
        # The node by name, and the daemon's own process, for dashboards and alerts.
        assert value(samples, "gpuwatch_node_info", node=socket.gethostname(),
                     driver_version="550.54.15") == 1
        assert value(samples, "process_resident_memory_bytes") > 0
        assert value(samples, "process_cpu_seconds_total") > 0

        # The state socket serves the CLI; only root and the gpuwatch group may read it.
        sock = d.runtime_dir / "state.sock"
        assert stat.S_IMODE(sock.stat().st_mode) == 0o660
        status = gpuwatch(["status"], cli_env)
        assert status.returncode == 0 and "from the running daemon" in status.stdout
        assert f"├─ {w0}" in status.stdout

        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0
        assert not sock.exists() and not (d.runtime_dir / "daemon.json").exists()


def test_the_daemons_threads_block_every_signal_so_a_sigterm_ends_it_at_once(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    """Only the main thread takes the daemon's signals: one a listener's thread took would be
    handled when the main thread next woke, an interval later (here a minute). A SIGTERM sent
    while the daemon is stopped waits for whichever thread runs first once it is continued."""
    from gpuwatch.serve.state_client import fetch_status

    with running_daemon(cli_env, tmp_path, args=("--interval", "60")) as d:
        d.scrape_text()  # the metrics port's listener and its worker running
        fetch_status(d.runtime_dir / "state.sock")  # the state socket's too
        pid = d.proc.pid
        threads = threads_of(pid)
        assert len(threads) >= 4, threads
        assert not blocked_signals(pid, pid) & BLOCKABLE_SIGNALS
        for tid in threads:
            if tid != pid:
                assert blocked_signals(pid, tid) >= BLOCKABLE_SIGNALS, f"thread {tid}"
        d.proc.send_signal(signal.SIGSTOP)
        wait_for("the daemon stopped", lambda: state(pid) == "T" or None, 10)
        d.proc.send_signal(signal.SIGHUP)  # pending in the main thread, as a reload asked
        d.proc.send_signal(signal.SIGTERM)
        d.proc.send_signal(signal.SIGCONT)
        assert d.proc.wait(30) == 0


def test_the_node_is_named_as_configured_in_metrics_and_status(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    """On Kubernetes `instance` is a pod IP and the hostname the pod's: the node's name comes
    from the configuration (GPUWATCH_NODE_NAME from the downward API)."""
    env = {**cli_env, "GPUWATCH_NODE_NAME": "gpu-node-07"}
    with running_daemon(env, tmp_path) as d:
        samples = d.wait_for_metrics("the node's info", lambda s: s if value(
            s, "gpuwatch_node_info") is not None else None)
        assert value(samples, "gpuwatch_node_info", node="gpu-node-07") == 1
        assert gpuwatch(["status"], env).stdout.startswith("node gpu-node-07 ")
    assert gpuwatch(["status", "--poll"], env).stdout.startswith("node gpu-node-07 ")


def test_series_of_a_process_vanish_when_it_exits(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_job(tmp_path, workers=2) as job, running_daemon(cli_env, tmp_path) as d:
        w0, w1 = job.workers
        fake_node.hold(w0, device=0, used=GIB)
        fake_node.hold(w1, device=0, used=GIB)
        d.wait_for_metrics("two series", lambda s: pids_with_series(
            s, "gpuwatch_process_gpu_memory_bytes") == {w0, w1} or None)
        os.kill(w1, signal.SIGKILL)
        samples = d.wait_for_metrics("the dead worker's series to go", lambda s: s if (
            pids_with_series(s, "gpuwatch_process_gpu_memory_bytes") == {w0}) else None)
        for name in ("gpuwatch_process_resident_memory_bytes",
                     "gpuwatch_process_start_time_seconds"):
            assert pids_with_series(samples, name) == {w0}


def test_nvml_lost_while_running_is_reported_and_recovered_with_metrics_answering_throughout(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    config = "[daemon]\nnvml_retry_max = 0.5\n"
    with running_job(tmp_path, workers=1) as job, \
            running_daemon(cli_env, tmp_path, config=config) as d:
        fake_node.hold(job.workers[0], device=0, used=GIB)
        d.wait_for_metrics("NVML up", lambda s: value(s, "gpuwatch_nvml_up") == 1 or None)

        fake_node.fail("*", fakenvml.DRIVER_NOT_LOADED)  # the driver goes away
        samples = d.wait_for_metrics("NVML down",
                                     lambda s: s if value(s, "gpuwatch_nvml_up") == 0 else None)
        assert value(samples, "gpuwatch_poll_errors_total", source="nvml") >= 1
        # This machine has no /dev/nvidiaN: to an alert, a CPU-only node, not a broken driver.
        assert value(samples, "gpuwatch_nvidia_device_files") == 0
        d.wait_for_log("NVML unavailable: Driver Not Loaded")
        d.wait_for_metrics("polls to go on", lambda s: (
            value(s, "gpuwatch_polls_total") > value(samples, "gpuwatch_polls_total")) or None)

        fake_node.clear_failures()  # and comes back
        samples = d.wait_for_metrics("NVML back", lambda s: s if (
            value(s, "gpuwatch_nvml_up") == 1
            and job.workers[0] in pids_with_series(s, "gpuwatch_process_gpu_memory_bytes"))
            else None)
        d.wait_for_log("NVML up")
        assert d.proc.poll() is None


def test_nvml_absent_at_start_then_the_driver_appears_and_is_picked_up(
        fake_nvml_lib: Path, cli_env: dict[str, str], tmp_path: Path) -> None:
    node = FakeNode(tmp_path / "late-driver.state", fake_nvml_lib, gpus=1)  # not written yet
    env = {**cli_env, **node.env(cli_env)}
    with running_job(tmp_path, workers=1) as job, running_daemon(
            env, tmp_path, config="[daemon]\nnvml_retry_max = 0.5\n") as d:
        samples = d.wait_for_metrics("a first poll", lambda s: s if value(
            s, "gpuwatch_polls_total") else None)
        assert value(samples, "gpuwatch_nvml_up") == 0
        d.wait_for_log("monitoring host processes only")
        status = gpuwatch(["status", "--json"], env)
        assert status.returncode == 3  # from the daemon's view: NVML unavailable

        node.hold(job.workers[0], device=0, used=GIB)  # the driver is loaded
        d.wait_for_metrics("NVML and the worker's series", lambda s: (
            value(s, "gpuwatch_nvml_up") == 1
            and job.workers[0] in pids_with_series(s, "gpuwatch_process_gpu_memory_bytes"))
            or None)


def test_json_logs_are_one_object_a_line(cli_env: dict[str, str], tmp_path: Path) -> None:
    env = {k: v for k, v in cli_env.items() if k != fakenvml.STATE_ENV}
    with running_daemon(env, tmp_path, args=("--interval", "0.2", "--log-format", "json")) as d:
        d.wait_for_log("monitoring host processes only")
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(10) == 0
    entries = [json.loads(line) for line in d.log().splitlines() if line.strip()]
    assert {"ts", "level", "logger", "msg"} <= set(entries[0])
    assert any(e["level"] == "warning" and "NVML unavailable" in e["msg"] for e in entries)


def test_a_bad_config_at_start_exits_78_naming_the_key(cli_env: dict[str, str],
                                                      tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[daemon]\ninterval = 0\n")
    result = gpuwatch(["daemon", "--config", str(bad)], cli_env, timeout=30)
    assert result.returncode == EXIT_CONFIG
    assert "daemon.interval: expected a duration > 0" in result.stderr
    assert str(bad) in result.stderr


def test_sighup_applies_a_good_config_and_refuses_a_bad_one_keeping_the_old(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_job(tmp_path, workers=2) as job, running_daemon(cli_env, tmp_path) as d:
        for pid in job.workers:
            fake_node.hold(pid, device=0, used=GIB)
        d.wait_for_metrics("two series", lambda s: len(pids_with_series(
            s, "gpuwatch_process_gpu_memory_bytes")) == 2 or None)

        d.config_path.write_text("[exporter]\nmax_process_series = 0\n")
        d.proc.send_signal(signal.SIGHUP)
        d.wait_for_log("configuration reload refused")
        assert "exporter.max_process_series: expected an integer >= 1, got 0" in d.log()
        samples = d.scrape()
        assert value(samples, "gpuwatch_config_reloads_total", result="refused") == 1
        assert len(pids_with_series(samples, "gpuwatch_process_gpu_memory_bytes")) == 2

        d.config_path.write_text("[exporter]\nmax_process_series = 1\n")
        d.proc.send_signal(signal.SIGHUP)
        samples = d.wait_for_metrics("the cap to apply", lambda s: s if len(pids_with_series(
            s, "gpuwatch_process_gpu_memory_bytes")) == 1 else None)
        assert value(samples, "gpuwatch_config_reloads_total", result="applied") == 1
        d.wait_for_metrics("the cap's drops to be counted", lambda s: (
            value(s, "gpuwatch_process_series_dropped_total", reason="max_process_series")
            >= 1) or None)
        assert d.proc.poll() is None


def test_sd_notify_ready_watchdog_and_stopping_arrive_on_a_real_socket(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "notify.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(path))
    receiver.settimeout(10)
    env = {**cli_env, "NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000"}
    messages: list[str] = []

    def received(wanted: str) -> None:
        deadline = time.monotonic() + 15
        while not any(wanted in m for m in messages):
            assert time.monotonic() < deadline, f"{wanted!r} never came: {messages}"
            messages.append(receiver.recv(4096).decode())

    try:
        with running_daemon(env, tmp_path, args=("--interval", "5")) as d:
            received("READY=1")
            ready_at = len(messages)
            received("WATCHDOG=1")
            # With a 5 s poll interval the watchdog (every 0.2 s) still comes in time.
            pings = sum("WATCHDOG=1" in m for m in messages[ready_at:])
            while pings < 3:
                messages.append(receiver.recv(4096).decode())
                pings = sum("WATCHDOG=1" in m for m in messages[ready_at:])
            d.proc.send_signal(signal.SIGHUP)
            received("RELOADING=1")
            d.proc.send_signal(signal.SIGTERM)
            received("STOPPING=1")
            assert d.proc.wait(10) == 0
        assert "STATUS=" in messages[0] and "GPU" in messages[0]
    finally:
        receiver.close()


def test_a_poll_that_raises_is_logged_counted_and_followed_by_the_next(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class FlakyPoller(Poller):
        """The real poller, made to raise on its second poll as a bug would."""

        calls = 0

        def poll(self, watch: Iterable[int] = ()) -> NodeSnapshot:
            FlakyPoller.calls += 1
            if FlakyPoller.calls == 2:
                raise RuntimeError("boom in the poll")
            return super().poll(watch)

    config = load_config(environ={"GPUWATCH_CONFIG": "/dev/null"}, overrides={
        "daemon.listen": "127.0.0.1:0", "daemon.interval": 0.05,
        "daemon.runtime_dir": tmp_path / "run", "daemon.state_dir": tmp_path / "state"})
    daemon = Daemon(config, poller=FlakyPoller())
    runner = threading.Thread(target=daemon.run)
    runner.start()
    try:
        wait_for("polls after the failure", lambda: FlakyPoller.calls >= 4 or None, 20)
        errors = daemon.registry.get_sample_value("gpuwatch_poll_errors_total",
                                                  {"source": "poll"})
        assert errors == 1
        assert daemon.registry.get_sample_value("gpuwatch_polls_total") >= 2
        assert any("poll failed" in r.message and r.exc_info for r in caplog.records)
        assert daemon.latest is not None
    finally:
        daemon.stop()
        runner.join(10)
    assert not runner.is_alive()


@pytest.mark.skipif(shutil.which("promtool") is None and not os.environ.get("CI"),
                    reason="promtool is not installed (make test installs it)")
def test_promtool_finds_nothing_to_report_in_the_real_metrics(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_job(tmp_path, workers=2) as job, running_daemon(cli_env, tmp_path) as d:
        fake_node.hold(job.workers[0], device=0, used=GIB)
        fake_node.hold(job.workers[1], device=1, used=None)
        fake_node.fail("nvmlDeviceGetUtilizationRates", fakenvml.NOT_SUPPORTED, device=1)
        d.wait_for_metrics("a worker's series", lambda s: pids_with_series(
            s, "gpuwatch_process_gpu_memory_bytes") or None)
        text = d.scrape_text()
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""


def _leak_registry() -> CollectorRegistry:
    report = leakreports.leak_report()
    registry = CollectorRegistry()
    registry.register(ReportCollector(lambda: report))
    return registry


def test_leak_series_name_the_culprit_and_how_it_was_found_one_series_per_leaking_process(
        ) -> None:
    families = {m.name: m for m in _leak_registry().collect()}
    per_step = families["gpuwatch_leak_growth_bytes_per_step"].samples
    labels = {s.labels["pid"]: s.labels for s in per_step}
    assert len(per_step) == len(labels) == len(leakreports.BY_STEP)
    assert {pid: (lb["culprit"], lb["found_by"]) for pid, lb in labels.items()} == {
        "700": ("fetch_buffer", "watched"),
        "701": ("areal.infra.rpc.rtensor._fetch_buffer", "discovered"),
        # A traced culprit is a source file and line: no path in a label (rule 5).
        "702": ("", "traced"), "704": ("", "traced"),
        "703": ("", ""), "705": ("", "")}
    # The other leak series carry the same labels, so they join on them.
    (oom,) = families["gpuwatch_leak_projected_oom_step"].samples
    assert oom.labels == labels["700"] and oom.value == 586
    oom_at = {s.labels["pid"]: s for s in
              families["gpuwatch_leak_projected_oom_timestamp_seconds"].samples}
    assert oom_at["700"].labels == labels["700"]
    assert oom_at["700"].value == leakreports.TAKEN_AT + 5400
    # Without the agent: per second, no culprit.
    (per_second,) = families["gpuwatch_leak_growth_bytes_per_second"].samples
    assert per_second.labels["pid"] == "706" and per_second.value == MIB
    assert per_second.labels["culprit"] == per_second.labels["found_by"] == ""
    assert set(oom_at) == {"700", "706"}


def test_a_culprits_own_growth_is_served_only_where_there_is_a_culprit_and_a_figure() -> None:
    families = {m.name: m for m in _leak_registry().collect()}
    culprit_bytes = {s.labels["pid"]: (s.labels["found_by"], s.value)
                     for s in families["gpuwatch_leak_culprit_bytes_per_step"].samples}
    assert culprit_bytes == {"700": ("watched", 2 * MIB), "701": ("discovered", 2 * GIB),
                             "702": ("traced", 3 * MIB), "704": ("traced", MIB)}
    culprit_items = {s.labels["pid"]: s.value
                     for s in families["gpuwatch_leak_culprit_items_per_step"].samples}
    assert culprit_items == {"700": 1.0, "701": 16.0}


def test_an_autograd_history_leak_serves_its_graph_nodes_per_step_as_its_culprits_items(
        ) -> None:
    # Raised on the history alone: no bytes, so no growth, projection or culprit bytes series;
    # its one gpuwatch_leak_* series is the nodes its graph gains a step.
    history = leakreports.leak(
        708, "autograd history grows every step; `__main__.total_loss` holds the graph of every "
        "step since step 20: use `loss.item()` or `.detach()` (autograd)",
        series="autograd history", culprit="__main__.total_loss", found_by="autograd",
        history_since_step=20, graph_nodes_per_step=12.0)
    report = leakreports.leak_report((history,))
    families = {m.name: m for m in ReportCollector(lambda: report).collect()}
    (items,) = families["gpuwatch_leak_culprit_items_per_step"].samples
    assert items.value == 12.0
    assert (items.labels["pid"], items.labels["series"], items.labels["culprit"],
            items.labels["found_by"]) == ("708", "autograd history", "__main__.total_loss",
                                          "autograd")
    for name in ("gpuwatch_leak_growth_bytes_per_step", "gpuwatch_leak_growth_bytes_per_second",
                 "gpuwatch_leak_projected_oom_step", "gpuwatch_leak_culprit_bytes_per_step"):
        assert families[name].samples == [], name


def test_each_finding_s_summary_is_served_on_the_info_series_never_its_reason_and_bounded(
        ) -> None:
    """gpuwatch_finding_info carries the labels of gpuwatch_finding and the summary, at most
    SUMMARY_LABEL_MAX characters; the reason is on no series."""
    long = leakreports.leak(707, "RSS grows every step; allocations at `/home/x/leaky.py:1`")
    long = replace(long, summary="RSS grows every step" + "; and more" * 40)
    report = leakreports.leak_report((*leakreports.LEAKS, long))
    families = {m.name: m for m in ReportCollector(lambda: report).collect()}
    info = {s.labels["pid"]: s.labels for s in families["gpuwatch_finding_info"].samples}
    found = {s.labels["pid"]: s.labels for s in families["gpuwatch_finding"].samples}
    assert info.keys() == found.keys() and len(info) == len(report.findings)
    for f in report.findings:
        labels = info[str(f.pid)]
        assert {k: v for k, v in labels.items() if k != "summary"} == found[str(f.pid)]
        if f.pid != 707:
            assert labels["summary"] == f.summary
    assert len(info["707"]["summary"]) == SUMMARY_LABEL_MAX
    assert info["707"]["summary"].endswith("...")
    registry = CollectorRegistry()
    registry.register(ReportCollector(lambda: report))
    assert "/home/x" not in generate_latest(registry).decode()


@pytest.mark.skipif(shutil.which("promtool") is None and not os.environ.get("CI"),
                    reason="promtool is not installed (make test installs it)")
def test_promtool_finds_nothing_to_report_in_the_leak_metrics() -> None:
    result = subprocess.run(["promtool", "check", "metrics"],
                            input=generate_latest(_leak_registry()).decode(),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""
