"""Status documents for the command line: the running daemon's, or polls of the command's own.

`gpuwatch status`, `reap`, `top` and `status --watch` ask the daemon through its state socket
first; when none answers (or `--poll` says not to ask) they poll here with the same Poller,
detectors and document builder the daemon uses. A one-shot look uses thresholds that wait for
nothing (DetectorConfig.for_single_poll); a repeated one keeps one History across its polls and
the daemon's thresholds, so that what takes more than one look (an orphan whose launcher was seen
to exit, a leftover past its grace) shows as the daemon would show it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from gpuwatch.serve.state_client import STATE_SOCKET_NAME, StateUnavailable, fetch_status

if TYPE_CHECKING:
    from gpuwatch.config import Config
    from gpuwatch.history import History
    from gpuwatch.poll import Poller


class StatusSource:
    """One status document per call; `close()` releases NVML when it polled."""

    def __init__(self, cfg: Config, force_poll: bool = False, one_shot: bool = False) -> None:
        self.cfg = cfg
        self.force_poll = force_poll
        self.one_shot = one_shot
        self._poller: Optional[Poller] = None
        self._history: Optional[History] = None

    def __call__(self) -> dict[str, Any]:
        why = "--poll given"
        if not self.force_poll:
            try:
                return fetch_status(self.cfg.daemon.runtime_dir / STATE_SOCKET_NAME)
            except StateUnavailable as exc:
                why = str(exc)
        return self._own_poll(why)

    def _own_poll(self, why: str) -> dict[str, Any]:
        from gpuwatch.config import sample_spacing
        from gpuwatch.detectors import assess
        from gpuwatch.history import History
        from gpuwatch.poll import Poller
        from gpuwatch.sinks.document import SOURCE_POLL, status_document

        if self._poller is None or self._history is None:
            from gpuwatch.sources.pods import pod_source

            k = self.cfg.kubernetes
            self._poller = Poller(hostname=self.cfg.daemon.node_name or None)
            self._poller.pods = pod_source(k.pod_resources_socket, k.pod_logs_dir,
                                           k.runtime_dirs, refresh=k.refresh, timeout=k.timeout,
                                           clock=self._poller.clock)
            self._history = History(self.cfg.history.samples, self.cfg.history.max_processes,
                                    sample_spacing=sample_spacing(self.cfg))
        snapshot = self._poller.poll(watch=self._history.watch_pids())
        detectors = self.cfg.detectors
        if self.one_shot:
            detectors = detectors.for_single_poll()
        report = assess(snapshot, self._history, detectors)
        return status_document(report, source=SOURCE_POLL, source_detail=why)

    def close(self) -> None:
        if self._poller is not None:
            self._poller.close()
            self._poller = None

    def __enter__(self) -> StatusSource:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
