"""The direct path: a sync loop's statements prepared under names of their own and sent below psycopg's cursor.

What it must keep from the cursor path: the same rows and types, psycopg's errors (as SQLAlchemy's), one
prepared statement per statement and parameter types per session, and no failure of its own when whoever had
the connection from the pool meanwhile ran DISCARD ALL — outside a transaction block or inside one.
"""

from __future__ import annotations

import random
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.exc import DBAPIError

from sa_outbox import Limit, Worker, _execute
from sa_outbox import _steps as eng
from sa_outbox._db import LoopConnection
from sa_outbox.models import Job

from .helpers import JOBS, seed_jobs, statuses


def ours(conn: Connection) -> list[tuple[str, str]]:
    """(name, statement) of this session's statements prepared by the direct path."""
    return [
        (r[0], r[1])
        for r in conn.exec_driver_sql(
            "SELECT name, statement FROM pg_prepared_statements WHERE starts_with(name, %(p)s) ORDER BY name",
            {"p": _execute._NAME_PREFIX},
        )
    ]


def discard_all(conn: Connection) -> None:
    conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("DISCARD ALL")


@pytest.fixture
def one_connection(engine: Engine) -> Any:
    """An engine with one pooled connection: the loop's and the test's are the same session."""
    e = create_engine(engine.url, pool_size=1, max_overflow=0)
    yield e
    e.dispose()


def test_a_loops_statements_are_prepared_once_each_and_return_what_the_cursor_path_returns(
    one_connection: Engine,
) -> None:
    seed_jobs(one_connection, 6)
    loop = LoopConnection(one_connection, "jobs")
    direct_rows = [
        loop.run(lambda c: eng.claim(c, JOBS, owner="w", batch=2, queue="default")) for _ in range(2)
    ]
    with loop.use() as conn:
        prepared = ours(conn)
    loop.drop()
    # the same statement claimed twice: prepared once, under this process's prefix
    assert len(prepared) == 1 and "SKIP LOCKED" in prepared[0][1], prepared
    with one_connection.connect() as conn:  # no kept cursor, no direct state: psycopg's cursor path
        conn.connection.info.pop(_execute._DIRECT, None)
        cursor_rows = eng.claim(conn, JOBS, owner="w", batch=2, queue="default")
        conn.commit()
    assert [len(r) for r in direct_rows] == [2, 2] and len(cursor_rows) == 2
    ids = [r[0] for rows in direct_rows for r in rows] + [r[0] for r in cursor_rows]
    assert sorted(ids) == list(range(1, 7))
    # same values and Python types column by column (binary results through psycopg's loaders)
    for a, b in zip(direct_rows[0][0], cursor_rows[0], strict=True):
        assert type(a) is type(b), (a, b)
    assert direct_rows[0][0][4:6] == cursor_rows[0][4:6] == ("noop", "default")


def test_discard_all_while_the_pool_lent_the_connection_out_is_survived(one_connection: Engine) -> None:
    """The missing statement is prepared again and retried (nothing ran the first time); a limited queue's
    claim, inside BEGIN … COMMIT, takes psycopg's cursor, which knows its own prepared statements."""
    seed_jobs(one_connection, 8)
    seed_jobs(one_connection, 4, queue="limited")
    loop = LoopConnection(one_connection, "jobs")
    limit = Limit(2)

    def limited(c: Connection) -> list[Any]:
        return eng.claim_limited(c, JOBS, owner="w", batch=1, queue="limited", limit=limit)[0]

    assert len(loop.run(lambda c: eng.claim(c, JOBS, owner="w", batch=1, queue="default"))) == 1
    assert len(loop.run(limited)) == 1
    with loop.use() as conn:
        before = {n for n, _ in ours(conn)}
    assert len(before) == 1  # the claim; the limited pick and claim ran inside a transaction block
    loop.drop()
    with one_connection.connect() as conn:  # application code on the pooled connection
        discard_all(conn)
        assert ours(conn) == []
    assert len(loop.run(lambda c: eng.claim(c, JOBS, owner="w", batch=1, queue="default"))) == 1
    assert len(loop.run(limited)) == 1
    with loop.use() as conn:
        after = {n for n, _ in ours(conn)}
    loop.drop()
    assert len(after) == 1 and not after & before  # prepared again, under a new name
    assert statuses(one_connection, "jobs") == {"running": 4, "queued": 8}


