"""The dashboard: an ASGI application (Starlette) that shows the outbox and jobs tables and, when enabled,
acts on them — mount it in your own application, or run ``sa-outbox dashboard`` (extra ``web``).

.. code-block:: python

    from sa_outbox.web import create_app

    dashboard = create_app(engine, tables=[OutboxEvent, Job])              # read-only
    dashboard = create_app(engine, actions=True, authenticate=current_user)  # retry, skip, cancel, pause
    app.mount("/outbox", dashboard)                                        # in your Starlette/FastAPI app

Pages (server-rendered HTML; a little JavaScript refreshes the overview and asks before an action, and every
page works without it): the overview of each table (rows by status, the oldest due and unfinished ages,
expired leases, the last hour's throughput, whether deliveries fail because the destination is unavailable,
blocked aggregates, table health, what holds back the xmin horizon); dead letters with filters, payload,
headers and last error, retry and skip (selected rows, or every matching row after a preview of how many);
ordered aggregates blocked behind a dead message; jobs by status, queue and task with cancel and retry;
queues with pause and resume; ``doctor``'s findings with their fixes; locks and the xmin horizon.

**Safe by default.** Read-only unless ``actions=True``, and actions need ``authenticate``: a callable that
receives the request and returns the user's name, or ``None`` to refuse (a coroutine function works too).
When given, it guards every page, not only the actions. Every action also needs the CSRF token of the page
it was sent from, is refused when the browser says it came from another site, calls the same
``sa_outbox.admin`` function as the CLI (so a bulk action selects its rows once and reports exactly the rows
it changed), and is logged on ``sa_outbox.web`` with who, what and how many.

**Bounded on big tables.** Each state is read through its partial index and counted up to 50,000 rows;
beyond that the figure is an estimate from the statistics, shown as ``≈``. Ages come from the database's
clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine
from starlette.applications import Starlette

from .._durations import Duration
from ._security import Authenticate, TokenAuth

__all__ = ["Authenticate", "TokenAuth", "create_app"]


def create_app(
    engine: Engine,
    *,
    tables: Sequence[type[Any]] | None = None,
    actions: bool = False,
    authenticate: Authenticate | None = None,
    stale_after: Duration = 60.0,
    long_transaction: Duration = 60.0,
    title: str = "sa_outbox",
    csrf_secret: bytes | str | None = None,
    statement_timeout: Duration = 10.0,
    allowed_hosts: Sequence[str] | None = None,
) -> Starlette:
    """The dashboard as a Starlette application.

    ``tables``: the outbox/jobs models to show (default: ``sa_outbox.models.OutboxEvent`` and ``Job``).
    ``actions``: allow retry, skip, cancel, pause and resume (needs ``authenticate``). ``authenticate``:
    ``request -> user name | None`` (or a coroutine function); when set, every page requires it.
    :class:`TokenAuth` authenticates a shared token. ``stale_after``: your workers' reaping window (running
    jobs locked longer ago count as expired leases). ``long_transaction``: the age from which an open
    transaction is shown as holding back the xmin horizon on the overview. ``csrf_secret``: the key the
    forms' CSRF tokens are signed with — give the same one to every process behind one load balancer
    (default: a random key per process). ``statement_timeout``: the longest a page's statements may run
    (``SET LOCAL``, so it works behind PgBouncer); past it the page says the database did not answer (503)
    instead of hanging. ``allowed_hosts``: the host names the dashboard answers to (a request with another
    ``Host`` gets 400; ``["*"]``: any) — by default, without ``authenticate``, only the loopback names
    (``127.0.0.1``, ``localhost``, ``::1``), so a page elsewhere cannot read an open dashboard through DNS
    rebinding; with ``authenticate``, any. Raises :class:`~sa_outbox.errors.ConfigurationError` on a bad
    option, before serving anything."""
    from ._app import Dashboard, build

    if tables is None:
        from ..models import Job, OutboxEvent

        tables = [OutboxEvent, Job]
    dashboard = Dashboard(
        engine, list(tables), actions=actions, authenticate=authenticate, stale_after=stale_after,
        long_transaction=long_transaction, title=title, csrf_secret=csrf_secret, statement_timeout=statement_timeout,
        allowed_hosts=allowed_hosts,
    )  # fmt: skip
    return build(dashboard)
