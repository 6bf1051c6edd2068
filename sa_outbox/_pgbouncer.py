"""Engines for a database behind PgBouncer in *transaction* pooling mode: one call, every setting it needs.

In transaction pooling mode each transaction of a client may run on a different server connection, and each
server connection serves many clients in turn. What that breaks, measured on PgBouncer 1.18
(``tests/test_pgbouncer.py``):

* **Server-side prepared statements.** psycopg prepares a statement after 5 executions, and sa_outbox prepares
  its hot statements (claim, finalize, the producer's insert) at once. A name prepared on one server
  connection is missing on the next (``prepared statement "_pg3_3" does not exist``), already taken there by
  another client (``… already exists``), or names another client's statement (``bind message supplies 4
  parameters, but prepared statement "_pg3_3" requires 12``). The engines below switch them off
  (``prepare_threshold=None``); PgBouncer ≥ 1.21 with ``max_prepared_statements`` set tracks them, and
  ``prepared_statements=True`` keeps them there.
* **LISTEN.** A LISTEN sent through the pooler registers on whichever server connection ran it; PgBouncer drops
  what arrives there later (``got packet 'A' from server when not linked``), so an idle loop only polls. The
  loops' wake-ups therefore listen on ``direct_url`` — the server itself, one connection per loop outside any
  pool — or are switched off (``listen=False``: poll every ``poll_interval``, the correctness path anyway).
* **Leases.** A worker's heartbeat must get through within ``stale_after``; through the pooler it waits for a
  free server connection like any client, and its lease guard (a transaction held while another transaction
  holds one of its jobs' rows) takes one. A Worker on an engine made here with ``direct_url`` therefore renews
  its leases, and holds its guards, on connections to ``direct_url`` (two at most, outside any pool).
* Session state (plain ``SET``, session-level advisory locks, ``WITH HOLD`` cursors) would leak to other
  clients: sa_outbox uses none — its locks are transaction-scoped, its one setting (``doctor``'s
  ``enable_seqscan``) is ``SET LOCAL``. Nothing to configure.

``pgbouncer_engine(url, direct_url=…)`` returns the engine and the wake-up options for every loop built on it::

    engine, wakeups = pgbouncer_engine(pooled_url, direct_url=server_url)
    dispatcher = Dispatcher(engine, OutboxEvent, publisher, **wakeups)
"""

from __future__ import annotations

from typing import Any, TypedDict

from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from .errors import ConfigurationError

__all__ = ["Wakeups", "pgbouncer_async_engine", "pgbouncer_engine"]

#: Driver names a PgBouncer engine accepts (psycopg 3 is the driver whose statements sa_outbox prepares).
_DRIVERS = {"postgresql", "postgres", "postgresql+psycopg", "postgresql+psycopg_async"}


#: The server itself behind the pooler URL of each engine made here with a ``direct_url`` (driver aside), with
#: the engine's ``connect_args`` (server-side prepared statements allowed again: nothing pools them). Keyed by
#: URL, which the engine's ``execution_options()`` copies share and ``dispose()`` keeps. A Worker's heartbeat
#: and lease guard connect there (see :func:`direct_server`).
_DIRECT: dict[str, tuple[URL, dict[str, Any]]] = {}


def _key(url: URL) -> str:
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def direct_server(engine: Engine | AsyncEngine) -> tuple[URL, dict[str, Any]] | None:
    """The server behind an engine of :func:`pgbouncer_engine`/:func:`pgbouncer_async_engine` made with a
    ``direct_url`` (or one of its ``execution_options()`` copies), and the engine's ``connect_args``; None for
    any other engine.

    A worker's leases are renewed there: through the pooler a beat waits in PgBouncer's queue whenever every
    server connection is taken (a review: an open transaction over a job's row and the worker's own lease
    guard took a pool of two; beats queued past stale_after, and other workers rescued and ran the live
    worker's jobs a second time — 2 to 4 of 8)."""
    return _DIRECT.get(_key(engine.url))


class Wakeups(TypedDict, total=False):
    """Keyword arguments for a Dispatcher/Worker (either flavour): where its LISTEN connection goes."""

    listen: bool
    listen_url: str | URL