def test_psycopgs_own_deallocate_all_on_a_rollback_is_survived(one_connection: Engine) -> None:
    """psycopg sends DEALLOCATE ALL when it rolls back (or runs DROP/ALTER) while it holds prepared statements
    of its own — ours go with them. Found by the model-based suite (a limited queue's claim rolled back)."""
    seed_jobs(one_connection, 3)
    loop = LoopConnection(one_connection, "jobs")
    assert len(loop.run(lambda c: eng.claim(c, JOBS, owner="w", batch=1, queue="default"))) == 1
    with loop.use() as conn:
        driver = conn.connection.driver_connection
        assert isinstance(driver, psycopg.Connection)
        for _ in range(2):
            driver.execute("SELECT 1", prepare=True)  # one of psycopg's own, "_pg3_…"
        driver.execute("BEGIN")
        driver.execute("ROLLBACK")  # psycopg: DEALLOCATE ALL
        assert ours(conn) == []
    for _ in range(2):
        assert len(loop.run(lambda c: eng.claim(c, JOBS, owner="w", batch=1, queue="default"))) == 1
    with loop.use() as conn:
        assert len(ours(conn)) == 1
    loop.drop()
    assert statuses(one_connection, "jobs") == {"running": 3}


def test_a_worker_drains_after_discard_all_between_two_runs(engine: Engine) -> None:
    e = create_engine(engine.url, pool_size=2, max_overflow=0)
    seed_jobs(e, 5)
    seen: list[int] = []
    w = Worker(e, Job, {"noop": lambda job: seen.append(job.id)}, batch=2, listen=False)
    try:
        assert w.run_once() == 2
        with e.connect() as a, e.connect() as b:  # every pooled connection: the loop's among them
            discard_all(a)
            discard_all(b)
        w.run(until_idle=True, install_signal_handlers=False)
    finally:
        w.close()
        e.dispose()
    assert sorted(seen) == [1, 2, 3, 4, 5]
    assert statuses(engine, "jobs") == {"done": 5}


def test_driver_errors_come_out_as_sqlalchemys_and_the_connection_keeps_working(
    one_connection: Engine,
) -> None:
    seed_jobs(one_connection, 2)
    loop = LoopConnection(one_connection, "jobs")
    with pytest.raises(DBAPIError, match="cannot adapt type 'object'"):  # refused before anything is sent
        loop.run(lambda c: eng.claim(c, JOBS, owner=object(), batch=2, queue="default"))  # type: ignore[arg-type]
    # a server-side error: the statement refused, nothing half-done, the next statement fine
    with pytest.raises(DBAPIError, match=r"invalid input syntax|out of range|negative"):
        loop.run(lambda c: eng.claim(c, JOBS, owner="w", batch=-1, queue="default"))
    assert len(loop.run(lambda c: eng.claim(c, JOBS, owner="w", batch=2, queue="default"))) == 2
    loop.drop()
    with one_connection.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM jobs WHERE status = 'running'")).scalar_one() == 2


