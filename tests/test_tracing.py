"""W3C trace context and OpenTelemetry spans, recorded by the OTel SDK's in-memory exporter.

One trace from the request that writes the event, through the publish span (opened the way the dispatcher
opens it, around a real publish to a real broker), to a consumer that extracts the context from the
broker's headers and opens its own span.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pika
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from sqlalchemy import Engine, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from sa_outbox import Defer, Message, Receipt, RetryableError, emit, enqueue, receive
from sa_outbox._tracing import inject, process_span, publish_span, publish_spans
from sa_outbox.inbox import consume_span, headers_from_amqp, headers_from_nats
from sa_outbox.models import Inbox, Job, OutboxEvent
from sa_outbox.publishers.nats import NatsPublisher
from sa_outbox.publishers.rabbitmq import RabbitMQPublisher

from . import test_publishers as brokers
from .conftest import ROOT
from .helpers import claim, claim_jobs, mark_done
from .test_publishers import AMQP, NATS, _stream_messages

rabbit_queue, jetstream = brokers.rabbit_queue, brokers.jetstream

_EXPORTER = InMemorySpanExporter()
_INSTALLED: list[bool] = []


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The SDK's in-memory exporter on the global tracer provider (installed once per process)."""
    if not _INSTALLED:
        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            provider = TracerProvider()
            trace.set_tracer_provider(provider)
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        _INSTALLED.append(True)
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def tracer() -> Any:
    return trace.get_tracer("tests")


def _by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()}


def _traceparent(span: Any) -> str:
    """The traceparent the W3C propagator writes for ``span`` (its flags included)."""
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier["traceparent"]


def _ids(traceparent: str) -> tuple[int, int]:
    """(trace id, parent span id) of a traceparent header."""
    _, trace_id, span_id, _ = traceparent.split("-")
    return int(trace_id, 16), int(span_id, 16)


def _publish(pub: Any, message: Message) -> None:
    """What the dispatcher does for one message: the span around the publish, the outcome as a value."""
    with publish_span(message, publisher=pub) as span:
        try:
            pub.publish(message)
            error: BaseException | None = None
        except Exception as exc:
            error = exc
        span.outcome(error)
    assert error is None


# --- the producer writes the active span's context ------------------------------------------------------


