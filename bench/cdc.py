"""CDC figures on a throwaway cluster with ``wal_level=logical``: what the producer pays for a CDC table, and
how fast PostgreSQL's logical decoding hands the events on.

``python -m bench.cdc`` starts a private cluster (tests/logical_pg.py: initdb + pg_ctl on a free port, deleted
afterwards; the machine's shared PostgreSQL is not touched) and measures, on one connection each:

* **producer**: ``session.add`` events per second at 1 and 10 events per transaction into a polling outbox
  table (``OutboxMixin``), a CDC table in insert-then-delete mode and a CDC table that keeps its rows — the
  three take turns in blocks, so they share the machine's drift — and the WAL each event costs
  (``pg_current_wal_lsn()`` before and after), plus the WAL of a dispatcher's claims and finalizes of the
  polling table's events;
* **decode throughput**: events committed first, then read in one go from a ``pgoutput`` slot through the
  publication (the plugin and publication Debezium uses) and from a ``wal2json`` slot, with the SQL functions
  ``pg_logical_slot_get_(binary_)changes`` — the server's decoding speed, not Debezium's;
* **decode latency**: one-event transactions, streamed by ``pg_recvlogical`` (wal2json, over the replication
  protocol Debezium also uses): from just before the ``COMMIT`` is sent to the change's line arriving — the
  reference point of the polling wake-up figure in docs/benchmarks.md.

Debezium, Kafka Connect and Kafka are part of no figure: a connector adds its own batching
(``poll.interval.ms``, default 500 ms), conversion and the Kafka produce on top.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import subprocess
import threading
import time
import uuid
from typing import Any

from sqlalchemy import Engine, MetaData, create_engine, text
from sqlalchemy.orm import DeclarativeBase, Session

from sa_outbox import CdcOutboxMixin, Dispatcher, OutboxMixin
from sa_outbox.cdc import setup_sql
from sa_outbox.testing import drain
from tests.logical_pg import (
    WAL2JSON_OPTIONS,
    LogicalCluster,
    Slot,
    logical_cluster,
    parse_pgoutput,
    parse_wal2json,
)


class Base(DeclarativeBase):
    metadata = MetaData()


class Polled(OutboxMixin, Base):
    __tablename__ = "bench_outbox"


class CdcDeleted(CdcOutboxMixin, Base):
    __tablename__ = "bench_cdc"


class CdcKept(CdcOutboxMixin, Base):
    __tablename__ = "bench_cdc_kept"
    sa_outbox_delete_after_insert = False


MODELS: tuple[tuple[str, Any], ...] = (
    ("polling outbox", Polled),
    ("CDC, insert then delete", CdcDeleted),
    ("CDC, rows kept", CdcKept),
)
PAYLOAD = {"order": 12345, "total": "99.90", "lines": [{"sku": "A-1", "qty": 2}, {"sku": "B-7", "qty": 1}]}
HEADERS = {"x-tenant": "acme", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


def _wal_lsn(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")).scalar_one())


def _event(model: Any, n: int, **payload: Any) -> Any:
    return model(aggregate_type="order", aggregate_id=str(n % 100), event_type="OrderPaid",
                 payload={**PAYLOAD, **payload}, headers=HEADERS)  # fmt: skip


# --- the producer -----------------------------------------------------------------------------------------


def produce(engine: Engine, model: Any, transactions: int, per_tx: int) -> tuple[float, int]:
    """``session.add`` ``per_tx`` events per transaction: (seconds, WAL bytes written meanwhile)."""
    start_lsn = _wal_lsn(engine)
    start = time.perf_counter()
    for t in range(transactions):
        with Session(engine) as s, s.begin():
            s.add_all(_event(model, t) for _ in range(per_tx))
    return time.perf_counter() - start, _wal_lsn(engine) - start_lsn


def producer_rows(engine: Engine, transactions: int, per_tx: int, rounds: int = 10) -> list[str]:
    """The three tables take turns in blocks (the order rotating each round)."""
    seconds = {label: 0.0 for label, _ in MODELS}
    wal = {label: 0 for label, _ in MODELS}
    block = max(1, transactions // rounds)
    for _, model in MODELS:
        produce(engine, model, max(1, block // 2), per_tx)  # warm-up
    for r in range(rounds):
        for label, model in MODELS[r % 3 :] + MODELS[: r % 3]:
            took, written = produce(engine, model, block, per_tx)
            seconds[label] += took
            wal[label] += written
    events = block * rounds * per_tx
    polling = events / seconds["polling outbox"]
    return [
        f"| producer, session.add, {per_tx} event(s)/tx, {label} | {events / seconds[label]:,.0f} events/s "
        f"({events / seconds[label] / polling:.2f}× polling), {wal[label] / events:,.0f} WAL bytes/event |"
        for label, _ in MODELS
    ]


class _Noop:
    def publish(self, message: Any) -> None:
        pass


def drain_wal(engine: Engine) -> tuple[int, float]:
    """A dispatcher (batch 50, plain claim, a publisher that does nothing) drains the polling table: (events,
    WAL bytes per event of its claims and finalizes)."""
    start = _wal_lsn(engine)
    dispatcher = Dispatcher(engine, Polled, _Noop(), batch=50)
    try:
        done = drain(dispatcher)
    finally:
        dispatcher.close()
    return done, (_wal_lsn(engine) - start) / max(1, done)


# --- decoding ---------------------------------------------------------------------------------------------


def decode_throughput(engine: Engine, events: int, per_tx: int) -> dict[str, float]:
    """Commit ``events`` CDC events (insert then delete), then decode them in one go per plugin: events/s of
    the server's decoding (the client only receives the rows in the timed part)."""
    names = {"slot_name": f"bench_pgoutput_{uuid.uuid4().hex[:6]}", "publication_name": "bench_pub"}
    with engine.connect() as conn:
        for statement in setup_sql(CdcDeleted, **names):
            conn.execute(text(statement))
            conn.commit()
    slots = {
        "pgoutput": Slot(engine, names["slot_name"], "pgoutput",
                         ("proto_version", "1", "publication_names", "bench_pub")),
        "wal2json": Slot(engine, f"bench_w2j_{uuid.uuid4().hex[:6]}", "wal2json",
                         (*WAL2JSON_OPTIONS, "add-tables", "public.bench_cdc")).create(),
    }  # fmt: skip
    produce(engine, CdcDeleted, events // per_tx, per_tx)
    out: dict[str, float] = {}
    for plugin, slot in slots.items():
        start = time.perf_counter()
        rows = slot.fetch()
        seconds = time.perf_counter() - start
        txns = parse_pgoutput(rows) if plugin == "pgoutput" else parse_wal2json(rows)
        decoded = sum(1 for tx in txns for c in tx.changes if c.action == "I")
        assert decoded == events, (plugin, decoded, events)
        out[plugin] = decoded / seconds
        slot.drop()
    with engine.begin() as conn:
        conn.execute(text("DROP PUBLICATION bench_pub"))
    return out


def decode_latency(cluster: LogicalCluster, engine: Engine, count: int) -> list[float]:
    """COMMIT sent → the change's line from ``pg_recvlogical`` (wal2json), in milliseconds: one event per
    transaction, the next one 20 ms after the previous one arrived."""
    slot = f"bench_recv_{uuid.uuid4().hex[:6]}"
    Slot(engine, slot, "wal2json").create()
    options = ["-o", "format-version=2", "-o", "include-xids=1", "-o", "add-tables=public.bench_cdc"]
    argv = cluster.command("pg_recvlogical", "-h", "127.0.0.1", "-p", str(cluster.port), "-U", "postgres",
                           "-d", "postgres", "--slot", slot, "--start", "-f", "-", "-s", "1", *options)  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, user=cluster.user)
    arrivals: queue.Queue[tuple[int, float]] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.perf_counter()
            msg = json.loads(line)
            if msg.get("action") == "I":
                payload = json.loads(next(c["value"] for c in msg["columns"] if c["name"] == "payload"))
                arrivals.put((payload["seq"], now))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    latencies = []
    try:
        time.sleep(1.0)  # the stream is up
        for seq in range(count):
            with Session(engine) as s, s.begin():
                s.add(_event(CdcDeleted, seq, seq=seq))
                s.flush()
                t0 = time.perf_counter()  # the COMMIT is sent when the block ends
            got, seen = arrivals.get(timeout=30)
            assert got == seq, (got, seq)
            latencies.append((seen - t0) * 1000)
            time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(30)
        reader.join(5)
        _wait_inactive(engine, slot)
        Slot(engine, slot).drop()
    return latencies


