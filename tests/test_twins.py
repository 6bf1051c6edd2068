"""The sync classes and their asyncio twins take the same options and honour each of them the same way
(issue #18: they had drifted — AsyncWorker ignored heartbeat, async run() had no startup_timeout or
max_batches, async loops logged nothing)."""

from __future__ import annotations

import inspect
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from sa_outbox import (
    AsyncDispatcher,
    AsyncWorker,
    ClaimedJob,
    ConfigurationError,
    Dispatcher,
    Worker,
    _steps,
)
from sa_outbox._sql import spec_for
from sa_outbox.models import Job, OutboxEvent
from sa_outbox.testing import RecordingPublisher

from .conftest import ROOT
from .factories import Runner
from .helpers import seed_events, seed_jobs, statuses

PAIRS = [(Dispatcher, AsyncDispatcher, {"publish_concurrency"}), (Worker, AsyncWorker, {"sync_engine"})]


def _params(fn: Any) -> dict[str, tuple[Any, Any]]:
    return {
        name: (p.kind, p.default)
        for name, p in inspect.signature(fn).parameters.items()
        if name not in ("self", "engine")
    }


@pytest.mark.parametrize(("sync", "aio", "only_async"), PAIRS)
def test_the_twins_take_the_same_options_with_the_same_defaults(
    sync: Any, aio: Any, only_async: set[str]
) -> None:
    a, s = _params(aio.__init__), _params(sync.__init__)
    assert {k: v for k, v in a.items() if k not in only_async} == s
    for method in ("run", "run_once", "serve", "stop"):
        assert _params(getattr(aio, method)) == _params(getattr(sync, method)), method
    assert inspect.iscoroutinefunction(aio.run) and not inspect.iscoroutinefunction(sync.run)


def test_every_option_is_typed_and_keyword_only() -> None:
    for sync, aio, _ in PAIRS:
        for cls in (sync, aio):
            sig = inspect.signature(cls.__init__)
            for name, p in list(sig.parameters.items())[4:]:  # after self, engine, model, publisher/handlers
                assert p.kind is inspect.Parameter.KEYWORD_ONLY, (cls.__name__, name)
                assert p.annotation is not inspect.Parameter.empty, (cls.__name__, name)


@pytest.mark.parametrize("heartbeat", [0.1, 0])
def test_heartbeat_keeps_a_long_job_leased(runner: Runner, engine: Engine, heartbeat: float) -> None:
    """A job running past stale_after is not reaped while its worker beats; ``heartbeat=0`` means no beat,
    and then it is (AsyncWorker used to beat on its own schedule whatever heartbeat said)."""
    seed_jobs(engine, 1, task="long")
    reaped: list[Any] = []

    def long(job: ClaimedJob) -> None:
        deadline = time.monotonic() + 2.5  # well past stale_after=1.0
        while time.monotonic() < deadline:
            time.sleep(0.1)
            with engine.begin() as conn:  # another worker's rescue, as it would run on any host
                reaped.extend(_steps.rescue(conn, spec_for(Job), stale_after=timedelta(seconds=1.0)))

    # ten beats per stale_after: a loaded CI box once let 0.4 s pass between two beats
    w = runner.worker({"long": long}, stale_after=1.0, heartbeat=heartbeat, concurrency=2)
    assert runner.run_once(w) == 1
    if heartbeat:
        assert reaped == [] and statuses(engine, "jobs") == {"done": 1}
    else:
        assert [r[0] for r in reaped] == [1] and w.stats.lost_leases == 1


def test_max_batches_bounds_the_claims(runner: Runner, engine: Engine) -> None:
    seed_events(engine, 10)
    pub = RecordingPublisher()
    d = runner.dispatcher(pub, batch=3)
    runner.run(d, max_batches=2)
    assert len(pub.ids) == 6


def test_until_idle_returns_once_nothing_is_left(runner: Runner, engine: Engine) -> None:
    seed_jobs(engine, 7)
    w = runner.worker({"noop": lambda j: None}, batch=3)
    runner.run(w, until_idle=True)
    assert statuses(engine, "jobs") == {"done": 7}


