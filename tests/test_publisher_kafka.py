"""The Kafka publisher against librdkafka's mock cluster: outbox row → dispatcher → Kafka → a second client.

No Kafka broker can be installed on these machines. librdkafka (bundled in the confluent-kafka wheel) has a
built-in *mock cluster*: in-process brokers that listen on real 127.0.0.1 TCP ports and speak the Kafka
protocol (metadata, idempotent producer ids and sequences, produce with acks, fetch). The publisher talks to it
over TCP like to any cluster, and a separate ``Consumer`` reads what arrived. Faults come from the mock's own
C API (``rd_kafka_mock_*``, called through ctypes on the librdkafka the wheel loaded): brokers set down, error
codes pushed onto the next produce requests, a topic's metadata error, a slower round trip. What the mock does
not prove is listed in docs/kafka.md.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import multiprocessing
import os
import threading
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

import confluent_kafka
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
from sqlalchemy import Engine

from sa_outbox import DestinationUnavailable, Dispatcher, Message, NoAnswer, PermanentError, RetryableError
from sa_outbox.errors import ConfigurationError
from sa_outbox.inbox import message_id_from_kafka
from sa_outbox.models import OutboxEvent
from sa_outbox.publishers import kafka as kafka_publisher
from sa_outbox.publishers.kafka import KafkaPublisher, KafkaRecord
from sa_outbox.testing import drain

from .factories import FAST, Runner
from .helpers import row, seed_events, statuses

CLOSED = "127.0.0.1:1"  # nothing listens on port 1

# Kafka protocol numbers used below.
PRODUCE = 0  # ApiKey of ProduceRequest
UNKNOWN_TOPIC_OR_PART = 3
MESSAGE_TOO_LARGE = 10
INVALID_TOPIC = 17
NOT_ENOUGH_REPLICAS = 19
TOPIC_AUTHORIZATION_FAILED = 29
CLUSTER_AUTHORIZATION_FAILED = 31
POLICY_VIOLATION = 44
OUT_OF_ORDER_SEQUENCE_NUMBER = 45
INVALID_RECORD = 87


# --- the mock cluster, driven through librdkafka's own C API --------------------------------------------


def _librdkafka() -> ctypes.CDLL:
    """The librdkafka that confluent_kafka loaded (the wheel bundles its own copy: find it in our maps)."""
    import confluent_kafka.cimpl  # noqa: F401  (loads the library)

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "librdkafka" in line}
    assert paths, "confluent_kafka did not load a librdkafka"
    lib = ctypes.CDLL(sorted(paths)[0])
    vp, i32, i16 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int16
    signatures: dict[str, tuple[Any, list[Any]]] = {
        "rd_kafka_conf_new": (vp, []),
        "rd_kafka_conf_set": (ctypes.c_int, [vp, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]),
        "rd_kafka_new": (vp, [ctypes.c_int, vp, ctypes.c_char_p, ctypes.c_size_t]),
        "rd_kafka_destroy": (None, [vp]),
        "rd_kafka_mock_cluster_new": (vp, [vp, ctypes.c_int]),
        "rd_kafka_mock_cluster_destroy": (None, [vp]),
        "rd_kafka_mock_cluster_bootstraps": (ctypes.c_char_p, [vp]),
        "rd_kafka_mock_broker_set_down": (ctypes.c_int, [vp, i32]),
        "rd_kafka_mock_broker_set_up": (ctypes.c_int, [vp, i32]),
        "rd_kafka_mock_broker_set_rtt": (ctypes.c_int, [vp, i32, ctypes.c_int]),
        "rd_kafka_mock_partition_set_leader": (ctypes.c_int, [vp, ctypes.c_char_p, i32, i32]),
        "rd_kafka_mock_topic_create": (ctypes.c_int, [vp, ctypes.c_char_p, ctypes.c_int, ctypes.c_int]),
        "rd_kafka_mock_topic_set_error": (None, [vp, ctypes.c_char_p, ctypes.c_int]),
        "rd_kafka_mock_push_request_errors_array": (None, [vp, i16, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int)]),
    }  # fmt: skip
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


class MockKafka:
    """A librdkafka mock cluster of ``brokers`` brokers (ids 1..n) on 127.0.0.1, destroyed by :meth:`close`."""

    lib = _librdkafka()

    def __init__(self, brokers: int = 3) -> None:
        self.brokers = brokers
        conf, err = self.lib.rd_kafka_conf_new(), ctypes.create_string_buffer(512)
        self.lib.rd_kafka_conf_set(conf, b"log_level", b"0", err, len(err))
        self._rk = self.lib.rd_kafka_new(0, conf, err, len(err))  # a handle to own the cluster, never used
        assert self._rk, err.value
        self._cluster = self.lib.rd_kafka_mock_cluster_new(self._rk, brokers)
        assert self._cluster
        self.bootstraps: str = self.lib.rd_kafka_mock_cluster_bootstraps(self._cluster).decode()

    def create_topic(self, topic: str, partitions: int) -> None:
        assert (
            self.lib.rd_kafka_mock_topic_create(self._cluster, topic.encode(), partitions, self.brokers) == 0
        )

    def all_down(self) -> None:
        """Every broker disconnects its clients and refuses new connections."""
        for b in range(1, self.brokers + 1):
            assert self.lib.rd_kafka_mock_broker_set_down(self._cluster, b) == 0

    def leader(self, topic: str, partition: int, broker: int) -> None:
        assert (
            self.lib.rd_kafka_mock_partition_set_leader(self._cluster, topic.encode(), partition, broker) == 0
        )

    def broker_down(self, broker: int) -> None:
        assert self.lib.rd_kafka_mock_broker_set_down(self._cluster, broker) == 0

    def all_up(self) -> None:
        for b in range(1, self.brokers + 1):
            assert self.lib.rd_kafka_mock_broker_set_up(self._cluster, b) == 0

    def slow(self, rtt_ms: int) -> None:
        """Every broker answers ``rtt_ms`` later."""
        for b in range(1, self.brokers + 1):
            assert self.lib.rd_kafka_mock_broker_set_rtt(self._cluster, b, rtt_ms) == 0

    def fail_next_produce_requests(self, *codes: int) -> None:
        """The next ``len(codes)`` ProduceRequests, on any broker, are answered with these error codes."""
        array = (ctypes.c_int * len(codes))(*codes)
        self.lib.rd_kafka_mock_push_request_errors_array(self._cluster, PRODUCE, len(codes), array)

    def topic_error(self, topic: str, code: int) -> None:
        """Metadata requests for ``topic`` answer with this error code."""
        self.lib.rd_kafka_mock_topic_set_error(self._cluster, topic.encode(), code)

    def close(self) -> None:
        self.lib.rd_kafka_mock_cluster_destroy(self._cluster)
        self.lib.rd_kafka_destroy(self._rk)


@pytest.fixture
def kafka() -> Iterator[MockKafka]:
    cluster = MockKafka(3)
    yield cluster
    cluster.close()


@dataclasses.dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: dict[str, Any]
    headers: dict[str, str]
    raw_headers: list[tuple[str, bytes]]


def read_topic(bootstraps: str, topic: str, *, timeout: float = 20.0) -> list[Record]:
    """Every record of every partition of ``topic``, read by a second client up to each partition's end."""
    consumer = Consumer({
        "bootstrap.servers": bootstraps, "group.id": f"reader-{uuid.uuid4().hex[:8]}",
        "enable.auto.commit": False, "enable.partition.eof": True, "log_level": 0,
    })  # fmt: skip
    try:
        meta = consumer.list_topics(topic, timeout=10)
        partitions = sorted(meta.topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        records: list[Record] = []
        at_end: set[int] = set()
        deadline = time.monotonic() + timeout
        while at_end != set(partitions):
            assert time.monotonic() < deadline, f"did not reach the end of {topic} in {timeout}s"
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                assert err.code() == KafkaError._PARTITION_EOF, err
                at_end.add(msg.partition())
                continue
            at_end.discard(msg.partition())
            raw = list(msg.headers() or [])
            # the consumer side's helper finds the de-duplication key the publisher wrote
            assert message_id_from_kafka(msg) == dict(raw)["message_id"].decode()
            records.append(Record(msg.topic(), msg.partition(), msg.offset(), msg.key(),
                                  json.loads(msg.value()), {k: v.decode() for k, v in raw}, raw))  # fmt: skip
        return records
    finally:
        consumer.close()


def partitions_of(bootstraps: str, topic: str) -> int:
    consumer = Consumer({"bootstrap.servers": bootstraps, "group.id": "meta", "log_level": 0})
    try:
        return len(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
    finally:
        consumer.close()


def message(
    i: int, *, aggregate: str = "a-1", payload: Any = None, headers: Mapping[str, str] | None = None,
    aggregate_type: str = "order",
) -> Message:  # fmt: skip
    """A claimed message as the dispatcher builds it; with ``headers`` also when Message has no such field yet."""
    fields = {
        "id": i, "message_id": str(i), "aggregate_type": aggregate_type, "aggregate_id": aggregate,
        "event_type": "OrderPaid", "payload": {"n": i} if payload is None else payload, "attempts": 1,
        "lease_version": 1, "created_at": datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC),
    }  # fmt: skip
    if "headers" in {f.name for f in dataclasses.fields(Message)}:
        return Message(**fields, headers=dict(headers or {}))  # type: ignore[call-arg,unused-ignore]
    if headers is None:
        return Message(**fields)

    @dataclasses.dataclass(frozen=True)
    class WithHeaders(Message):  # until Message carries its own ``headers`` (issue #19 §2)
        headers: Mapping[str, str] = dataclasses.field(default_factory=dict)

    return WithHeaders(**fields, headers=dict(headers))


def connected(pub: KafkaPublisher, m: Message) -> None:
    """Publish ``m`` until it goes through (15 s at most). A new producer's first call also connects and
    fetches metadata and a producer id: on a busy machine that can outlast a test's short ``timeout``."""
    deadline = time.monotonic() + 15
    while (result := pub.publish_many([m])) != [None]:
        assert time.monotonic() < deadline, result


def dispatch(engine: Engine, publisher: Any, **kw: Any) -> Dispatcher:
    d = Dispatcher(engine, OutboxEvent, publisher, listen=False, backoff=FAST, **kw)
    drain(d)
    return d


# --- end to end through the dispatcher ------------------------------------------------------------------


def test_dispatcher_delivers_every_message_once_keyed_by_aggregate_with_outbox_headers(
    engine: Engine, kafka: MockKafka
) -> None:
    seed_events(engine, 30)  # aggregates agg-0 … agg-29, one event each
    seed_events(engine, 10, aggregate="agg-7", start=30)
    pub = KafkaPublisher(kafka.bootstraps)
    dispatch(engine, pub)
    pub.close()
    assert statuses(engine) == {"done": 40}

    records = read_topic(kafka.bootstraps, "outbox.event.order")  # default topic: prefix + aggregate type
    assert sorted(int(r.headers["message_id"]) for r in records) == list(range(1, 41))  # each exactly once
    for r in records:
        assert r.key is not None and r.key.decode() == r.value["aggregate_id"]
        assert r.value["message_id"] == r.headers["message_id"]
        assert r.headers["event-type"] == "E" and r.headers["aggregate-type"] == "order"
        assert r.headers["aggregate-id"] == r.value["aggregate_id"]
        assert r.headers["lease-version"] == "1" and r.headers["attempts"] == "1"
        assert r.value["payload"] == {"n": int(r.headers["message_id"]) - 1}
    # The key picks the partition the way Java clients do (murmur2): Debezium/Kafka Connect producers writing
    # the same aggregate land in the same partition.
    count = partitions_of(kafka.bootstraps, "outbox.event.order")
    assert count > 1
    assert all(r.partition == confluent_kafka.murmur2(r.key, count) for r in records if r.key is not None)


def test_ordered_mode_keeps_each_aggregates_order_within_its_partition(
    engine: Engine, kafka: MockKafka
) -> None:
    kafka.create_topic("orders", 4)
    aggregates = [f"agg-{k}" for k in range(8)]
    for round_ in range(6):  # interleaved: agg-0, agg-1, … agg-7, agg-0, …
        for k, aggregate in enumerate(aggregates):
            seed_events(engine, 1, aggregate=aggregate, start=round_ * 8 + k)
    pub = KafkaPublisher(kafka.bootstraps, topic="orders")
    dispatch(engine, pub, ordered=True, batch=5)
    pub.close()
    assert statuses(engine) == {"done": 48}

    records = read_topic(kafka.bootstraps, "orders")
    assert len(records) == 48
    by_aggregate: dict[str, list[Record]] = {}
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        by_aggregate.setdefault(r.value["aggregate_id"], []).append(r)
    assert sorted(by_aggregate) == aggregates
    assert len({r.partition for r in records}) > 1  # the aggregates really are spread over partitions
    for aggregate, rs in by_aggregate.items():
        assert len({r.partition for r in rs}) == 1, f"{aggregate} is split over partitions"
        ids = [int(r.value["message_id"]) for r in rs]  # in log (offset) order
        assert ids == sorted(ids), f"{aggregate} out of order in its partition: {ids}"


def test_async_dispatcher_runs_the_publisher_in_a_thread(
    engine: Engine, async_url: Any, kafka: MockKafka
) -> None:
    seed_events(engine, 12)
    pub = KafkaPublisher(kafka.bootstraps, topic=lambda m: f"events.{m.event_type}")
    runner = Runner("async", engine, async_url)
    try:
        assert runner.drain(runner.dispatcher(pub, batch=5)) == 12
    finally:
        runner.close()
        pub.close()
    assert statuses(engine) == {"done": 12}
    assert len(read_topic(kafka.bootstraps, "events.E")) == 12


# --- the batch form ---------------------------------------------------------------------------------------


def test_publish_many_waits_for_every_delivery_report_and_reports_per_message(kafka: MockKafka) -> None:
    pub = KafkaPublisher(kafka.bootstraps, topic="batch", config={"message.max.bytes": 10_000})
    batch = [message(i, aggregate=f"a-{i % 7}") for i in range(1, 201)]
    batch[50] = message(51, payload="x" * 20_000)  # over message.max.bytes: refused before producing
    started = time.monotonic()
    results = pub.publish_many(batch)
    elapsed = time.monotonic() - started
    pub.close()
    assert len(results) == 200
    assert isinstance(results[50], PermanentError)
    assert [i for i, r in enumerate(results) if r is not None] == [50]
    records = read_topic(kafka.bootstraps, "batch")
    assert sorted(int(r.headers["message_id"]) for r in records) == [i for i in range(1, 201) if i != 51]
    assert elapsed < 5.0  # one wait for all reports, not 200 round trips in a row


def test_dispatcher_hands_a_claimed_batch_to_publish_many(engine: Engine, kafka: MockKafka) -> None:
    seed_events(engine, 25)
    calls: list[int] = []

    class Counting(KafkaPublisher):
        def publish(self, message: Message) -> None:
            raise AssertionError("the dispatcher uses the batch form")

        def publish_many(self, messages: Any) -> list[BaseException | None]:
            calls.append(len(messages))
            return super().publish_many(messages)

    pub = Counting(kafka.bootstraps, topic="claimed")
    dispatch(engine, pub, batch=10)
    pub.close()
    assert calls == [10, 10, 5]
    assert statuses(engine) == {"done": 25}
    assert len(read_topic(kafka.bootstraps, "claimed")) == 25


def test_threads_sharing_one_publisher_each_get_their_own_reports(kafka: MockKafka) -> None:
    """Whichever thread polls serves every thread's delivery reports; each call still waits for its own."""
    pub = KafkaPublisher(kafka.bootstraps, topic="shared")
    results: dict[int, list[BaseException | None]] = {}

    def send(t: int) -> None:
        results[t] = pub.publish_many([message(t * 100 + i, aggregate=f"a-{i}") for i in range(50)])

    threads = [threading.Thread(target=send, args=(t,)) for t in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    pub.close()
    assert sorted(results) == [1, 2, 3, 4] and all(r == [None] * 50 for r in results.values())
    assert len(read_topic(kafka.bootstraps, "shared")) == 200


def test_message_headers_travel_as_kafka_headers_after_the_outbox_metadata(kafka: MockKafka) -> None:
    pub = KafkaPublisher(kafka.bootstraps, topic="hdrs")
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    pub.publish(message(1, headers={"traceparent": trace, "message_id": "forged", "tenant": "ü"}))
    pub.close()
    (r,) = read_topic(kafka.bootstraps, "hdrs")
    assert r.headers["traceparent"] == trace and r.headers["tenant"] == "ü"
    # The outbox's own names cannot be overridden by an application header of the same name.
    assert [v for k, v in r.raw_headers if k == "message_id"] == [b"1"]


# --- failures ---------------------------------------------------------------------------------------------


def test_no_reachable_broker_is_destination_unavailable_for_every_message_of_a_batch() -> None:
    pub = KafkaPublisher(CLOSED, topic="t", timeout=1.0)
    started = time.monotonic()
    results = pub.publish_many([message(i) for i in range(1, 6)])
    elapsed = time.monotonic() - started
    assert all(isinstance(r, DestinationUnavailable) for r in results), results
    assert "127.0.0.1:1" in str(results[0])
    assert elapsed < 2.0  # one deadline for the whole batch
    with pytest.raises(DestinationUnavailable):
        pub.publish(message(6))
    pub.close()


def test_unreachable_cluster_under_the_dispatcher_refunds_attempts_and_keeps_messages(engine: Engine) -> None:
    seed_events(engine, 3)
    pub = KafkaPublisher(CLOSED, timeout=0.5)
    d = Dispatcher(engine, OutboxEvent, pub, listen=False, backoff=FAST)
    assert d.run_once() >= 1
    pub.close()
    for i in (1, 2, 3):
        r = row(engine, "outbox", i)
        assert r.status == "pending" and r.attempts == 0
    assert (
        "DestinationUnavailable: no Kafka broker reachable at 127.0.0.1:1"
        in row(engine, "outbox", 1).last_error
    )


def test_all_brokers_down_is_destination_unavailable_then_delivered_once_back(kafka: MockKafka) -> None:
    pub = KafkaPublisher(kafka.bootstraps, topic="outage", timeout=1.5)
    connected(pub, message(1))
    kafka.all_down()
    started = time.monotonic()
    results = pub.publish_many([message(i) for i in range(2, 6)])
    assert time.monotonic() - started < 3.0
    assert all(isinstance(r, DestinationUnavailable) for r in results), results
    kafka.all_up()
    deadline = time.monotonic() + 20
    while (results := pub.publish_many([message(i) for i in range(2, 6)])) != [None] * 4:
        assert time.monotonic() < deadline, results  # the client reconnects with its own backoff
    pub.close()
    ids = sorted(int(r.headers["message_id"]) for r in read_topic(kafka.bootstraps, "outage"))
    assert set(ids) == {1, 2, 3, 4, 5}  # (2-5 may be there twice: a timed-out batch may still have gone out)


def test_an_outage_longer_than_the_retry_budget_kills_nothing_and_keeps_order(
    engine: Engine, kafka: MockKafka
) -> None:
    """Issue #19 §1 on Kafka: with every broker down, the dispatcher's attempts are refunded (not one row
    dead after twice ``max_attempts`` claims) and each aggregate's order survives the outage."""
    aggregates = [f"agg-{k}" for k in range(4)]

    def seed(round_: int) -> None:
        for k, aggregate in enumerate(aggregates):
            seed_events(engine, 1, aggregate=aggregate, start=round_ * 4 + k)

    seed(0)
    pub = KafkaPublisher(kafka.bootstraps, topic="outage-ordered", timeout=0.5)
    d = Dispatcher(engine, OutboxEvent, pub, listen=False, backoff=FAST, ordered=True, max_attempts=2)
    deadline = time.monotonic() + 15
    while statuses(engine) != {"done": 4}:  # connected and delivering before the outage
        assert time.monotonic() < deadline
        d.run_once()
    kafka.all_down()
    seed(1)
    seed(2)
    for _ in range(4):  # explicit calls claim even while the circuit is open
        d.run_once()
    with engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT status, attempts FROM outbox WHERE id > 4").all()
    assert {tuple(r) for r in rows} == {("pending", 0)}
    kafka.all_up()
    deadline = time.monotonic() + 20
    while statuses(engine) != {"done": 12}:
        assert time.monotonic() < deadline, statuses(engine)
        d.run_once()
    pub.close()
    by_aggregate: dict[str, list[int]] = {}
    for r in sorted(read_topic(kafka.bootstraps, "outage-ordered"), key=lambda r: (r.partition, r.offset)):
        ids = by_aggregate.setdefault(r.value["aggregate_id"], [])
        if int(r.value["message_id"]) not in ids:  # a timed-out publish may have gone out twice
            ids.append(int(r.value["message_id"]))
    assert by_aggregate == {a: [k + 1, k + 5, k + 9] for k, a in enumerate(aggregates)}


def test_one_unreachable_partition_leader_spends_attempts_once_the_grace_is_over(
    kafka: MockKafka, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lost broker connection counts as an outage (attempt refunded) only for a grace period: a partition
    whose leader stays unreachable while the other brokers answer is this message's failure, which must spend
    attempts and end dead, not be refunded forever with the circuit held open (hostile review)."""
    monkeypatch.setattr(kafka_publisher, "_DROP_GRACE", 1.0)
    kafka.create_topic("one-leader", 1)
    kafka.leader("one-leader", 0, 1)
    pub = KafkaPublisher(kafka.bootstraps, topic="one-leader", timeout=0.5)
    connected(pub, message(1))
    kafka.broker_down(1)  # the partition's leader; brokers 2 and 3 stay up
    first = pub.publish_many([message(2)])[0]  # within the grace: refunded, or a plain retry
    time.sleep(1.5)
    later = [pub.publish_many([message(i)])[0] for i in (3, 4)]
    pub.close()
    assert isinstance(first, RetryableError), first
    assert [type(r) for r in later] == [NoAnswer, NoAnswer], later


def test_a_lost_connection_counts_as_an_outage_only_for_the_grace(
    kafka: MockKafka, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The classification itself, on librdkafka's own error values: after a _TRANSPORT error with no broker
    answering since, an unreported message is an outage for _DROP_GRACE, then this message's failure."""
    monkeypatch.setattr(kafka_publisher, "_DROP_GRACE", 0.3)
    pub = KafkaPublisher(kafka.bootstraps, topic="grace", timeout=0.5)
    connected(pub, message(1))  # a broker answered: up
    pub._on_error(KafkaError(KafkaError._TRANSPORT))
    assert type(pub._unreported()) is DestinationUnavailable
    time.sleep(0.4)
    assert type(pub._unreported()) is NoAnswer  # it was sticky: refunded forever
    pub.close()


def test_slow_cluster_is_retryable_and_bounded_by_one_deadline_for_the_batch(kafka: MockKafka) -> None:
    pub = KafkaPublisher(kafka.bootstraps, topic="slow", timeout=1.0)
    connected(pub, message(1))  # the cluster answers
    kafka.slow(3000)
    started = time.monotonic()
    results = pub.publish_many([message(i, aggregate=f"a-{i}") for i in range(2, 22)])
    elapsed = time.monotonic() - started
    pub.close()
    assert all(type(r) is NoAnswer for r in results), results  # brokers reachable: not an outage
    assert "no delivery report" in str(results[0])
    assert 0.9 < elapsed < 2.0  # one deadline, not 20 waits in a row


def test_oversize_message_is_permanent_naming_both_sizes_and_the_limit_matches_librdkafkas(
    kafka: MockKafka,
) -> None:
    limit = 4_000
    pub = KafkaPublisher(kafka.bootstraps, topic="sizes", config={"message.max.bytes": limit})

    def size(n: int) -> int | None:
        try:
            return pub.check_size(pub.record(message(1, payload="x" * n)))
        except PermanentError:
            return None

    fits = max(n for n in range(3_000, limit) if size(n) is not None)
    assert size(fits) == limit  # each payload character is one byte of the record: the largest fits exactly
    with pytest.raises(PermanentError) as refused:
        pub.publish(message(2, payload="x" * (fits + 1)))
    assert "4,001 bytes" in str(refused.value) and "message.max.bytes of 4,000 bytes" in str(refused.value)
    assert pub.publish_many([message(1, payload="x" * fits)]) == [None]  # librdkafka takes the largest one
    pub.close()

    class Unchecked(KafkaPublisher):  # librdkafka's own check, one byte over: the computations agree
        def check_size(self, record: KafkaRecord) -> int:
            return 0

    raw = Unchecked(kafka.bootstraps, topic="sizes", config={"message.max.bytes": limit})
    with pytest.raises(PermanentError, match="MSG_SIZE_TOO_LARGE"):
        raw.publish(message(3, payload="x" * (fits + 1)))
    raw.close()
    assert [int(r.headers["message_id"]) for r in read_topic(kafka.bootstraps, "sizes")] == [1]


def test_oversize_message_under_the_dispatcher_goes_dead(engine: Engine, kafka: MockKafka) -> None:
    seed_events(engine, 2)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE outbox SET payload = to_jsonb(repeat('x', 5000)) WHERE id = 2")
    pub = KafkaPublisher(kafka.bootstraps, topic="big", config={"message.max.bytes": 2_000})
    dispatch(engine, pub)
    pub.close()
    assert statuses(engine) == {"done": 1, "dead": 1}
    assert "PermanentError: message 2 is" in row(engine, "outbox", 2).last_error


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (MESSAGE_TOO_LARGE, PermanentError),  # the broker's or the topic's limit is below the producer's
        (INVALID_TOPIC, PermanentError),
        (TOPIC_AUTHORIZATION_FAILED, PermanentError),
        (POLICY_VIOLATION, PermanentError),
        (INVALID_RECORD, PermanentError),
        (CLUSTER_AUTHORIZATION_FAILED, DestinationUnavailable),  # no write to this cluster at all
    ],
)
def test_broker_errors_in_delivery_reports_map_onto_failure_classes(
    kafka: MockKafka, code: int, expected: type[BaseException]
) -> None:
    pub = KafkaPublisher(kafka.bootstraps, topic=lambda m: "refused" if m.id == 2 else "fine", timeout=3.0)
    connected(pub, message(1))
    kafka.fail_next_produce_requests(code)
    (result,) = pub.publish_many([message(2)])
    assert type(result) is expected, result
    # The producer goes on (librdkafka remembers an unauthorized topic, so the check uses another one).
    assert pub.publish_many([message(3)]) == [None]
    pub.close()


def test_a_partition_without_enough_replicas_is_retryable(kafka: MockKafka) -> None:
    pub = KafkaPublisher(kafka.bootstraps, topic="isr", timeout=1.0)
    connected(pub, message(1))
    kafka.fail_next_produce_requests(*[NOT_ENOUGH_REPLICAS] * 200)  # librdkafka retries it until the deadline
    (result,) = pub.publish_many([message(2)])
    pub.close()
    assert type(result) is NoAnswer, result  # (librdkafka retried until the deadline: no verdict)


def test_a_topic_the_cluster_does_not_have_is_retryable_not_an_outage(kafka: MockKafka) -> None:
    kafka.topic_error("missing", UNKNOWN_TOPIC_OR_PART)  # as a cluster with auto.create.topics.enable=false
    pub = KafkaPublisher(kafka.bootstraps, topic="missing", timeout=2.0)  # never delivered anything yet
    started = time.monotonic()
    (result,) = pub.publish_many([message(1)])
    assert time.monotonic() - started < 2.5
    pub.close()
    assert type(result) is RetryableError and "does not exist" in str(result), result


def test_unauthorized_topic_under_the_dispatcher_goes_dead_and_others_are_delivered(
    engine: Engine, kafka: MockKafka
) -> None:
    seed_events(engine, 2, event_type="Secret")
    seed_events(engine, 2, event_type="Open", start=2)
    kafka.topic_error("ev.Secret", TOPIC_AUTHORIZATION_FAILED)
    pub = KafkaPublisher(kafka.bootstraps, topic=lambda m: f"ev.{m.event_type}")
    dispatch(engine, pub)
    pub.close()
    assert statuses(engine) == {"dead": 2, "done": 2}
    assert "TOPIC_AUTHORIZATION_FAILED" in row(engine, "outbox", 1).last_error
    assert len(read_topic(kafka.bootstraps, "ev.Open")) == 2


def test_fatal_idempotence_error_is_retryable_and_the_next_call_gets_a_fresh_producer(
    kafka: MockKafka,
) -> None:
    pub = KafkaPublisher(kafka.bootstraps, topic="fatal", timeout=3.0)
    connected(pub, message(1))
    kafka.fail_next_produce_requests(OUT_OF_ORDER_SEQUENCE_NUMBER)  # the idempotent producer cannot go on
    (result,) = pub.publish_many([message(2)])
    assert type(result) is RetryableError and "fatal" in str(result), result
    assert pub.publish_many([message(2), message(3)]) == [None, None]
    pub.close()
    assert {int(r.headers["message_id"]) for r in read_topic(kafka.bootstraps, "fatal")} >= {1, 2, 3}


def test_a_bad_topic_fails_only_its_own_message(kafka: MockKafka) -> None:
    def topic(m: Message) -> str:
        if m.id == 2:
            raise LookupError("no route for message 2")
        return "no spaces allowed" if m.id == 3 else "good"

    pub = KafkaPublisher(kafka.bootstraps, topic=topic)
    results = pub.publish_many([message(1), message(2), message(3), message(4)])
    pub.close()
    assert results[0] is None and results[3] is None
    assert isinstance(results[1], LookupError)
    assert isinstance(results[2], PermanentError) and "not a valid Kafka topic" in str(results[2])


def test_options_that_would_break_the_delivery_guarantee_are_refused() -> None:
    for config in (
        {"enable.idempotence": False},
        {"acks": 1},
        {"transactional.id": "x"},
        {"bootstrap.servers": "elsewhere:9092"},
        {"no.such.setting": 1},
    ):
        with pytest.raises(ConfigurationError):
            KafkaPublisher(CLOSED, config=config)
    with pytest.raises(ConfigurationError):
        KafkaPublisher(CLOSED, timeout=0)


def test_close_frees_the_producer_and_a_later_publish_starts_a_new_one(kafka: MockKafka) -> None:
    pub = KafkaPublisher(kafka.bootstraps, topic="reopen", timeout=1.0)
    connected(pub, message(1))
    kafka.slow(3000)
    assert type(pub.publish_many([message(2)])[0]) is NoAnswer  # left in flight
    started = time.monotonic()
    pub.close()  # flushes within timeout, then drops what is left: never waits for the 3 s answer
    assert time.monotonic() - started < 2.0
    pub.close()  # idempotent
    kafka.slow(0)
    connected(pub, message(3))
    pub.close()
    assert {1, 3} <= {int(r.headers["message_id"]) for r in read_topic(kafka.bootstraps, "reopen")}


def _publish_in_child(pub: KafkaPublisher) -> None:
    os._exit(0 if pub.publish_many([message(2)]) == [None] else 1)


def test_a_forked_child_publishes_with_a_producer_of_its_own(kafka: MockKafka) -> None:
    """librdkafka's threads do not survive fork(): a child using its parent's producer would never get a
    delivery report, and freeing that producer would wait for threads the child does not have."""
    pub = KafkaPublisher(kafka.bootstraps, topic="forked", timeout=3.0)
    pub.publish(message(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a threaded process (Python 3.12+)
        child = multiprocessing.get_context("fork").Process(target=_publish_in_child, args=(pub,))
        child.start()
    child.join(15)
    assert child.exitcode == 0
    pub.publish(message(3))  # the parent's producer is untouched
    pub.close()
    assert sorted(int(r.headers["message_id"]) for r in read_topic(kafka.bootstraps, "forked")) == [1, 2, 3]
