"""CDC figures on a throwaway cluster with ``wal_level=logical``: what the producer pays for a CDC table, and
how fast PostgreSQL's logical decoding hands the events on.

``python -m bench.cdc`` starts a private cluster (tests/logical_pg.py: initdb + pg_ctl on a free port, deleted
afterwards; the machine's shared PostgreSQL is not touched) and measures, on one connection each:

* **producer**: ``session.add`` events per second at 1 and 10 events per transaction into a polling outbox
  table (``OutboxMixin``), a CDC table in insert-then-delete mode and a CDC table that keeps its rows; and the
  WAL each event costs (``pg_current_wal_lsn()`` before and after);
* **decode throughput**: events committed first, then read in one go from a ``pgoutput`` slot through the
  publication (the plugin and publication Debezium uses) and from a ``wal2json`` slot, with the SQL functions
  ``pg_logical_slot_get_(binary_)changes`` — the server's decoding speed, not Debezium's;
* **decode latency**: a steady trickle of one-event transactions, streamed by ``pg_recvlogical`` (wal2json, the
  replication protocol Debezium also uses): time from the producer's ``COMMIT`` returning to the change's line
  arriving, on one clock (``perf_counter``) in one process.

Debezium, Kafka Connect and Kafka are not part of any figure: a connector adds its own batching
(``poll.interval.ms``, default 500 ms), conversion and the Kafka produce on top.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time
import uuid
from typing import Any

from sqlalchemy import Engine, MetaData, create_engine, text
from sqlalchemy.orm import DeclarativeBase, Session

from sa_outbox import CdcOutboxMixin, OutboxMixin
from sa_outbox.cdc import setup_sql
from tests.logical_pg import WAL2JSON_OPTIONS, LogicalCluster, Slot, logical_cluster


class Base(DeclarativeBase):
    metadata = MetaData()


class Polled(OutboxMixin, Base):
    __tablename__ = "bench_outbox"


class CdcDeleted(CdcOutboxMixin, Base):
    __tablename__ = "bench_cdc"


class CdcKept(CdcOutboxMixin, Base):
    __tablename__ = "bench_cdc_kept"
    sa_outbox_delete_after_insert = False


PAYLOAD = {"order": 12345, "total": "99.90", "lines": [{"sku": "A-1", "qty": 2}, {"sku": "B-7", "qty": 1}]}
HEADERS = {"x-tenant": "acme", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


def _wal_lsn(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")).scalar_one())


def produce(engine: Engine, model: Any, transactions: int, per_tx: int) -> tuple[float, float]:
    """``session.add`` ``per_tx`` events per transaction: (events per second, WAL bytes per event)."""
    start_lsn = _wal_lsn(engine)
    start = time.perf_counter()
    for t in range(transactions):
        with Session(engine) as s, s.begin():
            s.add_all(
                model(
                    aggregate_type="order",
                    aggregate_id=str(t % 100),
                    event_type="OrderPaid",
                    payload=PAYLOAD,
                    headers=HEADERS,
                )
                for _ in range(per_tx)
            )
    seconds = time.perf_counter() - start
    events = transactions * per_tx
    return events / seconds, (_wal_lsn(engine) - start_lsn) / events


class _Noop:
    def publish(self, message: Any) -> None:
        pass


def drain_wal(engine: Engine) -> tuple[int, float]:
    """A dispatcher (batch 50, plain claim, a publisher that does nothing) drains the polling table: (events,
    WAL bytes per event of its claims and finalizes)."""
    from sa_outbox import Dispatcher
    from sa_outbox.testing import drain

    start = _wal_lsn(engine)
    dispatcher = Dispatcher(engine, Polled, _Noop(), batch=50)
    try:
        done = drain(dispatcher)
    finally:
        dispatcher.close()
    return done, (_wal_lsn(engine) - start) / max(1, done)


def decode_throughput(engine: Engine, events: int, per_tx: int) -> dict[str, float]:
    """Commit ``events`` CDC events (insert then delete), then decode them in one go per plugin: events/s."""
    names = {"slot_name": f"bench_pgoutput_{uuid.uuid4().hex[:6]}", "publication_name": "bench_pub"}
    with engine.connect() as conn:
        for statement in setup_sql(CdcDeleted, **names):
            conn.execute(text(statement))
            conn.commit()
    slots = {
        "pgoutput": Slot(
            engine, names["slot_name"], "pgoutput", ("proto_version", "1", "publication_names", "bench_pub")
        ),
        "wal2json": Slot(
            engine,
            f"bench_w2j_{uuid.uuid4().hex[:6]}",
            "wal2json",
            (*WAL2JSON_OPTIONS, "add-tables", "public.bench_cdc"),
        ).create(),
    }
    produce(engine, CdcDeleted, events // per_tx, per_tx)
    out: dict[str, float] = {}
    for plugin, slot in slots.items():
        start = time.perf_counter()
        txns = slot.take()
        seconds = time.perf_counter() - start
        decoded = sum(1 for tx in txns for c in tx.changes if c.action == "I")
        assert decoded == events, (plugin, decoded, events)
        out[plugin] = decoded / seconds
        slot.drop()
    with engine.begin() as conn:
        conn.execute(text("DROP PUBLICATION bench_pub"))
    return out


def decode_latency(cluster: LogicalCluster, engine: Engine, rate: float, seconds: float) -> list[float]:
    """Commit → line from ``pg_recvlogical`` (wal2json), in milliseconds, at ``rate`` one-event commits/s."""
    slot = f"bench_recv_{uuid.uuid4().hex[:6]}"
    Slot(engine, slot, "wal2json").create()
    options = [a for pair in zip(["-o"] * 3, ["format-version=2", "include-xids=1",
                                                "add-tables=public.bench_cdc"], strict=True) for a in pair]  # fmt: skip
    argv = cluster.command("pg_recvlogical", "-h", "127.0.0.1", "-p", str(cluster.port), "-U", "postgres",
                           "-d", "postgres", "--slot", slot, "--start", "-f", "-", "-s", "1", *options)  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, user=cluster.user)
    arrived: dict[int, float] = {}
    committed: dict[int, float] = {}

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.perf_counter()
            msg = json.loads(line)
            if msg.get("action") == "I":
                payload = json.loads(next(c["value"] for c in msg["columns"] if c["name"] == "payload"))
                arrived[payload["seq"]] = now

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        time.sleep(1.0)  # the stream is up
        count = int(rate * seconds)
        start = time.perf_counter()
        for seq in range(count):
            due = start + seq / rate
            time.sleep(max(0.0, due - time.perf_counter()))
            with Session(engine) as s, s.begin():
                s.add(CdcDeleted(aggregate_type="order", aggregate_id=str(seq % 100), event_type="OrderPaid",
                                 payload={**PAYLOAD, "seq": seq}, headers=HEADERS))  # fmt: skip
            committed[seq] = time.perf_counter()
        deadline = time.monotonic() + 30
        while len(arrived) < count and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)
        reader.join(5)
        Slot(engine, slot).drop()
    missing = set(committed) - set(arrived)
    assert not missing, f"{len(missing)} events never arrived"
    return [(arrived[s] - committed[s]) * 1000 for s in committed]


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cdc", description=__doc__.splitlines()[0])
    parser.add_argument("--transactions", type=int, default=2000, help="producer: transactions per row")
    parser.add_argument("--decode-events", type=int, default=20_000, help="decode throughput: events")
    parser.add_argument(
        "--rate", type=float, default=200.0, help="decode latency: one-event commits per second"
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="decode latency: how long")
    args = parser.parse_args(argv)
    with logical_cluster() as cluster:
        engine = create_engine(cluster.url, pool_size=4)
        Base.metadata.create_all(engine)
        try:
            print("| what | figure |\n|---|---|")
            for per_tx, transactions in ((1, args.transactions), (10, max(1, args.transactions // 5))):
                for label, model in (("polling outbox", Polled), ("CDC, insert then delete", CdcDeleted),
                                     ("CDC, rows kept", CdcKept)):  # fmt: skip
                    produce(engine, model, max(1, transactions // 10), per_tx)  # warm-up
                    rate, wal = produce(engine, model, transactions, per_tx)
                    print(f"| producer, session.add, {per_tx} event(s)/tx, {label} | {rate:,.0f} events/s, "
                          f"{wal:,.0f} WAL bytes/event |")  # fmt: skip
            done, wal = drain_wal(engine)
            print(f"| polling outbox: a dispatcher's claims and finalizes (batch 50) of those {done:,} events | "
                  f"{wal:,.0f} WAL bytes/event |")  # fmt: skip
            for plugin, rate in decode_throughput(engine, args.decode_events, 10).items():
                print(f"| decode throughput, {args.decode_events:,} events in tx of 10, {plugin} "
                      f"(pg_logical_slot_get_*changes) | {rate:,.0f} events/s |")  # fmt: skip
            lat = decode_latency(cluster, engine, args.rate, args.seconds)
            print(f"| decode latency, commit → pg_recvlogical line (wal2json), {args.rate:g} commits/s for "
                  f"{args.seconds:g} s | p50 {_pct(lat, 50):.1f} ms, p99 {_pct(lat, 99):.1f} ms, "
                  f"max {max(lat):.1f} ms |")  # fmt: skip
        finally:
            engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
