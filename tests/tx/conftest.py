"""Fixtures for transactional enqueue, dedup keys and bulk sends.

``app`` is a Celery app on the test schema (as in ``tests/workers``); ``engine`` is
a SQLAlchemy engine on the test database; ``rows`` reads the message table from a
connection of its own, so what it sees is what other sessions see.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from kombu import Connection
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine
from tx_helpers import make_app

import celery_pgqueue


@pytest.fixture
def celery_dsn(dsn: str) -> str:
    return dsn or "postgresql://"


@pytest.fixture
def app(celery_dsn: str, schema: str) -> Iterator[Celery]:
    app = make_app(celery_dsn, schema)
    yield app
    app.close()


@pytest.fixture
def sa_url(celery_dsn: str) -> str:
    return celery_pgqueue.result_backend_url(celery_dsn).removeprefix("db+")


@pytest.fixture
def engine(sa_url: str) -> Iterator[Engine]:
    engine = create_engine(sa_url)
    yield engine
    engine.dispose()


@pytest.fixture
def orders(connection: Connection, db: psycopg.Connection, schema: str) -> sql.Composed:
    """A business table in the (already migrated) test schema; returns its name."""
    name = sql.Identifier(schema, "orders")
    db.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY)").format(name))
    return name


@pytest.fixture
def count_orders(db: psycopg.Connection, orders: sql.Composed) -> Callable[[], int]:
    def count() -> int:
        row = db.execute(sql.SQL("SELECT count(*) FROM {}").format(orders)).fetchone()
        assert row is not None
        return int(row[0])

    return count


@pytest.fixture
def rows(db: psycopg.Connection, schema: str) -> Callable[..., list[tuple[Any, ...]]]:
    """``rows("queue, dedup_key", "queue = %s", "q")``: message rows, ordered by id."""

    def rows(columns: str = "*", where: str = "true", *params: Any) -> list[tuple[Any, ...]]:
        query = sql.SQL("SELECT {} FROM {}.message WHERE {} ORDER BY id").format(
            sql.SQL(columns), sql.Identifier(schema), sql.SQL(where)
        )
        return db.execute(query, params).fetchall()

    return rows


@pytest.fixture
def other_database_dsn(dsn: str) -> str:
    """A DSN for another database on the same server, where the broker schema is not."""
    params = conninfo_to_dict(dsn) if dsn else {}
    current = params.get("dbname") or "postgres"
    # the embedded server has only postgres and the templates; template1 is only read
    other = "postgres" if current != "postgres" else "template1"
    return make_conninfo(dsn or "", dbname=other)
