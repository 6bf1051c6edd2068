"""The transactional inbox: duplicates (sequential and concurrent) apply once; a crash leaves no record."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import ClassVar

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from sa_outbox import PayloadError, Receipt, receive
from sa_outbox.inbox import (
    message_id_from_amqp,
    message_id_from_http,
    message_id_from_nats,
    message_id_from_redis,
    purge_inbox,
)
from sa_outbox.models import Inbox

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


def test_works_with_async_session(engine: Engine, async_url: URL) -> None:
    async def main() -> list[Receipt]:
        aengine = create_async_engine(async_url)
        out = []
        try:
            for _ in range(2):
                async with AsyncSession(aengine) as s, s.begin():
                    out.append(await s.run_sync(lambda ss: receive(ss, Inbox, "async", "42")))
        finally:
            await aengine.dispose()
        return out

    assert asyncio.run(main()) == [Receipt.NEW, Receipt.DUPLICATE]


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
