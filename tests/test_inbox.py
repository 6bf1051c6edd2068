"""The transactional inbox: duplicates (sequential and concurrent) apply once; a crash leaves no record."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, ClassVar

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from sa_outbox import ConfigurationError, PayloadError, Receipt, receive
from sa_outbox.inbox import (
    HEAD_PREFIX,
    message_id_from_amqp,
    message_id_from_http,
    message_id_from_nats,
    message_id_from_redis,
    purge_inbox,
)
from sa_outbox.models import Inbox

from .commit_order import backend_pid, wait_until_waiting_or_done
from .models import Order


def _apply(engine: Engine, message_id: str, amount: int, *, fail: bool = False) -> Receipt:
    """A consumer: credit the order once per message, in one transaction with the inbox record."""
    with Session(engine) as s, s.begin():
        receipt = receive(s, Inbox, "billing", message_id, event_type="OrderPaid")
        if receipt:
            order = s.get(Order, 1, with_for_update=True)
            assert order is not None
            order.status = str(int(order.status) + amount)
            if fail:
                raise RuntimeError("consumer crashed after recording, before commit")
        return receipt


@pytest.fixture
def order(engine: Engine) -> Engine:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO orders (status) VALUES ('0')"))
    return engine


def _total(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT status FROM orders WHERE id = 1")).scalar_one())


def test_every_message_delivered_twice_and_some_three_times_concurrently_applies_once(order: Engine) -> None:
    engine = order
    for i in range(1, 21):
        assert _apply(engine, str(i), i) is Receipt.NEW
        assert _apply(engine, str(i), i) is Receipt.DUPLICATE
    results: list[Receipt] = []
    lock = threading.Lock()
    barrier = threading.Barrier(3)

    def racer(message_id: str) -> None:
        barrier.wait()
        r = _apply(engine, message_id, 1000)
        with lock:
            results.append(r)

    for message_id in ("race-1", "race-2", "race-3"):
        threads = [threading.Thread(target=racer, args=(message_id,)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        barrier.reset()
    assert results.count(Receipt.NEW) == 3 and results.count(Receipt.DUPLICATE) == 6
    assert _total(engine) == sum(range(1, 21)) + 3 * 1000


def test_crash_after_recording_leaves_no_inbox_row_and_the_redelivery_applies(order: Engine) -> None:
    engine = order
    with pytest.raises(RuntimeError):
        _apply(engine, "m-1", 5, fail=True)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM inbox")).scalar_one() == 0
    assert _total(engine) == 0
    assert _apply(engine, "m-1", 5) is Receipt.NEW
    assert _total(engine) == 5


def test_an_older_position_of_an_applied_aggregate_is_stale(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        assert receive(s, Inbox, "c", "12", aggregate="order-1", position=12) is Receipt.NEW
    with Session(engine) as s, s.begin():
        assert receive(s, Inbox, "c", "10", aggregate="order-1", position=10) is Receipt.STALE  # late publish
        assert receive(s, Inbox, "c", "12", aggregate="order-1", position=12) is Receipt.DUPLICATE
        assert receive(s, Inbox, "c", "13", aggregate="order-1", position=13) is Receipt.NEW
        assert receive(s, Inbox, "c", "5", aggregate="order-2", position=5) is Receipt.NEW
        assert (
            receive(s, Inbox, "other", "10", aggregate="order-1", position=10) is Receipt.NEW
        )  # per consumer


def test_a_duplicate_at_a_later_position_leaves_the_aggregates_head_where_it_was(engine: Engine) -> None:
    """A connector's replay redelivers message X at a later offset (the position): it is a duplicate, and
    writes nothing — the aggregate's head stays at X's first position, so message Y, between the two offsets
    and never applied, is new (before: the duplicate moved the head to 20 and Y was turned down as STALE)."""

    def head() -> int:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT position FROM inbox WHERE message_id = :h"),
                                    {"h": HEAD_PREFIX + "order-1"}).scalar_one())  # fmt: skip

    with Session(engine) as s, s.begin():
        assert receive(s, Inbox, "c", "X", aggregate="order-1", position=10) is Receipt.NEW
    with Session(engine) as s, s.begin():
        assert receive(s, Inbox, "c", "X", aggregate="order-1", position=20) is Receipt.DUPLICATE
    assert head() == 10
    with Session(engine) as s, s.begin():
        assert receive(s, Inbox, "c", "Y", aggregate="order-1", position=15) is Receipt.NEW
        assert receive(s, Inbox, "c", "W", aggregate="order-1", position=12) is Receipt.STALE
    assert head() == 15
    with engine.connect() as conn:  # the stale one left nothing
        assert conn.execute(text("SELECT count(*) FROM inbox WHERE message_id = 'W'")).scalar_one() == 0


def test_a_transaction_receiving_two_messages_of_an_aggregate_does_not_deadlock_with_one_receiving_one(
    engine: Engine,
) -> None:
    """T1 receives A then B of one aggregate in one transaction; T2 receives B meanwhile. Receipts queue on the
    aggregate's head row before they touch a record, so T2 waits for T1 and reports B a duplicate. (With the
    record written first, T2 held B's record and waited on the head while T1 waited on B's record: a deadlock,
    5 of 5 rounds in a review.)"""
    from sqlalchemy import create_engine

    other = create_engine(engine.url, connect_args={"application_name": "inbox_t2"})
    results: list[Any] = []
    done = threading.Event()

    def t2() -> None:
        try:
            with Session(other) as s, s.begin():
                results.append(receive(s, Inbox, "c", "B", aggregate="X", position=2))
        except Exception as exc:  # a deadlock would land here
            results.append(exc)
        finally:
            done.set()

    try:
        with Session(engine) as s1:
            s1.begin()
            assert receive(s1, Inbox, "c", "A", aggregate="X", position=1) is Receipt.NEW
            thread = threading.Thread(target=t2)
            thread.start()
            assert wait_until_waiting_or_done(engine, "inbox_t2", done, backend_pid(s1))  # on the head
            assert receive(s1, Inbox, "c", "B", aggregate="X", position=2) is Receipt.NEW
            s1.commit()
        thread.join(30)
    finally:
        other.dispose()
    assert results == [Receipt.DUPLICATE], results


ISOLATION_LEVELS = ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"]


def _is_serialization_failure(exc: OperationalError) -> bool:
    return getattr(exc.orig, "sqlstate", None) == "40001"


def _consume(
    engine: Engine,
    isolation: str,
    message_id: str,
    *,
    position: int | None = None,
    between: Any = None,
    app: str = "inbox_consumer",
    attempts: list[str] | None = None,
) -> Receipt:
    """A consumer at ``isolation``: its transaction reads first (so its snapshot is taken), then ``between``
    runs (another consumer commits, or nothing), then it receives. A serialization failure is retried as
    PostgreSQL requires at REPEATABLE READ and SERIALIZABLE; ``attempts`` records each try's outcome."""
    bind = engine.execution_options(isolation_level=isolation)
    for _ in range(5):
        try:
            with Session(bind) as s, s.begin():
                s.execute(text("SELECT set_config('application_name', :a, true)"), {"a": app})
                s.execute(text("SELECT count(*) FROM inbox"))  # the snapshot of REPEATABLE READ is taken here
                if between is not None:
                    between()
                    between = None
                aggregate = None if position is None else "order-1"
                receipt = receive(s, Inbox, "c", message_id, aggregate=aggregate, position=position)
            if attempts is not None:
                attempts.append(receipt.value)
            return receipt
        except OperationalError as exc:
            if not _is_serialization_failure(exc):
                raise
            if attempts is not None:
                attempts.append("serialization failure")
    raise AssertionError("still failing after 5 attempts")


