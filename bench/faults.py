"""Long fault-injection mode: ``python -m bench.faults --url URL [--minutes 2] [--pg-restarts 1]
[--outages 1] [--outage-seconds S]``.

The same run as tests/test_faults.py with more producers, events and faults, a broker outage longer than the
dispatchers' whole retry budget (``--outages``, default 1; ``--outage-seconds``, default twice the budget:
about 49 s for the fault run's dispatchers, 50 attempts with backoff capped at 0.5 s), and optionally
PostgreSQL restarts (only on a server this run owns: it restarts the machine's cluster with pg_ctlcluster).
Prints the checker's figures; the verdict needs nothing lost, nothing dead and every outage survived. Needs a
PostgreSQL (a database ``sa_outbox_faults`` is created and dropped) and the ``redis-server`` binary (the run
starts a private one).
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
    p.add_argument("--outages", type=int, default=1, help="broker outages longer than the retry budget")
    p.add_argument("--outage-seconds", type=float, default=None, help="each outage (default: 2x the budget)")
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
                      chaos_seconds=seconds, settle_seconds=180, pg_restarts=args.pg_restarts,
                      broker_outages=args.outages, outage_seconds=args.outage_seconds)  # fmt: skip
    report = run_faults(engine, url.render_as_string(hide_password=False), cfg)
    engine.dispose()
    print(json.dumps(asdict(report), indent=2), flush=True)
    admin.dispose()  # its connections did not survive a PostgreSQL restart
    with admin.connect() as conn:
        conn.execute(text("DROP DATABASE IF EXISTS sa_outbox_faults WITH (FORCE)"))
    ok = (report.undelivered == 0 and report.rolled_back_delivered == 0 and report.unexplained_duplicates == 0
          and report.order_violations == 0 and report.jobs_not_done == 0 and report.stuck_rows == 0
          and report.dead_rows == 0 and report.broker_outages == args.outages)  # fmt: skip
    print("verdict:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
