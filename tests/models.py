"""A small business schema for tests: orders (the aggregate) and order lines (a child with an FK)."""

from __future__ import annotations

from sqlalchemy import BigInteger, ForeignKey, Identity, MetaData, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class AppBase(DeclarativeBase):
    metadata = MetaData()


class Order(AppBase):
    __tablename__ = "orders"
    __outbox_aggregate_type__ = "order"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    status: Mapped[str] = mapped_column(Text, default="new")


class OrderLine(AppBase):
    __tablename__ = "order_lines"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    order_id: Mapped[int] = mapped_column(ForeignKey("orders.id"))
    sku: Mapped[str] = mapped_column(Text)