def _with_tracestate() -> Any:
    """A context whose remote parent carries a tracestate (which its child spans inherit)."""
    return TraceContextTextMapPropagator().extract(
        {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tracestate": "vendor=1"}
    )


def test_every_producer_path_writes_the_active_spans_traceparent(
    engine: Engine, async_url: URL, spans: Any
) -> None:
    with (
        tracer().start_as_current_span("request", context=_with_tracestate()) as request,
        Session(engine) as s,
        s.begin(),
    ):
        s.add(OutboxEvent(aggregate_type="o", aggregate_id="1", event_type="E", payload={}))
        s.add(OutboxEvent(aggregate_type="o", aggregate_id="2", event_type="E", payload={},
                          headers={"x-tenant": "acme"}))  # fmt: skip
        s.add(OutboxEvent(aggregate_type="o", aggregate_id="3", event_type="E", payload={},
                          headers={"Traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}))  # fmt: skip
        emit(s, OutboxEvent, [("o", "4", "E", {})])
        enqueue(s, Job, "t", {})
    expected = _traceparent(request)
    expected_state = "vendor=1"

    async def in_async_session() -> None:
        aengine = create_async_engine(async_url)
        with tracer().start_as_current_span("async request") as span:
            async with AsyncSession(aengine) as s, s.begin():
                s.add(OutboxEvent(aggregate_type="o", aggregate_id="5", event_type="E", payload={}))
                await emit(s, OutboxEvent, [("o", "6", "E", {})])
            async_expected.append(_traceparent(span))
        await aengine.dispose()

    async_expected: list[str] = []
    asyncio.run(in_async_session())
    with Session(engine) as s, s.begin():  # no span: no trace headers
        s.add(OutboxEvent(aggregate_type="o", aggregate_id="7", event_type="E", payload={}))
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT headers FROM outbox ORDER BY id")).scalars().all()
        job = conn.execute(text("SELECT headers FROM jobs")).scalar_one()
    assert [r and r.get("traceparent") for r in rows[:2]] == [expected, expected]
    assert rows[0] == {"traceparent": expected, "tracestate": expected_state}
    assert rows[1]["x-tenant"] == "acme"
    # kept whole: no tracestate of the request's span next to the application's own traceparent
    assert rows[2] == {"Traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    context_headers = {"traceparent": expected, "tracestate": expected_state}
    assert rows[3] == context_headers and job == context_headers
    assert rows[4] == rows[5] == {"traceparent": async_expected[0]}
    assert rows[6] is None


# --- one trace: request → publish → broker → consumer ---------------------------------------------------


def test_one_trace_from_the_request_through_rabbitmq_to_the_consumer(
    engine: Engine, rabbit_queue: Any, spans: Any
) -> None:
    exchange, (ch, queue) = rabbit_queue
    with tracer().start_as_current_span("POST /orders") as request, Session(engine) as s, s.begin():
        s.add(OutboxEvent(aggregate_type="order", aggregate_id="7", event_type="OrderPaid", payload={"n": 1}))
    (message,) = claim(engine, "dispatcher-1", 10, 30)
    pub = RabbitMQPublisher(AMQP, exchange=exchange, routing_key="order.x")
    _publish(pub, message)
    pub.close()
    assert mark_done(engine, message)

    _, props, _ = ch.basic_get(queue, auto_ack=True)
    headers = headers_from_amqp(props)
    consumer_span = consume_span(headers, consumer="billing", message_id=props.message_id, destination=queue)
    with consumer_span, Session(engine) as s, s.begin():
        assert receive(s, Inbox, "billing", props.message_id, headers=headers)
        with tracer().start_as_current_span("apply"):
            pass

    got = _by_name(spans)
    publish, consumer, apply = got[f"publish {exchange}"], got[f"process {queue}"], got["apply"]
    trace_id = request.get_span_context().trace_id
    assert {s.context.trace_id for s in got.values()} == {trace_id}  # one trace
    assert publish.parent is not None and publish.parent.span_id == request.get_span_context().span_id
    assert consumer.parent is not None and consumer.parent.span_id == publish.context.span_id
    assert apply.parent is not None and apply.parent.span_id == consumer.context.span_id
    assert publish.kind == SpanKind.PRODUCER and consumer.kind == SpanKind.CONSUMER
    attributes = dict(publish.attributes or {})
    assert {k: attributes.get(k) for k in ("messaging.system", "messaging.destination.name",
            "messaging.message.id", "messaging.operation", "sa_outbox.attempt")} == {
        "messaging.system": "rabbitmq", "messaging.destination.name": exchange,
        "messaging.message.id": "1", "messaging.operation": "publish", "sa_outbox.attempt": 1,
    }  # fmt: skip
    assert (consumer.attributes or {})["sa_outbox.inbox.receipt"] == "new"
    assert publish.status.status_code == StatusCode.UNSET
    # The broker got the publish span's context, the row keeps the request's.
    assert _ids(headers["traceparent"]) == (trace_id, publish.context.span_id)
    assert dict(message.headers) == {"traceparent": _traceparent(request)}


def test_a_batch_publish_gives_each_message_its_own_span_and_context(
    engine: Engine, jetstream: tuple[str, str], spans: Any
) -> None:
    stream, prefix = jetstream
    requests = []
    for n in range(2):
        with tracer().start_as_current_span(f"request {n}") as request, Session(engine) as s, s.begin():
            s.add(OutboxEvent(aggregate_type="order", aggregate_id=str(n), event_type="E", payload={}))
        requests.append(request.get_span_context())
    messages = claim(engine, "dispatcher-1", 10, 30)
    pub = NatsPublisher(NATS, subject_prefix=prefix)  # publishes on its own event loop thread
    with publish_spans(messages, publisher=pub) as batch:
        errors = pub.publish_many(messages)
        batch.outcomes(errors)
    pub.close()
    assert errors == [None, None]
    published = sorted((s for s in spans.get_finished_spans() if s.name.startswith("publish ")),
                       key=lambda s: dict(s.attributes or {})["messaging.message.id"])  # fmt: skip
    delivered = [headers_from_nats(m)["traceparent"] for m in _stream_messages(stream)]
    for request, span, traceparent in zip(requests, published, delivered, strict=True):
        assert span.parent is not None and span.parent.span_id == request.span_id
        assert span.context.trace_id == request.trace_id
        assert _ids(traceparent) == (request.trace_id, span.context.span_id)
        assert (span.attributes or {})["messaging.destination.name"] == f"{prefix}.E"


# --- retries link; outcomes; jobs -----------------------------------------------------------------------


def _message(attempts: int, headers: dict[str, str]) -> Message:
    return Message(1, "1", "o", "1", "E", {}, attempts, attempts, datetime.now(UTC), headers=headers)


def test_a_retry_links_to_the_producer_instead_of_continuing_its_trace(spans: Any) -> None:
    with tracer().start_as_current_span("request") as request:
        producer = {"traceparent": _traceparent(request)}
    with publish_span(_message(1, producer), system="x", destination="d"):
        pass
    with publish_span(_message(3, producer), system="x", destination="d"):
        pass
    first, retry = [s for s in spans.get_finished_spans() if s.name == "publish d"]
    assert first.parent is not None and first.parent.span_id == request.get_span_context().span_id
    assert retry.parent is None and retry.context.trace_id != request.get_span_context().trace_id
    assert [link.context.span_id for link in retry.links] == [request.get_span_context().span_id]


def test_publish_outcomes_errors_defer_and_exceptions(spans: Any) -> None:
    with publish_span(_message(1, {}), system="x", destination="failed") as span:
        span.outcome(RetryableError("broker said no"))
    with publish_span(_message(1, {}), system="x", destination="deferred") as span:
        span.outcome(Defer(5, "later"))
    with pytest.raises(RuntimeError), publish_span(_message(1, {}), system="x", destination="raised"):
        raise RuntimeError("boom")
    got = _by_name(spans)
    failed, deferred, raised = got["publish failed"], got["publish deferred"], got["publish raised"]
    assert failed.status.status_code == StatusCode.ERROR and "broker said no" in (
        failed.status.description or ""
    )
    assert (failed.attributes or {})["error.type"] == "RetryableError"
    assert [e.name for e in failed.events] == ["exception"]
    assert (
        deferred.status.status_code == StatusCode.UNSET and (deferred.attributes or {})["sa_outbox.deferred"]
    )
    assert raised.status.status_code == StatusCode.ERROR and [e.name for e in raised.events] == ["exception"]


def test_process_span_continues_the_enqueuing_request_and_records_failures(
    engine: Engine, spans: Any
) -> None:
    with tracer().start_as_current_span("request") as request, Session(engine) as s, s.begin():
        enqueue(s, Job, "send_email", {}, queue="mail")
    with engine.begin() as conn:
        (job,) = claim_jobs(conn, "worker-1", queue="mail")
    with pytest.raises(ValueError), process_span(job):
        with tracer().start_as_current_span("handler work"):
            pass
        raise ValueError("bad address")
    got = _by_name(spans)
    process, work = got["process mail"], got["handler work"]
    assert process.parent is not None and process.parent.span_id == request.get_span_context().span_id
    assert work.parent is not None and work.parent.span_id == process.context.span_id
    assert process.kind == SpanKind.CONSUMER and process.status.status_code == StatusCode.ERROR
    assert {k: (process.attributes or {})[k] for k in ("messaging.system", "messaging.destination.name",
            "messaging.message.id", "messaging.operation", "sa_outbox.task")} == {
        "messaging.system": "sa_outbox", "messaging.destination.name": "mail", "messaging.message.id": str(job.id),
        "messaging.operation": "process", "sa_outbox.task": "send_email"}  # fmt: skip


def test_receive_without_a_consumer_span_records_a_receive_span_in_the_producers_trace(
    engine: Engine, spans: Any
) -> None:
    with tracer().start_as_current_span("request") as request:
        headers = {"traceparent": _traceparent(request)}
    with Session(engine) as s, s.begin():
        assert receive(s, Inbox, "billing", "42", headers=headers)
        assert not receive(s, Inbox, "billing", "42", headers=headers)
    new, duplicate = [s for s in spans.get_finished_spans() if s.name == "receive billing"]
    for span in (new, duplicate):
        assert span.parent is not None and span.parent.span_id == request.get_span_context().span_id
    assert [(s.attributes or {})["sa_outbox.inbox.receipt"] for s in (new, duplicate)] == ["new", "duplicate"]


def test_headers_that_are_not_utf_8_are_no_trace_context_and_never_fail_a_receipt(
    engine: Engine, spans: Any
) -> None:
    """A broker hands over bytes; a traceparent value or a header name that is not UTF-8 is ignored like a
    malformed one, never an error of the receipt (before: UnicodeDecodeError from receive on every delivery,
    so the message could never be consumed) — and a valid traceparent beside such a name is still found."""
    with tracer().start_as_current_span("request") as request:
        traceparent = _traceparent(request).encode()
    cases = [{b"traceparent": b"\xff\xfe00-bad"}, {b"\xff\xfename": b"x", b"traceparent": traceparent}]
    for i, headers in enumerate(cases):
        with Session(engine) as s, s.begin():
            assert receive(s, Inbox, "billing", f"bin-{i}", headers=headers) is Receipt.NEW
        with Session(engine) as s, s.begin():
            assert receive(s, Inbox, "billing", f"bin-{i}", headers=headers) is Receipt.DUPLICATE
    received = [s for s in spans.get_finished_spans() if s.name == "receive billing"]
    assert [(s.attributes or {})["messaging.message.id"] for s in received] == ["bin-1", "bin-1"], received
    assert all(
        s.parent is not None and s.parent.span_id == request.get_span_context().span_id for s in received
    )


def test_inject_uses_the_current_span_and_leaves_headers_alone_without_one(spans: Any) -> None:
    given = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "x": "1"}
    assert inject(dict(given)) == given
    with tracer().start_as_current_span("send") as span:
        assert inject({"TraceParent": "old", "x": "1"}) == {"x": "1", "traceparent": _traceparent(span)}


# --- without opentelemetry-api ----------------------------------------------------------------------------


def test_without_opentelemetry_every_hook_is_a_no_op(engine: Engine, db_url: URL) -> None:
    """A process where ``import opentelemetry`` fails: the producer writes no trace headers, the spans and
    inject() do nothing, publishers still copy headers."""
    code = f"""
import sys
sys.modules["opentelemetry"] = None  # ImportError on import, as when the package is absent
from datetime import UTC, datetime
from sqlalchemy import create_engine
from sqlalchemy.orm import Session
from sa_outbox import Message, _tracing, emit, receive
from sa_outbox.inbox import consume_span
from sa_outbox.models import Inbox, OutboxEvent
from sa_outbox.publishers._common import outgoing_headers
assert not _tracing.ENABLED
engine = create_engine({db_url.render_as_string(hide_password=False)!r})
with Session(engine) as s, s.begin():
    s.add(OutboxEvent(aggregate_type="nootel", aggregate_id="1", event_type="E", payload={{}}))
    emit(s, OutboxEvent, [("nootel", "2", "E", {{}}, {{"x": "1"}})])
    with consume_span({{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}, consumer="c"):
        assert receive(s, Inbox, "nootel", "1", headers={{"traceparent": "x"}})
m = Message(1, "1", "o", "1", "E", {{}}, 1, 1, datetime.now(UTC), headers={{"x": "1"}})
with _tracing.publish_span(m, system="s", destination="d") as span:
    span.outcome(RuntimeError("x"))
    assert _tracing.inject({{"a": "b"}}, m) == {{"a": "b"}}
    assert outgoing_headers(m) == {{"x": "1"}}
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT headers FROM outbox WHERE aggregate_type = 'nootel' ORDER BY id"))
        assert rows.scalars().all() == [None, {"x": "1"}]


def test_without_a_tracer_provider_a_job_still_passes_its_trace_context_on(
    engine: Engine, db_url: URL
) -> None:
    """OpenTelemetry installed, no provider configured (a process of its own: this module sets a global one).
    The loops then skip the spans of jobs without trace headers (they would record nothing), while a job that
    carries a traceparent still runs inside that context, so what its handler sends stays in the trace; and a
    message's traceparent goes out unchanged, also on a retry (whose non-recording span used to make inject()
    drop it: hostile review)."""
    code = f"""
import json
from opentelemetry import trace
from sqlalchemy import create_engine
from sqlalchemy.orm import Session
from sa_outbox import Worker, enqueue
from sa_outbox.models import Job
assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
engine = create_engine({db_url.render_as_string(hide_password=False)!r})
with Session(engine) as s, s.begin():
    enqueue(s, Job, "seen", {{"n": 1}}, queue="noprovider")
    enqueue(s, Job, "seen", {{"n": 2}}, queue="noprovider",
            headers={{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}})
seen = {{}}
def handler(job):
    seen[job.payload["n"]] = format(trace.get_current_span().get_span_context().trace_id, "032x")
worker = Worker(engine, Job, {{"seen": handler}}, queues=["noprovider"], listen=False)
worker.run(install_signal_handlers=False, until_idle=True)
# a retried message (its span links to the producer instead of continuing the trace) keeps its traceparent
from datetime import UTC, datetime
from sa_outbox import Message, _tracing
tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
for attempt in (1, 3):
    m = Message(1, "1", "o", "1", "E", {{}}, attempt, 1, datetime.now(UTC), headers={{"traceparent": tp}})
    with _tracing.publish_span(m, system="s", destination="d"):
        seen[f"publish {{attempt}}"] = _tracing.inject(dict(m.headers), m).get("traceparent")
    with _tracing.publish_spans([m], system="s", destination="d"):
        seen[f"publish_many {{attempt}}"] = _tracing.inject(dict(m.headers), m).get("traceparent")
print(json.dumps(seen))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert json.loads(out.stdout) == {
        "1": "0" * 32, "2": "0af7651916cd43dd8448eb211c80319c",
        "publish 1": tp, "publish_many 1": tp, "publish 3": tp, "publish_many 3": tp,
    }  # fmt: skip
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM jobs WHERE queue = 'noprovider'"))


def test_a_message_without_trace_headers_gets_a_root_consumer_span(
    engine: Engine, rabbit_queue: Any, spans: Any
) -> None:
    """A raw AMQP message published by someone else (no trace headers): the consumer span is a new root."""
    exchange, (ch, queue) = rabbit_queue
    ch.basic_publish(exchange, "order.x", json.dumps({}).encode(),
                     pika.BasicProperties(message_id=str(uuid.uuid4()), headers={"x": "1"}))  # fmt: skip
    _, props, _ = ch.basic_get(queue, auto_ack=True)
    span_of = consume_span(headers_from_amqp(props), consumer="billing", message_id=props.message_id)
    with span_of, Session(engine) as s, s.begin():
        assert receive(s, Inbox, "billing", props.message_id, headers=headers_from_amqp(props))
    (span,) = spans.get_finished_spans()
    assert span.name == "process billing" and span.parent is None


# --- the loops open the spans themselves ------------------------------------------------------------------


def test_the_dispatchers_and_workers_open_publish_and_process_spans_in_the_producers_trace(
    runner: Any, engine: Engine, spans: Any
) -> None:
    """End to end through real loops (sync and async): the publish span of each message and the process
    span of each job are children of the request span that wrote them; a failed publish is an ERROR span."""
    from sa_outbox import RetryableError, enqueue
    from sa_outbox.models import Job, OutboxEvent
    from sa_outbox.testing import RecordingPublisher

    with tracer().start_as_current_span("request") as request, Session(engine) as session, session.begin():
        session.add(OutboxEvent(aggregate_type="o", aggregate_id="1", event_type="Ok", payload={}))
        session.add(OutboxEvent(aggregate_type="o", aggregate_id="2", event_type="Fails", payload={}))
        enqueue(session, Job, "t", {})
    trace_id = request.get_span_context().trace_id
    pub = RecordingPublisher(fail=lambda m: RetryableError("no") if m.event_type == "Fails" else None)
    runner.run_once(runner.dispatcher(pub))
    runner.run_once(runner.worker({"t": lambda j: None}))
    finished = spans.get_finished_spans()
    publishes = [s for s in finished if s.name.startswith("publish")]
    processes = [s for s in finished if s.name.startswith("process")]
    assert len(publishes) == 2 and len(processes) == 1
    for span in publishes + processes:
        assert span.context.trace_id == trace_id and span.parent is not None
        assert span.parent.span_id == request.get_span_context().span_id
    statuses = sorted((s.attributes["messaging.message.id"], s.status.status_code.name) for s in publishes)
    assert statuses == [("1", "UNSET"), ("2", "ERROR")]
