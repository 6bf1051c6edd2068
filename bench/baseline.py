"""The jobs document's own worker, in plain psycopg, as the baseline every scenario is compared with.

Exactly its SQL: claim with ``UPDATE … WHERE id IN (SELECT … FOR UPDATE SKIP LOCKED) RETURNING`` and one
``DONE`` statement per job, on an autocommit connection.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

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


def baseline_worker(dsn: str, batch: int, job_seconds: float, ready: Any, go: Any) -> None:
    with psycopg.connect(dsn, autocommit=True, application_name="bench-baseline") as conn:
        ready.set()
        go.wait()
        name = f"baseline-{id(conn)}"
        while True:
            rows = conn.execute(CLAIM_SQL, {"w": name, "q": "default", "n": batch}).fetchall()
            if not rows:
                return
            for job_id, _payload, _attempts, _max in rows:
                if job_seconds:
                    time.sleep(job_seconds)
                conn.execute(DONE_SQL, (job_id,))