def test_a_forked_child_draws_its_own_name_prefix() -> None:
    """A pid repeats (containers, forked workers): the prefix is a random token, drawn again in a child."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=lambda: child_end.send(_execute._NAME_PREFIX))
    child.start()
    theirs = parent_end.recv()
    child.join(10)
    assert child.exitcode == 0
    assert theirs.startswith("_sao_") and _execute._NAME_PREFIX.startswith("_sao_")
    assert theirs != _execute._NAME_PREFIX and len(theirs) == len(_execute._NAME_PREFIX) == 22


def test_each_checkout_reads_rows_with_the_connections_adapters_and_encoding_as_they_are_then(
    one_connection: Engine,
) -> None:
    """Application code had the pooled connection in between: it set another client encoding and registered
    a loader. The loop's next claim sees both, as psycopg's cursor would; and the connection, while lent
    out, holds no Transformer (no rows of the loop's last claim) and takes the cursor path."""
    seed_jobs(one_connection, 3, queue="café", headers={"h": 1})
    loop = LoopConnection(one_connection, "jobs")
    first = loop.run(lambda c: eng.claim(c, JOBS, owner="w", batch=1, queue="café"))
    assert first[0][5] == "café" and first[0][9] == {"h": 1}
    loop.drop()
    with one_connection.connect() as conn:
        assert conn.connection.info[_execute._DIRECT].tx is None
        conn.exec_driver_sql("SET client_encoding TO 'LATIN1'")
        conn.commit()
        driver = conn.connection.driver_connection
        assert isinstance(driver, psycopg.Connection)

        class Tagged(psycopg.types.json.JsonbBinaryLoader):
            def load(self, data: Any) -> Any:
                return ("tagged", super().load(data))

        driver.adapters.register_loader("jsonb", Tagged)
    second = loop.run(lambda c: eng.claim(c, JOBS, owner="w", batch=1, queue="café"))
    loop.drop()
    assert len(second) == 1 and second[0][5] == "café" and second[0][9] == ("tagged", {"h": 1})


def test_sqlstate_26000_raised_by_the_statement_itself_is_not_taken_for_a_missing_statement(
    engine: Engine,
) -> None:
    """Only the server's "prepared statement "<our name>" does not exist" is retried: a trigger raising the
    same SQLSTATE leaves its statement run once, and the error comes out."""
    seed_jobs(engine, 1)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE SEQUENCE direct_runs")
        conn.exec_driver_sql(
            "CREATE FUNCTION direct_boom() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "PERFORM nextval('direct_runs'); RAISE EXCEPTION 'boom' USING ERRCODE = '26000'; END $$"
        )
        conn.exec_driver_sql(
            "CREATE TRIGGER direct_boom BEFORE UPDATE ON jobs FOR EACH ROW EXECUTE FUNCTION direct_boom()"
        )
    loop = LoopConnection(engine, "jobs")
    try:
        with pytest.raises(Exception, match="boom"):
            loop.run(lambda c: eng.claim(c, JOBS, owner="w", batch=1, queue="default"))
    finally:
        loop.drop()
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP TRIGGER direct_boom ON jobs")
            conn.exec_driver_sql("DROP FUNCTION direct_boom()")
            runs = conn.exec_driver_sql("SELECT last_value FROM direct_runs").scalar_one()
            conn.exec_driver_sql("DROP SEQUENCE direct_runs")
    assert runs == 1
    assert statuses(engine, "jobs") == {"queued": 1}


def test_a_migration_changing_a_returned_columns_type_is_ridden_out(engine: Engine) -> None:
    """``ALTER TABLE … TYPE`` from another session while a loop holds its prepared claim: the server refuses
    the old plan ("cached plan must not change result type", before anything ran); the loop prepares the
    statement again and claims, rather than failing every claim until it restarts."""
    seed_jobs(engine, 2)
    loop = LoopConnection(engine, "jobs")
    try:
        assert len(loop.run(lambda c: eng.claim(c, JOBS, owner="w", batch=1, queue="default"))) == 1
        with engine.begin() as conn:
            conn.exec_driver_sql("ALTER TABLE jobs ALTER COLUMN priority TYPE bigint")
        rows = loop.run(lambda c: eng.claim(c, JOBS, owner="w", batch=1, queue="default"))
        with loop.use() as conn:
            left = len(ours(conn))
    finally:
        loop.drop()
        with engine.begin() as conn:
            conn.exec_driver_sql("ALTER TABLE jobs ALTER COLUMN priority TYPE integer")
    assert len(rows) == 1 and rows[0][0] == 2
    assert left == 1  # the stale one deallocated
    assert statuses(engine, "jobs") == {"running": 2}


def test_array_literals_read_back_as_the_lists_they_were_made_of(engine: Engine) -> None:
    """The outcome arrays go to the server as one text literal each (a join, not psycopg's dump per element).
    The server must read back the very list — quotes, backslashes, commas, braces, spaces, the word NULL, the
    empty string — and a list of a kind the literal cannot carry (a bool, an infinite float, a NUL) must be
    left to psycopg (None)."""
    rng = random.Random(26)
    alphabet = ['"', "\\", ",", "{", "}", " ", "NULL", "", "a", "ü", "\t", "'"]
    cases: list[tuple[list[Any], str]] = [
        ([], "text[]"),
        ([1, -2, 2**62, 0], "bigint[]"),
        ([None, None, None], "text[]"),
        (["done"] * 5, "text[]"),
        (["a b", "", "{x}", "NULL", "ü,ö", "'q'"], "text[]"),
        (['say "hi"', "back\\slash", None], "text[]"),
        ([1, None, 3], "bigint[]"),
        ([1.5, None, -0.25], "float8[]"),
    ]
    for _ in range(200):
        words = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 8))
        ]
        cases.append(([None if rng.random() < 0.2 else w for w in words], "text[]"))
        cases.append((words, "text[]"))
    with engine.connect() as conn:
        for values, sql_type in cases:
            literal = _execute._array_literal(values)
            assert literal is not None, values
            back = conn.exec_driver_sql(f"SELECT CAST(%(v)s AS {sql_type})", {"v": literal}).scalar_one()
            assert back == values, (values, literal, back)
    for refused in ([True, 1], [1.0, float("inf")], ["a\x00b"], ["a", "b\x00"], [1, "x", object()]):
        assert _execute._array_literal(refused) is None, refused
    assert _execute._array_literal((1, 2)) is None  # a tuple is psycopg's to dump