def _wait_inactive(engine: Engine, slot: str, timeout: float = 15.0) -> None:
    """Until the walsender of a stopped ``pg_recvlogical`` has let go of ``slot`` (a slot in use cannot be
    dropped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            active = conn.execute(
                text("SELECT active FROM pg_replication_slots WHERE slot_name = :s"), {"s": slot}
            ).scalar_one()
        if not active:
            return
        time.sleep(0.05)
    raise TimeoutError(f"replication slot {slot} still active after {timeout:g}s")


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cdc", description=__doc__.splitlines()[0])
    parser.add_argument("--transactions", type=int, default=2000, help="producer: transactions per table")
    parser.add_argument("--decode-events", type=int, default=20_000, help="decode throughput: events")
    parser.add_argument(
        "--latency-events", type=int, default=500, help="decode latency: events, one at a time"
    )
    args = parser.parse_args(argv)
    with logical_cluster() as cluster:
        engine = create_engine(cluster.url, pool_size=4)
        Base.metadata.create_all(engine)
        try:
            print("| what | figure |\n|---|---|")
            for per_tx, transactions in ((1, args.transactions), (10, max(1, args.transactions // 5))):
                for line in producer_rows(engine, transactions, per_tx):
                    print(line)
            done, wal = drain_wal(engine)
            print(f"| polling outbox: a dispatcher's claims and finalizes (batch 50) of those {done:,} events | "
                  f"{wal:,.0f} WAL bytes/event |")  # fmt: skip
            for plugin, rate in decode_throughput(engine, args.decode_events, 10).items():
                print(f"| decode throughput, {args.decode_events:,} events in tx of 10, {plugin} "
                      f"(pg_logical_slot_get_*changes) | {rate:,.0f} events/s |")  # fmt: skip
            lat = decode_latency(cluster, engine, args.latency_events)
            print(f"| decode latency, COMMIT sent → pg_recvlogical line (wal2json), {len(lat)} one-event "
                  f"transactions | p50 {_pct(lat, 50):.1f} ms, p99 {_pct(lat, 99):.1f} ms, "
                  f"max {max(lat):.1f} ms |")  # fmt: skip
        finally:
            engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
