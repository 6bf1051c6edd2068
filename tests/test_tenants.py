"""A tenant's schema through SQLAlchemy's ``schema_translate_map``: the producer's rows and the loops' claims
stay in the tenant's tables (the library's own execution compiles each statement once per translate map, with
the tenant's schema written in)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from sa_outbox import AsyncDispatcher, AsyncWorker, Dispatcher, Worker, _execute, emit, enqueue
from sa_outbox import _steps as eng
from sa_outbox._db import LoopConnection
from sa_outbox.models import Base, Job, OutboxEvent
from sa_outbox.testing import RecordingPublisher

from .helpers import JOBS, fresh_schema

TENANT = "tenant_a"
MAP = {"schema_translate_map": {None: TENANT}}


@pytest.fixture
def tenant(engine: Engine) -> Iterator[Engine]:
    with fresh_schema(engine, TENANT):
        translated = engine.execution_options(**MAP)
        Base.metadata.create_all(translated)
        yield translated


def counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {f"{s}.{t}": conn.execute(text(f"SELECT count(*) FROM {s}.{t}")).scalar_one()
                for s in ("public", TENANT) for t in ("outbox", "jobs")}  # fmt: skip


def drain_async_worker(async_url: URL, handlers: dict[str, Any], *, engine_kwargs: Any = None,
                       options: dict[str, Any] | None = None, **worker: Any) -> None:  # fmt: skip
    """Run an AsyncWorker on its own async engine (``engine_kwargs`` for create_async_engine, ``options``
    as execution options) until nothing is left, then close both."""

    async def main() -> None:
        aengine = create_async_engine(async_url, **(engine_kwargs or {}))
        if options:
            aengine = aengine.execution_options(**options)
        w = AsyncWorker(aengine, Job, handlers, listen=False, **worker)
        try:
            await w.run(until_idle=True, install_signal_handlers=False)
        finally:
            await w.close()
            await aengine.dispose()

    asyncio.run(main())


def test_a_tenants_rows_and_claims_stay_in_its_schema(engine: Engine, tenant: Engine) -> None:
    with Session(tenant) as s, s.begin():
        s.add(OutboxEvent(aggregate_type="a", aggregate_id="t1", event_type="E", payload={}))
        emit(s, OutboxEvent, [("a", "t2", "E", {})])
        enqueue(s, Job, "t", {"who": "tenant"})
    with Session(engine) as s, s.begin():  # the default schema's own rows
        s.add(OutboxEvent(aggregate_type="a", aggregate_id="public", event_type="E", payload={}))
        enqueue(s, Job, "t", {"who": "public"})
    assert counts(engine) == {
        "public.outbox": 1,
        "public.jobs": 1,
        f"{TENANT}.outbox": 2,
        f"{TENANT}.jobs": 1,
    }

    publisher, seen = RecordingPublisher(), []
    Dispatcher(tenant, OutboxEvent, publisher, listen=False).run(
        until_idle=True, install_signal_handlers=False
    )
    Worker(tenant, Job, {"t": lambda j: seen.append(j.payload["who"])}, listen=False).run(
        until_idle=True, install_signal_handlers=False
    )
    assert sorted(m.aggregate_id for m in publisher.messages) == ["t1", "t2"] and seen == ["tenant"]
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT DISTINCT status FROM {TENANT}.outbox")).scalars().all() == ["done"]
        assert conn.execute(text("SELECT status FROM public.jobs")).scalars().all() == ["queued"]


def test_the_async_loops_and_producer_keep_to_the_tenants_schema(
    engine: Engine, tenant: Engine, async_url: URL
) -> None:
    async def main() -> tuple[list[str], list[str]]:
        aengine = create_async_engine(async_url).execution_options(**MAP)
        try:
            async with AsyncSession(aengine) as s, s.begin():
                s.add(OutboxEvent(aggregate_type="a", aggregate_id="t1", event_type="E", payload={}))
                await s.run_sync(lambda sync: enqueue(sync, Job, "t", {"who": "tenant"}))
            publisher, seen = RecordingPublisher(), []
            d = AsyncDispatcher(aengine, OutboxEvent, publisher, listen=False)
            await d.run(until_idle=True, install_signal_handlers=False)
            await d.close()

            async def handle(job: object) -> None:
                seen.append(job.payload["who"])  # type: ignore[attr-defined]

            w = AsyncWorker(aengine, Job, {"t": handle}, listen=False)
            await w.run(until_idle=True, install_signal_handlers=False)
            await w.close()
            return [m.aggregate_id for m in publisher.messages], seen
        finally:
            await aengine.dispose()

    with Session(engine) as s, s.begin():
        enqueue(s, Job, "t", {"who": "public"})
    assert asyncio.run(main()) == (["t1"], ["tenant"])
    assert counts(engine) == {
        "public.outbox": 0,
        "public.jobs": 1,
        f"{TENANT}.outbox": 1,
        f"{TENANT}.jobs": 1,
    }


def test_an_async_workers_sync_session_handler_completes_in_the_tenants_schema(
    engine: Engine, tenant: Engine, async_url: URL
) -> None:
    """A sync handler that takes a session runs on a sync engine the AsyncWorker builds: it carries the async
    engine's translate map, so the fenced completion lands on the tenant's job — not on the default schema's
    job with the same id and lease version."""
    from sqlalchemy import select

    with Session(tenant) as s, s.begin():
        enqueue(s, Job, "tx", {"who": "tenant"})
    with Session(engine) as s, s.begin():
        enqueue(s, Job, "tx", {"who": "public"})
    seen: list[tuple[str, int]] = []

    def handle(job: Job, session: Session) -> None:
        ids = (
            session.execute(select(Job.id).where(Job.payload["who"].as_string() == "tenant")).scalars().all()
        )
        seen.append((job.payload["who"], len(ids)))  # type: ignore[index]

    drain_async_worker(async_url, {"tx": handle}, options=MAP)
    assert seen == [("tenant", 1)]
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT status FROM {TENANT}.jobs")).scalars().all() == ["done"]
        assert conn.execute(text("SELECT status, lease_version FROM public.jobs")).all() == [("queued", 0)]


def test_an_async_worker_takes_the_sync_engine_it_is_given(engine: Engine, async_url: URL) -> None:
    from sqlalchemy import create_engine

    from sa_outbox.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="sync_engine must be a sync SQLAlchemy Engine"):
        AsyncWorker(create_async_engine(async_url), Job, {}, sync_engine="postgresql://x")  # type: ignore[arg-type]
    mine = create_engine(engine.url, connect_args={"application_name": "my-sync-handlers"})
    with Session(engine) as s, s.begin():
        enqueue(s, Job, "tx", {})
    names: list[str] = []

    def handle(job: Job, session: Session) -> None:
        names.append(session.execute(text("SELECT current_setting('application_name')")).scalar_one())

    drain_async_worker(async_url, {"tx": handle}, sync_engine=mine)
    assert names == ["my-sync-handlers"]
    with mine.connect() as conn:  # close() left the caller's engine alone
        assert conn.execute(text("SELECT 1")).scalar_one() == 1
    mine.dispose()


def test_an_async_worker_refuses_a_sync_engine_on_another_schema(
    engine: Engine, tenant: Engine, async_url: URL
) -> None:
    """A search_path in the async engine's connect_args is not in its URL: the sync engine built for session
    handlers would finalize in the default schema — marking there a job of the same id and lease version
    done. The worker compares the claimed row's table as both engines see it and stops with a clear error
    before the handler runs; nothing in either schema is completed."""
    from sqlalchemy import create_engine

    from sa_outbox.errors import ConfigurationError

    on_tenant = create_engine(engine.url, connect_args={"options": f"-c search_path={TENANT}"})
    try:
        with Session(on_tenant) as s, s.begin():
            enqueue(s, Job, "tx", {"who": "tenant"})
        with Session(engine) as s, s.begin():
            enqueue(s, Job, "tx", {"who": "public"})
        with engine.begin() as conn:  # the public job looks claimed by the same lease: the fence would match
            conn.execute(text("UPDATE public.jobs SET status = 'running', lease_version = 1"))
    finally:
        on_tenant.dispose()
    ran: list[int] = []

    def handle(job: Job, session: Session) -> None:
        ran.append(job.id)

    with pytest.raises(ConfigurationError, match="does not reach the jobs table"):
        drain_async_worker(
            async_url, {"tx": handle}, engine_kwargs={"connect_args": {"options": f"-c search_path={TENANT}"}}
        )
    assert ran == []
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT status FROM {TENANT}.jobs")).scalars().all() == ["queued"]
        assert conn.execute(text("SELECT status FROM public.jobs")).scalars().all() == ["running"]


def test_create_all_through_a_translate_map_tunes_the_tenants_tables_not_the_defaults(
    engine: Engine, tenant: Engine
) -> None:
    """The after_create hook names the table in text (ALTER TABLE … SET (autovacuum_…)): it must name the
    tenant's table. Before, it altered public's (and failed outright when public had none)."""

    def reloptions(schema: str) -> list[str]:
        with engine.connect() as conn:
            return conn.execute(
                text("SELECT coalesce(c.reloptions, '{}') FROM pg_class c JOIN pg_namespace n ON n.oid = "
                     "c.relnamespace WHERE n.nspname = :s AND c.relname = 'jobs'"), {"s": schema}
            ).scalar_one()  # fmt: skip

    assert any(o.startswith("autovacuum_vacuum_scale_factor") for o in reloptions(TENANT))
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE public.jobs RESET (autovacuum_vacuum_scale_factor)"))
    try:
        with engine.begin() as conn:
            conn.execute(text(f"DROP TABLE {TENANT}.jobs CASCADE"))
        Job.__table__.create(tenant)
        assert any(o.startswith("autovacuum_vacuum_scale_factor") for o in reloptions(TENANT))
        assert not any(o.startswith("autovacuum_vacuum_scale_factor") for o in reloptions("public"))
    finally:
        from sa_outbox.migration import set_queue_storage_parameters

        with engine.begin() as conn:
            set_queue_storage_parameters(conn, "jobs")


def test_status_and_doctor_read_the_tenants_table(engine: Engine, tenant: Engine) -> None:
    """queue_status's health and doctor's checks find the table by name in the catalog: the tenant's, not
    public's (before: public's figures and settings)."""
    from sa_outbox.doctor import doctor
    from sa_outbox.monitoring import queue_status

    with Session(tenant) as s, s.begin():
        for _ in range(5):
            enqueue(s, Job, "t", {})
    with engine.begin() as conn:
        conn.execute(text(f"ANALYZE {TENANT}.jobs"))
        conn.execute(text("ALTER TABLE public.jobs SET (autovacuum_enabled = false)"))
    try:
        status = queue_status(tenant, Job)
        assert status.counts["queued"] == 5 and status.health is not None and status.health.live_tuples == 5
        off = [f for f in doctor(tenant, [Job]) if f.check == "autovacuum" and f.table is not None]
        assert off == []  # public's jobs table has autovacuum off; the tenant's does not
    finally:
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE public.jobs RESET (autovacuum_enabled)"))


def test_doctors_index_fixes_name_the_tenants_table_and_mend_it(engine: Engine, tenant: Engine) -> None:
    """doctor's fix for a missing or INVALID index of a tenant's table is DDL on the tenant's table (before: an
    unqualified CREATE INDEX, which on the default search_path built public's index, or failed as a duplicate;
    the claim plan's fix analyzed public's table), and running the fix as written mends the finding."""
    from sa_outbox.doctor import doctor

    def index_findings(check: str = "indexes") -> list[Any]:
        return [f for f in doctor(tenant, [OutboxEvent]) if f.check == check]

    def run_fix(fix: str) -> None:
        for statement in fix.splitlines():  # one statement per line: CONCURRENTLY runs outside a transaction
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(text(statement))

    with engine.begin() as conn:
        conn.execute(text(f"DROP INDEX {TENANT}.ix_outbox_ready"))
    [missing] = index_findings()
    assert missing.status == "fail" and "ix_outbox_ready is missing" in missing.message
    assert f"ON {TENANT}.outbox" in missing.fix, missing.fix
    [plan] = index_findings("claim plan")  # without the index the claim reads the table
    assert plan.status == "fail" and plan.fix.endswith(f"ANALYZE {TENANT}.outbox"), plan
    run_fix(missing.fix)
    [ok] = index_findings()
    assert ok.status == "ok", ok
    [plan] = index_findings("claim plan")
    assert plan.status == "ok", plan

    with engine.begin() as conn:  # as a failed CREATE INDEX CONCURRENTLY leaves it
        conn.execute(text(f"UPDATE pg_index SET indisvalid = false "
                          f"WHERE indexrelid = CAST('{TENANT}.ix_outbox_aggregate' AS regclass)"))  # fmt: skip
    [invalid] = index_findings()
    assert invalid.status == "fail" and "INVALID" in invalid.message
    assert invalid.fix.splitlines()[0] == f"DROP INDEX CONCURRENTLY {TENANT}.ix_outbox_aggregate", invalid.fix
    run_fix(invalid.fix)
    [ok] = index_findings()
    assert ok.status == "ok", ok
    with engine.connect() as conn:  # public's own indexes untouched, valid
        assert conn.execute(text("SELECT bool_and(x.indisvalid) AND count(*) = 6 FROM pg_index x "
                                 "WHERE x.indrelid = CAST('public.outbox' AS regclass)")).scalar_one()  # fmt: skip


def test_a_tenants_partitioned_outbox_is_listed_and_maintained_in_its_schema(
    engine: Engine, tenant: Engine
) -> None:
    """Partition DDL and catalog lookups name the table in text: through a translate map they must name the
    tenant's. Before, list_partitions and maintain_partitions looked for the table in the default schema."""
    from sa_outbox import list_partitions, maintain_partitions
    from sa_outbox.models import model_for

    model = model_for("outbox", "tenant_parted_outbox", partitioned="day")
    model.__table__.create(tenant)  # its partitions come with it, in the tenant's schema
    with engine.connect() as conn:
        assert conn.execute(text("SELECT to_regclass('public.tenant_parted_outbox')")).scalar() is None
    parts = list_partitions(tenant, model)
    assert len(parts) >= 4 and {p.schema for p in parts} == {TENANT}
    report = maintain_partitions(tenant, model)
    assert report.errors == [] and report.created == []
    with Session(tenant) as s, s.begin():
        s.add(model(aggregate_type="a", aggregate_id="1", event_type="E", payload={}))
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {TENANT}.tenant_parted_outbox")).scalar_one() == 1
    # doctor's claim plan is EXPLAINed as text, and its partition indexes looked up by name: the tenant's
    # (before: "relation tenant_parted_outbox does not exist", raised out of doctor)
    from sa_outbox.doctor import doctor

    [plan] = [f for f in doctor(tenant, [model]) if f.check == "claim plan"]
    assert plan.status == "ok", plan