def _receive_committed(engine: Engine, message_id: str, position: int | None) -> None:
    with Session(engine) as s, s.begin():
        aggregate = None if position is None else "order-1"
        assert receive(s, Inbox, "c", message_id, aggregate=aggregate, position=position) is Receipt.NEW


@pytest.mark.parametrize("isolation", ISOLATION_LEVELS)
def test_stale_after_a_newer_position_committed_since_the_snapshot(engine: Engine, isolation: str) -> None:
    """The consumer's snapshot predates the commit of position 12; position 10 must not be applied: it is
    reported STALE (at REPEATABLE READ/SERIALIZABLE possibly after a serialization failure and a retry)."""
    attempts: list[str] = []
    receipt = _consume(engine, isolation, "10", position=10, between=lambda: _receive_committed(engine, "12", 12),
                       attempts=attempts)  # fmt: skip
    assert receipt is Receipt.STALE, attempts
    # READ COMMITTED reads the newest head; the other levels cannot, and fail instead of reading a stale one
    assert attempts == (["stale"] if isolation == "READ COMMITTED" else ["serialization failure", "stale"])
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM inbox WHERE message_id = '10'")).scalar_one() == 0


@pytest.mark.parametrize("isolation", ISOLATION_LEVELS)
@pytest.mark.parametrize(("message_id", "position", "expected"), [("10", 10, Receipt.STALE),
                                                                   ("12", 12, Receipt.DUPLICATE),
                                                                   ("m", None, Receipt.DUPLICATE)])  # fmt: skip
