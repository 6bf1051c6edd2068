"""Prometheus metrics for a running Dispatcher/Worker (extra ``metrics``: prometheus-client).

``MetricsExporter(loop).start(port)`` serves ``/metrics`` with:

* counters from the loop (``sa_outbox_claimed_total``, ``…_completed_total`` (published or done),
  ``…_retried_total``, ``…_deferred_total``, ``…_dead_total``, ``…_released_total``,
  ``…_lost_leases_total``, ``…_rescued_total``, ``…_db_errors_total``, ``…_wakeups_total``);
* histograms: ``sa_outbox_claim_seconds`` (one claim statement), ``sa_outbox_handle_seconds`` (one publish or
  handler call) and ``sa_outbox_age_at_handle_seconds`` (from ``created_at`` to publish/handling: end-to-end);
* gauges from :func:`sa_outbox.monitoring.queue_status`, refreshed at most every ``status_interval``:
  ``sa_outbox_rows{status=…}``, ``sa_outbox_oldest_pending_age_seconds``, ``sa_outbox_expired_leases``.

Every series carries ``table`` and ``kind`` labels. ``sa-outbox dispatch|worker --metrics-port N`` starts it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from .errors import ConfigurationError

try:
    from prometheus_client import CollectorRegistry, Histogram, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ConfigurationError(f"metrics need their extra: pip install 'sa-outbox[metrics]' ({exc})") from exc

__all__ = ["MetricsExporter"]

_COUNTERS = {
    "claimed": "rows claimed",
    "done": "rows completed (published / handled successfully)",
    "retried": "rows sent back for a retry",
    "deferred": "rows deferred (attempt refunded)",
    "dead": "rows that ended dead/failed",
    "released": "rows given back unhandled (shutdown, lease budget)",
    "lost_leases": "finalizes refused by the fence (lease rescued or re-claimed meanwhile)",
    "rescued": "expired leases rescued",
    "db_errors": "database connection faults ridden out",
    "wakeups": "NOTIFY wake-ups",
}


class _Collector(Collector):
    def __init__(self, exporter: MetricsExporter) -> None:
        self.exporter = exporter

    def collect(self) -> Iterator[Any]:
        ex = self.exporter
        labels = ["table", "kind"]
        values = [ex.core.spec.table.name, ex.core.spec.kind]
        stats = ex.core.stats.as_dict()
        for name, doc in _COUNTERS.items():
            metric = "completed" if name == "done" else name
            c = CounterMetricFamily(f"sa_outbox_{metric}", doc, labels=labels)
            c.add_metric(values, stats[name])
            yield c
        status = ex.status()
        if status is not None:
            rows = GaugeMetricFamily("sa_outbox_rows", "rows per status", labels=[*labels, "status"])
            for st, n in status.counts.items():
                rows.add_metric([*values, st], n)
            yield rows
            age = GaugeMetricFamily(
                "sa_outbox_oldest_pending_age_seconds", "age of the oldest unfinished row", labels=labels
            )
            age.add_metric(values, status.oldest_pending_age or 0.0)
            yield age
            exp = GaugeMetricFamily("sa_outbox_expired_leases", "leased rows past their lease", labels=labels)
            exp.add_metric(values, status.expired_leases)
            yield exp


class MetricsExporter:
    """Exposes a Dispatcher's or Worker's metrics (sync or async: pass either)."""

    def __init__(
        self, loop: Any, *, status_interval: float = 15.0, registry: CollectorRegistry | None = None
    ) -> None:
        self.core = getattr(loop, "core", loop)  # the async classes keep a sync core
        self.registry = registry or CollectorRegistry()
        self.status_interval = status_interval
        self._status: Any = None
        self._status_at = 0.0
        self._lock = threading.Lock()
        names = ("table", "kind")
        self.claim_seconds = Histogram(
            "sa_outbox_claim_seconds", "one claim statement", names, registry=self.registry
        )
        self.handle_seconds = Histogram(
            "sa_outbox_handle_seconds", "one publish / handler call", names, registry=self.registry
        )
        self.age_seconds = Histogram(
            "sa_outbox_age_at_handle_seconds", "created_at to publish/handling", names, registry=self.registry,
            buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600),
        )  # fmt: skip
        self.registry.register(_Collector(self))
        self.core.observer = self.observe
        self._server: Any = None
        # Scrapes arrive on the HTTP server's thread, outside any event loop: the async loops' engine cannot
        # serve them, so their status queries get a small sync engine of their own (same URL, psycopg).
        engine = self.core.engine
        if engine.dialect.is_async:
            from sqlalchemy import create_engine
            from sqlalchemy.pool import NullPool

            engine = create_engine(engine.url.set(drivername="postgresql+psycopg"), poolclass=NullPool)
        self._status_engine = engine

    def observe(self, what: str, seconds: float) -> None:
        labels = (self.core.spec.table.name, self.core.spec.kind)
        {"claim": self.claim_seconds, "handle": self.handle_seconds, "age": self.age_seconds}[what].labels(
            *labels
        ).observe(seconds)

    def status(self) -> Any:
        from .monitoring import queue_status

        with self._lock:
            if self._status is None or time.monotonic() - self._status_at > self.status_interval:
                try:
                    self._status = queue_status(self._status_engine, self.core.model)
                    self._status_at = time.monotonic()
                except Exception:  # the database may be down: serve the loop's counters anyway
                    return self._status
            return self._status

    def start(self, port: int, addr: str = "0.0.0.0") -> MetricsExporter:
        self._server = start_http_server(port, addr=addr, registry=self.registry)
        return self

    def stop(self) -> None:
        if self._server is not None:
            server, _thread = self._server
            server.shutdown()
            server.server_close()
            self._server = None