def _url(url: str | URL, driver: str, name: str) -> URL:
    try:
        parsed = make_url(url)
    except Exception as exc:  # ArgumentError: not a URL at all
        raise ConfigurationError(f"{name}: not a database URL ({exc})") from None
    if parsed.drivername not in _DRIVERS:
        raise ConfigurationError(
            f"{name}: driver {parsed.drivername!r} is not supported behind PgBouncer by sa_outbox; use "
            "psycopg 3 (postgresql+psycopg://USER:PASSWORD@PGBOUNCER_HOST:PORT/DATABASE)"
        )
    return parsed.set(drivername=driver)


def _options(
    url: str | URL,
    driver: str,
    direct_url: str | URL | None,
    prepared_statements: bool,
    kwargs: dict[str, Any],
) -> tuple[URL, Wakeups, dict[str, Any]]:
    pooled = _url(url, driver, "url")
    wakeups: Wakeups = {"listen": False}
    if direct_url is not None:
        wakeups = {"listen": True, "listen_url": _url(direct_url, "postgresql+psycopg", "direct_url")}
    connect_args = dict(kwargs.pop("connect_args", None) or {})
    if not prepared_statements:
        given = connect_args.get("prepare_threshold")
        if given is not None:
            raise ConfigurationError(
                f"connect_args prepare_threshold={given!r} contradicts prepared_statements=False: pass "
                "prepared_statements=True (PgBouncer >= 1.21 with max_prepared_statements set) instead"
            )
        connect_args["prepare_threshold"] = None
    return pooled, wakeups, {**kwargs, "connect_args": connect_args}


def pgbouncer_engine(
    url: str | URL,
    *,
    direct_url: str | URL | None = None,
    prepared_statements: bool = False,
    **engine_kwargs: Any,
) -> tuple[Engine, Wakeups]:
    """A SQLAlchemy engine (psycopg 3) for ``url`` — PgBouncer in transaction pooling mode — and the wake-up
    options to pass to every Dispatcher/Worker built on it.

    * Prepared statements are off (``prepare_threshold=None``), unless ``prepared_statements=True``: only
      with PgBouncer >= 1.21 and ``max_prepared_statements`` set in its configuration.
    * ``direct_url`` is the PostgreSQL server itself (not the pooler): the loops' LISTEN connections go there
      (``{"listen": True, "listen_url": direct_url}``). Without it the loops do not listen (``{"listen": False}``) and find
      work by polling every ``poll_interval``.
    * ``engine_kwargs`` go to :func:`sqlalchemy.create_engine` (``pool_size``, ``connect_args``, …).

    ``postgresql://`` URLs get the psycopg driver; other drivers are a
    :class:`~sa_outbox.errors.ConfigurationError`. Nothing connects until the engine is used::

        engine, wakeups = pgbouncer_engine("postgresql+psycopg://app@pgbouncer:6432/app",
                                           direct_url="postgresql+psycopg://app@db:5432/app")
        worker = Worker(engine, Job, handlers, **wakeups)
    """
    pooled, wakeups, kwargs = _options(
        url, "postgresql+psycopg", direct_url, prepared_statements, engine_kwargs
    )
    return _remembered(create_engine(pooled, **kwargs), wakeups, kwargs), wakeups


def _remembered(engine: Any, wakeups: Wakeups, kwargs: dict[str, Any]) -> Any:
    """``engine``, its ``direct_url`` remembered for :func:`direct_server` — unless it is the engine's own
    server (no pooler between: nothing to route around)."""
    direct = wakeups.get("listen_url")
    pooled = _key(engine.url)
    if direct is not None and _key(make_url(direct)) != pooled:
        connect_args = {k: v for k, v in kwargs["connect_args"].items() if k != "prepare_threshold"}
        _DIRECT[pooled] = (make_url(direct), connect_args)
    return engine


def pgbouncer_async_engine(
    url: str | URL,
    *,
    direct_url: str | URL | None = None,
    prepared_statements: bool = False,
    **engine_kwargs: Any,
) -> tuple[AsyncEngine, Wakeups]:
    """The asyncio twin of :func:`pgbouncer_engine`: an ``AsyncEngine`` (psycopg's async driver) and the
    wake-up options for ``AsyncDispatcher``/``AsyncWorker``."""
    pooled, wakeups, kwargs = _options(
        url, "postgresql+psycopg_async", direct_url, prepared_statements, engine_kwargs
    )
    return _remembered(create_async_engine(pooled, **kwargs), wakeups, kwargs), wakeups
