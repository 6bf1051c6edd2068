"""A jobs worker with retries and a dead letter: a flaky job succeeds on its third attempt, a broken one
ends ``failed`` and is requeued by an operator action once fixed."""

from __future__ import annotations

from sqlalchemy import create_engine
from sqlalchemy.orm import DeclarativeBase, Session

from sa_outbox import Backoff, ClaimedJob, JobMixin, RetryableError, TaskRegistry, Worker, enqueue
from sa_outbox.admin import retry_dead
from sa_outbox.embedded import database_url
from sa_outbox.testing import drain


class Base(DeclarativeBase):
    pass


class Job(JobMixin, Base):
    __tablename__ = "ex_jobs"


tasks = TaskRegistry()
broken = {"fixed": False}


@tasks.task("flaky_email")
def flaky_email(job: ClaimedJob) -> None:
    if job.attempts < 3:
        raise RetryableError(f"SMTP 451 on attempt {job.attempts}")
    print(f"job {job.id}: email sent on attempt {job.attempts}")


@tasks.task("import_file")
def import_file(job: ClaimedJob) -> None:
    if not broken["fixed"]:
        raise ValueError(f"cannot parse {job.payload['path']}")  # unclassified: retried, then failed
    print(f"job {job.id}: imported {job.payload['path']} after the fix")


def main() -> None:
    with database_url() as url:
        engine = create_engine(url)
        Base.metadata.create_all(engine)
        try:
            with Session(engine) as s, s.begin():
                enqueue(s, Job, "flaky_email", {"to": "a@example.com"}, max_attempts=5, registry=tasks)
                enqueue(s, Job, "import_file", {"path": "orders.csv"}, max_attempts=2, registry=tasks)
            # Short backoff so the example finishes quickly (the default is min(300 s, 2^attempts s)).
            worker = Worker(engine, Job, tasks, backoff=Backoff(0.05, 0.2, jitter=False), listen=False)
            for _ in range(40):
                drain(worker)
                with engine.connect() as conn:
                    left = conn.exec_driver_sql(
                        "SELECT count(*) FROM ex_jobs WHERE status IN ('queued', 'running')"
                    ).scalar()
                if not left:
                    break
                __import__("time").sleep(0.1)
            with engine.connect() as conn:
                for row in conn.exec_driver_sql(
                    "SELECT id, task, status, attempts, last_error FROM ex_jobs ORDER BY id"
                ):
                    print(
                        f"job {row.id} {row.task}: {row.status} after {row.attempts} attempts ({row.last_error})"
                    )
            broken["fixed"] = True
            print("requeued:", retry_dead(engine, Job, task="import_file"))
            drain(worker)
        finally:
            Base.metadata.drop_all(engine)
            engine.dispose()


if __name__ == "__main__":
    main()