def test_a_receipt_waiting_on_a_concurrent_one_sees_its_outcome(
    engine: Engine, isolation: str, message_id: str, position: int | None, expected: Receipt
) -> None:
    """T1 records position 12 (or message m) and holds its transaction; T2, at each isolation level, took its
    snapshot before and waits in receive(); T1 commits. T2 must report STALE/DUPLICATE, never apply."""
    first = ("12", 12) if position is not None else ("m", None)
    results: list[Receipt] = []
    attempts: list[str] = []
    t2_started, t1_recorded, done = threading.Event(), threading.Event(), threading.Event()

    def snapshot_taken() -> None:
        t2_started.set()
        assert t1_recorded.wait(10)

    def t2() -> None:
        try:
            results.append(_consume(engine, isolation, message_id, position=position, between=snapshot_taken,
                                    app="inbox_t2", attempts=attempts))  # fmt: skip
        finally:
            done.set()

    with Session(engine) as s1:
        s1.begin()
        thread = threading.Thread(target=t2)
        thread.start()
        assert t2_started.wait(10)  # T2's snapshot is taken before T1 records anything
        aggregate = None if first[1] is None else "order-1"
        assert receive(s1, Inbox, "c", first[0], aggregate=aggregate, position=first[1]) is Receipt.NEW
        t1_recorded.set()
        # T2 waits on T1's record
        assert wait_until_waiting_or_done(engine, "inbox_t2", done, backend_pid(s1))
        s1.commit()
    thread.join(30)
    assert results == [expected], attempts
    retried = [] if isolation == "READ COMMITTED" else ["serialization failure"]
    assert attempts == [*retried, expected.value]


def test_purge_inbox_refuses_bad_options(engine: Engine) -> None:
    for batch_size in (0, -1, 1.5, True, "10"):
        with pytest.raises(ConfigurationError, match=r"batch_size must be an integer >= 1"):
            purge_inbox(engine, Inbox, older_than=60, batch_size=batch_size)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"older_than must be >= 0"):
        purge_inbox(engine, Inbox, older_than=-1)


def _incompressible(n: int) -> str:
    import random

    rnd = random.Random(n)
    return "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(n))


def test_receive_refuses_what_the_inbox_indexes_cannot_hold(engine: Engine) -> None:
    """(consumer, message_id) is the primary key: one btree entry of at most 2,704 bytes. Longer ids are a
    PayloadError naming the limit, before any SQL; the longest that fits is recorded."""
    with Session(engine) as s, s.begin():
        with pytest.raises(
            PayloadError,
            match=r"consumer and message_id are 2690 bytes together.*at most 2689 bytes.*pk_inbox",
        ):
            receive(s, Inbox, "c", _incompressible(2689))
        with pytest.raises(PayloadError, match=r"consumer and message_id are .* bytes together.*pk_inbox"):
            receive(s, Inbox, _incompressible(3000), "1")
        with pytest.raises(PayloadError, match=r"consumer and aggregate .*ix_inbox_position"):
            receive(s, Inbox, "c", "1", aggregate=_incompressible(3000), position=1)
        with pytest.raises(PayloadError, match=r"position must be between"):
            receive(s, Inbox, "c", "1", aggregate="a", position=2**63)
        with pytest.raises(PayloadError, match=r"position must be an integer"):
            receive(s, Inbox, "c", "1", aggregate="a", position=True)
        assert receive(s, Inbox, "c", _incompressible(2688)) is Receipt.NEW