@pytest.mark.parametrize("kind", ["dispatcher", "worker"])
def test_lifecycle_lines_are_logged_by_both_flavours(
    runner: Runner, engine: Engine, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    loop = runner.dispatcher(RecordingPublisher()) if kind == "dispatcher" else runner.worker({})
    with caplog.at_level(logging.INFO, logger=f"sa_outbox.{kind}"):
        runner.run(loop, until_idle=True)
    lines = [(r.name, r.getMessage(), getattr(r, "owner", None)) for r in caplog.records]
    assert (f"sa_outbox.{kind}", "started", loop.owner) in lines
    assert (f"sa_outbox.{kind}", "stopped", loop.owner) in lines


def _unreachable(url: URL, flavour: str) -> Any:
    bad = url.set(
        host="127.0.0.1", port=1, drivername="postgresql+psycopg_async" if flavour == "async" else None
    )
    return bad


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_startup_timeout_names_a_database_never_reached(db_url: URL, flavour: str) -> None:
    import asyncio

    from sqlalchemy import create_engine

    url = db_url.set(host="127.0.0.1", port=1)  # nothing listens there: refused, retried as an outage
    if flavour == "async":
        aengine = create_async_engine(url.set(drivername="postgresql+psycopg_async"))
        w: Any = AsyncWorker(aengine, Job, {}, listen=False)

        async def go() -> None:
            try:
                await w.run(install_signal_handlers=False, startup_timeout=0.5)
            finally:
                await aengine.dispose()

        with pytest.raises(ConfigurationError, match=r"unreachable for 0\.5s"):
            asyncio.run(go())
    else:
        engine = create_engine(url)
        with pytest.raises(ConfigurationError, match=r"unreachable for 0\.5s"):
            Worker(engine, Job, {}, listen=False).run(install_signal_handlers=False, startup_timeout=0.5)
        engine.dispose()


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_database_that_does_not_exist_is_named_at_once(db_url: URL, flavour: str) -> None:
    """Not an outage: retrying the same URL cannot help, so the loop says so instead of waiting."""
    import asyncio

    from sqlalchemy import create_engine

    url = db_url.set(database="sa_outbox_no_such_database")
    started = time.monotonic()
    if flavour == "async":
        aengine = create_async_engine(url.set(drivername="postgresql+psycopg_async"))
        d: Any = AsyncDispatcher(aengine, OutboxEvent, RecordingPublisher(), listen=False)

        async def go() -> None:
            try:
                await d.run(install_signal_handlers=False)
            finally:
                await aengine.dispose()

        with pytest.raises(ConfigurationError, match='database "sa_outbox_no_such_database" does not exist'):
            asyncio.run(go())
    else:
        engine = create_engine(url)
        with pytest.raises(ConfigurationError, match='database "sa_outbox_no_such_database" does not exist'):
            Dispatcher(engine, OutboxEvent, RecordingPublisher(), listen=False).run(
                install_signal_handlers=False
            )
        engine.dispose()
    assert time.monotonic() - started < 10  # not ridden out as an outage (no startup_timeout was given)


@pytest.mark.parametrize("cls", ["Dispatcher", "AsyncDispatcher", "Worker", "AsyncWorker"])
def test_sigterm_stops_serve_gracefully_with_exit_zero(db_url: URL, cls: str) -> None:
    """serve() is the one blocking entry point of every flavour: SIGTERM finishes what is in hand, exit 0."""
    is_async = cls.startswith("Async")
    driver = "postgresql+psycopg_async" if is_async else "postgresql+psycopg"
    url = db_url.set(drivername=driver).render_as_string(hide_password=False)
    make = "create_async_engine" if is_async else "create_engine"
    build = (
        f"{cls}(engine, OutboxEvent, RecordingPublisher(), poll_interval=0.2)"
        if "Dispatcher" in cls
        else f"{cls}(engine, Job, {{'noop': lambda j: None}}, poll_interval=0.2)"
    )
    script = textwrap.dedent(
        f"""
        import logging, sys
        from sqlalchemy import create_engine
        from sqlalchemy.ext.asyncio import create_async_engine
        from sa_outbox import {cls}
        from sa_outbox.models import Job, OutboxEvent
        from sa_outbox.testing import RecordingPublisher
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
        engine = {make}({url!r})
        {build}.serve()
        print("returned", flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        seen = ""
        deadline = time.monotonic() + 30
        while "started" not in seen and time.monotonic() < deadline:
            seen += proc.stderr.readline()
        assert "started" in seen, seen
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "returned" in out and " stopped" in err


def test_engines_of_the_wrong_flavour_are_refused(engine: Engine, async_url: URL) -> None:
    aengine = create_async_engine(async_url)
    with pytest.raises(ConfigurationError, match="needs a sqlalchemy Engine, got AsyncEngine"):
        Worker(aengine, Job, {})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="needs a sqlalchemy AsyncEngine, got Engine"):
        AsyncDispatcher(engine, OutboxEvent, RecordingPublisher())  # type: ignore[arg-type]
    with engine.connect() as conn:
        assert conn.execute(select(1)).scalar_one() == 1
