"""Long fault-injection mode: ``python -m bench.faults [--minutes 2] [--pg-restarts 1]``.

The same run as tests/test_faults.py with more producers, events and faults, and optionally PostgreSQL
restarts (only on a server this run owns: it restarts the machine's cluster with pg_ctlcluster). Prints the
checker's figures. Needs ``DATABASE_URL`` (a database ``sa_outbox_faults`` is created and dropped) and Redis.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from sqlalchemy import create_engine, make_url, text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sa_outbox.models import Base
from tests.faults import FaultConfig, run_faults


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.faults")
    p.add_argument("--url", required=True)
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--pg-restarts", type=int, default=0)
    args = p.parse_args()
    server = make_url(args.url)
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text("DROP DATABASE IF EXISTS sa_outbox_faults WITH (FORCE)"))
        conn.execute(text("CREATE DATABASE sa_outbox_faults"))
    url = server.set(database="sa_outbox_faults")
    engine = create_engine(url, pool_pre_ping=True)
    Base.metadata.create_all(engine)
    seconds = args.minutes * 60
    cfg = FaultConfig(producers=4, transactions=int(seconds * 40), aggregates=200, dispatchers=4, workers=3,
                      kills=int(seconds / 4), terminations=int(seconds / 8), broker_restarts=max(1, int(seconds / 60)),
                      chaos_seconds=seconds, settle_seconds=180, pg_restarts=args.pg_restarts)  # fmt: skip
    report = run_faults(engine, url.render_as_string(hide_password=False), cfg)
    engine.dispose()
    print(json.dumps(asdict(report), indent=2), flush=True)
    admin.dispose()  # its connections did not survive a PostgreSQL restart
    with admin.connect() as conn:
        conn.execute(text("DROP DATABASE IF EXISTS sa_outbox_faults WITH (FORCE)"))
    ok = (report.undelivered == 0 and report.rolled_back_delivered == 0 and report.unexplained_duplicates == 0
          and report.order_violations == 0 and report.jobs_not_done == 0 and report.stuck_rows == 0)  # fmt: skip
    print("verdict:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
