"""PgQueuer, a pip-installable Python PostgreSQL queue, in the same run on the same database (``--with-pgqueuer``).

Install it with ``pip install -e '.[bench]'`` (PgQueuer plus asyncpg, its fastest driver). Its own schema
(``Queries.install()``, default durability: every table logged) lives beside the library's tables; each
run enqueues the no-op jobs in one statement, then N processes each run one ``PgQueuer`` on one connection
with ``run(batch_size=…, mode=drain)`` and an ``async def`` no-op entrypoint — as PgQueuer's own drain
benchmark (``tools/benchmark.py``) does. The driver is asyncpg when it is installed, else psycopg's async
connection; the table names which.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .harness import Harness, Run, timed_processes

INSTALL_HINT = "PgQueuer is not installed: pip install -e '.[bench]' (or pip install pgqueuer asyncpg)"


async def _connect(dsn: str) -> tuple[Any, Any, int, str]:
    """(PgQueuer driver, connection, backend pid, driver name): asyncpg when installed, else psycopg."""
    try:
        import asyncpg
        from pgqueuer.db import AsyncpgDriver

        conn = await asyncpg.connect(dsn=dsn)
        return AsyncpgDriver(conn), conn, conn.get_server_pid(), "asyncpg"
    except ImportError:
        import psycopg
        from pgqueuer.db import PsycopgDriver

        pconn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        return PsycopgDriver(pconn), pconn, pconn.info.backend_pid, "psycopg"


def _run(coro: Any) -> Any:
    try:
        import uvloop  # a PgQueuer dependency; its own benchmark runs on it

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def pgqueuer_worker(dsn: str, batch: int, h: Harness) -> None:
    from pgqueuer import PgQueuer
    from pgqueuer.types import QueueExecutionMode

    from .harness import measured

    async def main() -> None:
        driver, conn, pid, name = await _connect(dsn)
        pgq = PgQueuer(driver)
        handled = 0

        @pgq.entrypoint("noop")
        async def noop(job: Any) -> None:
            nonlocal handled
            handled += 1

        with measured(h, lambda: [pid]) as box:
            await pgq.run(batch_size=batch, mode=QueueExecutionMode.drain)
            box.update(jobs=handled, driver=name)
        await conn.close()

    _run(main())


def _prepare(dsn: str, n: int) -> None:
    from pgqueuer import Queries

    async def main() -> None:
        driver, conn, _, _ = await _connect(dsn)
        q = Queries(driver)
        if not await q.schema_is_installed():
            await q.install()
        await q.clear_queue()
        await q.clear_queue_log()
        await q.clear_statistics_log()
        await q.enqueue(["noop"] * n, [None] * n, [0] * n)
        await conn.close()

    _run(main())


def _left(dsn: str) -> int:
    from pgqueuer import Queries

    async def main() -> int:
        driver, conn, _, _ = await _connect(dsn)
        size = sum(s.count for s in await Queries(driver).queue_size())
        await conn.close()
        return size

    return int(_run(main()))


def pgqueuer_drain(url: str, n: int, procs: int, batch: int) -> Run:
    try:
        import pgqueuer  # noqa: F401
    except ImportError:
        raise RuntimeError(INSTALL_HINT) from None
    from .db import libpq  # (not at the top: the PgQueuer processes import this module)

    dsn = libpq(url)
    _prepare(dsn, n)
    run = timed_processes(pgqueuer_worker, [(dsn, batch)] * procs)
    handled = sum(r["jobs"] for r in run.reports)
    left = _left(dsn)
    if handled != n or left:
        raise RuntimeError(f"PgQueuer: {handled} of {n} jobs handled, {left} left in its queue")
    return run
