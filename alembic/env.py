"""Alembic environment for sa_outbox's reference models.

URL: ``alembic -x url=...``, else ``DATABASE_URL``, else ``sqlalchemy.url`` in alembic.ini. A caller may also
pass an open connection in ``config.attributes["connection"]`` (the tests and the demo do); it then runs every
revision in that connection's transaction. On its own connection (``alembic upgrade head``) each revision is
its own transaction with bounded, retried lock waits (:func:`sa_outbox.migration.run_migrations_with_lock_retries`),
so an upgrade can run beside a live service: ``-x lock_timeout=0.5 -x give_up_after=600`` (seconds; the defaults).
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import create_engine, pool
from sqlalchemy.engine import Connection

from sa_outbox.migration import run_migrations_with_lock_retries
from sa_outbox.models import Base

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url") or os.environ.get("DATABASE_URL")
    url = url or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit(
            "no database URL: set DATABASE_URL or pass `alembic -x url=postgresql+psycopg://...`"
        )
    return url


def _lock_options() -> dict[str, float]:
    """``-x lock_timeout=0.5 -x give_up_after=600``, in seconds."""
    given = context.get_x_argument(as_dictionary=True)
    options: dict[str, float] = {}
    for name in ("lock_timeout", "give_up_after"):
        if name in given:
            try:
                options[name] = float(given[name])
            except ValueError:
                raise SystemExit(
                    f"-x {name}={given[name]}: a number of seconds, e.g. -x {name}=0.5"
                ) from None
    return options


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:  # the caller's connection and transaction: the caller decides
        _run(connection)
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            # one transaction per revision, lock waits bounded and retried: safe beside a running service
            run_migrations_with_lock_retries(
                context, conn, target_metadata=target_metadata, compare_type=True, **_lock_options()
            )
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
