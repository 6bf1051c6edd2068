"""The jobs document's own worker, on the jobs document's own table, as the baseline of the jobs scenarios.

Everything here is the document's (``002_eb7221707991e28a.txt``), not this library's:

* its DDL, in a schema of its own (``docbench``): the ``job_status`` enum, the ``jobs`` table with the
  document's columns, and its two partial indexes ``jobs_dequeue_idx`` and ``jobs_running_idx`` — not the
  library's table (four partial indexes, a text status with a CHECK) in ``public``;
* its worker's SQL, word for word (``CLAIM_SQL``, ``DONE_SQL``, ``RETRY_SQL``, ``REAP_SQL``), on an autocommit
  psycopg connection whose ``search_path`` is that schema, so the statements run unqualified as written;
* its loop: reap once at start and every 10 s, claim a batch, run each job, one ``DONE`` per job (``RETRY`` on
  an exception). Only the per-job ``print`` is left out, and the loop stops when a claim comes back empty
  instead of sleeping ``POLL_SEC`` (a drain has nothing more to wait for).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import psycopg

from .harness import Harness, measured

if TYPE_CHECKING:  # the worker processes import this module: SQLAlchemy only where the parent needs it
    from sqlalchemy import Engine

SCHEMA = "docbench"

# The document's DDL, as printed there.
DDL = [
    "CREATE TYPE job_status AS ENUM ('queued', 'running', 'done', 'failed')",
    """CREATE TABLE jobs (
  id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  queue        text        NOT NULL DEFAULT 'default',
  payload      jsonb       NOT NULL,
  status       job_status  NOT NULL DEFAULT 'queued',
  priority     int         NOT NULL DEFAULT 0,
  run_at       timestamptz NOT NULL DEFAULT now(),
  attempts     int         NOT NULL DEFAULT 0,
  max_attempts int         NOT NULL DEFAULT 3,
  locked_by    text,
  locked_at    timestamptz,
  last_error   text,
  created_at   timestamptz NOT NULL DEFAULT now(),
  finished_at  timestamptz
)""",
    "CREATE INDEX jobs_dequeue_idx ON jobs (queue, priority DESC, run_at, id) WHERE status = 'queued'",
    "CREATE INDEX jobs_running_idx ON jobs (locked_at) WHERE status = 'running'",
]

# The document's worker SQL, as printed there.
CLAIM_SQL = """
UPDATE jobs
   SET status = 'running', locked_by = %(w)s, locked_at = now(), attempts = attempts + 1
 WHERE id IN (SELECT id FROM jobs
               WHERE queue = %(q)s AND status = 'queued' AND run_at <= now()
               ORDER BY priority DESC, run_at, id
               LIMIT %(n)s
               FOR UPDATE SKIP LOCKED)
RETURNING id, payload, attempts, max_attempts
"""
DONE_SQL = """UPDATE jobs SET status = 'done', finished_at = now(), locked_by = NULL, locked_at = NULL
               WHERE id = %s AND status = 'running'"""
RETRY_SQL = """
UPDATE jobs
   SET status = CASE WHEN attempts >= max_attempts THEN 'failed'::job_status ELSE 'queued'::job_status END,
       run_at = now() + make_interval(secs => least(300, 2 ^ attempts)),
       last_error = left(%s, 2000),
       finished_at = CASE WHEN attempts >= max_attempts THEN now() END,
       locked_by = NULL, locked_at = NULL
 WHERE id = %s AND status = 'running'
RETURNING status, run_at
"""
REAP_SQL = """
UPDATE jobs
   SET status = CASE WHEN attempts >= max_attempts THEN 'failed'::job_status ELSE 'queued'::job_status END,
       last_error = concat_ws(E'\\n', last_error, 'stale running: ' || locked_by),
       locked_by = NULL, locked_at = NULL
 WHERE status = 'running' AND locked_at < now() - make_interval(secs => %s)
"""
STALE_SEC = 60


def install(engine: Engine) -> None:
    """The document's schema in its own namespace, beside the library's tables."""
    from sqlalchemy import text

    with engine.begin() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
        conn.execute(text(f"CREATE SCHEMA {SCHEMA}"))
        conn.execute(text(f"SET LOCAL search_path = {SCHEMA}"))
        for statement in DDL:
            conn.execute(text(statement))


def reset(engine: Engine, n: int) -> None:
    """``n`` queued jobs in the document's table (its defaults: queue 'default', priority 0, due now)."""
    from sqlalchemy import text

    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {SCHEMA}.jobs RESTART IDENTITY"))
        conn.execute(
            text(
                f"INSERT INTO {SCHEMA}.jobs (payload) SELECT jsonb_build_object('n', g) FROM generate_series(1, :n) g"
            ),
            {"n": n},
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"VACUUM ANALYZE {SCHEMA}.jobs"))


def done_count(engine: Engine) -> int:
    from sqlalchemy import text

    with engine.connect() as conn:
        return int(
            conn.execute(text(f"SELECT count(*) FROM {SCHEMA}.jobs WHERE status = 'done'")).scalar_one()
        )


def conninfo(libpq_url: str) -> str:
    """The libpq URL with the document's schema first on the search path."""
    sep = "&" if "?" in libpq_url else "?"
    return f"{libpq_url}{sep}options=-csearch_path%3D{SCHEMA}"


def baseline_worker(dsn: str, batch: int, job_seconds: float, h: Harness) -> None:
    """The document's ``main()`` loop with a no-op (or ``time.sleep``) handler; stops on an empty claim."""

    def handle(payload: Any) -> None:
        if job_seconds:
            time.sleep(job_seconds)

    with psycopg.connect(conninfo(dsn), autocommit=True, application_name="bench-baseline") as conn:
        worker = f"worker-{conn.info.backend_pid}"
        with measured(h, lambda: [conn.info.backend_pid]) as box:
            last_reap = 0.0
            while True:
                if time.time() - last_reap > 10:
                    conn.execute(REAP_SQL, (STALE_SEC,))
                    last_reap = time.time()
                rows = conn.execute(CLAIM_SQL, {"w": worker, "q": "default", "n": batch}).fetchall()
                if not rows:
                    break
                for job_id, payload, _attempts, _max_attempts in rows:
                    try:
                        handle(payload)
                        conn.execute(DONE_SQL, (job_id,))
                        box["jobs"] += 1
                    except Exception as e:
                        conn.execute(RETRY_SQL, (f"{type(e).__name__}: {e}", job_id)).fetchone()
