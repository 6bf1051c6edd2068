"""One ``/metrics`` endpoint for a ``--processes N`` pool (extra ``metrics``: prometheus-client).

Each child keeps its own :class:`~sa_outbox.metrics.MetricsExporter` (no port of its own) and sends a snapshot of
its series to the supervisor over a pipe every second and once more when it stops (:class:`ChildReport`). The
supervisor serves them on the one ``--metrics-port`` (:class:`PoolMetrics`):

* counters and histograms are the sum over the live children plus what every replaced child had reported, so
  a pool counter never goes backwards when a child is replaced (what a SIGKILLed child did after its last
  snapshot — under a second of work — is not counted);
* the queue gauges (``sa_outbox_rows``, oldest age, expired leases) come from child 0 alone: every child sees
  the same table, one query per ``status_interval`` is enough;
* ``sa_outbox_circuit_open`` is or-ed over the live children: 1 while any child's circuit breaker is open
  (each child keeps its own and learns of an outage from its own probes), 0 when all are closed;
* the pool's own series: ``sa_outbox_pool_processes`` (children alive) and ``sa_outbox_pool_restarts_total``
  (children replaced after an unexpected exit), labelled with the command (``dispatch`` / ``worker``).

Why not prometheus_client's multiprocess mode: the loop counters come from a custom collector reading the
loop's stats, which that mode does not aggregate, and it needs an environment variable set before
prometheus_client is first imported in every process. A pipe per child needs neither, and keeps working while
children come and go.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .errors import ConfigurationError
from .metrics import CIRCUIT_OPEN, MetricsExporter

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

__all__ = ["ChildReport", "PoolMetrics", "port_taken"]

#: One metric family as it travels: (name, type, documentation, [(sample name, labels, value), …]).
Family = tuple[str, str, str, list[tuple[str, dict[str, str], float]]]
_SUMMED = frozenset({"counter", "histogram", "summary"})

_Key = tuple[str, tuple[tuple[str, str], ...]]
_Families = dict[str, tuple[str, str, dict[_Key, float]]]


def port_taken(port: int, exc: OSError) -> ConfigurationError:
    """The error for a metrics port this process cannot listen on."""
    return ConfigurationError(
        f"--metrics-port {port}: cannot listen ({exc.strerror or exc}); another process (an sa-outbox still "
        f"running?) has it: stop it or choose another port"
    )


def snapshot(registry: CollectorRegistry) -> list[Family]:
    """Every series of ``registry`` as plain, picklable values."""
    return [
        (m.name, m.type, m.documentation, [(s.name, dict(s.labels), float(s.value)) for s in m.samples])
        for m in registry.collect()
    ]


def _merge(into: _Families, families: list[Family], *, summed: bool) -> None:
    """Add counters and histograms (``summed``) or take gauges as they are (``summed=False``) into ``into``;
    ``*_created`` timestamps keep the earliest."""
    for name, typ, doc, samples in families:
        if (typ in _SUMMED) != summed:
            continue
        values = into.setdefault(name, (typ, doc, {}))[2]
        for sample_name, labels, value in samples:
            key = (sample_name, tuple(sorted(labels.items())))
            if sample_name.endswith("_created"):
                value = min(values.get(key, value), value)
            elif summed:
                value += values.get(key, 0.0)
            values[key] = value


def _any_open(children: Iterable[list[Family]]) -> tuple[str, str, dict[_Key, float]] | None:
    """``sa_outbox_circuit_open`` of the pool: per label set, the largest value a live child reports (1 while
    any child's circuit is open). ``None`` when no child reports it (a worker pool)."""
    found: tuple[str, str, dict[_Key, float]] | None = None
    for families in children:
        for name, typ, doc, samples in families:
            if name != CIRCUIT_OPEN:
                continue
            values = (found := found or (typ, doc, {}))[2]
            for sample_name, labels, value in samples:
                key = (sample_name, tuple(sorted(labels.items())))
                values[key] = max(values.get(key, 0.0), value)
    return found


class _NoStatus(MetricsExporter):
    """A child exporter without the queue gauges: only child 0 queries the table for them."""

    def status(self) -> Any:
        return None


class ChildReport:
    """Sends one child's series to its supervisor every ``every`` seconds (a thread), and once more on
    :meth:`close`. A supervisor that is gone ends the reports quietly."""

    def __init__(self, loop: Any, conn: Connection, *, with_status: bool, every: float = 1.0) -> None:
        exporter = MetricsExporter(loop) if with_status else _NoStatus(loop)
        self.registry = exporter.registry
        self.conn = conn
        self.every = every
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="sa-outbox-metrics-report", daemon=True)

    def start(self) -> ChildReport:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._done.wait(self.every) and self._send():
            pass

    def _send(self) -> bool:
        with self._lock:
            if self.conn.closed:
                return False
            try:
                self.conn.send(snapshot(self.registry))
                return True
            except (OSError, ValueError):
                return False

    def close(self) -> None:
        """The final snapshot (everything this child did), then the pipe is closed."""
        self._done.set()
        self._send()
        with self._lock:
            self.conn.close()


class PoolMetrics(Collector):
    """The supervisor's side: the pool's series on one port, from the children's snapshots."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._live: dict[int, list[Family]] = {}
        self._retired: _Families = {}
        self._gauges: list[Family] = []
        self._processes = 0
        self._restarts = 0
        self._server: Any = None
        self.registry.register(self)

    def start(self, port: int, addr: str = "0.0.0.0") -> PoolMetrics:
        """Listen on ``port``; a taken port is a :class:`~sa_outbox.errors.ConfigurationError` naming it."""
        try:
            self._server = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            raise port_taken(port, exc) from None
        return self

    def stop(self) -> None:
        if self._server is not None:
            server, _thread = self._server
            server.shutdown()
            server.server_close()
            self._server = None

    def update(self, slot: int, families: list[Family]) -> None:
        """A child's latest snapshot (its totals so far, not a delta)."""
        with self._lock:
            self._live[slot] = families
            gauges = [f for f in families if f[1] not in _SUMMED and f[0] != CIRCUIT_OPEN]
            if gauges:  # only child 0 reads the queue gauges
                self._gauges = gauges

    def retire(self, slot: int) -> None:
        """The child of ``slot`` exited: its last counts stay in the pool's totals."""
        with self._lock:
            _merge(self._retired, self._live.pop(slot, []), summed=True)

    def set_processes(self, n: int) -> None:
        with self._lock:
            self._processes = n

    def count_restart(self) -> None:
        with self._lock:
            self._restarts += 1

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            merged: _Families = {
                name: (typ, doc, dict(values)) for name, (typ, doc, values) in self._retired.items()
            }
            for families in self._live.values():
                _merge(merged, families, summed=True)
            _merge(merged, self._gauges, summed=False)
            circuit = _any_open(self._live.values())
            if circuit is not None:
                merged[CIRCUIT_OPEN] = circuit
            processes, restarts = self._processes, self._restarts
        for name, (typ, doc, values) in merged.items():
            metric = Metric(name, doc, typ)
            for (sample_name, labels), value in values.items():
                metric.add_sample(sample_name, dict(labels), value)
            yield metric
        alive = GaugeMetricFamily("sa_outbox_pool_processes", "children alive", labels=["command"])
        alive.add_metric([self.command], processes)
        yield alive
        replaced = CounterMetricFamily(
            "sa_outbox_pool_restarts", "children replaced after an unexpected exit", labels=["command"]
        )
        replaced.add_metric([self.command], restarts)
        yield replaced
