"""Headers: written by every producer path, validated before any SQL, handed to publishers and handlers."""

from __future__ import annotations

import asyncio
import types
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import Engine, insert, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from sa_outbox import ClaimedJob, Message, PayloadError, emit, enqueue
from sa_outbox.models import Job, OutboxEvent

from .conftest import count_rows
from .helpers import claim, claim_jobs
from .test_producer import statement_log


def _stored(engine: Engine, table: str = "outbox") -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(text(f"SELECT headers FROM {table} ORDER BY id")).scalars())


def _event(agg: str = "A", **kw: Any) -> OutboxEvent:
    return OutboxEvent(aggregate_type="order", aggregate_id=agg, event_type="E", payload={}, **kw)


# --- every producer path writes them ------------------------------------------------------------------


def test_session_add_writes_headers_and_null_without_them(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        s.add(_event(headers={"x-tenant": "acme", "x-empty": ""}))
        s.add(_event())
    assert _stored(engine) == [{"x-tenant": "acme", "x-empty": ""}, None]


def test_events_with_headers_stay_on_the_one_statement_path(engine: Engine) -> None:
    with statement_log(engine) as seen, Session(engine) as s, s.begin():
        for n in range(1000):
            s.add(_event(f"agg-{n % 50}", headers={"n": str(n)} if n % 2 else None))
    inserts = [st for st in seen if st.lstrip().upper().startswith("INSERT")]
    assert len(inserts) == 1 and "unnest" in inserts[0], inserts
    stored = _stored(engine)
    assert stored[:3] == [None, {"n": "1"}, None] and stored[999] == {"n": "999"}


def test_emit_takes_call_wide_and_per_event_headers(engine: Engine) -> None:
    with statement_log(engine) as seen, Session(engine) as s, s.begin():
        ids = emit(
            s,
            OutboxEvent,
            [("order", "A", "E", {}), ("order", "A", "F", {}, {"x-b": "2", "x-a": "own"}), ("order", "B", "G", {}, None)],
            headers={"x-a": "1"},
        )  # fmt: skip
    assert ids == [1, 2, 3]
    assert _stored(engine) == [{"x-a": "1"}, {"x-a": "own", "x-b": "2"}, {"x-a": "1"}]
    assert sum(st.lstrip().upper().startswith("INSERT") for st in seen) == 1


def test_enqueue_and_a_job_added_directly_write_headers(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        enqueue(s, Job, "t", {}, headers={"x-request-id": "r1"})
        s.add(Job(task="t", payload={}, headers={"x-request-id": "r2"}))
        enqueue(s, Job, "t", {})
    assert _stored(engine, "jobs") == [{"x-request-id": "r1"}, {"x-request-id": "r2"}, None]


def test_session_insert_statement_writes_headers(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        s.execute(insert(OutboxEvent), [{"aggregate_type": "o", "aggregate_id": "1", "event_type": "E",
                                         "payload": {}, "headers": {"k": "v"}}])  # fmt: skip
    assert _stored(engine) == [{"k": "v"}]


def test_async_session_paths_write_headers(engine: Engine, async_url: URL) -> None:
    async def main() -> None:
        aengine = create_async_engine(async_url)
        async with AsyncSession(aengine) as s, s.begin():
            s.add(_event(headers={"a": "1"}))
            await emit(s, OutboxEvent, [("order", "B", "E", {}, {"b": "2"})])
            enqueue(s, Job, "t", {}, headers={"c": "3"})
        await aengine.dispose()

    asyncio.run(main())
    assert _stored(engine) == [{"a": "1"}, {"b": "2"}] and _stored(engine, "jobs") == [{"c": "3"}]


# --- validation: PayloadError naming the event or job, before any SQL, nothing written ----------------


BAD_HEADERS = [
    ({"x": 1}, "value of header 'x' must be a string"),
    ({1: "x"}, "header names must be strings"),
    ({"": "x"}, "header name must be non-empty"),
    ({"bad name": "x"}, "not a valid header name"),
    ({"bad\nname": "x"}, "not a valid header name"),
    ({"x": "line\r\nbreak"}, "control character"),
    ({"x": "nul\x00"}, "control character"),
    ({"X-Dup": "1", "x-dup": "2"}, "differ only in case"),
    ({"ce-id": "1"}, "reserved"),
    ({"Content-Length": "1"}, "reserved"),
    ({"x": "v" * 9000}, "over the limit of 8192 bytes"),
    (["not", "a", "mapping"], "headers must be a mapping"),
]


@pytest.mark.parametrize(("headers", "message"), BAD_HEADERS)
def test_bad_headers_are_refused_before_any_sql(engine: Engine, headers: Any, message: str) -> None:
    with statement_log(engine) as seen, Session(engine) as s:
        s.add(_event("ok"))
        s.add(
            OutboxEvent(
                aggregate_type="order", aggregate_id="A", event_type="Bad", payload={}, headers=headers
            )
        )
        with pytest.raises(PayloadError, match=message) as info:
            s.flush()
        assert "'Bad'" in str(info.value)  # names the event
        s.rollback()
    assert count_rows(engine, "outbox") == 0
    assert not [st for st in seen if "outbox" in st]


@pytest.mark.parametrize(("headers", "message"), BAD_HEADERS[:3])
def test_bad_headers_are_refused_by_emit_and_enqueue(engine: Engine, headers: Any, message: str) -> None:
    with Session(engine) as s, s.begin():
        with pytest.raises(PayloadError, match=message):
            emit(s, OutboxEvent, [("order", "A", "E", {}, headers)])
        with pytest.raises(PayloadError, match=message):
            emit(s, OutboxEvent, [("order", "A", "E", {})], headers=headers)
        with pytest.raises(PayloadError, match=rf"job 'mail'.*{message}"):
            enqueue(s, Job, "mail", {}, headers=headers)
    assert count_rows(engine, "outbox") == 0 and count_rows(engine, "jobs") == 0


def test_the_size_limit_is_a_model_setting(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(OutboxEvent, "sa_outbox_max_headers_bytes", 16)
    with Session(engine) as s:
        s.add(_event(headers={"k": "v" * 20}))
        with pytest.raises(PayloadError, match="over the limit of 16 bytes"):
            s.flush()


# --- what publishers and handlers get -----------------------------------------------------------------


def test_claimed_message_and_job_carry_read_only_headers_never_none(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        s.add(_event("A", headers={"k": "v"}))
        s.add(_event("B"))
        enqueue(s, Job, "t", {}, headers={"j": "1"})
        enqueue(s, Job, "t", {})
    with_headers, without = claim(engine, "me", 10, 30)
    assert isinstance(with_headers.headers, types.MappingProxyType) and dict(with_headers.headers) == {
        "k": "v"
    }
    assert isinstance(without.headers, types.MappingProxyType) and dict(without.headers) == {}
    with pytest.raises(TypeError):
        with_headers.headers["k"] = "changed"  # type: ignore[index]
    with engine.begin() as conn:
        jobs = claim_jobs(conn, "me", batch=10)
    assert [dict(j.headers) for j in jobs] == [{"j": "1"}, {}]
    assert all(isinstance(j.headers, types.MappingProxyType) for j in jobs)


def test_values_built_by_hand_get_a_read_only_mapping() -> None:
    now = datetime.now(UTC)
    m = Message(1, "1", "o", "1", "E", {}, 1, 1, now)
    assert isinstance(m.headers, types.MappingProxyType) and dict(m.headers) == {}
    given = {"k": "v"}
    m2 = Message(1, "1", "o", "1", "E", {}, 1, 1, now, headers=given)
    given["k"] = "changed"
    assert m2.headers == {"k": "v"} and isinstance(m2.headers, types.MappingProxyType)
    j = ClaimedJob(1, "t", "default", {}, 1, 3, 1, 0, now, headers={"a": "b"})
    assert isinstance(j.headers, types.MappingProxyType) and j.headers["a"] == "b"


def test_an_event_built_for_an_aggregate_takes_headers_set_afterwards(engine: Engine) -> None:
    from .models import Order

    with Session(engine, expire_on_commit=False) as s, s.begin():
        existing = Order(status="new")
        s.add(existing)
    with Session(engine) as s, s.begin():
        ev = OutboxEvent.for_aggregate(s.get(Order, existing.id), "Paid", {})
        ev.headers = {"x-tenant": "acme"}
        s.add(ev)
        new = Order(status="new")
        s.add(new)
        ev2 = OutboxEvent.for_aggregate(new, "Created", {})  # written after the ORM inserts the order
        ev2.headers = {"x-tenant": "globex"}
        s.add(ev2)
    assert _stored(engine) == [{"x-tenant": "acme"}, {"x-tenant": "globex"}]


# --- claimed rows become the same values as the dataclasses' own constructors ------------------------------

#: Every JSON shape a payload can have, as jsonb stores it: nested, unicode and escapes, big and negative
#: numbers, floats, and top-level scalars (a null payload is refused by enqueue; `null` text is tested below).
_PAYLOADS: list[Any] = [
    {"n": 1}, {}, [], {"a": [1, 2.5, None, True, False], "b": {"c": "d"}}, "text", 'quote " and \\ back',
    "日本語 ✓ \u0001", 12345678901234567890, -7, 0.1, 2.5e-7, True, [{"k": [[]]}],
]  # fmt: skip


def test_claimed_payloads_decode_as_json_loads_and_values_equal_the_constructors(engine: Engine) -> None:
    """from_row builds ClaimedJob/Message through their slot setters and reads ``jsonb`` text with json's own
    scanner: for every payload shape the value equals json.loads of the stored text, and each instance equals
    one the (frozen) constructor makes from the row's columns as the table holds them after the claim (every
    integer field a different value, so two setters swapped would show); it stays frozen, with read-only
    headers."""
    import dataclasses
    import json

    with Session(engine) as s, s.begin():
        for i, p in enumerate(_PAYLOADS):
            enqueue(
                s,
                Job,
                "t",
                p,
                headers={"h": str(i)} if i % 2 else None,
                priority=i + 100,
                max_attempts=50 + i,
            )
            s.add(OutboxEvent(aggregate_type="o", aggregate_id=str(i), event_type=f"E{i}", payload=p,
                              headers={"h": str(i)} if i % 2 else None))  # fmt: skip
    with engine.begin() as conn:  # attempts and lease_version apart from each other and from the ids
        conn.execute(text("UPDATE jobs SET attempts = 7 + id, lease_version = 30 + id"))
        conn.execute(text("UPDATE outbox SET attempts = 7 + id, lease_version = 30 + id"))
    with engine.begin() as conn:
        jobs = sorted(
            claim_jobs(conn, "w", batch=len(_PAYLOADS)), key=lambda j: j.id
        )  # (claimed by priority)
    events = claim(engine, "d", batch=len(_PAYLOADS), lease=30)
    with engine.connect() as conn:
        job_rows = conn.execute(text("SELECT *, payload::text AS stored FROM jobs ORDER BY id")).all()
        event_rows = conn.execute(text("SELECT *, payload::text AS stored FROM outbox ORDER BY id")).all()
    assert [j.payload for j in jobs] == [json.loads(r.stored) for r in job_rows] == _PAYLOADS
    assert [m.payload for m in events] == [json.loads(r.stored) for r in event_rows] == _PAYLOADS
    for i, (job, msg, jr, er) in enumerate(zip(jobs, events, job_rows, event_rows, strict=True)):
        headers = {"h": str(i)} if i % 2 else {}
        assert job == ClaimedJob(jr.id, jr.task, jr.queue, _PAYLOADS[i], jr.attempts, jr.max_attempts,
                                 jr.lease_version, jr.priority, jr.created_at, headers)  # fmt: skip
        assert (job.attempts, job.lease_version, job.max_attempts, job.priority) == (
            8 + job.id,
            31 + job.id,
            50 + i,
            100 + i,
        )
        assert msg == Message(er.id, str(er.id), er.aggregate_type, er.aggregate_id, er.event_type, _PAYLOADS[i],
                              er.attempts, er.lease_version, er.created_at, headers)  # fmt: skip
        assert (msg.attempts, msg.lease_version, msg.event_type) == (8 + msg.id, 31 + msg.id, f"E{i}")
        assert type(job.headers) is type(msg.headers) is types.MappingProxyType
        assert not job.cancel_requested
        with pytest.raises(dataclasses.FrozenInstanceError):
            job.payload = 1  # type: ignore[misc]
        with pytest.raises(dataclasses.FrozenInstanceError):
            msg.payload = 1  # type: ignore[misc]


def test_fast_built_values_keep_subclasses_replaced_loaders_and_the_outcome_defaults() -> None:
    """The fast paths step aside where they would differ: a subclass of ClaimedJob/Message is built by its own
    constructor (its fields and __post_init__ run); an application's replacement of ``json.loads`` is called,
    not bypassed by the scanner; a success's Outcome equals the dataclass's own, defaults included."""
    import dataclasses
    import json
    from decimal import Decimal

    from sa_outbox._messages import _json
    from sa_outbox._steps import Outcome, done_outcome

    now = datetime.now(UTC)

    @dataclasses.dataclass(frozen=True, slots=True)
    class TenantJob(ClaimedJob):
        tenant: str = "default"

        def __post_init__(self) -> None:
            object.__setattr__(self, "tenant", self.tenant.upper())

    job = TenantJob.from_row((1, 2, 3, 4, "t", "q", '{"a": 1}', 5, now, None, 0.0))
    assert (job.tenant, job.payload, job.attempts, job.lease_version) == ("DEFAULT", {"a": 1}, 3, 2)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Traced(Message):
        span: str = "none"

    msg = Traced.from_row((1, 2, 3, "o", "7", "E", "[1]", now, {"h": "v"}, 0.0))
    assert (msg.span, msg.payload, dict(msg.headers)) == ("none", [1], {"h": "v"})

    original = json.loads

    def decimals(text: str) -> Any:
        return original(text, parse_float=Decimal)

    json.loads = decimals  # type: ignore[assignment]
    try:
        assert _json('{"f": 10.10}', json.loads) == {"f": Decimal("10.10")}
    finally:
        json.loads = original
    assert _json('{"f": 10.10}', json.loads) == {"f": 10.1}
    assert done_outcome(4, 5, "done", '{"r": 1}') == Outcome(4, 5, "done", result='{"r": 1}')
    assert done_outcome(4, 5, "done") == Outcome(4, 5, "done")


def test_a_payload_json_loads_would_refuse_is_refused_the_same_way() -> None:
    """Text the scanner does not read to its end (surrounding whitespace, trailing data) goes to json.loads:
    decoded when json.loads decodes it, its own error when not; an engine's json_deserializer is used as is."""
    import json
    from decimal import Decimal

    from sa_outbox._messages import _json

    assert _json(' {"a": 1} ', json.loads) == {"a": 1}
    assert _json("null", json.loads) is None and _json(None, json.loads) is None
    for bad in ('{"a": 1} x', "{bad", "", "[1,]"):
        with pytest.raises(json.JSONDecodeError) as caught:
            _json(bad, json.loads)
        with pytest.raises(json.JSONDecodeError) as expected:
            json.loads(bad)
        assert str(caught.value) == str(expected.value)
    as_decimal = _json('{"f": 0.1}', lambda t: json.loads(t, parse_float=Decimal))
    assert as_decimal == {"f": Decimal("0.1")} and isinstance(as_decimal["f"], Decimal)
