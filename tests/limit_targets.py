"""Worker processes for tests/test_limits.py: each logs when its handler starts and ends (database clock)."""

from __future__ import annotations

import threading
import time
from typing import Any

from sqlalchemy import create_engine, text

from sa_outbox import ClaimedJob, Limit, Worker
from sa_outbox.models import Job


def run_worker(
    url: str, limits: dict[str, Any], queues: Any, concurrency: int, seconds: float, deadline: float
) -> None:
    """Run a Worker until no job is queued or running (or ``deadline`` seconds), logging each handler."""
    engine = create_engine(url, pool_size=concurrency + 2)

    def handle(job: ClaimedJob) -> None:
        with engine.begin() as conn:
            conn.execute(
                text("INSERT INTO limit_log (job_id, queue, key) VALUES (:j, :q, :k)"),
                {"j": job.id, "q": job.queue, "k": job.payload.get("key", "")},
            )
        time.sleep(seconds)
        with engine.begin() as conn:
            conn.execute(
                text("UPDATE limit_log SET ended = clock_timestamp() WHERE job_id = :j"), {"j": job.id}
            )

    w = Worker(engine, Job, {"t": handle}, queues=queues, concurrency=concurrency, poll_interval=0.05,
               listen=False, limits={q: Limit(**spec) for q, spec in limits.items()})  # fmt: skip
    thread = threading.Thread(target=lambda: w.run(install_signal_handlers=False), daemon=True)
    thread.start()
    end = time.monotonic() + deadline
    try:
        while time.monotonic() < end:
            time.sleep(0.1)
            with engine.connect() as conn:
                left = conn.execute(
                    text("SELECT count(*) FROM jobs WHERE status IN ('queued', 'running')")
                ).scalar()
            if not left:
                break
    finally:
        w.stop()
        thread.join(30)
        w.close()
        engine.dispose()
