"""Outbox rows whose ``xmax`` reads as a transaction in progress although nothing holds them.

The settled claim passes over rows another claim holds or has just taken (``_sql._live_xmax``). A MultiXact id in
``xmax`` — two transactions share-locked the row, as inserts into a table with a foreign key into the outbox do —
is read as an xid; on a cluster whose MultiXact counter runs up to 2^20 ahead of its xid counter it reads as a
transaction that began after the claim's snapshot, until the xid counter passes it. Such a cluster is built here:
a throwaway one (``tests/logical_pg.py``) whose MultiXact counter ``pg_resetwal -m`` set 400,000 ahead.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, insert, text

from sa_outbox import _steps as eng
from sa_outbox.models import OutboxEvent
from sa_outbox.testing import RecordingPublisher

from .factories import Runner
from .helpers import OUTBOX
from .logical_pg import LogicalCluster, bin_dir, logical_cluster

#: The MultiXact id the cluster's counter starts from: ahead of its xid counter (a few hundred after initdb)
#: by less than ``_sql._BEGAN_AFTER_WINDOW``.
NEXT_MULTIXACT = 400_000
OLD, NEW = 300, 2000


def _multixacts_ahead(cluster: LogicalCluster) -> None:
    """Set the new cluster's MultiXact counter to ``NEXT_MULTIXACT``, with the offsets segment it needs (what
    pg_resetwal's manual says to do: a zero-filled segment file)."""
    cluster.run(bin_dir() / "pg_resetwal", "-m", f"{NEXT_MULTIXACT},{NEXT_MULTIXACT}", cluster.datadir)
    per_page, pages = 8192 // 4, 32  # offsets: 4 bytes each, 32 pages a segment
    segment = cluster.datadir / "pg_multixact" / "offsets" / f"{NEXT_MULTIXACT // per_page // pages:04X}"
    cluster.run("dd", "if=/dev/zero", f"of={segment}", "bs=8192", f"count={pages}", "status=none")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LogicalCluster]:
    with logical_cluster(_multixacts_ahead) as c:
        yield c


def _database(cluster: LogicalCluster, name: str) -> Engine:
    with psycopg.connect(host="127.0.0.1", port=cluster.port, user="postgres", autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}"')
        c.execute(f'CREATE DATABASE "{name}"')
    engine = create_engine(cluster.url.set(database=name))
    OutboxEvent.metadata.create_all(engine, tables=[OutboxEvent.__table__])  # type: ignore[list-item]
    return engine


def _seed(engine: Engine, n: int, start: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            insert(OutboxEvent),
            [{"aggregate_type": "order", "aggregate_id": f"agg-{i}", "event_type": "E", "payload": {"n": i}}
             for i in range(start, start + n)],
        )  # fmt: skip


@pytest.mark.parametrize("ordered", [False, True], ids=["plain", "ordered"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_rows_the_settled_form_passes_over_are_all_taken_at_the_claims_pace(
    cluster: LogicalCluster, kind: str, ordered: bool
) -> None:
    """300 such events, then 2,000 newer ones, batch 10: a locking claim that takes any is followed by another,
    so the 300 go first, one batch after another, and one ``run(until_idle=True)`` delivers every event. With
    a locking claim only every second (or after a short claim) they went 10 at a time: a hostile review's 300
    were delivered over 27.6 s, the last after 5,970 newer events, and ``until_idle`` returned with 20-30 of
    them still pending."""
    engine = _database(cluster, f"passed_over_{kind}_{int(ordered)}")
    try:
        _seed(engine, OLD, 0)
        lockers = [psycopg.connect(host="127.0.0.1", port=cluster.port, user="postgres",
                                   dbname=engine.url.database) for _ in range(2)]  # fmt: skip
        for locker in lockers:  # two KEY SHARE lockers at once: xmax becomes a MultiXact id
            locker.execute("SELECT id FROM outbox FOR KEY SHARE")
        for locker in lockers:  # and both are gone: nothing holds the rows
            locker.commit()
            locker.close()
        _seed(engine, NEW, OLD)
        with engine.connect() as conn:
            xmax = conn.execute(text("SELECT xmax::text::bigint FROM outbox WHERE id = 1")).scalar_one()
            # (the premise: the settled form passes over every one of them)
            settled = eng.claim(
                conn, OUTBOX, owner="x", batch=10, lease=timedelta(seconds=30), ordered=ordered
            )
            conn.rollback()
        assert xmax >= NEXT_MULTIXACT
        assert [r[0] for r in settled] == list(range(OLD + 1, OLD + 11))

        runner = Runner(kind, engine, cluster.url.set(drivername="postgresql+psycopg_async",
                                                      database=engine.url.database))  # fmt: skip
        try:
            publisher = RecordingPublisher()
            d = runner.dispatcher(publisher, batch=10, ordered=ordered)
            runner.run(d, until_idle=True)
        finally:
            runner.close()
        published = publisher.ids
        with engine.connect() as conn:
            left = dict(conn.execute(text("SELECT status, count(*) FROM outbox GROUP BY status")).all())
        assert left == {"done": OLD + NEW}
        assert sorted(published[:OLD]) == list(range(1, OLD + 1)), published[: OLD + 20]
    finally:
        engine.dispose()
