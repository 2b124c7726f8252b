"""The daemon's metrics core: metric families and their samples, the daemon's own counters and
histograms, a registry of collectors, its process metrics (process_*, read from /proc/self) and
the text and OpenMetrics encoders, chosen by a scrape's `Accept` header.

The families, samples and bytes are prometheus-client's (tests/test_metrics_core.py compares
them with what prometheus-client writes for the same families), without importing it: its
package brings an HTTP server, WSGI, e-mail and TLS along, 12 MiB of a daemon's memory it does
not use (docs/design-notes.md). Nothing of gpuwatch is imported here.
"""

from gpuwatch.metrics.core import (
    Collector,
    Counter,
    CounterMetricFamily,
    GaugeMetricFamily,
    Histogram,
    InfoMetricFamily,
    Metric,
    Registry,
    Sample,
)
from gpuwatch.metrics.exposition import Encoder, choose_encoder, generate_text
from gpuwatch.metrics.process import ProcessCollector

__all__ = ["Collector", "Counter", "CounterMetricFamily", "Encoder", "GaugeMetricFamily",
           "Histogram", "InfoMetricFamily", "Metric", "ProcessCollector", "Registry", "Sample",
           "choose_encoder", "generate_text"]
