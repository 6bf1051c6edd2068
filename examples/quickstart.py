"""Quickstart: mixins, an event and a job in a business transaction, a dispatcher and a worker.

Run with ``DATABASE_URL=postgresql+psycopg://...`` or with no URL at all (an embedded PostgreSQL is started
in a temporary directory and removed at the end).
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Identity, Text, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sa_outbox import ClaimedJob, Dispatcher, JobMixin, Message, OutboxMixin, Worker, enqueue
from sa_outbox.embedded import database_url
from sa_outbox.testing import drain


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "qs_orders"
    __outbox_aggregate_type__ = "order"
    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    status: Mapped[str] = mapped_column(Text)


class OutboxEvent(OutboxMixin, Base):
    __tablename__ = "qs_outbox"


class Job(JobMixin, Base):
    __tablename__ = "qs_jobs"


class PrintPublisher:
    """Stands in for a broker: a real one raises RetryableError/PermanentError/Defer on failure."""

    def publish(self, message: Message) -> None:
        print(
            f"published #{message.message_id}: {message.aggregate_type}/{message.aggregate_id} {message.event_type}"
        )


def send_receipt(job: ClaimedJob) -> None:
    print(f"job #{job.id} {job.task} ran with {job.payload}")


def main() -> None:
    with database_url() as url:
        engine = create_engine(url)
        Base.metadata.create_all(engine)  # in a real project: an alembic migration (docs/getting-started.md)
        try:
            # One transaction: the order, its event and a job commit together — or not at all.
            with Session(engine) as session, session.begin():
                order = Order(status="paid")
                session.add(order)
                session.add(OutboxEvent.for_aggregate(order, "OrderPaid", {"amount": "10.00"}))
                enqueue(session, Job, "send_receipt", {"order": 1}, queue="mail")

            dispatcher = Dispatcher(engine, OutboxEvent, PrintPublisher(), listen=False)
            worker = Worker(engine, Job, {"send_receipt": send_receipt}, queues=["mail"], listen=False)
            drain(dispatcher)  # in production: dispatcher.run() / `sa-outbox dispatch module:dispatcher`
            drain(worker)
        finally:
            Base.metadata.drop_all(engine)
            engine.dispose()


if __name__ == "__main__":
    main()
