"""A worker, or a publisher, whose result tables go to its broker's schema starts on an
empty database.

Celery creates its result tables as the worker starts (``database_create_tables_at_setup``),
before the broker's first connection would install the broker's schema: the tables'
schema did not exist yet, and the worker died at startup (``InvalidSchemaName``).
"""

from __future__ import annotations

import socket
from pathlib import Path

import psycopg
import pytest
from celery_workers import workers
from lifecycle_app import pgqueue_cli, worker_env
from psycopg import sql
from psycopg.conninfo import make_conninfo
from results_app import make_app
from waiting import wait_for

import celery_pgqueue
from celery_pgqueue._worker import SchemaFirst

pytestmark = pytest.mark.celery

HERE = Path(__file__).resolve().parent


def test_results_in_the_broker_schema_on_an_empty_database(
    dsn: str, schema: str, db: psycopg.Connection, tmp_path: Path
) -> None:
    exists = "SELECT count(*) FROM pg_namespace WHERE nspname = %s"
    assert db.execute(exists, (schema,)).fetchone() == (0,)  # nothing installed yet
    with workers(tmp_path) as started:
        worker = started.start(
            "results_app",
            "results",
            cwd=HERE,
            env=worker_env(dsn, schema),
            options=("-P", "threads", "-c", "2", "-Q", "celery"),
        )
        wait_for(lambda: worker.says(" ready."), 60, "the worker to start", worker)
        app = make_app(dsn, schema)
        try:
            assert app.send_task("results.add", (2, 3)).get(timeout=30) == 5
        finally:
            app.close()
    stored = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "celery_taskmeta"))
    assert db.execute(stored).fetchone() == (1,)


def test_a_publisher_first_with_results_in_the_broker_schema_on_an_empty_database(
    dsn: str, schema: str, db: psycopg.Connection
) -> None:
    """A web app publishes before any worker ran: Celery makes its result backend, and
    creates its tables, at the first send_task, before the broker's first statement."""
    exists = "SELECT count(*) FROM pg_namespace WHERE nspname = %s"
    assert db.execute(exists, (schema,)).fetchone() == (0,)
    app = make_app(dsn, schema)
    try:
        sent = app.send_task("results.add", (2, 3))
        assert sent.state == "PENDING"  # read from the result tables
    finally:
        app.close()
    waiting = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "message_store"))
    assert db.execute(waiting).fetchone() == (1,)
    tables = "SELECT count(*) FROM pg_tables WHERE schemaname = %s AND tablename LIKE 'celery_%%'"
    assert db.execute(tables, (schema,)).fetchone() == (2,)


def test_the_schema_is_tried_again_while_the_database_cannot_be_reached(
    dsn: str, schema: str, db: psycopg.Connection
) -> None:
    """A web app's first delay() while its database still starts: Celery makes a new
    engine at each retry, and the schema is installed once it can be."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        nobody = make_conninfo(dsn, host="127.0.0.1", port=str(sock.getsockname()[1]))
    app = make_app(nobody, schema)
    try:
        first = SchemaFirst(app)
        first(None)  # nothing listens there: not installed, and not given up
        assert not first.done
        celery_pgqueue.configure(app, dsn, schema=schema)  # the database is up
        first(None)
        assert first.done
    finally:
        app.close()
    exists = "SELECT count(*) FROM pg_namespace WHERE nspname = %s"
    assert db.execute(exists, (schema,)).fetchone() == (1,)


def test_migrate_creates_the_result_tables_too(
    dsn: str, schema: str, db: psycopg.Connection
) -> None:
    """What a role that may not create tables needs to find there (docs/operations.md)."""
    done = pgqueue_cli("results_app", dsn, schema, "migrate")

    assert done.returncode == 0, done.stderr
    tables = f"{schema}.celery_taskmeta, {schema}.celery_tasksetmeta"
    assert done.stdout.splitlines()[-1] == f"Celery's result tables: {tables}"
    found = "SELECT count(*) FROM pg_tables WHERE schemaname = %s AND tablename LIKE 'celery_%%'"
    assert db.execute(found, (schema,)).fetchone() == (2,)
