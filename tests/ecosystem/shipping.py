"""The task of the enqueue-in-a-transaction tests (test_django, test_async_sqlalchemy):
``eco.ship(order_id)``, run by an in-process worker, checks from a connection of its
own whether its order is committed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from celery import Celery
from celery.contrib.testing.worker import start_worker
from psycopg import sql
from waiting import wait_for


class Shipped:
    """What the worker did: order id -> was that order committed when the task ran."""

    def __init__(self) -> None:
        self.seen: dict[int, bool] = {}

    def ran(self, *order_ids: int) -> dict[int, bool]:
        """Once the tasks of ``order_ids`` ran: whether each saw its order committed."""
        wait_for(
            lambda: set(order_ids) <= set(self.seen),
            20,
            f"the tasks of orders {order_ids} to run",
            details=lambda: self.seen,
        )
        return {i: self.seen[i] for i in order_ids}


@contextmanager
def shipping(app: Celery, dsn: str, orders: sql.Identifier) -> Iterator[Any]:
    """The task ``eco.ship(order_id)`` of ``app``, run by an in-process worker for the
    block; its ``shipped`` (:class:`Shipped`) tells whether each order was in ``orders``
    when its task ran."""
    shipped = Shipped()
    query = sql.SQL("SELECT count(*) FROM {} WHERE id = %s").format(orders)

    @app.task(name="eco.ship", shared=False)
    def ship(order_id: int) -> None:
        with psycopg.connect(dsn) as conn:
            row = conn.execute(query, (order_id,)).fetchone()
        shipped.seen[order_id] = bool(row and row[0])

    ship.shipped = shipped
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        yield ship
