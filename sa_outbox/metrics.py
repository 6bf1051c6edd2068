"""Prometheus metrics for a running Dispatcher/Worker (extra ``metrics``: prometheus-client).

``MetricsExporter(loop).start(port)`` serves ``/metrics`` with:

* counters from the loop (``sa_outbox_claimed_total``, ``…_completed_total`` (published or done),
  ``…_retried_total``, ``…_deferred_total``, ``…_dead_total``, ``…_released_total``,
  ``…_lost_leases_total``, ``…_rescued_total``, ``…_db_errors_total``, ``…_wakeups_total``);
* histograms: ``sa_outbox_claim_seconds`` (one claim statement), ``sa_outbox_handle_seconds`` (one publish or
  handler call) and ``sa_outbox_age_at_handle_seconds`` (from ``created_at`` to publish/handling: end-to-end);
* gauges from :func:`sa_outbox.monitoring.queue_status`, read from the database at most every
  ``status_interval`` (a scrape in between serves the last reading):
  ``sa_outbox_rows{status=…}`` (rows per status; ``done`` is exact up to ``done_count_cap`` and estimated
  from the table statistics beyond it), ``sa_outbox_rows_estimated{status=…}`` (1 when that figure is an
  estimate), ``sa_outbox_oldest_pending_age_seconds`` (how long the oldest row that is due and not started
  has waited: alert on this), ``sa_outbox_oldest_unfinished_age_seconds`` (oldest pending/leased row by
  ``created_at``, including rows scheduled or deferred for later: for information),
  ``sa_outbox_expired_leases`` (jobs: counted with the loop's own ``stale_after``),
  ``sa_outbox_blocked_aggregates`` (outbox: aggregates with pending messages behind a dead one) and
  ``sa_outbox_status_age_seconds`` (seconds since those gauges were read: it grows while the database cannot
  be read and the last reading is served);
* ``sa_outbox_circuit_open`` (dispatchers only): 1 while the dispatcher's circuit breaker is open — its
  destination raised :class:`~sa_outbox.DestinationUnavailable` and it claims nothing but one probe message
  at a time until one gets through — else 0. Read from the loop at every scrape.

Every series carries ``table`` and ``kind`` labels. ``sa-outbox dispatch|worker --metrics-port N`` starts it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from ._durations import Duration, to_seconds, to_timedelta
from .errors import ConfigurationError
from .monitoring import DONE_COUNT_CAP

try:
    from prometheus_client import CollectorRegistry, Histogram, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ConfigurationError(f"metrics need their extra: pip install 'sa-outbox[metrics]' ({exc})") from exc

__all__ = ["MetricsExporter"]

log = logging.getLogger("sa_outbox.metrics")

#: The circuit breaker's gauge (read from the loop on every scrape, never from the database).
CIRCUIT_OPEN = "sa_outbox_circuit_open"

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
        values = [ex.core.spec.table.fullname, ex.core.spec.kind]
        stats = ex.core.stats.as_dict()
        for name, doc in _COUNTERS.items():
            metric = "completed" if name == "done" else name
            c = CounterMetricFamily(f"sa_outbox_{metric}", doc, labels=labels)
            c.add_metric(values, stats[name])
            yield c
        open_ = getattr(ex.core, "circuit_open", None)  # dispatchers only: a worker has no circuit breaker
        if open_ is not None:
            circuit = GaugeMetricFamily(
                CIRCUIT_OPEN, "1 while the dispatcher's circuit breaker is open: its destination was unavailable "
                "(DestinationUnavailable); it claims nothing but probe messages until one gets through",
                labels=labels,
            )  # fmt: skip
            circuit.add_metric(values, 1.0 if open_ else 0.0)
            yield circuit
        status, read_at = ex.status_with_time()
        if status is None:
            return
        rows = GaugeMetricFamily("sa_outbox_rows", "rows per status (see sa_outbox_rows_estimated)",
                                 labels=[*labels, "status"])  # fmt: skip
        estimated = GaugeMetricFamily(
            "sa_outbox_rows_estimated", "1 when sa_outbox_rows for this status is an estimate from the table "
            "statistics (done rows beyond the exact-count cap), else 0", labels=[*labels, "status"],
        )  # fmt: skip
        for st, n in status.counts.items():
            rows.add_metric([*values, st], n)
            estimated.add_metric(
                [*values, st], 1.0 if status.done_is_estimate and st == ex.core.spec.done else 0.0
            )
        yield rows
        yield estimated
        for name, doc, value in (
            ("sa_outbox_oldest_pending_age_seconds",
             "seconds the oldest row that is due and not started has waited (0 when none): alert on this",
             status.oldest_pending_age or 0.0),
            ("sa_outbox_oldest_unfinished_age_seconds",
             "age of the oldest unfinished row, including rows scheduled or deferred for later (information)",
             status.oldest_unfinished_age or 0.0),
            ("sa_outbox_expired_leases", "leased rows past their lease (jobs: running longer than stale_after)",
             status.expired_leases),
            ("sa_outbox_blocked_aggregates", "aggregates with pending messages behind a dead one",
             status.blocked_aggregates_total),
            ("sa_outbox_status_age_seconds", "seconds since the status gauges were read from the database",
             max(time.monotonic() - read_at, 0.0)),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(values, value)
            yield gauge


class MetricsExporter:
    """Exposes a Dispatcher's or Worker's metrics (sync or async: pass either).

    ``status_interval`` (seconds, >= 0) bounds how often the status gauges query the database;
    ``stale_after`` is the reaping window used to count expired job leases (default: the loop's own
    ``stale_after``, else 60 s); ``done_count_cap`` is how many done rows are counted exactly before the
    figure becomes an estimate (``sa_outbox_rows_estimated`` then says so)."""

    def __init__(
        self,
        loop: Any,
        *,
        status_interval: float = 15.0,
        registry: CollectorRegistry | None = None,
        stale_after: Duration | None = None,
        done_count_cap: int = DONE_COUNT_CAP,
    ) -> None:
        self.core = loop
        self.status_interval = to_seconds(status_interval, name="status_interval")
        if stale_after is None:
            stale_after = getattr(self.core, "stale_after", None) or 60.0
        self.stale_after = to_timedelta(stale_after, name="stale_after", allow_zero=False)
        if isinstance(done_count_cap, bool) or not isinstance(done_count_cap, int) or done_count_cap < 0:
            raise ConfigurationError(f"done_count_cap must be an integer >= 0, got {done_count_cap!r}")
        self.done_count_cap = done_count_cap
        self.registry = registry or CollectorRegistry()
        self._status: Any = None
        self._status_at = 0.0  # when the gauges were last read (monotonic)
        self._tried_at: float | None = None  # when a reading was last attempted, successful or not
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
        # serve them, so their status queries get a small sync engine of their own (same URL, psycopg), with
        # the async engine's execution options (a tenant's schema_translate_map) and no server-side prepared
        # statements — a handful of different queries every 15 s gain nothing from them, and behind PgBouncer
        # in transaction mode a prepared name does not survive its transaction (a review found psycopg's
        # default, 5, where the loop's engine had none).
        engine = self.core.engine
        if engine.dialect.is_async:
            from sqlalchemy import create_engine
            from sqlalchemy.pool import NullPool

            from ._db import with_options_of

            built = create_engine(
                engine.url.set(drivername="postgresql+psycopg"), poolclass=NullPool,
                connect_args={"prepare_threshold": None},
            )  # fmt: skip
            engine = with_options_of(built, engine)
        self._status_engine = engine

    def observe(self, what: str, seconds: float) -> None:
        labels = (self.core.spec.table.fullname, self.core.spec.kind)
        {"claim": self.claim_seconds, "handle": self.handle_seconds, "age": self.age_seconds}[what].labels(
            *labels
        ).observe(seconds)

    def status(self) -> Any:
        """The last :class:`~sa_outbox.monitoring.QueueStatus` read (``None`` before the first success)."""
        return self.status_with_time()[0]

    def status_with_time(self) -> tuple[Any, float]:
        """The last status and when it was read (``time.monotonic()``). The database is asked at most every
        ``status_interval``, also while it fails (the loop's counters are served meanwhile)."""
        from .monitoring import queue_status

        with self._lock:
            now = time.monotonic()
            if self._tried_at is None or now - self._tried_at >= self.status_interval:
                self._tried_at = now
                try:
                    self._status = queue_status(self._status_engine, self.core.model, stale_after=self.stale_after,
                                                done_count_cap=self.done_count_cap)  # fmt: skip
                    self._status_at = time.monotonic()
                except Exception:  # the database may be down: serve the last reading, its age says how old
                    log.debug("status gauges not refreshed", exc_info=True)
            return self._status, self._status_at

    def start(self, port: int, addr: str = "0.0.0.0") -> MetricsExporter:
        self._server = start_http_server(port, addr=addr, registry=self.registry)
        return self

    def stop(self) -> None:
        if self._server is not None:
            server, _thread = self._server
            server.shutdown()
            server.server_close()
            self._server = None
