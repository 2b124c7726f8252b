"""The daemon's own CPU, memory and file descriptors (process_*), read from /proc/self at each
scrape: prometheus-client's ProcessCollector's families, names and help."""

from __future__ import annotations

import io
import os
import resource
from typing import Optional

from gpuwatch.metrics.core import Collector, CounterMetricFamily, GaugeMetricFamily, Metric

try:
    _PAGESIZE = os.sysconf("SC_PAGE_SIZE")
except (ValueError, OSError):
    _PAGESIZE = 4096


def _count_fds(fd_dir: str) -> int:
    """The descriptors open in a process: the size Linux 6.2 and later give its /proc/PID/fd
    directory (one system call where the daemon holds a thousand descriptors, one per GPU
    process it reads), else its entries counted, as prometheus-client counts them (its own
    process's count then includes the descriptor the listing opens)."""
    size = os.stat(fd_dir).st_size
    return size if size > 0 else len(os.listdir(fd_dir))


class ProcessCollector(Collector):
    """process_virtual_memory_bytes, process_resident_memory_bytes, process_start_time_seconds,
    process_cpu_seconds_total, process_open_fds and process_max_fds of this process.

    Read at every render: the stat line through a descriptor kept open (a read at offset 0
    makes the kernel write the line afresh), the limit on descriptors from getrlimit (what
    /proc/self/limits shows as "Max open files", without reading and splitting its table)."""

    def __init__(self, proc: str = "/proc") -> None:
        self._proc = proc
        self._prefix = "process_"
        try:
            self._ticks = float(os.sysconf("SC_CLK_TCK"))
        except (ValueError, TypeError, OSError):
            self._ticks = 100.0
        self._btime = self._boot_time()
        #: /proc/self/stat, open, for the PID it was opened by (a fork's child opens its own).
        self._stat: Optional[tuple[int, io.FileIO]] = None

    def _boot_time(self) -> float:
        """The boot time, or 0.0 where /proc cannot tell it (then no family is collected)."""
        try:
            with open(os.path.join(self._proc, "stat"), "rb") as stat:
                for line in stat:
                    if line.startswith(b"btime "):
                        return float(line.split()[1])
        except OSError:
            pass
        return 0.0

    def collect(self) -> list[Metric]:
        if not self._btime:
            return []
        result: list[Metric] = []
        p = self._prefix
        try:
            parts = self._stat_line().rpartition(b")")[2].split()
            result.extend([
                GaugeMetricFamily(p + "virtual_memory_bytes", "Virtual memory size in bytes.",
                                  value=float(parts[20])),
                GaugeMetricFamily(p + "resident_memory_bytes", "Resident memory size in bytes.",
                                  value=float(parts[21]) * _PAGESIZE),
                GaugeMetricFamily(p + "start_time_seconds",
                                  "Start time of the process since unix epoch in seconds.",
                                  value=float(parts[19]) / self._ticks + self._btime),
                CounterMetricFamily(p + "cpu_seconds_total",
                                    "Total user and system CPU time spent in seconds.",
                                    value=float(parts[11]) / self._ticks
                                    + float(parts[12]) / self._ticks),
            ])
        except (OSError, IndexError, ValueError):
            pass
        try:
            result.append(GaugeMetricFamily(p + "open_fds", "Number of open file descriptors.",
                                            _count_fds(f"{self._proc}/self/fd")))
        except OSError:
            return result
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY:
            result.append(GaugeMetricFamily(p + "max_fds",
                                            "Maximum number of open file descriptors.",
                                            value=float(soft)))
        return result

    def _stat_line(self) -> bytes:
        pid = os.getpid()
        kept = self._stat
        if kept is None or kept[0] != pid:
            # (A FileIO, not a bare descriptor: it is closed with the collector.)
            kept = self._stat = (pid, io.FileIO(f"{self._proc}/self/stat"))
        return os.pread(kept[1].fileno(), 4096, 0)
