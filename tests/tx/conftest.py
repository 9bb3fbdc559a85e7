"""Fixtures for transactional enqueue, dedup keys and bulk sends.

``app`` (``tests/conftest.py``) is a Celery app on the test schema; ``engine`` is a
SQLAlchemy engine on the test database; ``rows`` reads the message table from a
connection of its own, so what it sees is what other sessions see.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from kombu import Connection
from psycopg import sql
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine

import celery_pgqueue


@pytest.fixture
def celery_dsn(dsn: str) -> str:
    """``dsn`` under the name ``test_dedup`` asks for (that module keeps its fixtures)."""
    return dsn


@pytest.fixture
def sa_url(dsn: str) -> str:
    return celery_pgqueue.result_backend_url(dsn).removeprefix("db+")


@pytest.fixture
def app_conn(dsn: str) -> Iterator[psycopg.Connection]:
    """The application's own psycopg 3 connection (not autocommit)."""
    with psycopg.connect(dsn) as conn:
        yield conn


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
        query = sql.SQL("SELECT {} FROM {}.message_store WHERE {} ORDER BY id").format(
            sql.SQL(columns), sql.Identifier(schema), sql.SQL(where)
        )
        return db.execute(query, params).fetchall()

    return rows
