"""Quickstart: declare the tables with the mixins, write an event and a job in a business transaction.

Run with ``DATABASE_URL=postgresql+psycopg://...`` or with no URL at all (an embedded PostgreSQL is started
in a temporary directory and removed at the end).
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Identity, Text, create_engine, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sa_outbox import JobMixin, OutboxMixin, enqueue
from sa_outbox.embedded import database_url


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


def main() -> None:
    with database_url() as url:
        engine = create_engine(url)
        Base.metadata.create_all(engine)  # in a real project: an alembic migration (see README)
        try:
            # One transaction: the order, its event and a job commit together — or not at all.
            with Session(engine) as session, session.begin():
                order = Order(status="paid")
                session.add(order)
                session.add(OutboxEvent.for_aggregate(order, "OrderPaid", {"amount": "10.00"}))
                enqueue(session, Job, "send_receipt", {"order": "pending"}, queue="mail")

            with Session(engine) as session:
                for ev in session.scalars(select(OutboxEvent)):
                    print(
                        f"outbox #{ev.id}: {ev.aggregate_type}/{ev.aggregate_id} {ev.event_type} -> {ev.status}"
                    )
                for job in session.scalars(select(Job)):
                    print(f"job #{job.id}: {job.queue}/{job.task} -> {job.status}")
        finally:
            Base.metadata.drop_all(engine)
            engine.dispose()


if __name__ == "__main__":
    main()