def test_works_with_async_session(engine: Engine, async_url: URL) -> None:
    async def main() -> list[Receipt]:
        aengine = create_async_engine(async_url)
        out = []
        try:
            for _ in range(2):
                async with AsyncSession(aengine) as s, s.begin():
                    out.append(await s.run_sync(lambda ss: receive(ss, Inbox, "async", "42")))
            # with aggregate=: the receipt's savepoint inside the AsyncSession's transaction (a duplicate at a
            # later position, a stale one, a new one — and the caller's own row commits with them)
            for n, (message_id, position) in enumerate((("a", 10), ("a", 20), ("b", 5), ("c", 11))):
                async with AsyncSession(aengine) as s, s.begin():
                    out.append(await s.run_sync(
                        lambda ss: receive(ss, Inbox, "async", message_id, aggregate="o", position=position)))  # noqa: B023  # fmt: skip
                    await s.execute(text("INSERT INTO inbox (consumer, message_id) VALUES ('async-own', :m)"),
                                    {"m": f"own-{n}"})  # fmt: skip
        finally:
            await aengine.dispose()
        return out

    assert asyncio.run(main()) == [Receipt.NEW, Receipt.DUPLICATE,
                                   Receipt.NEW, Receipt.DUPLICATE, Receipt.STALE, Receipt.NEW]  # fmt: skip
    with engine.connect() as conn:
        own = conn.execute(text("SELECT count(*) FROM inbox WHERE consumer = 'async-own'")).scalar_one()
        head = conn.execute(text("SELECT position FROM inbox WHERE consumer = 'async' AND message_id = :h"),
                            {"h": HEAD_PREFIX + "o"}).scalar_one()  # fmt: skip
    assert (own, head) == (4, 11)


def test_bad_input_and_message_id_helpers(engine: Engine) -> None:
    with Session(engine) as s:
        with pytest.raises(PayloadError, match="non-empty"):
            receive(s, Inbox, "", "1")
        with pytest.raises(PayloadError, match="together"):
            receive(s, Inbox, "c", "1", aggregate="a")

    class Props:
        message_id = "77"

    class NatsMsg:
        headers: ClassVar[dict[str, str]] = {"Nats-Msg-Id": "78"}

    assert message_id_from_amqp(Props()) == "77"
    assert message_id_from_nats(NatsMsg()) == "78"
    assert message_id_from_redis({b"message_id": b"79"}) == "79"
    assert message_id_from_http({"idempotency-key": "80"}) == "80"
    with pytest.raises(PayloadError, match="Idempotency-Key"):
        message_id_from_http({})


def test_purge_inbox_keeps_the_window(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO inbox (consumer, message_id, received_at) "
                "SELECT 'c', g::text, now() - interval '10 days' FROM generate_series(1, 2500) g"
            )
        )
        conn.execute(text("INSERT INTO inbox (consumer, message_id) VALUES ('c', 'fresh')"))
    assert purge_inbox(engine, Inbox, older_than=7 * 86400, batch_size=1000) == 2500
    with engine.connect() as conn:
        assert conn.execute(text("SELECT message_id FROM inbox")).scalars().all() == ["fresh"]


