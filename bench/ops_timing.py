"""How long status, check, doctor and locks take on a 1,000,000-row table: ``python -m bench.ops_timing --url …``.

Creates a database ``sa_outbox_ops`` with 1M outbox rows (mostly done) and 1M jobs, times each command's
Python API (median of 5), drops the database.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from sqlalchemy import create_engine, make_url, text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sa_outbox.doctor import doctor, locks
from sa_outbox.models import Base, Job, OutboxEvent
from sa_outbox.monitoring import queue_status


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ops_timing")
    p.add_argument("--url", required=True)
    p.add_argument("--rows", type=int, default=1_000_000)
    args = p.parse_args()
    admin = create_engine(make_url(args.url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text("DROP DATABASE IF EXISTS sa_outbox_ops WITH (FORCE)"))
        conn.execute(text("CREATE DATABASE sa_outbox_ops"))
    engine = create_engine(make_url(args.url).set(database="sa_outbox_ops"))
    Base.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status, done_at, attempts) "
            "SELECT 'o', (g % 5000)::text, 'E', '{}', CASE WHEN g % 100 = 0 THEN 'pending' WHEN g % 1000 = 1 "
            "THEN 'dead' ELSE 'done' END, now(), g % 3 FROM generate_series(1, :n) g"), {"n": args.rows})  # fmt: skip
        conn.execute(text(
            "INSERT INTO jobs (task, payload, status, finished_at) SELECT 't', '{}', CASE WHEN g % 100 = 0 "
            "THEN 'queued' ELSE 'done' END, now() FROM generate_series(1, :n) g"), {"n": args.rows})  # fmt: skip
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE outbox"))
        conn.execute(text("VACUUM ANALYZE jobs"))
    timings = {}
    for name, fn in (
        ("status (outbox + jobs)", lambda: [queue_status(engine, m) for m in (OutboxEvent, Job)]),
        ("doctor (outbox + jobs)", lambda: doctor(engine, [OutboxEvent, Job])),
        ("locks", lambda: locks(engine, ["outbox", "jobs"])),
    ):
        fn()
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - t0) * 1000)
        timings[name] = statistics.median(runs)
        print(f"{name:<26} {timings[name]:8.1f} ms (median of 5, {args.rows:,} rows per table)")
    engine.dispose()
    with admin.connect() as conn:
        conn.execute(text("DROP DATABASE IF EXISTS sa_outbox_ops WITH (FORCE)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
