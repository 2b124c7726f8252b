"""The node daemon: poll, keep bounded history, serve /metrics and the state socket.

One thread polls; the HTTP and state-socket threads only read the latest immutable report, so a
scrape never waits on NVML and never sees half a poll. Signals only set flags: SIGTERM/SIGINT stop,
SIGHUP reloads the configuration (a bad one is refused and the running one kept).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from gpuwatch import __version__, systemd_notify
from gpuwatch.actions.reap_plan import OUTCOMES, REAPABLE_KINDS
from gpuwatch.actions.trace_requests import RESULTS as TRACE_REQUEST_RESULTS
from gpuwatch.actions.trace_requests import SEARCH_RESULTS, TraceRequests
from gpuwatch.agent_budget import AgentBudget, PollTrim, limit_malloc_arenas
from gpuwatch.app.reaping import DaemonReaping
from gpuwatch.config import (
    EXIT_CONFIG,
    Config,
    ConfigError,
    load_config,
    sample_spacing,
    split_listen,
)
from gpuwatch.daemon_info import DaemonInfo
from gpuwatch.detectors import assess
from gpuwatch.history import History
from gpuwatch.logs import setup_logging
from gpuwatch.metrics import ProcessCollector, Registry
from gpuwatch.model import NodeReport, NodeSnapshot
from gpuwatch.poll import Poller
from gpuwatch.protocol import SOCKET_NAME as AGENT_SOCKET_NAME
from gpuwatch.protocol import TRACE_STATUSES
from gpuwatch.runtime_dir import (
    DAEMON_INFO_NAME,
    EXIT_ALREADY_RUNNING,
    EXIT_UNSAFE_DIRECTORY,
    AlreadyRunning,
    TrustedDir,
    UnsafeDirectory,
    lock_runtime_dir,
    open_private_dir,
    remove_own_daemon_info,
)
from gpuwatch.serve.connections import ConnectionCollector, ConnectionStats
from gpuwatch.serve.exposition import RenderedMetrics
from gpuwatch.serve.http_server import MetricsServer, bind_tcp
from gpuwatch.serve.state_socket import STATE_SOCKET_NAME, StateServer
from gpuwatch.sinks.daemon_metrics import DaemonMetrics
from gpuwatch.sinks.document import SOURCE_DAEMON, DocumentWriter
from gpuwatch.sinks.exit_reports import ExitReportLog
from gpuwatch.sinks.exported_processes import SERIES_DROPPED_REASONS
from gpuwatch.sinks.exporter import ReportCollector
from gpuwatch.sinks.exposition_text import LineWriter
from gpuwatch.sinks.pod_metrics import PodSourceCollector
from gpuwatch.sources.agent_socket import AgentReceiver
from gpuwatch.sources.memory import read_mem_total
from gpuwatch.sources.nvml import NvmlSource
from gpuwatch.sources.pods import pod_source
from gpuwatch.sources.proc_static import TRUNCATED_TEXTS
from gpuwatch.threads import start_without_signals
from gpuwatch.units import plural

log = logging.getLogger("gpuwatch.daemon")

class Daemon:
    def __init__(self, config: Config, config_path: Optional[Path] = None,
                 overrides: Optional[dict[str, Any]] = None,
                 poller: Optional[Poller] = None) -> None:
        self.config = config
        self._config_path = config_path
        self._overrides = dict(overrides or {})
        d = config.daemon
        a = config.agent
        self.poller = poller or Poller(nvml=NvmlSource(retry_initial=1.0,
                                                       retry_max=d.nvml_retry_max),
                                       hostname=d.node_name or None)
        # Private memory is read for a process as often as the history keeps its samples.
        self.poller.private_memory.every = sample_spacing(config)
        # One memory budget for what agent reports create, the receiver's and the history's;
        # one clock for the times of polls and reports, which detectors compare.
        self.agents = AgentReceiver(d.runtime_dir / AGENT_SOCKET_NAME,
                                    max_processes=a.max_processes,
                                    budget=AgentBudget(a.memory_budget),
                                    max_reports_per_second=a.max_reports_per_second,
                                    clock=self.poller.clock)
        if self.poller.agents is None:
            self.poller.agents = self.agents
        if self.poller.pods is None:
            self.poller.pods = pod_source(config.kubernetes.pod_resources_socket,
                                          config.kubernetes.pod_logs_dir,
                                          config.kubernetes.runtime_dirs,
                                          refresh=config.kubernetes.refresh,
                                          timeout=config.kubernetes.timeout,
                                          clock=self.poller.clock)
        #: MemTotal, with the GPUs' memory the most a report's figure may be.
        self._mem_total = read_mem_total()
        self.trace_requests = TraceRequests(self.agents, config.agent)
        self.history = History(config.history.samples, config.history.max_processes,
                               budget=self.agents.budget, sample_spacing=sample_spacing(config))
        self._latest: Optional[NodeReport] = None
        self._document: tuple[Optional[NodeReport], Optional[bytes]] = (None, None)
        self._document_lock = threading.Lock()
        #: Keeps each process's part of the document while it does not change.
        self.document_writer = DocumentWriter()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._reload_requested = False
        #: A configuration read in progress (off the poll loop), and what it gave when done.
        self._reload_thread: Optional[threading.Thread] = None
        self._reload_result: Optional[tuple[Optional[Config], Optional[ConfigError]]] = None
        self._nvml_was_up: Optional[bool] = None
        #: Hands the allocator's free pages back after a poll (agent_budget.PollTrim).
        self._give_back_free_memory = PollTrim()

        # No `_created` series (gpuwatch.metrics writes none): they would double every counter
        # for no use on a node exporter.
        self.registry = Registry()
        self.rendered = RenderedMetrics(self.registry, writer=LineWriter().write_parts)
        self.collector = ReportCollector(
            lambda: self._latest, config.exporter.max_process_series,
            agent_counts=lambda: (self.agents.accepted, self.agents.rejected),
            agent_budget=self.agents.budget.stats, max_agent_series=a.max_series_per_user)
        self.registry.register(self.collector)
        # The daemon's own CPU, memory and file descriptors: a node agent is watched too.
        self.registry.register(ProcessCollector())
        # Its own counters (polls, reloads, reaps, trace requests), listed after the above.
        self.metrics = DaemonMetrics(
            self.registry, reap_kinds=REAPABLE_KINDS, reap_outcomes=OUTCOMES,
            trace_request_results=TRACE_REQUEST_RESULTS, trace_statuses=TRACE_STATUSES,
            search_results=SEARCH_RESULTS, series_dropped_reasons=SERIES_DROPPED_REASONS,
            truncated_texts=(*TRUNCATED_TEXTS, "document"))
        self.reaping = DaemonReaping(config, self.metrics.count_reaps)
        self.exit_reports = ExitReportLog()

        self._http: Optional[MetricsServer] = None
        self._state_server: Optional[StateServer] = None
        # How the metrics port and state.sock ended their connections (timeouts, the cap).
        self.connections = ConnectionStats()
        self.registry.register(ConnectionCollector(self.connections))
        pod_status = getattr(self.poller.pods, "status", None)
        if pod_status is not None:
            self.registry.register(PodSourceCollector(pod_status))
        self.metrics_url: Optional[str] = None

    # -- what the sinks read -----------------------------------------------------------------
    @property
    def latest(self) -> Optional[NodeReport]:
        return self._latest

    def document_bytes(self) -> Optional[bytes]:
        """The status document of the latest report, serialised once per poll."""
        report = self._latest
        if report is None:
            return None
        with self._document_lock:
            cached_for, body = self._document
            if cached_for is not report:
                # Bounded in bytes: a node of thousands of processes with long texts is served
                # shortened, saying so, never a document too large for its readers.
                body, cut = self.document_writer.json(report, source=SOURCE_DAEMON)
                if cut is not None:
                    self.metrics.count_truncated({"document": 1})
                self._document = (report, body)
            return body

    # -- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        d = self.config.daemon
        # Checked before anything in them is touched, and held open: every file the daemon
        # makes in the runtime directory is made through this descriptor (docs/security.md,
        # rule 3). The state directory is only checked here; the audit log's writers check it
        # again each time they open it.
        runtime = open_private_dir(d.runtime_dir, create_mode=0o755,
                                   setting="daemon.runtime_dir")
        try:
            open_private_dir(d.state_dir, create_mode=0o750, setting="daemon.state_dir").close()
            # Before any socket or file in the directory is touched: a second daemon there would
            # take over the sockets the CLI and the agents use, and delete them when it exits.
            lock = lock_runtime_dir(runtime)
        except BaseException:
            runtime.close()
            raise
        # A reload may change daemon.runtime_dir; what this run created stays where it was made.
        runtime_dir = runtime.path
        try:
            self._install_signal_handlers()
            host, port = split_listen(d.listen)
            try:
                self._http = self._listen(host, port)
                bound_port = self._http.port
                self.metrics_url = f"{self._http.scheme}://{_url_host(host)}:{bound_port}/metrics"
                self._state_server = StateServer(runtime_dir / STATE_SOCKET_NAME,
                                                 self.document_bytes, group=d.state_socket_group,
                                                 stats=self.connections, directory=runtime)
                self._state_server.start()
                self.agents.start(runtime)
                start_pods = getattr(self.poller.pods, "start", None)
                if start_pods is not None:
                    start_pods()
                self._write_daemon_info(runtime, bound_port)
            except BaseException:
                self._shutdown(runtime)
                raise
            log.info("gpuwatch %s serving %s; state socket %s; agent socket %s; polling every "
                     "%g s", __version__, self.metrics_url, self._state_server.path,
                     self.agents.path, d.interval)
            try:
                self._loop()
            finally:
                systemd_notify.stopping()
                self._shutdown(runtime)
        finally:
            # Only once every file of this run is gone, so that the next daemon starts clean.
            os.close(lock)
            runtime.close()
        log.info("stopped")
        return 0

    def _listen(self, host: str, port: int) -> MetricsServer:
        """/metrics on HOST:PORT, over HTTPS with basic auth where daemon.web_config says so
        (a bad web config is a ConfigError, before the port is taken)."""
        address = f"{_url_host(host) if host else '0.0.0.0'}:{port}"
        web = None
        if self.config.daemon.web_config:  # PyYAML and bcrypt only for a daemon that has one
            from gpuwatch.serve.web_config import WebSettings

            web = WebSettings(Path(self.config.daemon.web_config))
        try:
            sock = bind_tcp(host, port)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(exc.errno, f"cannot serve /metrics on {address}: the address is "
                              "already in use (another gpuwatch daemon, or an exporter, holds "
                              "it); choose another with --listen HOST:PORT or daemon.listen "
                              "in the config file") from None
            if exc.errno == errno.EACCES:
                raise OSError(exc.errno, f"cannot serve /metrics on {address}: permission "
                              "denied (ports below 1024 need root); choose another with "
                              "--listen HOST:PORT") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise OSError(exc.errno, f"cannot serve /metrics on {address}: no interface "
                              "of this machine has that address; check --listen HOST:PORT"
                              ) from None
            raise
        server = MetricsServer(sock, self.registry, self.connections, web,
                               rendered=self.rendered)
        server.start()
        if web is not None and web.users and not web.tls:
            log.warning("%s: basic_auth_users without tls_server_config: passwords cross the "
                        "network in clear text", web.path)
        return server

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # embedded in a test thread: stop() is the way out
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGINT, lambda *_: self.stop())
        signal.signal(signal.SIGHUP, self._on_sighup)

    def _on_sighup(self, *_: Any) -> None:
        self._reload_requested = True
        self._wake.set()

    def _loop(self) -> None:
        watchdog = systemd_notify.watchdog_interval()
        next_poll = time.monotonic()
        next_ping = time.monotonic()
        ready = False
        while not self._stop.is_set():
            now = time.monotonic()
            if self._reload_requested and self._reload_thread is None:
                self._reload_requested = False
                self._start_reload()
            result = self._reload_result
            if result is not None:
                self._reload_result, self._reload_thread = None, None
                self._apply_reload(*result)
                self._render_for_scrapes()  # the reload's outcome, counted, shows at once
            if now >= next_poll:
                self.poll_once()
                # The allocator's free pages back, where the poll and its renders grew the RSS
                # by more than a slack (docs/design-notes.md, "A trim after a poll only where
                # it gives memory back").
                self._give_back_free_memory()
                # Catch up by skipping, not by polling back to back after a slow poll.
                next_poll = max(next_poll + self.config.daemon.interval, time.monotonic())
                if not ready:
                    ready = True
                    systemd_notify.ready(status=self._status_line())
            if watchdog is not None and time.monotonic() >= next_ping:
                systemd_notify.watchdog_ping()
                next_ping = time.monotonic() + watchdog
            wake_at = next_poll if watchdog is None else min(next_poll, next_ping)
            self._wake.wait(max(0.0, wake_at - time.monotonic()))
            self._wake.clear()

    def poll_once(self) -> None:
        """One poll and what follows it; then /metrics is rendered for the scrapes to come."""
        try:
            self._poll()
        finally:
            self._render_for_scrapes()

    def _render_for_scrapes(self) -> None:
        try:
            self.rendered.refresh(self.config.daemon.interval)
        except Exception:
            # A scrape renders what failed here again, and answers 500 if it fails again.
            log.exception("rendering /metrics failed")
            self.metrics.poll_raised()

    def _poll(self) -> None:
        try:
            snapshot = self.poller.poll(watch=self.history.watch_pids())
            snapshot = self.trace_requests.before_assess(snapshot)
            report = assess(snapshot, self.history, self.config.detectors)
        except Exception:
            # A bug or an unexpected state must not end monitoring: log, count, poll again.
            log.exception("poll failed; the next poll follows as scheduled")
            self.metrics.poll_raised()
            return
        self._latest = report
        self.agents.note_node_memory(self._mem_total, sum(
            g.memory_total_bytes or 0 for g in snapshot.gpus) if snapshot.nvml.available else None)
        self.metrics.count_poll(snapshot,
                                self.collector.exported(report)[1],
                                self.history.rss_disagreements)
        self.collector.count_poll(report)
        self._log_nvml_transition(snapshot)
        self.exit_reports.log(snapshot)
        try:
            self.trace_requests.after_assess(report)
        except Exception:
            log.exception("trace requests failed; the next poll tries again")
            self.metrics.poll_raised()
        self.metrics.count_traces(self.trace_requests.counts, self.trace_requests.search_counts,
                                  self.agents.trace_reports)
        self.metrics.count_truncated(self.poller.truncated,
                                     running_totals=True)
        self.reaping.after_poll(report)

    def _log_nvml_transition(self, snapshot: NodeSnapshot) -> None:
        up = snapshot.nvml.available
        if up == self._nvml_was_up:
            return
        if up:
            log.info("NVML up: %s, %s", snapshot.nvml.message, plural(len(snapshot.gpus), "GPU"))
        else:
            log.warning("%s; monitoring host processes only, retrying NVML with backoff up to "
                        "%g s", snapshot.nvml.message, self.config.daemon.nvml_retry_max)
        self._nvml_was_up = up
        systemd_notify.status(self._status_line())

    def _status_line(self) -> str:
        if self._latest is None:
            return "starting"
        s = self._latest.snapshot
        return (f"{s.nvml.message}; {plural(len(s.gpus), 'GPU')}, "
                f"{plural(len(s.gpu_holders), 'GPU process')}, "
                f"{plural(len(self._latest.findings), 'finding')}")

    def _read_config(self) -> tuple[Optional[Config], Optional[ConfigError]]:
        try:
            return load_config(self._config_path, overrides=self._overrides), None
        except ConfigError as exc:
            return None, exc

    def _start_reload(self) -> None:
        """Read the configuration on a thread of its own: a file on a hung mount, or anything
        else slow to read, delays the reload, never a poll. The loop applies the result."""
        systemd_notify.reloading()

        def read() -> None:
            self._reload_result = self._read_config()
            self._wake.set()

        self._reload_thread = threading.Thread(target=read, name="gpuwatch-reload", daemon=True)
        start_without_signals(self._reload_thread)

    def reload(self) -> bool:
        """Read and apply the configuration now (the poll loop does the two apart)."""
        systemd_notify.reloading()
        return self._apply_reload(*self._read_config())

    def _apply_reload(self, new: Optional[Config], error: Optional[ConfigError]) -> bool:
        if new is None:
            exc = error
            log.error("configuration reload refused, keeping the running one: %s", exc)
            self.metrics.count_reload(applied=False)
            systemd_notify.ready(status=self._status_line())
            return False
        old = self.config
        for key in ("listen", "runtime_dir", "state_dir", "node_name", "web_config"):
            if getattr(new.daemon, key) != getattr(old.daemon, key):
                log.warning("daemon.%s changed; it takes effect at the next restart", key)
        self.config = new
        self.reaping.config = new
        self.collector.max_process_series = new.exporter.max_process_series
        self.trace_requests.config = new.agent
        self.collector.max_agent_series = new.agent.max_series_per_user
        self.agents.configure(new.agent.max_processes, new.agent.memory_budget,
                              new.agent.max_reports_per_second)
        self.history.resize(new.history.samples, new.history.max_processes,
                            sample_spacing(new))
        self.poller.private_memory.every = sample_spacing(new)
        self.poller.nvml.backoff.maximum = new.daemon.nvml_retry_max
        setup_logging(new.daemon.log_format, new.daemon.log_level)
        self.metrics.count_reload(applied=True)
        log.info("configuration reloaded")
        systemd_notify.ready(status=self._status_line())
        return True

    def _write_daemon_info(self, runtime: TrustedDir, port: int) -> None:
        info = DaemonInfo(pid=os.getpid(), version=__version__, metrics_url=self.metrics_url,
                          port=port, state_socket=str(runtime.path / STATE_SOCKET_NAME))
        # daemon.json.tmp made anew (O_EXCL, O_NOFOLLOW) and renamed, within the directory.
        runtime.write_file(DAEMON_INFO_NAME, info.to_json())

    def _shutdown(self, runtime: TrustedDir) -> None:
        if self._state_server is not None:
            self._state_server.stop()
        self.agents.stop()
        if self._http is not None:
            self._http.stop()
        remove_own_daemon_info(runtime)
        self.poller.close()


_USAGE = "usage: gpuwatch daemon [--config PATH] [--set SECTION.KEY=VALUE ...]"


def parse_daemon_args(argv: list[str]) -> tuple[Optional[Path], dict[str, Any]]:
    """The config path and the `--set` overrides of the daemon process's command line, which
    exec_daemon writes (`--config PATH`, `--set=KEY=VALUE`; `--opt VALUE` and `--opt=VALUE`
    alike). Raises ValueError for anything else: argparse, kept for the daemon's life, would
    cost it a third of a MiB for two options."""
    config: Optional[Path] = None
    overrides: dict[str, Any] = {}
    items = iter(argv)
    for arg in items:
        name, eq, value = arg.partition("=")
        if name not in ("--config", "--set"):
            raise ValueError(f"unrecognised argument {arg!r}")
        if not eq:
            following = next(items, None)
            if following is None:
                raise ValueError(f"{name}: expected a value")
            value = following
        if name == "--config":
            config = Path(value)
            continue
        key, sep, setting = value.partition("=")
        if not sep:
            raise ValueError(f"--set {value!r}: expected SECTION.KEY=VALUE")
        overrides[key] = setting
    return config, overrides


def main(argv: Optional[list[str]] = None) -> int:
    """The daemon process's own entry point: `gpuwatch daemon` execs into it.

    The CLI framework (click, and the modules of every command) costs the process memory it
    would keep for its whole life; the daemon needs none of it, so it starts afresh with only
    this parser. Flags arrive as `--set section.key=value` config overrides.
    """
    # Before any thread: one malloc arena for all of them (the HTTP server's, the agent
    # socket's, the poll's), whose free pages the trim after each poll hands back; large blocks
    # (a /metrics body) mapped on their own, back to the system as they are freed.
    limit_malloc_arenas()
    try:
        config_path, overrides = parse_daemon_args(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(f"{_USAGE}\ngpuwatch daemon: error: {exc}", file=sys.stderr)
        return 2
    try:
        config = load_config(config_path, overrides=overrides)
    except ConfigError as exc:
        print(f"gpuwatch: bad configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(config.daemon.log_format, config.daemon.log_level)
    try:
        return Daemon(config, config_path=config_path, overrides=overrides).run()
    except AlreadyRunning as exc:
        print(f"gpuwatch daemon: {exc}", file=sys.stderr)
        return EXIT_ALREADY_RUNNING
    except UnsafeDirectory as exc:  # another user could write where the daemon would
        print(f"gpuwatch daemon: refusing the directory: {exc}", file=sys.stderr)
        return EXIT_UNSAFE_DIRECTORY
    except ConfigError as exc:  # daemon.web_config, read when the port is opened
        print(f"gpuwatch: bad configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as exc:  # the port or a directory is not ours to take
        print(f"gpuwatch daemon: {exc.strerror or exc}", file=sys.stderr)
        return 1


def exec_daemon(config: Optional[Path], overrides: dict[str, Any]) -> None:
    """Replace this process (same PID, as systemd expects) with a lean daemon process."""
    argv = [sys.executable, "-m", "gpuwatch.daemon"]
    if config is not None:
        argv += ["--config", str(config)]
    argv += [f"--set={key}={value}" for key, value in overrides.items() if value is not None]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)


def _url_host(host: str) -> str:
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


if __name__ == "__main__":
    sys.exit(main())
