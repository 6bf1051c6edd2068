"""The benchmark's database: created fresh on the given server, the library's tables in ``public`` and the jobs
document's own DDL in the schema ``docbench``, dropped at the end."""

from __future__ import annotations

import re

from sqlalchemy import Engine, create_engine, make_url, text

from sa_outbox.models import Base

from . import baseline

NAME = "sa_outbox_bench"


def create(server_url: str, icu_locale: str | None = None) -> str:
    """Create the benchmark's database (dropped first if left over) with the library's tables and the
    document's schema; ``icu_locale``: its default collation an ICU one of that locale (``en-US``: text
    compares linguistically, as on many production databases) instead of the server's template's."""
    url = make_url(server_url)
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS {NAME} WITH (FORCE)"))
        if icu_locale is None:
            conn.execute(text(f"CREATE DATABASE {NAME}"))
        else:
            if not re.fullmatch(r"[A-Za-z0-9_-]+", icu_locale):
                raise ValueError(f"--icu-locale {icu_locale!r}: a locale name such as en-US")
            conn.execute(
                text(
                    f"CREATE DATABASE {NAME} TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE '{icu_locale}'"
                )
            )
    admin.dispose()
    bench_url = url.set(database=NAME).render_as_string(hide_password=False)
    engine = create_engine(bench_url)
    Base.metadata.create_all(engine)
    baseline.install(engine)
    engine.dispose()
    return bench_url


def drop(server_url: str) -> None:
    admin = create_engine(make_url(server_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS {NAME} WITH (FORCE)"))
    admin.dispose()


def libpq(url: str) -> str:
    """The SQLAlchemy URL as a plain libpq URL (for psycopg.connect and pgbench)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def vacuum(engine: Engine, *tables: str) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for t in tables:
            conn.execute(text(f"VACUUM ANALYZE {t}"))


def reset_jobs(engine: Engine, n: int) -> None:
    """``n`` queued no-op jobs in the library's table (task 'noop', queue 'default', due now)."""
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE jobs RESTART IDENTITY"))
        conn.execute(
            text(
                "INSERT INTO jobs (task, payload) SELECT 'noop', jsonb_build_object('n', g) FROM generate_series(1, :n) g"
            ),
            {"n": n},
        )
    vacuum(engine, "jobs")


def reset_outbox(engine: Engine, n: int, aggregates: int) -> None:
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox RESTART IDENTITY"))
        conn.execute(
            text(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                "SELECT 'order', (g % :a)::text, 'E', jsonb_build_object('n', g) FROM generate_series(1, :n) g"
            ),
            {"n": n, "a": aggregates},
        )
    vacuum(engine, "outbox")


def done_count(engine: Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {table} WHERE status = 'done'")).scalar_one())


def check_drained(engine: Engine, table: str, n: int) -> None:
    done = done_count(engine, table)
    if done != n:
        raise RuntimeError(f"{table}: {done} of {n} done after the drain")