def recorder(ran: list[tuple[str, int]]) -> Any:
    """A handler that records each job's (who, i)."""
    return lambda job: ran.append((job.payload["who"], job.payload["i"]))


@contextlib.contextmanager
def tenant_schemas(engine: Engine, tenants: Sequence[str], *, jobs: int) -> Iterator[None]:
    """A schema of each tenant's own, with the tables and ``jobs`` jobs (payload: who, i); dropped after."""
    with contextlib.ExitStack() as stack:
        for name in tenants:
            stack.enter_context(fresh_schema(engine, name))
            placed = engine.execution_options(schema_translate_map={None: name})
            Base.metadata.create_all(placed)
            with Session(placed) as s, s.begin():
                for i in range(jobs):
                    enqueue(s, Job, "t", {"who": name, "i": i})
        yield


def claim_as(engine: Engine, tenant: str) -> list[Any]:
    """Two jobs claimed by a loop connection of ``tenant`` (through its translate map) on ``engine``."""
    loop = LoopConnection(engine.execution_options(schema_translate_map={None: tenant}), "jobs")
    try:
        return loop.run(lambda c: eng.claim(c, JOBS, owner="w", batch=2, queue="default"))
    finally:
        loop.drop()


def test_tenants_sharing_one_connection_take_the_direct_path_each_in_its_own_schema(engine: Engine) -> None:
    """A tenant's loop takes the library's own execution (prepared under its names, below psycopg's cursor) —
    on SQLAlchemy's regular path a tenant's worker spent 2-3× the client CPU per job at batch 1 — and what is
    compiled for one tenant is never sent for another: two tenants' loop connections take turns on one pooled
    connection (one server session), each claims only its own schema's jobs, and each statement is prepared
    once per tenant, naming that tenant's table. Their workers then drain their own schemas and no other."""
    one = create_engine(engine.url, pool_size=1, max_overflow=0)
    tenants = ("tenant_a", "tenant_b")
    try:
        with tenant_schemas(engine, tenants, jobs=6):
            claimed: dict[str, list[Any]] = {name: [] for name in tenants}
            for _ in range(2):  # turns on the one session: a, b, a, b
                for name in tenants:
                    claimed[name] += claim_as(one, name)
            with one.connect() as conn:
                prepared = (
                    conn.exec_driver_sql(
                        "SELECT statement FROM pg_prepared_statements WHERE starts_with(name, %(p)s)",
                        {"p": _execute._NAME_PREFIX},
                    )
                    .scalars()
                    .all()
                )
            for name in tenants:
                assert sorted(json.loads(r[6])["i"] for r in claimed[name]) == [0, 1, 2, 3], claimed
                assert {json.loads(r[6])["who"] for r in claimed[name]} == {name}, claimed
                assert [sql for sql in prepared if f"{name}.jobs" in sql] != [], prepared
            assert len(prepared) == 2 == len(set(prepared)), prepared  # one claim statement per tenant

            with (
                engine.begin() as conn
            ):  # the four claimed above: their leases as a crashed worker leaves them
                for name in tenants:
                    conn.execute(text(f"UPDATE {name}.jobs SET locked_at = now() - interval '1 hour'"))
            seen: dict[str, list[tuple[str, int]]] = {name: [] for name in tenants}
            for name in tenants:
                w = Worker(
                    engine.execution_options(schema_translate_map={None: name}), Job, {"t": recorder(seen[name])},
                    listen=False, batch=2,
                )  # fmt: skip
                w.run(until_idle=True, install_signal_handlers=False)
                w.close()
            with engine.connect() as conn:
                for name in tenants:
                    assert sorted(seen[name]) == [(name, i) for i in range(6)], seen
                    assert conn.execute(text(f"SELECT DISTINCT status FROM {name}.jobs")).scalars().all() == [
                        "done"
                    ]
    finally:
        one.dispose()