def test_end_to_end_lost_lease_double_publish_applies_once(order: Engine) -> None:
    """outbox → dispatcher → RabbitMQ → consumer with the inbox. Dispatcher A's lease runs out mid-publish,
    B re-claims and publishes the same message: the broker holds two copies, the effect happens once."""
    import json
    import uuid

    import pika

    from sa_outbox import Dispatcher
    from sa_outbox.inbox import message_id_from_amqp
    from sa_outbox.models import OutboxEvent
    from sa_outbox.publishers.rabbitmq import RabbitMQPublisher

    from .helpers import claim, mark_done

    engine = order
    amqp = "amqp://guest:guest@127.0.0.1:5672/%2F"
    queue = f"inbox_e2e_{uuid.uuid4().hex[:6]}"
    conn = pika.BlockingConnection(pika.URLParameters(amqp))
    ch = conn.channel()
    ch.queue_declare(queue)
    try:
        with Session(engine) as s, s.begin():
            s.add(
                OutboxEvent(
                    aggregate_type="order", aggregate_id="1", event_type="OrderPaid", payload={"amount": 7}
                )
            )
        publisher = RabbitMQPublisher(amqp, routing_key=queue)
        # A claims with a short lease and publishes, then stalls past its lease before finalizing.
        [a] = claim(engine, "A", batch=1, lease=0.2)
        publisher.publish(a)
        time.sleep(0.3)
        # B rescues and re-claims (lease_version + 1) and publishes the same message again.
        b_dispatcher = Dispatcher(engine, OutboxEvent, publisher, listen=False)
        assert b_dispatcher.run_once() == 1
        assert mark_done(engine, a) is False  # A's late finalize is fenced off
        publisher.close()
        deliveries = []
        while True:
            method, props, body = ch.basic_get(queue, auto_ack=True)
            if method is None:
                break
            deliveries.append((message_id_from_amqp(props), json.loads(body)))
        assert [d[0] for d in deliveries] == ["1", "1"]  # the double publish really happened
        receipts = [_apply(engine, mid, body["payload"]["amount"]) for mid, body in deliveries]
        assert receipts == [Receipt.NEW, Receipt.DUPLICATE]
        assert _total(engine) == 7
    finally:
        ch.queue_delete(queue)
        conn.close()


def test_header_helpers_read_each_brokers_shape_and_receive_checks_headers(engine: Engine) -> None:
    import json
    from email.parser import BytesParser
    from types import SimpleNamespace

    from sa_outbox.inbox import (
        headers_from_amqp,
        headers_from_http,
        headers_from_mqtt,
        headers_from_nats,
        headers_from_redis,
        message_id_from_mqtt,
    )

    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert headers_from_amqp(SimpleNamespace(headers={"traceparent": tp.encode(), "n": 1})) == {
        "traceparent": tp, "n": "1"}  # fmt: skip
    assert headers_from_amqp(SimpleNamespace(headers=None)) == {}
    parsed = BytesParser().parsebytes("x-note: crème\r\n\r\n".encode())  # what js.get_msg hands out
    assert headers_from_nats(SimpleNamespace(headers={"x-note": parsed["x-note"]})) == {"x-note": "crème"}
    fields = {b"message_id": b"1", b"header:traceparent": tp.encode(), b"payload": b"{}"}
    assert headers_from_redis(fields) == {"traceparent": tp}
    assert headers_from_http({"Traceparent": tp}) == {"Traceparent": tp}
    v5 = SimpleNamespace(properties=SimpleNamespace(UserProperty=[("traceparent", tp)]), payload=b"{}")
    v311 = SimpleNamespace(properties=None, payload=json.dumps({"message_id": "5", "headers": {"a": "b"}}))
    structured = SimpleNamespace(properties=None, payload=json.dumps({"specversion": "1.0", "id": "6",
                                                                       "traceparent": tp}))  # fmt: skip
    assert headers_from_mqtt(v5) == {"traceparent": tp} and headers_from_mqtt(v311) == {"a": "b"}
    assert headers_from_mqtt(structured) == {"traceparent": tp}
    assert message_id_from_mqtt(v311) == "5" and message_id_from_mqtt(structured) == "6"
    with pytest.raises(PayloadError, match="no message_id"):
        message_id_from_mqtt(SimpleNamespace(properties=None, payload=b"not json"))
    with Session(engine) as s, pytest.raises(PayloadError, match="headers must be a mapping"):
        receive(s, Inbox, "c", "1", headers=["traceparent"])  # type: ignore[arg-type]