def test_many_tenants_through_one_process_keep_a_bounded_number_of_statements(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process serving many tenants through one pool: each tenant's statements are statements of their own,
    so the compiled ones are kept for the most recently used tenants only (``TRANSLATED_MAX``) and a session
    keeps at most ``PREPARED_MAX`` of them prepared, the least recently used deallocated — a hostile review
    served 500 tenants: 4,000 compiled statements (14 MB) and 1,300-1,570 prepared on one connection (120 MB
    of cached plans on the server), where SQLAlchemy's regular path had kept both bounded. Here with bounds
    of 3: four tenants take turns twice on one session, every claim still right."""
    monkeypatch.setattr(_execute, "PREPARED_MAX", 3)
    monkeypatch.setattr(_execute, "TRANSLATED_MAX", 3)
    one = create_engine(engine.url, pool_size=1, max_overflow=0)
    tenants = [f"tenant_{c}" for c in "wxyz"]
    try:
        with tenant_schemas(engine, tenants, jobs=4):
            claimed: dict[str, list[Any]] = {name: [] for name in tenants}
            for _ in range(2):
                for name in tenants:
                    claimed[name] += claim_as(one, name)
                    with one.connect() as conn:
                        prepared = conn.exec_driver_sql(
                            "SELECT count(*) FROM pg_prepared_statements WHERE starts_with(name, %(p)s)",
                            {"p": _execute._NAME_PREFIX},
                        ).scalar_one()
                    assert 1 <= prepared <= 3, prepared
                    assert len(_execute._TRANSLATED) <= 3
            for name in tenants:
                assert sorted(json.loads(r[6])["i"] for r in claimed[name]) == [0, 1, 2, 3], claimed
                assert {json.loads(r[6])["who"] for r in claimed[name]} == {name}, claimed
    finally:
        one.dispose()


def test_names_with_a_percent_sign_work_end_to_end(engine: Engine) -> None:
    """A schema and tables whose names hold ``%``: the DDL and catalog lookups that name a table in text quote
    it without the driver's ``%%`` (before: ``create_all`` failed — ALTER TABLE "out%%box", the name doubled
    by the preparer, then by ``text()``; a partitioned table's regclass lookup read ``"p%%o"``). Through a
    translate map, as a tenant: created with the queue's storage parameters and partitions, written to, drained
    by a Worker and a Dispatcher, its partitions maintained, and doctor's findings about it clean."""
    from sa_outbox import maintain_partitions
    from sa_outbox.doctor import doctor
    from sa_outbox.models import model_for

    schema = '"te%nant"'
    with fresh_schema(engine, schema):
        tenant = engine.execution_options(schema_translate_map={None: "te%nant"})
        jobs = model_for("jobs", "jo%bs")
        events = model_for("outbox", "out%box", partitioned="day")
        for model in (jobs, events):
            model.__table__.create(tenant)
        with engine.connect() as conn:
            options = conn.execute(
                text(
                    "SELECT c.reloptions FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE n.nspname = 'te%nant' AND c.relname = 'jo%bs'"
                )
            ).scalar_one()
            parts = conn.execute(
                text("SELECT count(*) FROM pg_inherits WHERE inhparent = CAST(:t AS regclass)"),
                {"t": '"te%nant"."out%box"'},
            ).scalar_one()
        assert any(o.startswith("autovacuum_vacuum_scale_factor") for o in options) and parts >= 4
        with Session(tenant) as s, s.begin():
            for i in range(5):
                enqueue(s, jobs, "t", {"i": i})
                s.add(events(aggregate_type="order", aggregate_id="1", event_type="E", payload={"i": i}))
        ran: list[int] = []
        w = Worker(tenant, jobs, {"t": lambda job: ran.append(job.payload["i"])}, listen=False)
        publisher = RecordingPublisher()
        d = Dispatcher(tenant, events, publisher, ordered=True, listen=False)
        try:
            w.run(until_idle=True, install_signal_handlers=False)
            d.run(until_idle=True, install_signal_handlers=False)
        finally:
            w.close()
            d.close()
        assert sorted(ran) == [0, 1, 2, 3, 4]
        assert [m.payload["i"] for m in publisher.messages] == [0, 1, 2, 3, 4]
        report = maintain_partitions(tenant, events)
        assert report.errors == [] and report.created == []
        failing = [f for f in doctor(tenant, [jobs, events]) if f.status == "fail"]
        assert failing == []
